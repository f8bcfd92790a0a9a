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
# tests/test_triton_ptx.py's slow tests; under 3.6 only BOUNDS of them run, beside the quick set
SLOW = {"test_every_default_case_launch_compiles_to_the_specs_operations",
        "test_the_gpt2_case_compiles_to_the_specs_operations", "test_the_roofline_of_the_launched_kernels_meets_the_targets",
        "test_the_bf16_kernels_at_a_temperature_are_within_1_25x_of_the_h100_floor",
        "test_the_fp16_kernels_are_within_1_3x_of_the_h100_floor", "test_the_roofline_variants_are_listed_with_their_own_case"}
BOUNDS = ("test_the_bf16_kernels_at_a_temperature_are_within_1_25x_of_the_h100_floor[True-True-True]",
          "test_the_fp16_kernels_are_within_1_3x_of_the_h100_floor[True-True-0.7-True]")
SELECT = f"not ({' or '.join(sorted(SLOW))}) or {' or '.join(BOUNDS)}"


def test_the_installed_triton_is_supported() -> None:
    triton = pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton.triton_backend import MIN_TRITON, _version

    assert _version(triton.__version__) >= MIN_TRITON == (3, 6)


def test_the_slow_ptx_tests_are_the_ones_named_here() -> None:
    """:data:`SLOW` is test_triton_ptx.py's slow set, so the run under 3.6 below keeps its whole quick set."""
    pytest.importorskip("triton")
    import test_triton_ptx as ptx

    slow = {name for name, fn in vars(ptx).items()
            if name.startswith("test_") and any(mark.name == "slow" for mark in getattr(fn, "pytestmark", []))}
    assert slow == SLOW


@pytest.mark.slow
def test_the_oldest_supported_triton_passes_the_interpreter_and_ptx_checks() -> None:
    if not (OLDEST_DIR / "triton" / "__init__.py").exists():
        message = f"Triton {OLDEST} is not installed in {OLDEST_DIR}; run `{INSTALL}` (.ci/run does)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(OLDEST_DIR), str(REPO)])}
    # one interpreter (one import of torch and Triton): the Triton it imports and what the interpreter
    # mode says of it, on one line, then under pytest the PTX/AMD checks (the quick set) and the bounds
    # of the variants nearest them under 3.6 (the entropy gradient at T = 0.7: bf16 1.25x, fp16 1.3x
    # the H100 floor forward+backward; docs/performance.md, "The variants"), every result listed
    probe = ("import json, sys, triton, pytest; "
             "from rl_engine.logprob.backends.triton.triton_backend import triton_unavailable as u; "
             "print('PROBE ' + json.dumps([triton.__version__, u('interpreter')]), flush=True); "
             f"sys.exit(pytest.main(['-q', '-rA', '-p', 'no:cacheprovider', '-m', 'slow or not slow', '-k', {SELECT!r}, "
             "'-W', 'ignore::RuntimeWarning', 'tests/test_triton_ptx.py']))")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=900,
                          check=False, cwd=REPO)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary and "failed" not in summary, tail
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    version, refusal = json.loads(line.removeprefix("PROBE "))
    assert version == OLDEST
    assert "Triton 3.6.0's interpreter computes tl.fma" in refusal and "rounds twice" in refusal
    passed = {line.removeprefix("PASSED tests/test_triton_ptx.py::") for line in done.stdout.splitlines()
              if line.startswith("PASSED ")}
    assert set(BOUNDS) <= passed, (BOUNDS, passed)
    # the quick set ran whole: every other test passed is not slow
    assert not {name.split("[")[0] for name in passed - set(BOUNDS)} & SLOW, passed
