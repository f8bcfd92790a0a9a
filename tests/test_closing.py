"""The workflow's closing message.

:func:`rl_engine.workflow.closing` reads the files the stages left; these tests lay out
run directories by hand for each outcome, from the one stage list (:func:`rl_engine.rundir.stages`,
which the Snakefile's targets are built from too). ``tests/test_workflow.py`` checks the message of a
real run, and ``tests/test_gates_workflow.py`` that of a run whose validation gate fails.
"""

from __future__ import annotations

import importlib
import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from rl_engine import jsonio
from rl_engine.rundir import Topology, stages
from rl_engine.workflow import VERIFIED, closing, print_closing

NAME = "camp-abc1234-case-0123abcd"
STEMS = [Topology(1, 1), Topology(2, 1)]
DIGEST = "ab" * 32


def lay_out(results: Path, upto: str | None = None, verify_passed: bool = True, **flags: bool) -> Path:
    """Every stage's outputs up to (not including) the stage named ``upto``; all of them when None;
    ``flags``: the optional stages (capture, parity)."""
    run = results / NAME
    for stage in stages(run, STEMS, **flags):
        if stage.label == upto:
            break
        for path in stage.outputs:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.name.endswith(".sha256"):
                path.write_text(f"{DIGEST}  {NAME}.tar.gz\n")
            elif path.name.endswith(".verify.json"):
                jsonio.write_json(path, {"archive": f"{NAME}.tar.gz", "passed": verify_passed})
            else:
                path.write_text("x")
    return run


def rows(result) -> dict[str, str]:
    return dict(result.rows)


def test_verified_run_names_archive_checksum_summary_and_command(tmp_path: Path) -> None:
    run = lay_out(tmp_path / "results")
    result = closing(run, STEMS, succeeded=True)
    assert result.verdict == VERIFIED
    archive = tmp_path / "results" / f"{NAME}.tar.gz"
    assert rows(result)["Archive"] == str(archive) and rows(result)["SHA-256"] == DIGEST
    assert rows(result)["SUMMARY.md"] == str(run / "SUMMARY.md")
    assert rows(result)["Verify (reviewer)"] == f"python -m rl_engine verify {archive}"
    out = io.StringIO()
    print_closing(run, STEMS, succeeded=True, console=Console(file=out, width=200))
    printed = out.getvalue()
    for text in (VERIFIED, str(archive), DIGEST, str(run / "SUMMARY.md"), f"python -m rl_engine verify {archive}"):
        assert text in printed, (text, printed)


def test_failed_gate_is_named_with_its_log_and_an_older_archive_is_not_this_runs(tmp_path: Path) -> None:
    """A rerun whose validation fails beside the archive of an earlier run of the same case."""
    run = lay_out(tmp_path / "results")
    (run / "validation.json").unlink()  # what Snakemake does to a failed job's output
    result = closing(run, STEMS, succeeded=False)
    assert result.verdict == "FAILED at validation gate (missing validation.json)"
    assert rows(result)["Log"] == str(run / "logs" / "validation.log") + " (not written)"
    assert rows(result)["Archive"].startswith(f"none from this run; {tmp_path / 'results' / NAME}.tar.gz is from an "
                                              "earlier run of this case")
    assert "SHA-256" not in rows(result) and rows(result)["SUMMARY.md"] == "not written by this run"
    assert rows(result)["Verify (reviewer)"].endswith("(once the archive is built)")


@pytest.mark.parametrize(("upto", "verdict"), [
    ("regression", "FAILED at regression (missing regression.json, pytest-focused.log, pytest-junit.xml)"),
    ("case", "FAILED at case (missing case.json)"),
    ("topology tp2-cp1", "FAILED at topology tp2-cp1 (missing tp2-cp1.json, tp2-cp1.logp.f32, tp2-cp1.lse.f32, "
                         "tp2-cp1.entropy.f32)"),
    ("crosscheck gate", "FAILED at crosscheck gate (missing crosscheck.json)"),
    ("archive", "FAILED at archive (missing camp-abc1234-case-0123abcd.tar.gz, camp-abc1234-case-0123abcd.tar.gz.sha256)"),
])
def test_the_first_missing_stage_is_the_failing_one(tmp_path: Path, upto: str, verdict: str) -> None:
    run = lay_out(tmp_path / "results", upto=upto)
    result = closing(run, STEMS, succeeded=False)
    assert result.verdict == verdict
    assert ("Archive" in rows(result) and rows(result)["Archive"].startswith("none: no archive is built"))


