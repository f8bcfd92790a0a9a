"""Faults during a real workflow run, and corrupted evidence through the real workflow.

One small campaign (real vocabulary 1000 / padded 1024 / 8 tiles, TP x CP = 1x2 and 2x1: a CP>1
and a TP>1 topology, the first the cross-topology reference; a short focused regression) runs with
``snakemake --cores 8`` in a temporary copy of the repository. Faults are real: a rank hangs or
SIGKILLs itself (``RL_ENGINE_FAULT``), a second snakemake runs on the same directory, the archive
process is SIGKILLed while it writes. The tests share that one copy and run in file order; each
names the state it starts from and leaves, and a run one test makes serves the next where it can
(the hung topology's control is the rerun of the killed one; the archive job is killed in that
rerun, and the run that rebuilds it alone also shows an undeclared report is never packed), so the
module stays within one small campaign's cost.

Holding the archive writer at a known point: a ``sitecustomize`` on ``PYTHONPATH`` (written by
the ``hold_hook`` fixture) makes ``os.fsync`` of one chosen temporary file sleep, so the test
can SIGKILL the real process exactly while the archive's bytes sit in a temporary file next
to the final path (or after the archive was renamed into place, while its ``.sha256`` is
written). Nothing else in the process is changed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rl_engine import jsonio

from _procs import mentioning
from _workflow_util import (
    SHORT_REGRESSION,
    SMALL_VOCAB,
    copy_repo,
    env_for,
    jobs_run,
    run_name_of,
    snakemake,
    snakemake_cmd,
    verify_here,
    write_config,
)

pytestmark = pytest.mark.slow  # end to end: snakemake runs (in the full suite, not the quick loop)

LABELS = ("tp1-cp2", "tp2-cp1")
CASE: dict[str, Any] = {
    **SMALL_VOCAB,
    "topologies": ["1x2", "2x1"],
    "regression": SHORT_REGRESSION,
    "topology_timeout_s": 180,
    "pg_timeout_s": 60,
}
HANG_LIMIT_S = 20
# the hang's fault setting; the rerun of the killed TP=2 x CP=1 runs under it too, as its control
HANG = "hang:1x2:1"
DOWNSTREAM = {"validation": 1, "crosscheck": 1, "summary": 1, "archive": 1, "verify_archive": 1}
HOOK = '''"""Test hook of tests/test_gates_workflow.py: hold one fsync so the test can kill the process there,
or act while it is held and then release it (a file named as the marker plus ".release")."""
import json
import os
import re
import time

_MARKER = os.environ.get("GATES_HOLD_FSYNC_MARKER")
_PATTERN = os.environ.get("GATES_HOLD_FSYNC_PATTERN")
if _MARKER and _PATTERN:
    _real_fsync = os.fsync

    def _held_fsync(fd):
        try:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            name = ""
        if re.fullmatch(_PATTERN, name):
            with open(_MARKER + ".part", "w") as handle:
                handle.write(f"{os.getpid()} {name}")
            os.replace(_MARKER + ".part", _MARKER)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not os.path.exists(_MARKER + ".release"):
                time.sleep(0.05)
        return _real_fsync(fd)

    os.fsync = _held_fsync
'''


def hold_archive(name: str) -> str:
    """mkstemp names: "." + target name + "." + 8 of [a-z0-9_] + ".tmp" (jsonio.atomic_write_bytes)."""
    return rf"\.{re.escape(name)}\.tar\.gz\.[a-z0-9_]+\.tmp"


def hold_sidecar(name: str) -> str:
    return rf"\.{re.escape(name)}\.tar\.gz\.sha256\.[a-z0-9_]+\.tmp"


@dataclass(frozen=True)
class Workflow:
    repo: Path
    name: str  # the run name of CASE
    # "complete" while the test that ran last left a verified archive and said so (:func:`left_complete`)
    marks: set[str] = field(default_factory=set)
    # what a test hands the next: the console of the run whose archive job was killed, the held file
    handed: dict[str, str] = field(default_factory=dict)

    @property
    def results(self) -> Path:
        return self.repo / "results"

    @property
    def run(self) -> Path:
        return self.results / self.name

    @property
    def archive(self) -> Path:
        return self.results / f"{self.name}.tar.gz"

    @property
    def finals(self) -> tuple[Path, Path, Path]:
        """The archive, its .sha256 and the workflow's verify.json."""
        return self.archive, self.results / f"{self.name}.tar.gz.sha256", self.results / f"{self.name}.verify.json"

    def report(self, label: str) -> Path:
        return self.run / f"{label}.json"

    def files_of(self, label: str) -> list[Path]:
        return [self.report(label)] + [self.run / f"{label}.{t}.f32" for t in ("logp", "lse", "entropy")]

    def log(self, name: str) -> str:
        return (self.run / "logs" / f"{name}.log").read_text(errors="replace")

    def declared(self) -> list[Path]:
        """The archive rule's inputs in the run: every file the workflow wrote there (checked by
        tests/test_workflow.py::test_default_campaign_builds_an_archive_that_verifies)."""
        return sorted(p for p in self.run.rglob("*") if p.is_file() and not p.name.startswith("."))

    def remove(self, *paths: Path) -> None:
        for path in paths:
            path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def wf(tmp_path_factory: pytest.TempPathFactory) -> Workflow:
    repo = copy_repo(tmp_path_factory.mktemp("gates-workflow"))
    write_config(repo, CASE)
    return Workflow(repo, run_name_of(repo))


