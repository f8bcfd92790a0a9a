"""The workflow's closing message: the verdict, the archive, its SHA-256, SUMMARY.md, how to verify.

``workflow/Snakefile`` calls :func:`print_closing` from its ``onsuccess:`` and ``onerror:``
handlers, so the console's last table says what the run established. Everything is read from
the files the stages left (Snakemake deletes the outputs of a failed job), in stage order:

* ``VERIFIED``: the verifier's ``results/<name>.verify.json`` passed, is not older than the
  archive it checked, and names it;
* ``FAILED at <stage>``: the run ended in an error and ``<stage>`` is the first stage whose
  output is missing (the gate that failed, or the stage that failed before it), with its log;
* ``INCOMPLETE``: the run succeeded but was asked for less than everything (explicit targets),
  and names the first stage not built.

An archive at the final path that this run did not rebuild (it is older than this run's
evidence, or a gate before it failed) is shown as such, never as this run's result.
Snakemake calls no handler when there is nothing to be done and in a dry run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rl_engine import jsonio
from rl_engine.rundir import Stage, Topology, stages

VERIFIED = "VERIFIED"


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


def _sha256_of(sidecar: Path) -> str:
    try:
        text = sidecar.read_text(encoding="utf-8").split()
    except OSError:
        return "(no .sha256 file)"
    return text[0] if text else "(empty .sha256 file)"


def closing(run: str | Path, topologies: list[Topology], succeeded: bool) -> Closing:
    """The closing message of a run of ``run`` with ``topologies``; ``succeeded`` as Snakemake says."""
    run = Path(run)
    all_stages = stages(run, topologies)
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
    rows: list[tuple[str, str]] = [("Run directory", f"{run}/")]
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
                  console: Console | None = None) -> Closing:
    """Print :func:`closing` as a rich table (what the Snakefile's handlers call) and return it."""
    result = closing(run, topologies, succeeded)
    (console or Console(width=160)).print(result.table())
    return result


__all__ = ["Closing", "VERIFIED", "closing", "print_closing"]
