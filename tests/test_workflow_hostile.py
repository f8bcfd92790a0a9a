"""Hostile workflow configs and kills, under real snakemake runs.

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

from rl_engine.proctree import alive

from _procs import parent
from _workflow_util import SMALL_VOCAB, copy_repo, env_for, run_name_of, snakemake, snakemake_cmd, write_config

pytestmark = pytest.mark.slow  # end to end: snakemake runs (in the full suite, not the quick loop)

PROBE = "tests/test_probe_of_pytest_args.py"
# The limit stops the sleeping test; the probe must have run before it (the scratch copy's conftest,
# torch and the helpers, is emptied: pytest starts in 2.4 s on a quiet 2-core VM). A run whose limit
# came before the probe wrote says nothing, and runs again with twice the limit: the first limit is
# about six quiet starts (8 s was missed beside the rest of the suite, costing a second run), and a
# loaded machine costs another run, never the verdict.
TIME_LIMITS_S = (16, 32, 64, 128)
# an hour: a run that ends at all had its sleeping test stopped by the limit (no bound on how long the
# stop took, which a loaded machine stretches; snakemake's own timeout bounds a failure)
SLEEP_S = 3600


def test_pytest_args_reach_pytest_whole_and_run_nothing_in_the_shell(tmp_path: Path) -> None:
    """pytest_args reach pytest as separate words, never through a shell: otherwise ``touch`` would
    run, ``-k 'probe or sleeps'`` would be split, and a ``#`` would comment out ``--timeout-s`` and
    the log redirect (pytest would run its sleeping test to the end and the rule would pass)."""
    repo = copy_repo(tmp_path)
    (repo / "tests" / "conftest.py").write_text('"""Emptied in this scratch copy: the probe needs a quick start."""\n')
    argv_file, marks = tmp_path / "argv.json", [tmp_path / f"ran{i}" for i in range(3)]
    (repo / PROBE).write_text(
        "import json\nimport os\nimport sys\nimport time\n\n\n"
        f"def test_probe():\n    with open({str(argv_file) + '.part'!r}, 'w') as f:\n        json.dump(sys.argv, f)\n"
        f"    os.replace({str(argv_file) + '.part'!r}, {str(argv_file)!r})\n\n\n"
        f"def test_sleeps():\n    time.sleep({SLEEP_S})\n"
    )
    args = [
        f"--deselect={PROBE}::absent;touch {marks[0]};#",
        f"--deselect={PROBE}::absent$(touch {marks[1]})",
        f"--deselect={PROBE}::absent`touch {marks[2]}`",
        "-k", "probe or sleeps",
    ]
    for limit in TIME_LIMITS_S:  # the limit is no part of the run's name: each try is the same run
        write_config(repo, {**SMALL_VOCAB, "topologies": ["1x1", "2x1"],
                            "regression": {"tests": [PROBE], "pytest_args": args, "timeout_s": limit}})
        name = run_name_of(repo)
        start = time.monotonic()
        done = snakemake(repo, f"results/{name}/regression.json", timeout=300)
        elapsed = time.monotonic() - start
        text = done.stdout + done.stderr
        if argv_file.exists() or done.returncode == 0:
            break
    assert [m.name for m in marks if m.exists()] == [], text[-3000:]  # no shell ran them
    argv = json.loads(argv_file.read_text())  # what pytest was started with
    start_at = argv.index(args[0])
    assert argv[start_at:start_at + len(args)] == args, argv  # each one whole, in order
    # the time limit applied (the sleeping test was stopped) and the verb's output is in the log
    assert done.returncode != 0, text[-3000:]
    log = (repo / "results" / name / "logs" / "regression.log").read_text()
    assert f"pytest exceeded --timeout-s={limit}" in log, log[-3000:]
    assert elapsed < SLEEP_S, elapsed


# ----- 13. killing the workflow during the archive stage --------------------------------------

FAKE_ARCHIVE = '''"""Stands in for `python -m rl_engine archive` in a scratch copy: says it started, waits for the
test's release (a file named as the marker plus ".release"; at most an hour), writes."""
import argparse, os, time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--run-dir"); p.add_argument("--output")
p.add_argument("--schemas", nargs="*"); p.add_argument("--files", nargs="*"); p.add_argument("--spec")
p.add_argument("--workflow", nargs="*")
a = p.parse_args()
marker = Path(os.environ["FAKE_ARCHIVE_MARKER"])
marker.with_suffix(".tmp").write_text(str(os.getpid()))
marker.with_suffix(".tmp").rename(marker)
release = Path(str(marker) + ".release")
deadline = time.monotonic() + 3600
while not release.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
Path(a.output).write_bytes(b"an archive written after the job was killed")
Path(a.output + ".sha256").write_text("0" * 64 + "  x\\n")
'''
# After the job's kill the test releases the stand-in and waits this long for an archive process that
# outlived the job to exit: released, it writes and exits at once (the bound only ends a failure)
OUTLIVE_LIMIT_S = 30.0


@pytest.fixture(scope="module")
def archive_stage(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A scratch copy where only the archive job is left to run: every input of the archive rule
    (listed by a dry run) is a placeholder, and the archive program is FAKE_ARCHIVE; the rule's
    shell command is otherwise the real one."""
    base = tmp_path_factory.mktemp("archive-stage")
    repo = copy_repo(base)
    write_config(repo, {**SMALL_VOCAB, "topologies": ["1x1", "2x1"]})
    target = f"results/{run_name_of(repo)}.tar.gz"
    done = subprocess.run(snakemake_cmd("-n", target), cwd=repo, env=env_for(repo), capture_output=True,
                          text=True, timeout=300)
    found = re.search(r"rule archive:\n\s+input: ([^\n]+)", done.stdout + done.stderr)
    assert done.returncode == 0 and found, (done.stdout + done.stderr)[-3000:]
    for name in found.group(1).split(", "):
        path = repo / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("placeholder\n")
    (repo / "fake_archive.py").write_text(FAKE_ARCHIVE)
    rule = repo / "workflow" / "rules" / "archive.smk"
    original = rule.read_text()
    assert original.count("python -m rl_engine archive ") == 1
    rule.write_text(original.replace("python -m rl_engine archive ", f"python {repo / 'fake_archive.py'} "))
    return repo, target


def _release(marker: Path) -> Path:
    return Path(f"{marker}.release")


def _start(repo: Path, target: str, marker: Path, log: Path) -> subprocess.Popen[bytes]:
    marker.unlink(missing_ok=True)
    _release(marker).unlink(missing_ok=True)
    for left in (repo / target, repo / f"{target}.sha256"):  # from an earlier test
        left.unlink(missing_ok=True)
    env = env_for(repo, {"FAKE_ARCHIVE_MARKER": str(marker)})
    with open(log, "w") as out:
        return subprocess.Popen(snakemake_cmd(target), cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _kill_group(proc: subprocess.Popen[bytes], archive: int) -> None:
    """Cleanup: snakemake's group, and the archive process should it have outlived it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if archive and alive(archive):
        os.kill(archive, signal.SIGKILL)


def _archive_pid(proc: subprocess.Popen[bytes], marker: Path, log: Path) -> int:
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "the archive job did not start"
        time.sleep(0.1)
    return int(marker.read_text())


def test_a_sigkill_of_the_archive_job_leaves_no_archive_process_and_no_archive(
    archive_stage: tuple[Path, str], tmp_path: Path
) -> None:
    """The archive job's process is the archive process itself: were it ``bash -c '...; python -m
    rl_engine archive ...'``, SIGKILL would kill bash, the archive process would go on, and its
    archive would appear after the job had failed. The stand-in is released once snakemake has
    ended, and an archive process that outlived the job would write then."""
    repo, target = archive_stage
    marker, log = tmp_path / "started", tmp_path / "snakemake.log"
    proc = _start(repo, target, marker, log)
    archive = 0
    try:
        archive = _archive_pid(proc, marker, log)
        job = archive  # the job's process: the child of snakemake the archive process descends from
        while parent(job) != proc.pid:
            job = parent(job)
            assert job > 1, "the archive process does not descend from snakemake"
        os.kill(job, signal.SIGKILL)
        rc = proc.wait(timeout=120)
        left = alive(archive)
        _release(marker).write_text("")  # a surviving archive process writes its archive now...
        deadline = time.monotonic() + OUTLIVE_LIMIT_S
        while alive(archive) and time.monotonic() < deadline:  # ...and exits
            time.sleep(0.05)
    finally:
        _kill_group(proc, archive)
    text = log.read_text()
    assert not left, "the archive process outlived its killed job"
    assert not (repo / target).exists() and not (repo / f"{target}.sha256").exists()
    assert rc != 0 and "Error in rule archive" in text, text[-3000:]
    assert job == archive  # the rule execs the verb: no wrapper between snakemake and the archive


def test_a_killed_snakemake_leaves_a_lock_that_unlock_clears_and_the_rerun_completes(
    archive_stage: tuple[Path, str], tmp_path: Path
) -> None:
    """docs/workflow.md, "A killed run": kill the whole process group, ``--unlock``, run again."""
    repo, target = archive_stage
    marker, log = tmp_path / "started", tmp_path / "snakemake.log"
    proc = _start(repo, target, marker, log)
    archive = 0
    try:
        archive = _archive_pid(proc, marker, log)
        os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its jobs: they share its process group
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        while alive(archive) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(archive)
    finally:
        _kill_group(proc, archive)
    _release(marker).write_text("")  # the rerun's stand-in writes at once
    env = env_for(repo, {"FAKE_ARCHIVE_MARKER": str(marker)})
    refused = snakemake(repo, target, env=env, timeout=300)
    assert refused.returncode != 0 and "Directory cannot be locked" in refused.stdout + refused.stderr
    assert "--unlock" in refused.stdout + refused.stderr
    unlocked = snakemake(repo, "--unlock", env=env, timeout=300)
    assert unlocked.returncode == 0, unlocked.stderr[-3000:]
    rerun = snakemake(repo, target, env=env, timeout=300)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    assert (repo / target).read_bytes() == b"an archive written after the job was killed"
    docs = (Path(__file__).resolve().parents[1] / "docs" / "workflow.md").read_text()
    assert "snakemake --unlock" in docs and "kill -KILL -- -" in docs