@pytest.fixture(scope="module")
def hold_hook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hold-hook")
    (directory / "sitecustomize.py").write_text(HOOK)
    return directory


def text_of(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout + done.stderr


def failed_rules(text: str) -> list[str]:
    return re.findall(r"^Error in rule (\w+):", text, re.M)


def started(text: str, rule: str) -> bool:
    return re.search(rf"^(local)?rule {rule}:", text, re.M) is not None


def ensure_complete(wf: Workflow) -> None:
    """Bring the run to a verified archive. Where the test before left it so (its last step a
    successful run, :func:`left_complete`), nothing is run: a snakemake start that has nothing to do
    proves nothing here. A test that failed, or left the run changed, leaves no mark, and snakemake runs."""
    if "complete" in wf.marks:
        wf.marks.discard("complete")
        assert wf.archive.is_file()
        return
    done = snakemake(wf.repo)
    assert done.returncode == 0, text_of(done)[-6000:]
    assert wf.archive.is_file()


def left_complete(wf: Workflow) -> None:
    """Called last by a test whose last run ended with a verified archive and that changed nothing since."""
    wf.marks.add("complete")


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen[Any], what: str, limit_s: float = 300) -> None:
    """Poll ``condition`` while ``proc`` runs; fail (not hang) if it exits first or never happens."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the process exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {limit_s} s")
        time.sleep(0.05)


def mtimes(paths: list[Path]) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in paths}


def hold_env(wf: Workflow, hook: Path, marker: Path, pattern: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    held = {"GATES_HOLD_FSYNC_MARKER": str(marker), "GATES_HOLD_FSYNC_PATTERN": pattern}
    return env_for(wf.repo, {**held, **(extra or {})}, prepend=hook)


# ---------------------------------------------------------------- faults during a run


def test_hanging_rank_fails_the_rule_at_its_time_limit(wf: Workflow) -> None:
    """From scratch, rank 1 of TP=1 x CP=2 sleeps forever once the mesh is up; with
    topology_timeout_s=20 (given to this run alone) the rule fails at the limit. Its control, a
    topology under the same fault setting that completes, is TP=2 x CP=1's rerun in
    :func:`test_rerun_redoes_the_killed_topology_alone_while_a_second_run_is_locked_out`: under the
    default limit, as a healthy run is never given a limit that a loaded machine could miss, so
    the verdict does not depend on the load."""
    env = env_for(wf.repo, {"RL_ENGINE_FAULT": HANG})
    hung = str(wf.report("tp1-cp2").relative_to(wf.repo))
    done = snakemake(wf.repo, hung, "--config", f"topology_timeout_s={HANG_LIMIT_S}", env=env, timeout=600)
    text = text_of(done)
    assert done.returncode != 0
    assert failed_rules(text) == ["topology"], text[-4000:]
    assert "wildcards: tp=1, cp=2" in text and "returned non-zero exit status 124." in text
    assert f"--tp 1 --cp 2 --timeout-s {HANG_LIMIT_S} " in text
    log = wf.log("tp1-cp2")
    assert (f"error: topology 1x2 exceeded --timeout-s={HANG_LIMIT_S}; the runner and its ranks were "
            "killed and its outputs removed") in log
    assert [p.name for p in wf.files_of("tp1-cp2") if p.exists()] == []
    assert mentioning(str(wf.report("tp1-cp2"))) == {}  # the hung rank is gone too


def test_killed_rank_fails_only_its_topology_and_leaves_no_report(wf: Workflow) -> None:
    """Where the hang left the run (plan made, no report), rank 1 of TP=2 x CP=1 SIGKILLs itself
    once the mesh is up; TP=1 x CP=2, under the same fault setting, completes."""
    assert not wf.report("tp1-cp2").exists(), "starts where the hanging-rank test left the run"
    done = snakemake(wf.repo, env=env_for(wf.repo, {"RL_ENGINE_FAULT": "kill:2x1:1"}))
    text = text_of(done)
    assert done.returncode != 0, text[-4000:]
    assert failed_rules(text) == ["topology"], text[-6000:]
    assert "wildcards: tp=2, cp=1" in text
    # the rule ended on the dead rank (launch exit 2: no valid report), not at its time limit (124)
    assert "returned non-zero exit status 2." in text and "exit status 124" not in text
    log = wf.log("tp2-cp1")
    assert "(SIGKILL)" in log and "rank      : 1" in log  # torchrun's record of the killed rank
    assert "error: topology 2x1: runner exited with 1; no valid report was written; outputs removed" in log
    assert [p.name for p in wf.files_of("tp2-cp1") if p.exists()] == []
    assert list(wf.run.glob(".tp2-cp1*")) == []  # no partial temporary report either
    # keep-going: the other topology completed and passed
    assert jsonio.load(wf.report("tp1-cp2"))["passed"] is True
    assert not (wf.run / "validation.json").exists()
    assert not any(p.exists() for p in wf.finals)


def test_rerun_redoes_the_killed_topology_alone_while_a_second_run_is_locked_out(wf: Workflow, hold_hook: Path,
                                                                             tmp_path: Path) -> None:
    """The next plain ``snakemake --cores 8`` reruns TP=2 x CP=1 alone, under the hang's fault
    setting (its control: a topology that setting does not name completes under the default limit),
    and goes on to the archive; a second snakemake started on the same directory meanwhile is
    refused by the lock. The first run is held at its archive's ``.sha256`` (work still to do, the
    lock taken) until the second has been refused: the verdict does not depend on how fast the
    machine is. The held archive job is then SIGKILLed, which
    :func:`test_archive_job_killed_under_snakemake_leaves_no_archive_and_reruns` goes on from."""
    assert not wf.report("tp2-cp1").exists(), "starts where the killed-rank test left the run"
    kept = wf.files_of("tp1-cp2")
    before = mtimes(kept)
    locks = wf.repo / ".snakemake" / "locks"
    first_log = tmp_path / "first.log"
    marker = tmp_path / "held"
    env = hold_env(wf, hold_hook, marker, hold_sidecar(wf.name), {"RL_ENGINE_FAULT": HANG})
    with open(first_log, "w") as out:
        first = subprocess.Popen(snakemake_cmd(), cwd=wf.repo, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(marker.exists, first, "the first run reached its archive's .sha256")
        pid, held = marker.read_text().split()
        assert locks.is_dir() and any(locks.glob("*.lock")), "the first run holds its lock"
        second = snakemake(wf.repo, timeout=300)
        assert wf.archive.is_file() and not wf.finals[1].exists()  # the state the kill interrupts
        os.kill(int(pid), signal.SIGKILL)
        first_rc = first.wait(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    second_text = text_of(second)
    assert second.returncode != 0
    assert "Directory cannot be locked" in second_text, second_text[-3000:]
    assert not re.search(r"^(local)?rule \w+:", second_text, re.M)  # it started no job
    text = first_log.read_text()
    wf.handed.update(console=text, held=held)
    assert first_rc != 0, text[-6000:]
    counts = {k: v for k, v in jobs_run(text).items() if k != "all"}
    assert counts == {"topology": 1, **DOWNSTREAM}, counts
    assert "wildcards: tp=2, cp=1" in text
    assert mtimes(kept) == before  # the completed topology was not redone
    report = jsonio.load(wf.report("tp2-cp1"))  # the control: recorded the hang's setting, ran, passed
    assert report["fault_injection"] == HANG and report["passed"] is True
    for gate in ("validation.json", "crosscheck.json", "SUMMARY.md"):  # the gates passed before the archive
        assert (wf.run / gate).is_file(), gate
    assert not locks.exists() or list(locks.iterdir()) == []  # a failed run leaves no lock either


def test_archive_job_killed_under_snakemake_leaves_no_archive_and_reruns(wf: Workflow) -> None:
    """The archive job of the rerun above was SIGKILLed after its archive was renamed into place,
    while the .sha256 was written: Snakemake failed the job and removed the archive. A report of a
    topology the plan does not list, dropped into the run after the gates passed, is no rule's
    input: the next run rebuilds the archive and its verification alone (no gate) and does not pack
    it; the archive verifies with ``--recompute``."""
    text, held = wf.handed.pop("console"), wf.handed.pop("held")
    assert failed_rules(text) == ["archive"], text[-4000:]
    # the rule execs its verb, so the process Snakemake waits on is the killed one (Python's
    # CalledProcessError words a death by signal so)
    assert "died with <Signals.SIGKILL: 9>." in text, text[-4000:]
    assert "Removing output files of failed job archive since they might be corrupted" in text
    assert not any(p.exists() for p in wf.finals)
    # hidden, never at a final path (results/.reuse is the reuse cache's directory, not the archive's)
    assert sorted(p.name for p in wf.results.glob(".*") if p.is_file()) == [held]
    wf.remove(wf.results / held)
    stale = wf.run / "tp4-cp1.json"
    stale.write_bytes(wf.report("tp1-cp2").read_bytes())
    try:
        done = snakemake(wf.repo)
        text = text_of(done)
        assert done.returncode == 0, text[-4000:]
        # the verify_archive job of that run verified the rebuilt archive (the run exited 0)
        assert {k: v for k, v in jobs_run(text).items() if k != "all"} == {"archive": 1, "verify_archive": 1}
        with tarfile.open(wf.archive) as tar:
            assert f"{wf.name}/tp4-cp1.json" not in tar.getnames()
    finally:
        stale.unlink()
    assert verify_here(wf.archive, "--recompute") == 0  # its report: the captured stdout
    left_complete(wf)  # the undeclared report, no rule's input, is gone again


def test_archive_verb_killed_mid_write_leaves_nothing_at_the_final_path(wf: Workflow, hold_hook: Path,
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m rl_engine archive`` SIGKILLed while the archive's bytes are in its temporary file;
    the verb run again (in this process: the claim is the killed process's leftovers) writes an
    archive that verifies."""
    from rl_engine import cli

    ensure_complete(wf)
    out = tmp_path / "out" / f"{wf.name}.tar.gz"
    out.parent.mkdir()
    out.write_bytes(b"stale archive of an earlier run")
    out.with_name(out.name + ".sha256").write_text("stale\n")
    marker = tmp_path / "held"
    args = ["archive", "--run-dir", str(wf.run), "--output", str(out),
            "--spec", str(wf.repo / "docs" / "arithmetic.md"), "--schemas", *map(str, sorted((wf.repo / "schemas").glob("*.schema.json"))),
            "--workflow", str(wf.repo / "workflow" / "Snakefile"), *map(str, sorted((wf.repo / "workflow" / "rules").glob("*.smk"))),
            "--files", *map(str, wf.declared())]
    proc = subprocess.Popen([sys.executable, "-m", "rl_engine", *args], cwd=wf.repo,
                            env=hold_env(wf, hold_hook, marker, hold_archive(wf.name)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(marker.exists, proc, "the archive writer reached its fsync")
        pid, held = marker.read_text().split()
        assert int(pid) == proc.pid
        assert (out.parent / held).stat().st_size > 1000  # the whole archive is in the temporary file
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the stale outputs were removed first; the killed writer's hidden temporary file is all that is left
    assert sorted(p.name for p in out.parent.iterdir()) == [held]
    monkeypatch.chdir(wf.repo)
    assert cli.main(args) == 0
    assert verify_here(out) == 0
    left_complete(wf)  # it wrote outside the run


# ---------------------------------------------------------------- corrupted evidence through the workflow


def test_a_report_edited_after_the_gates_reruns_them(wf: Workflow) -> None:
    """The archive packs its declared inputs and Snakemake decides what is stale. A report
    edited after the gates passed (same evidence, new bytes) is an input of validation and of the
    archive: the gates, the summary, the archive and its verification run again, once each, and the
    archive holds the new bytes. (A report the plan does not list, added after the gates passed, is
    no rule's input: :func:`test_archive_job_killed_under_snakemake_leaves_no_archive_and_reruns`.)"""
    ensure_complete(wf)
    report = wf.report("tp1-cp2")
    edited = json.dumps(jsonio.load(report), indent=1, sort_keys=True).encode()
    assert edited != report.read_bytes()
    report.write_bytes(edited)
    done = snakemake(wf.repo)
    text = text_of(done)
    assert done.returncode == 0, text[-4000:]
    assert {k: v for k, v in jobs_run(text).items() if k != "all"} == DOWNSTREAM  # verify_archive passed too
    with tarfile.open(wf.archive) as tar:
        assert tar.extractfile(f"{wf.name}/tp1-cp2.json").read() == edited  # type: ignore[union-attr]
    left_complete(wf)


def _edit(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    report = jsonio.load(path)
    change(report)
    jsonio.write_json(path, report)


def _nan_statistic(path: Path) -> None:
    report = jsonio.load(path)
    report["drift"]["fp32_oracle"]["lse"]["max_abs"] = float("nan")
    path.write_text(json.dumps(report, indent=2))  # as a non-strict writer would
    assert "NaN" in path.read_text()


def _fallen_back(report: dict[str, Any]) -> None:
    report.update(passed=False, fallback=True, actual_backend="cpu-vocab-parallel-logp-ws2")
    report.pop("reduction")


def test_corrupted_evidence_fails_the_validation_rule_naming_file_and_field(wf: Workflow) -> None:
    """Several corruptions at once; the validation rule names each by file and field, no archive.
    A loaded report gets every finding at once, so TP=1 x CP=2 carries all but the NaN (a report
    that does not load)."""
    ensure_complete(wf)
    saved = {p: p.read_bytes() for p in wf.run.glob("tp*-cp*.*")}
    wf.remove(*wf.finals)
    stale = wf.run / "tp4-cp1.json"
    try:
        _edit(wf.report("tp1-cp2"), _fallen_back)
        _nan_statistic(wf.report("tp2-cp1"))
        raw = wf.run / "tp1-cp2.lse.f32"
        data = bytearray(raw.read_bytes())
        data[9] ^= 0x01
        raw.write_bytes(bytes(data))
        stale.write_bytes(saved[wf.report("tp1-cp2")])  # a report of a topology the plan does not list
        done = snakemake(wf.repo)
        text = text_of(done)
        assert done.returncode != 0
        assert failed_rules(text) == ["validation"], text[-4000:]
        assert not started(text, "archive") and not any(p.exists() for p in wf.finals)
        assert not (wf.run / "validation.json").exists()  # a failed gate leaves no passing record
        log = wf.log("validation")
        for expected in (
            "tp1-cp2.json: passed: is False",
            "tp1-cp2.json: fallback: is True",
            "tp1-cp2.json: actual_backend: is 'cpu-vocab-parallel-logp-ws2'",
            "tp1-cp2.json: (file): schema report: 'reduction' is a required property",
            "tp2-cp1.json: drift.fp32_oracle.lse.max_abs: non-finite literal NaN",
            "tp1-cp2.json: tensors.lse.sha256:",
            "tp4-cp1.json: (file): topology tp4-cp1 is not in plan.json",
        ):
            assert expected in log, (expected, log)
    finally:
        for path, data in saved.items():
            path.write_bytes(data)
        stale.unlink(missing_ok=True)


def test_fingerprint_differing_in_one_topology_fails_the_crosscheck_rule(wf: Workflow) -> None:
    """Starts from restored (good) reports; validation passes, the cross-topology check does not."""
    path = wf.report("tp2-cp1")
    saved = path.read_bytes()
    wf.remove(*wf.finals)
    try:
        _edit(path, lambda r: r["bitwise_fingerprints"].update(candidate_grad_sha256="0" * 64))
        done = snakemake(wf.repo)
        text = text_of(done)
        assert done.returncode != 0
        assert failed_rules(text) == ["crosscheck"], text[-4000:]
        assert (wf.run / "validation.json").is_file()  # the per-report gate passed...
        log = wf.log("crosscheck")  # ...the cross-topology gate names topology and field
        assert f"tp2-cp1: bitwise_fingerprints.candidate_grad_sha256: '{'0' * 64}' differs from tp1-cp2's" in log
        assert "tp1-cp2: bitwise" not in log
        assert not started(text, "archive") and not any(p.exists() for p in wf.finals)
    finally:
        path.write_bytes(saved)


def test_really_failing_topology_keeps_its_report_and_blocks_the_archive(
        wf: Workflow, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """TP=2 x CP=1 really runs with a perturbed candidate (RL_ENGINE_FAULT=perturb:2x1): the workflow's
    validation gate fails on it, and the two gates' verbs on (a copy of) the run it left, in this
    process, fail too, naming that topology alone: ``validate`` its report (the other accepted),
    ``crosscheck`` its fingerprint, which differs from the reference's; ``summary`` of it says FAILED."""
    from rl_engine import cli

    wf.remove(*wf.files_of("tp2-cp1"), *wf.finals)
    done = snakemake(wf.repo, env=env_for(wf.repo, {"RL_ENGINE_FAULT": "perturb:2x1"}))
    text = text_of(done)
    assert done.returncode != 0
    assert failed_rules(text) == ["validation"], text[-4000:]  # the topology rule kept its report
    report = jsonio.load(wf.report("tp2-cp1"))
    assert report["passed"] is False and report["fault_injection"] == "perturb:2x1"
    assert "acceptance failed; report kept for the validation gate" in wf.log("tp2-cp1")
    log = wf.log("validation")
    assert "tp2-cp1.json: passed: is False" in log and "tp2-cp1.json: failures: must be empty" in log
    assert "tp1-cp2.json:" not in log
    assert not started(text, "archive") and not any(p.exists() for p in wf.finals)
    closing = done.stdout[done.stdout.rindex("rl_engine evidence workflow: result"):]  # the verdict
    assert "FAILED at validation gate (missing validation.json)" in closing, closing
    assert f"{wf.name}/logs/validation.log" in closing and "none: no archive is built" in closing
    # the gates' verbs and the summary on a copy of that run (the workflow's directory is left as it is)
    run = tmp_path / "run"
    shutil.copytree(wf.run, run)
    capsys.readouterr()
    assert cli.main(["validate", "--run-dir", str(run), "--output", str(run / "validation.json")]) == 1
    err = capsys.readouterr().err
    val = jsonio.load(run / "validation.json")
    assert val["passed"] is False and "tp2-cp1.json: passed: is False" in err, err
    assert {r["topology"]: r["accepted"] for r in val["reports"]} == {"tp1-cp2": True, "tp2-cp1": False}, val["reports"]
    assert cli.main(["crosscheck", "--run-dir", str(run), "--output", str(run / "crosscheck.json")]) == 1
    err = capsys.readouterr().err
    assert "tp2-cp1: bitwise_fingerprints.candidate_logp_sha256:" in err, err
    assert "tp1-cp2: bitwise" not in err  # only the perturbed topology is named
    # SUMMARY.md of the failing run says so, naming the failed topology's row
    assert cli.main(["summary", "--run-dir", str(run), "--output", str(run / "SUMMARY.md")]) == 0
    text = (run / "SUMMARY.md").read_text()
    assert "FAILED:" in text and "| 2 | 1 | 2 |" in text and "| Failed |" in text, text
    assert "1 of 2 topology reports passed" in text, text
