#!/usr/bin/env bash
# Builds the environment the DeepSpeed ZeRO-3 test runs in (tests/test_trl_zero3.py): a virtual
# environment over this Python's packages (torch, transformers, TRL: the ones the suite tests) with
# DeepSpeed added, so DeepSpeed never enters the main environment.
#   scripts/deepspeed-env.sh [DIR]      (default .ci/deepspeed-env, ignored by git)
# DeepSpeed ships as a source distribution whose setup.py imports torch: it is built without build
# isolation (against this torch) and without its compiled ops (DS_BUILD_OPS=0); the one op its CPU
# accelerator loads at start (shared-memory collectives) is compiled on first use, by ninja, into
# ~/.cache/torch_extensions. An existing environment with the right DeepSpeed is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.ci/deepspeed-env}
version=$(sed -n 's/^deepspeed==//p' constraints/deepspeed.txt)
if [ -x "$dir/bin/python" ] &&
    "$dir/bin/python" -c "import deepspeed, sys; sys.exit(deepspeed.__version__ != '$version')" 2>/dev/null; then
    echo "deepspeed-env: $dir has DeepSpeed $version"
    exit 0
fi
python -m venv --system-site-packages "$dir"
"$dir/bin/python" -m pip install -q -c constraints/deepspeed.txt 'setuptools>=61' wheel
DS_BUILD_OPS=0 "$dir/bin/python" -m pip install -q --no-build-isolation -c constraints/deepspeed.txt "deepspeed==$version"
"$dir/bin/python" -c "import deepspeed, trl; print('deepspeed-env:', '$dir', 'DeepSpeed', deepspeed.__version__)" 2>&1 |
    grep -v 'Setting accelerator to CPU'