def test_rejected_or_stale_verification_is_not_verified(tmp_path: Path) -> None:
    run = lay_out(tmp_path / "results", verify_passed=False)
    verify_json = tmp_path / "results" / f"{NAME}.verify.json"
    assert closing(run, STEMS, succeeded=False).verdict.startswith("FAILED at verify_archive: ")
    jsonio.write_json(verify_json, {"archive": f"{NAME}.tar.gz", "passed": True})
    assert closing(run, STEMS, succeeded=True).verdict == VERIFIED
    os.utime(verify_json, (1, 1))  # older than the archive it claims to have checked
    assert closing(run, STEMS, succeeded=True).verdict != VERIFIED
    jsonio.write_json(verify_json, {"archive": "other.tar.gz", "passed": True})
    assert closing(run, STEMS, succeeded=True).verdict != VERIFIED


def test_a_successful_partial_run_is_incomplete(tmp_path: Path) -> None:
    """Explicit targets (e.g. one report) succeed without the archive: not a failure, not verified."""
    run = lay_out(tmp_path / "results", upto="validation gate")
    result = closing(run, STEMS, succeeded=True)
    assert result.verdict == "INCOMPLETE: validation gate not built by this run (missing validation.json)"
    assert "Log" not in rows(result)


def test_every_stage_that_fails_is_named_with_its_own_log(tmp_path: Path) -> None:
    """Each stage in turn fails (its outputs are gone, as Snakemake leaves a failed job, and every
    later stage's too): the closing table names that stage and that stage's log, with no other stage
    named. The labels and logs come from the one stage list; the expected logs are spelled out here."""
    results = tmp_path / "results"
    run = results / NAME
    expected_logs = {
        "sources": results / "logs" / f"{NAME}-sources.log",
        "environment": run / "logs" / "environment.log", "regression": run / "logs" / "regression.log",
        "case": run / "logs" / "case.log", "plan": run / "logs" / "plan.log",
        "topology tp1-cp1": run / "logs" / "tp1-cp1.log", "topology tp2-cp1": run / "logs" / "tp2-cp1.log",
        "validation gate": run / "logs" / "validation.log", "crosscheck gate": run / "logs" / "crosscheck.log",
        "summary": run / "logs" / "summary.log", "archive": results / "logs" / f"{NAME}-archive.log",
        "verify_archive": results / "logs" / f"{NAME}-verify.log",
    }
    all_stages = stages(run, STEMS)
    assert [s.label for s in all_stages] == list(expected_logs)  # workflow order, the case stage included
    for stage in all_stages[:-1]:  # verify_archive fails by its record, below
        lay_out(results)
        for later in all_stages[all_stages.index(stage):]:
            for path in later.outputs:
                path.unlink()
        stage.log.parent.mkdir(parents=True, exist_ok=True)
        stage.log.write_text("the error\n")
        result = closing(run, STEMS, succeeded=False)
        assert result.verdict.startswith(f"FAILED at {stage.label} (missing "), (stage.label, result.verdict)
        assert rows(result)["Log"] == str(expected_logs[stage.label]), (stage.label, rows(result))
        stage.log.unlink()
    lay_out(results, verify_passed=False)
    result = closing(run, STEMS, succeeded=False)
    assert result.verdict.startswith("FAILED at verify_archive: ")
    assert rows(result)["Log"] == str(expected_logs["verify_archive"])


def test_a_failed_case_rule_is_named_at_case_not_plan(tmp_path: Path) -> None:
    """The closing table said "FAILED at plan" with logs/plan.log when the case rule failed."""
    run = lay_out(tmp_path / "results", upto="case")
    (run / "logs").mkdir(parents=True, exist_ok=True)
    (run / "logs" / "case.log").write_text("CaseError: ...\n")
    result = closing(run, STEMS, succeeded=False)
    assert result.verdict == "FAILED at case (missing case.json)"
    assert rows(result)["Log"] == str(run / "logs" / "case.log")


def test_a_failed_stage_shows_the_end_of_its_log(tmp_path: Path) -> None:
    """The default profile quiets Snakemake's error block, so the table shows the failed
    stage's last lines itself (rich markup in the log is shown as text, not interpreted)."""
    run = lay_out(tmp_path / "results", upto="topology tp2-cp1")
    log = run / "logs" / "tp2-cp1.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"line {i}\n" for i in range(40)) + "[bold]rank 1 exited with code 2[/bold]\n")
    result = closing(run, STEMS, succeeded=False)
    tail = rows(result)["Log, last 15 lines"]
    assert tail.splitlines()[0] == "line 26" and len(tail.splitlines()) == 15
    out = io.StringIO()
    print_closing(run, STEMS, succeeded=False, console=Console(file=out, width=200))
    assert "[bold]rank 1 exited with code 2[/bold]" in out.getvalue() and "line 25" not in out.getvalue()
    log.unlink()  # no log: no tail row, the log row says so
    assert "Log, last 15 lines" not in rows(closing(run, STEMS, succeeded=False))


