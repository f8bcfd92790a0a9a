"""Hostile workflow configs and kills (issue 20, items 11 and 13), under real snakemake runs.

11. The regression rule joined ``pytest_args`` unquoted into its shell command:
    ``-x;touch /tmp/x;#`` ran ``touch`` and commented out the time limit and the log redirect,
    and an argument with spaces was split. Each argument is now quoted: the test gives
    arguments with ``;``, ``$(...)`` and backquotes, and one with spaces, and checks that pytest
    received each one whole, nothing ran, and the time limit and the log still apply.
13. A SIGKILL of the archive rule's shell wrapper orphaned the archive process (it finished
    after Snakemake had recorded the job as failed). The rule now ``exec``\\ s the verb, so the
    process Snakemake started is the archive process. The test replaces only the archive
    program (a stand-in that waits, then writes the outputs) in a scratch copy whose other
    evidence files are placeholders, so no campaign runs. A SIGKILLed snakemake leaves its lock:
    the second test shows the refusal, ``--unlock`` and the rerun that docs/workflow.md describes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rl_engine.evidence.regression import KILL_GRACE_S

from _workflow_util import SMALL_VOCAB, copy_repo, env_for, run_name_of, snakemake, snakemake_cmd, write_config

pytestmark = pytest.mark.slow  # end to end: snakemake runs (in the full suite, not the quick loop)

PROBE = "tests/test_probe_of_pytest_args.py"
TIME_LIMIT_S = 5
SLEEP_S = 30


def test_pytest_args_reach_pytest_whole_and_run_nothing_in_the_shell(tmp_path: Path) -> None:
    """Before: ``touch`` ran, ``-k 'probe or sleeps'`` was split, and ``--timeout-s`` and the log
    redirect were commented out (pytest ran its 30 s test to the end, the rule passed)."""
    repo = copy_repo(tmp_path)
    argv_file, marks = tmp_path / "argv.json", [tmp_path / f"ran{i}" for i in range(3)]
    (repo / PROBE).write_text(
        "import json\nimport sys\nimport time\n\n\n"
        f"def test_probe():\n    with open({str(argv_file)!r}, 'w') as f:\n        json.dump(sys.argv, f)\n\n\n"
        f"def test_sleeps():\n    time.sleep({SLEEP_S})\n"
    )
    args = [
        f"--deselect={PROBE}::absent;touch {marks[0]};#",
        f"--deselect={PROBE}::absent$(touch {marks[1]})",
        f"--deselect={PROBE}::absent`touch {marks[2]}`",
        "-k", "probe or sleeps",
    ]
    write_config(repo, {**SMALL_VOCAB, "topologies": ["1x1", "2x1"],
                        "regression": {"tests": [PROBE], "pytest_args": args, "timeout_s": TIME_LIMIT_S}})
    name = run_name_of(repo)
    start = time.monotonic()
    done = snakemake(repo, f"results/{name}/regression.json", timeout=300)
    elapsed = time.monotonic() - start
    text = done.stdout + done.stderr
    assert [m.name for m in marks if m.exists()] == [], text[-3000:]  # no shell ran them
    argv = json.loads(argv_file.read_text())  # what pytest was started with
    start_at = argv.index(args[0])
    assert argv[start_at:start_at + len(args)] == args, argv  # each one whole, in order
    # the time limit applied (the sleeping test was stopped) and the verb's output is in the log
    assert done.returncode != 0, text[-3000:]
    log = (repo / "results" / name / "logs" / "regression.log").read_text()
    assert f"pytest exceeded --timeout-s={TIME_LIMIT_S}" in log, log[-3000:]
    assert elapsed < TIME_LIMIT_S + KILL_GRACE_S + 60, elapsed
