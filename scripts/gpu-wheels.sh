#!/usr/bin/env bash
# Fetch, on a machine with network, every wheel the GPU smoke needs beyond what a bare GPU
# machine has (a CUDA torch and Triton): rl_engine's other dependencies for the GPU machine's
# Python (default 3.12, manylinux x86_64), setuptools to build rl_engine there, and this
# checkout as a source archive. Copy the output folder to the GPU machine and run the one line
# of docs/gpus.md. DRY_RUN=1 prints the commands instead of running them.
#   usage: scripts/gpu-wheels.sh [OUT_DIR] [PYTHON_VERSION]
# How: `pip wheel` resolves the dependencies here (pinned by constraints/cpu.txt) and builds
# pure-Python wheels (py3-none-any: any Python); each wheel built for this Python's ABI is then
# replaced by the same version's wheel for the GPU machine's Python (`pip download
# --python-version`).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-wheels}"
py="${2:-3.12}"
tag="cp${py/./}"
# the [project] dependencies of pyproject.toml and its workflow extra (the smoke runs a campaign), less
# torch (the GPU machine's CUDA build stays)
mapfile -t deps < <(python - <<'PY'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["workflow"]
print("\n".join(d for d in deps if not d.replace(" ", "").startswith("torch")))
PY
)
run() { if [ "${DRY_RUN:-0}" = 1 ]; then echo "$*"; else "$@"; fi; }
run mkdir -p "$out"
run python -m pip wheel -q -c constraints/cpu.txt -w "$out" "${deps[@]}" "setuptools>=61" wheel pytest
if [ "${DRY_RUN:-0}" != 1 ]; then
    for whl in "$out"/*.whl; do
        case "$whl" in *-none-any.whl|*-"$tag"-*) continue ;; esac
        spec="$(basename "$whl" | cut -d- -f1,2 | sed 's/-/==/')"
        rm "$whl"
        python -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
            --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
            --platform manylinux_2_17_x86_64 -d "$out" "$spec"
    done
fi
run git archive --format=tar.gz --prefix=rl_engine/ -o "$out/rl_engine-src.tar.gz" HEAD