def test_the_optional_capture_and_parity_stages_are_named_when_they_fail(tmp_path: Path) -> None:
    """A failed parity rule (refused captures: exit 2) or capture copy: the table names that stage and its
    log, not the validation gate the run never reached. Their place: capture after case, parity after
    the topologies, before the validation gate."""
    flags = {"capture": True, "parity": True}
    run = tmp_path / "results" / NAME
    labels = [s.label for s in stages(run, STEMS, **flags)]
    assert labels[labels.index("case") + 1] == "capture copy"
    assert labels[labels.index("validation gate") - 1] == "parity"
    assert labels[labels.index("parity") - 1] == "topology tp2-cp1"
    assert [s.label for s in stages(run, STEMS)] == [x for x in labels if x not in ("capture copy", "parity")]
    for failed, missing in (("parity", "parity.json, parity.png"), ("capture copy", "capture.safetensors")):
        results = tmp_path / failed.replace(" ", "-") / "results"
        run = lay_out(results, upto=failed, **flags)
        result = closing(run, STEMS, succeeded=False, **flags)
        assert result.verdict == f"FAILED at {failed} (missing {missing})", result.verdict
        log = "parity.log" if failed == "parity" else "capture.log"
        assert rows(result)["Log"] == f"{run / 'logs' / log} (not written)"
        # negative control: told nothing of the optional stages, the table names a later stage
        assert "FAILED at parity" not in closing(run, STEMS, succeeded=False).verdict
    complete = lay_out(tmp_path / "all" / "results", **flags)
    assert closing(complete, STEMS, succeeded=True, **flags).verdict == VERIFIED


def test_the_closing_table_says_which_stages_were_reused_and_from_which_run(tmp_path: Path) -> None:
    """A focused suite copied from an earlier run must not look like one that ran: the table names
    the run it came from, when and its commit, and says so of a stage that ran."""
    run = lay_out(tmp_path / "results")
    origin = {"key": "c" * 64, "from_run": "camp-abc1234-case-99999999", "captured_utc": "2025-01-02T03:04:05Z",
              "from_commit": "abc1234" + "0" * 33}
    jsonio.write_json(run / "environment.json", {"git": {"commit": origin["from_commit"]}})
    jsonio.write_json(run / "regression.json", {"passed": 305, "skipped": 2, "failed": 0, "errors": 0, "reused": origin})
    result = closing(run, STEMS, succeeded=True)
    assert result.verdict == VERIFIED
    assert rows(result)["Environment capture"] == "captured for this run directory"
    assert rows(result)["Focused suite"] == ("[bold yellow]REUSED[/], not run for this case: copied from run "
                                             "camp-abc1234-case-99999999 (captured 2025-01-02T03:04:05Z, commit "
                                             "abc123400000): 305 passed, 2 skipped")
    out = io.StringIO()
    print_closing(run, STEMS, succeeded=True, console=Console(file=out, width=300))
    assert "REUSED, not run for this case: copied from run camp-abc1234-case-99999999" in out.getvalue()
    jsonio.write_json(run / "regression.json", {"passed": 305, "skipped": 2, "failed": 0, "errors": 0})
    jsonio.write_json(run / "environment.json", {"git": {}, "reused": {**origin, "from_commit": None}})
    assert rows(closing(run, STEMS, succeeded=True))["Focused suite"] == "ran for this run directory: 305 passed, 2 skipped"
    assert rows(closing(run, STEMS, succeeded=True))["Environment capture"] == (
        "[bold yellow]REUSED[/], not run for this case: copied from run camp-abc1234-case-99999999 "
        "(captured 2025-01-02T03:04:05Z, no git commit)")


@pytest.mark.parametrize(("name", "says"), [
    ("default-1a2b3c4-case-0123abcd", "(commit 1a2b3c4, clean checkout)"),
    ("default-1a2b3c4-dirty-case-0123abcd", "(commit 1a2b3c4, DIRTY: the checkout has uncommitted changes"),
    ("default-nogit-case-0123abcd", "(no git state could be read (commit 'nogit'))"),
])
def test_a_dry_run_ends_naming_the_run_and_whether_it_is_dirty(
        name: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``snakemake -n`` (the Snakefile's exit handler with ``workflow.dryrun``) prints the run it would make."""
    module = importlib.import_module("rl_engine.workflow.closing")  # the package's `closing` is the function
    registered: list = []
    monkeypatch.setattr(module.atexit, "register", registered.append)

    class Workflow:
        is_main_process = True
        dryrun = True

    module.print_closing_when_nothing_to_do(Workflow(), f"results/{name}", [Topology(1, 1)])
    (at_exit,) = registered
    at_exit()
    printed = capsys.readouterr().out
    assert printed.startswith(f"dry run: the run directory is results/{name} {says}") and printed.count("\n") == 1
    Workflow.dryrun = False  # negative control: a real run with work to do prints nothing here
    at_exit()
    assert capsys.readouterr().out == ""
