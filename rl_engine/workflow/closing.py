"""The console's last table (:func:`print_closing`), read from the files the stages left, and the
labels of ``snakemake --report``'s entries, read from the run's files too.
"""

from __future__ import annotations

import atexit
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rl_engine import jsonio
from rl_engine.campaign.casename import NOGIT, RunName, RunNameError
from rl_engine.evidence.summary import regression_text
from rl_engine.record import reuse
from rl_engine.rundir import Stage, Topology, stages

# ----- the closing table -------------------------------------------------------------------
# The workflow's closing message: the verdict, the archive, its SHA-256, SUMMARY.md, how to verify.
#
# ``workflow/Snakefile`` calls :func:`print_closing` from its ``onsuccess:`` and ``onerror:``
# handlers, so the console's last table says what the run established. Everything is read from
# the files the stages left (Snakemake deletes the outputs of a failed job), in stage order:
#
# * ``VERIFIED``: the verifier's ``results/<name>.verify.json`` passed, is not older than the
#   archive it checked, and names it;
# * ``FAILED at <stage>``: the run ended in an error and ``<stage>`` is the first stage whose
#   output is missing (the gate that failed, or the stage that failed before it), with its log;
# * ``INCOMPLETE``: the run succeeded but was asked for less than everything (explicit targets),
#   and names the first stage not built.
#
# An archive at the final path that this run did not rebuild (it is older than this run's
# evidence, or a gate before it failed) is shown as such, never as this run's result. The rows
# "Environment capture" and "Focused suite" say whether those stages ran for this run directory or
# were REUSED from an earlier run (rl_engine.record.reuse: which run, when, its commit), read from
# the ``reused`` record of environment.json and regression.json; they are left out while a file
# is missing or unreadable.
# Snakemake calls no handler when there is nothing to be done and in a dry run.

VERIFIED = "VERIFIED"
# The default profile quiets Snakemake's per-job blocks (its error block and failed log included),
# so a failed run's table shows the end of the failed stage's log itself.
LOG_TAIL_LINES = 15


