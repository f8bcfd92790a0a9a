"""The Triton versions the backend supports: the oldest (3.6.0) and the installed newest.

``.ci/run`` installs Triton 3.6.0 (the oldest supported: clusters with torch 2.11 pin it) into
the ignored folder ``.ci/triton-3.6`` (``pip install --no-deps --target``); this test runs the
quick ahead-of-time PTX/AMD checks (what Triton 3.6 compiles at launch: the compiled kernels a
GPU with 3.6 runs) in a subprocess with that folder first on ``PYTHONPATH``, and requires that
the subprocess imported 3.6.0 and passed them all, then the roofline bounds of the two variants
nearest theirs (bf16 and fp16 at ``T = 0.7`` with the entropy gradient). Triton 3.6's interpreter computes ``tl.fma``
with two roundings, so the interpreter mode must refuse it, saying so: the subprocess checks that
too. The installed Triton (3.9.0 when written) runs the interpreter byte tests in the suite
itself. In CI (``CI=true``) a missing folder is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OLDEST = "3.6.0"
OLDEST_DIR = REPO / ".ci" / "triton-3.6"
INSTALL = f"python -m pip install --no-deps --target .ci/triton-3.6 triton=={OLDEST}"


def test_the_installed_triton_is_supported() -> None:
    triton = pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton.triton_backend import MIN_TRITON, _version

    assert _version(triton.__version__) >= MIN_TRITON == (3, 6)


@pytest.mark.slow
def test_the_oldest_supported_triton_passes_the_interpreter_and_ptx_checks() -> None:
    if not (OLDEST_DIR / "triton" / "__init__.py").exists():
        message = f"Triton {OLDEST} is not installed in {OLDEST_DIR}; run `{INSTALL}` (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(OLDEST_DIR), str(REPO)])}
    # one interpreter (one import of torch and Triton): the Triton it imports and what the interpreter
    # mode says of it, on one line, then the PTX/AMD checks under pytest
    probe = ("import json, sys, triton, pytest; "
             "from rl_engine.logprob.backends.triton.triton_backend import triton_unavailable as u; "
             "print('PROBE ' + json.dumps([triton.__version__, u('interpreter')]), flush=True); "
             "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'not slow', "
             "'-W', 'ignore::RuntimeWarning', 'tests/test_triton_ptx.py']))")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=900,
                          check=False, cwd=REPO)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail and "failed" not in tail, tail
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    version, refusal = json.loads(line.removeprefix("PROBE "))
    assert version == OLDEST
    assert "Triton 3.6.0's interpreter computes tl.fma" in refusal and "rounds twice" in refusal
    # the bounds of the variants nearest them under 3.6 (the entropy gradient at T = 0.7: bf16 1.25x,
    # fp16 1.3x the H100 floor forward+backward; docs/performance.md, "The variants")
    bounds = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow", "-W", "ignore::RuntimeWarning",
         "-k", "(within_1_25x and True-True-True) or (within_1_3x and True-True-0.7-True)", "tests/test_triton_ptx.py"],
        env=env, capture_output=True, text=True, timeout=900, check=False, cwd=REPO,
    )
    tail = bounds.stdout[-3000:] + bounds.stderr[-2000:]
    assert bounds.returncode == 0 and "2 passed" in tail, tail
