"""The suite's threads sleep at OpenMP barriers instead of spinning (tests/conftest.py).

Two pytest workers on two cores, each with two intra-op threads, spin against each other at every
parallel region's end under libgomp's default (300,000 spins before sleeping): on a loaded machine
one test took 38 s of wall for a second of work. conftest.py sets ``OMP_WAIT_POLICY=PASSIVE``
before torch loads, so the workers and every process a test starts get a spin count of 0. Read
from libgomp itself: ``OMP_DISPLAY_ENV=VERBOSE`` makes it print its settings when it starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

PROBE = "import torch; torch.ones(64).sum()"


def gomp_spincount(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE], env={**env, "OMP_DISPLAY_ENV": "VERBOSE"},
                          capture_output=True, text=True, timeout=120, check=True)
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
    assert found, done.stderr[-2000:]
    return int(found.group(1))


def test_a_process_a_test_starts_sleeps_at_openmp_barriers() -> None:
    assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"
    assert gomp_spincount(dict(os.environ)) == 0
    # negative control: without the setting, libgomp spins before it sleeps
    assert gomp_spincount({k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}) > 0