@dataclass(frozen=True)
class Closing:
    """The verdict and the rows of the closing table (label, value)."""

    verdict: str
    rows: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if not self.verdict:
            raise ValueError("Closing.verdict must be non-empty")

    def table(self) -> Table:
        colour = "bold green" if self.verdict == VERIFIED else "bold red"
        table = Table(title="rl_engine evidence workflow: result", title_justify="left", show_header=False)
        table.add_column("Item", style="bold")
        table.add_column("Value", overflow="fold")
        table.add_row("Verdict", f"[{colour}]{self.verdict}[/]")
        for label, value in self.rows:
            table.add_row(label, value)
        return table


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of ``log``, shown as text (rich markup escaped, undecodable bytes replaced)."""
    text = log.read_bytes()[-64 * 1024:].decode("utf-8", errors="replace")
    return escape("\n".join(text.splitlines()[-lines:])) or "(empty)"


def _sha256_of(sidecar: Path) -> str:
    try:
        text = sidecar.read_text(encoding="utf-8").split()
    except OSError:
        return "(no .sha256 file)"
    return escape(text[0]) if text else "(empty .sha256 file)"  # the file's text, as text: never markup


def _counts(record: dict[str, Any]) -> str:
    return escape(regression_text(record))  # SUMMARY.md's wording of the counts, as text


def reuse_rows(environment_json: Path, regression_json: Path) -> list[tuple[str, str]]:
    """The rows that say whether the environment capture and the focused suite ran for this run
    directory or were reused (the module comment); none for a file that is missing or unreadable."""
    rows = []
    for label, path, done in (("Environment capture", environment_json, "captured for this run directory"),
                              ("Focused suite", regression_json, "ran for this run directory")):
        try:
            record = jsonio.load(path)
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        counts = f": {_counts(record)}" if path == regression_json else ""
        if reuse.REUSED in record:
            rows.append((label, f"[bold yellow]REUSED[/], not run for this case: copied from "
                                f"{escape(reuse.reused_text(record[reuse.REUSED]))}{counts}"))
        else:
            rows.append((label, f"{done}{counts}"))
    return rows


def closing(run: str | Path, topologies: list[Topology], succeeded: bool, *, capture: bool = False,
            parity: bool = False) -> Closing:
    """The closing message of a run of ``run`` with ``topologies``; ``succeeded`` as Snakemake says;
    ``capture`` and ``parity``: the optional stages of the run (:func:`stage_flags`)."""
    run = Path(run)
    all_stages = stages(run, topologies, capture=capture, parity=parity)
    stage_of = {s.rule: s for s in all_stages}  # (the topology stages share a rule; not looked up here)
    summary_stage, archive_stage, verify_stage = stage_of["summary"], stage_of["archive"], stage_of["verify_archive"]
    archive, sidecar = archive_stage.outputs
    verify_json = verify_stage.outputs[0]
    verify_cmd = f"python -m rl_engine verify {archive}"
    first_missing = next((s for s in all_stages if s.missing()), None)
    verified = None
    if first_missing is None:
        try:
            result = jsonio.load(verify_json)
            verified = (isinstance(result, dict) and result.get("passed") is True
                        and result.get("archive") == archive.name
                        and verify_json.stat().st_mtime_ns >= archive.stat().st_mtime_ns)
        except (OSError, ValueError):
            verified = False
    rows: list[tuple[str, str]] = [("Run directory", f"{run}/"),
                                   *reuse_rows(stage_of["environment"].outputs[0], stage_of["regression"].outputs[0])]
    if verified:
        verdict = VERIFIED
    elif first_missing is None:
        verdict = f"FAILED at verify_archive: {verify_json} does not record a pass for {archive.name}"
        rows.append(("Log", str(verify_stage.log)))
    else:
        missing = ", ".join(p.name for p in first_missing.missing())
        if succeeded:
            verdict = f"INCOMPLETE: {first_missing.label} not built by this run (missing {missing})"
        else:
            verdict = f"FAILED at {first_missing.label} (missing {missing})"
            rows.append(("Log", f"{first_missing.log}" + ("" if first_missing.log.is_file() else " (not written)")))
            if first_missing.log.is_file():
                rows.append((f"Log, last {LOG_TAIL_LINES} lines", log_tail(first_missing.log)))
    def done(stage: Stage) -> bool:  # built, and no stage before it is missing
        return first_missing is None or all_stages.index(first_missing) > all_stages.index(stage)

    built_here = done(archive_stage)
    if archive.is_file() and built_here:
        rows += [("Archive", str(archive)), ("SHA-256", _sha256_of(sidecar))]
    elif archive.is_file():
        rows.append(("Archive", f"none from this run; {archive} is from an earlier run of this case, older than "
                                "this run's evidence, and is rebuilt once every gate passes"))
    else:
        rows.append(("Archive", "none: no archive is built until every stage before it passes"))
    rows.append(("SUMMARY.md", str(summary_stage.outputs[0]) if done(summary_stage) else "not written by this run"))
    rows.append(("Verify (reviewer)", verify_cmd if archive.is_file() and built_here else
                 f"{verify_cmd}  (once the archive is built)"))
    return Closing(verdict, tuple(rows))


def print_closing(run: str | Path, topologies: list[Topology], succeeded: bool,
                  console: Console | None = None, **flags: bool) -> Closing:
    """Print :func:`closing` as a rich table (what the Snakefile's handlers call) and return it;
    ``flags``: :func:`stage_flags`."""
    result = closing(run, topologies, succeeded, **flags)
    (console or Console(width=160)).print(result.table())
    return result


def print_closing_at_exit(run: str | Path, topologies: list[Topology], succeeded: bool, **flags: bool) -> None:
    """:func:`print_closing` when the Snakemake process exits (what the Snakefile's handlers call).

    Snakemake logs the complete log's path and the elapsed time after ``onsuccess:`` and
    ``onerror:`` return (and on error its final error line); printing at interpreter exit keeps
    the table the last thing on the console. The files are read then, when every job
    is over."""
    atexit.register(functools.partial(print_closing, run, topologies, succeeded, **flags))


# ----- Snakemake's HTML report (snakemake --report report.html) -------------------------------
# The outputs a reviewer looks at are marked with report() in their rules (SUMMARY.md, verify.json,
# crosscheck.json, parity.png); each gets labels read from the run's files when the report is made,
# so the report's table shows the closing table's rows, the cross-topology result and the parity
# counts beside the embedded files. A label function never raises: a file it cannot read is named.

def _plain(value: str) -> str:
    from rich.text import Text

    return Text.from_markup(value).plain


def _read_json(path: str | Path) -> dict[str, Any] | None:
    try:
        data = jsonio.load(Path(path))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def report_closing_labels(run: str | Path, topologies: list[Topology], **flags: bool) -> Callable[..., dict[str, str]]:
    """Labels of the verify_archive output: the closing table's rows, as the console's closing table shows them."""
    def labels(wildcards: Any) -> dict[str, str]:
        result = closing(run, topologies, True, **flags)
        return {"Verdict": result.verdict, **{label: _plain(value) for label, value in result.rows}}
    return labels


def report_crosscheck_labels(wildcards: Any, output: Any) -> dict[str, str]:
    """Labels of crosscheck.json: the result, the reference topology and what was compared."""
    data = _read_json(output[0])
    if data is None:
        return {"Cross-topology check": f"{output[0]} cannot be read"}
    topologies = [t.get("topology", t) if isinstance(t, dict) else t for t in data.get("topologies", [])]
    return {"Cross-topology check": "PASSED: bitwise equal" if data.get("passed") is True else
            f"FAILED: {len(data.get('failures', []))} difference(s)",
            "Reference": str(data.get("reference")), "Topologies": str(len(topologies)),
            "Fields compared": ", ".join(str(f) for f in data.get("fields", []))}


def report_parity_labels(wildcards: Any, output: Any) -> dict[str, str]:
    """Labels of parity.png: the verdict and the counts the figure shows, from parity.json."""
    data = _read_json(output.json)
    if data is None:
        return {"Parity": f"{output.json} cannot be read"}
    try:
        active = data["targets_and_mask"]["active_tokens"]
        ours = data["our_logprob"]
        equal = sum(1 for a, e in zip(data["targets_and_mask"]["per_token"]["active"],
                                      ours["per_token"]["bitwise_equal"]) if a and e)
        ratio = data["importance_ratio"]["ours"]
        return {"Parity": str(data["verdict"]), "Active tokens": str(active),
                "Logprob bitwise equal": f"{equal} of {active}",
                "Logits bitwise equal": str(data["logits"]["bitwise_equal"]),
                "Ratio outside bounds": f"{ratio['outside_bounds']} of {active}"}
    except (KeyError, TypeError) as exc:
        return {"Parity": f"{output.json} lacks {exc}"}


class _NothingToDo(logging.Filter):
    """Notes whether Snakemake logged "Nothing to be done" (it then returns before ``onsuccess:``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("Nothing to be done"):
            self.seen = True
        return True


def dry_run_line(run: str | Path) -> str:
    """What ``snakemake -n`` ends with: the run directory the config names, its commit, and whether
    the checkout is dirty (uncommitted changes: the run's name says ``-dirty``, and its evidence
    records them)."""
    try:
        name = RunName.parse(Path(run).name)
    except RunNameError:
        return f"dry run: the run directory is {run}"
    if name.commit == NOGIT:
        state = "no git state could be read (commit 'nogit')"
    elif name.dirty:
        state = (f"commit {name.commit}, DIRTY: the checkout has uncommitted changes (git status shows them); "
                 "commit them for a clean run")
    else:
        state = f"commit {name.commit}, clean checkout"
    return f"dry run: the run directory is {run} ({state})"


def print_closing_when_nothing_to_do(workflow: Any, run: str | Path, topologies: list[Topology],
                                     **flags: bool) -> None:
    """The closing table of the run the config names, at exit, when a real run (not a dry run, in
    the main process) ended with "Nothing to be done": its evidence is on disk and up to date, so the
    table says its verdict, archive and verify command as the run that made them did. Snakemake
    returns before ``onsuccess:`` then, so this watches its log for the message. A dry run
    (``snakemake -n``) ends with :func:`dry_run_line` instead: which run, and whether it is dirty."""
    seen = _NothingToDo()
    logging.getLogger("snakemake.logging").addFilter(seen)

    def at_exit() -> None:
        if not workflow.is_main_process:
            return
        if workflow.dryrun:
            print(dry_run_line(run))
        elif seen.seen:
            print_closing(run, topologies, True, **flags)

    atexit.register(at_exit)
