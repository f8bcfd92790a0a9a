#!/usr/bin/env bash
# Builds the environment the DeepSpeed ZeRO-3 test runs in (tests/test_trl_zero3.py): a virtual
# environment over this Python's packages (torch, transformers, TRL: the ones the suite tests) with
# DeepSpeed added, so DeepSpeed never enters the main environment.
#   scripts/deepspeed-env.sh [DIR]      (default .ci/deepspeed-env, ignored by git)
# DeepSpeed ships as a source distribution whose setup.py imports torch: it is built without build
# isolation (against this torch) and without its compiled ops (DS_BUILD_OPS=0); the one op its CPU
# accelerator loads at start (shared-memory collectives) is compiled here, by ninja, into the
# environment's own DIR/torch_extensions (TORCH_EXTENSIONS_DIR; about 60 s of CPU), so the test that
# starts DeepSpeed, which sets the same directory, does not compile it, and two checkouts do not
# rebuild one shared ~/.cache copy for each other's include paths. An existing environment with the
# right DeepSpeed is kept; its op is built if it is missing (ninja's check, about 2 s when it is not).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.ci/deepspeed-env}
version=$(sed -n 's/^deepspeed==//p' constraints/deepspeed.txt)
if [ -x "$dir/bin/python" ] &&
    "$dir/bin/python" -c "import deepspeed, sys; sys.exit(deepspeed.__version__ != '$version')" 2>/dev/null; then
    echo "deepspeed-env: $dir has DeepSpeed $version"
else
    python -m venv --system-site-packages "$dir"
    "$dir/bin/python" -m pip install -q -c constraints/deepspeed.txt 'setuptools>=61' wheel
    DS_BUILD_OPS=0 "$dir/bin/python" -m pip install -q --no-build-isolation -c constraints/deepspeed.txt "deepspeed==$version"
    "$dir/bin/python" -c "import deepspeed, trl; print('deepspeed-env:', '$dir', 'DeepSpeed', deepspeed.__version__)" 2>&1 |
        grep -v 'Setting accelerator to CPU'
fi
# the shared-memory collectives op, loaded as DeepSpeed's communication starts (deepspeed/comm/torch.py)
TORCH_EXTENSIONS_DIR="$(cd "$dir" && pwd)/torch_extensions"
export TORCH_EXTENSIONS_DIR
"$dir/bin/python" - <<'PY' 2>&1 | grep -v 'Setting accelerator to CPU'
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)
print("deepspeed-env: the shared-memory collectives op is built")
PY
