"""Validation gate: every artifact against its schema, every report against the acceptance.

``python -m rl_engine validate --run-dir RUN --output RUN/validation.json [--schemas DIR]``
checks ``environment.json``, ``regression.json`` and ``plan.json`` against ``DIR`` (default:
the repository's ``schemas/``), then every report the plan lists (a missing report is a
failure) against ``report.schema.json`` and :func:`rl_engine.evidence.acceptance.check_report`.
A ``tp<T>-cp<C>.*`` report or tensor of a topology the plan does not list (left from an
earlier plan) is a failure too: it would sit in the run directory looking like evidence that no
gate checked (the archive packs only the workflow's declared files, so it would not ship, and
``verify`` fails one found in an archive). The focused regression must have run tests and have
none failed. A run with a parity stage has ``parity.json`` checked against ``parity.schema.json``
(its verdict is a finding, never a failure); a case whose capture the archive holds (config
``inputs.archive: true``) needs ``capture.safetensors`` in the run with the case's recorded size
and SHA-256. It writes
``validation.json`` (validated against ``validation.schema.json`` of ``DIR`` first; a result
that does not match is not written and the verb exits 1) and exits 1, naming the file or
topology and the field on stderr, when anything fails; 2 when the schemas themselves cannot
be loaded.

:func:`validate_run` is what the verb and ``verify`` (on an extracted archive, with the
schemas shipped inside it, and ``gates=True`` to also check the recorded
``validation.json`` and ``crosscheck.json``) both call.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_engine import jsonio, schemas
from rl_engine.evidence.acceptance import check_report
from rl_engine.evidence.gate import finish_gate
from rl_engine.rundir import (
    CAPTURE,
    CASE,
    CROSSCHECK,
    ENVIRONMENT,
    PARITY_JSON,
    PLAN,
    REGRESSION,
    VALIDATION,
    WHOLE_FILE,
    Finding,
    Run,
    Topology,
)
from rl_engine.tables import SCHEMA_VERSION

MAX_MESSAGE = 300
FILES: tuple[tuple[str, str], ...] = ((ENVIRONMENT, "environment"), (REGRESSION, "regression"), (CASE, "case"),
                                      (PLAN, "plan"))
GATES: tuple[tuple[str, str], ...] = ((VALIDATION, "validation"), (CROSSCHECK, "crosscheck"))


def schema_findings(instance: Any, name: str, where: str, schema_dir: Path) -> list[Finding]:
    """Schema errors of ``instance`` as findings naming the JSON path."""
    try:
        validator = schemas.validator(name, schema_dir)
    except schemas.SchemaError as exc:
        return [Finding(where, "(schema)", str(exc))]
    found = []
    for error in sorted(validator.iter_errors(instance), key=lambda e: [str(p) for p in e.path]):
        path = error.json_path
        field = WHOLE_FILE if path == "$" else path.removeprefix("$.").removeprefix("$")
        message = error.message if len(error.message) <= MAX_MESSAGE else error.message[:MAX_MESSAGE] + "..."
        found.append(Finding(where, field, f"schema {name}: {message}"))
    return found


def regression_findings(regression: Any) -> list[Finding]:
    """The focused regression ran tests and none failed or errored."""
    if not isinstance(regression, dict):
        return []
    found = []
    for key in ("failed", "errors"):
        if regression.get(key) != 0:
            found.append(Finding(REGRESSION, key, f"is {regression.get(key)!r}; the focused regression must have none"))
    if not isinstance(regression.get("total"), int) or regression.get("total", 0) < 1:
        found.append(Finding(REGRESSION, "total", f"is {regression.get('total')!r}; no test ran"))
    if regression.get("exit_code") != 0:
        found.append(Finding(REGRESSION, "exit_code", f"pytest exited {regression.get('exit_code')!r}, not 0"))
    parts = [regression.get(k) for k in ("passed", "failed", "skipped", "errors")]
    if all(isinstance(p, int) for p in parts) and sum(parts) != regression.get("total"):
        found.append(Finding(REGRESSION, "total", f"is {regression.get('total')!r} but passed+failed+skipped+errors is {sum(parts)}"))
    return found


def capture_findings(run: Run) -> list[Finding]:
    """A case whose archive holds its capture: ``capture.safetensors`` is in the run and has the
    recorded size and SHA-256 (what ``verify --recompute`` replays from)."""
    if not run.archives_capture:
        return []
    from rl_engine.campaign.captured import check_file  # the capture's check (imports torch)
    from rl_engine.capture.format import CaptureError

    record = run.plan_case()["capture"]
    path = run.root / CAPTURE
    if path.is_symlink():
        return [Finding(CAPTURE, WHOLE_FILE, f"{CAPTURE} is a symbolic link; the archived capture must be a regular file")]
    try:
        check_file(record, path)
    except (CaptureError, OSError, KeyError, TypeError) as exc:
        return [Finding(CAPTURE, WHOLE_FILE, f"the case says the archive holds its capture (inputs.archive: true) "
                        f"but {exc}")]
    return []


def unplanned_findings(run_dir: Path, planned_labels: set[str]) -> list[Finding]:
    """Reports and tensors in ``run_dir`` of topologies the plan does not list."""
    found = []
    for path in sorted(run_dir.iterdir()):
        topology = Topology.of_file(path.name)
        label = topology.stem if topology is not None else None
        if label is not None and label not in planned_labels:
            found.append(Finding(path.name, WHOLE_FILE, f"topology {label} is not in {PLAN} (left from an earlier "
                                 "plan?): it looks like evidence but no gate checks it; remove it or plan that "
                                 "topology"))
    return found


def _schema_hashes(schema_dir: Path) -> dict[str, str]:
    return {p.name[: -len(".schema.json")]: jsonio.sha256_file(p) for p in sorted(schema_dir.glob("*.schema.json"))}


@dataclass(frozen=True)
class Validation:
    """Result of :func:`validate_run`: validation.json's content and the findings by kind."""

    result: dict[str, Any]
    load: tuple[Finding, ...] = ()
    schema: tuple[Finding, ...] = ()
    regression: tuple[Finding, ...] = ()
    acceptance: tuple[Finding, ...] = ()
    gates: tuple[Finding, ...] = ()

    @property
    def findings(self) -> list[Finding]:
        return [*self.load, *self.schema, *self.regression, *self.acceptance, *self.gates]

    @property
    def passed(self) -> bool:
        return not self.findings


def plan_case_findings(plan: Any, case_file: Any) -> list[Finding]:
    """The plan must be the plan of the case file: the same case and the same topologies, in order."""
    if not isinstance(plan, dict) or not isinstance(case_file, dict):
        return []  # a missing or unreadable file is already a finding of its own
    found = []
    if plan.get("case") != case_file.get("case"):
        differ = sorted(k for k in set(plan.get("case") or {}) | set(case_file.get("case") or {})
                        if (plan.get("case") or {}).get(k) != (case_file.get("case") or {}).get(k))
        found.append(Finding(PLAN, "case", f"differs from {CASE}'s case in {differ}: the plan was not built from this case file"))
    pairs = [(t.get("tp"), t.get("cp")) for t in plan.get("topologies", []) if isinstance(t, dict)]
    wanted = [(t.get("tp"), t.get("cp")) for t in case_file.get("topologies", []) if isinstance(t, dict)]
    if pairs != wanted:
        found.append(Finding(PLAN, "topologies", f"plans {pairs}, but {CASE} lists {wanted}"))
    return found


def plan_command_findings(plan: Any) -> list[Finding]:
    """Each planned ``command`` is ``shlex.join`` of the ``argv`` launch runs (plans from before
    ``argv`` was recorded have none to compare)."""
    entries = plan.get("topologies") if isinstance(plan, dict) else None
    found = []
    for index, entry in enumerate(entries if isinstance(entries, list) else []):
        argv = entry.get("argv") if isinstance(entry, dict) else None
        if isinstance(argv, list) and all(isinstance(word, str) for word in argv) and entry.get("command") != shlex.join(argv):
            found.append(Finding(PLAN, f"topologies[{index}].command", f"{entry.get('command')!r} is not "
                                 f"shlex.join(argv) {shlex.join(argv)!r}: the printed command is not the one launch runs"))
    return found


def validate_run(run: Run, schema_dir: Path, *, gates: bool = False) -> Validation:
    """Validate a loaded run directory against ``schema_dir`` and the acceptance.

    ``load`` holds missing or unreadable files (including non-finite literals, by field),
    ``schema`` schema errors, ``regression`` a failed or empty focused regression,
    ``acceptance`` every report's acceptance findings and any report or tensor of an unplanned
    topology, and with ``gates=True`` ``gates`` holds
    a recorded validation.json or crosscheck.json that did not pass.
    """
    try:
        schemas.load(schema_dir)
    except (schemas.SchemaError, OSError, ValueError) as exc:
        finding = Finding(str(schema_dir), "(schemas)", f"cannot load the schemas: {exc}")
        return Validation({"schema_version": SCHEMA_VERSION, "passed": False, "schemas": {}, "files": [],
                           "reports": [], "failures": [str(finding)]}, load=(finding,))
    load: list[Finding] = []
    schema: list[Finding] = []
    regression: list[Finding] = []
    gate: list[Finding] = []
    files: list[dict[str, Any]] = []
    optional = ((PARITY_JSON, "parity"),) if run.has_parity else ()
    for name, schema_name in FILES + optional + (GATES if gates else ()):
        obj, file_load = run.doc(name), run.found(name)
        file_schema = schema_findings(obj, schema_name, name, schema_dir) if obj is not None else []
        file_other: list[Finding] = []
        if name == REGRESSION:
            file_other = regression_findings(obj)
            regression += file_other
        if name in (VALIDATION, CROSSCHECK) and obj is not None and (not isinstance(obj, dict) or obj.get("passed") is not True):
            file_other = [Finding(name, "passed", "the recorded gate did not pass")]
            gate += file_other
        load += file_load
        schema += file_schema
        everything = file_load + file_schema + file_other
        files.append({"file": name, "schema": schema_name, "valid": not everything, "errors": [str(f) for f in everything]})
    acceptance = plan_case_findings(run.plan, run.case) + plan_command_findings(run.plan) + capture_findings(run)
    reports, report_found = _validate_reports(run, schema_dir)
    load += report_found[0]
    schema += report_found[1]
    acceptance += report_found[2]
    everything = [*load, *schema, *regression, *acceptance, *gate]
    result = {
        "schema_version": SCHEMA_VERSION,
        "passed": not everything,
        "schemas": _schema_hashes(schema_dir),
        "files": files,
        "reports": reports,
        "failures": [str(f) for f in everything],
    }
    return Validation(result, tuple(load), tuple(schema), tuple(regression), tuple(acceptance), tuple(gate))


def _validate_reports(run: Run, schema_dir: Path) -> tuple[list[dict[str, Any]], tuple[list[Finding], ...]]:
    """validation.json's ``reports`` rows, and the (load, schema, acceptance) findings of the planned reports."""
    load: list[Finding] = []
    schema: list[Finding] = []
    acceptance: list[Finding] = []
    rows: list[dict[str, Any]] = []
    if run.plan is None:
        return rows, (load, schema, acceptance)
    load += run.plan_findings
    for item, report in run.reports():
        report_load = run.found(item.file)
        report_schema: list[Finding] = []
        report_accept: list[Finding] = []
        if report is not None:
            report_schema = schema_findings(report, "report", item.file, schema_dir)
            report_accept = check_report(report, item.file, run.root, planned=item, plan=run.plan, read=run.file_bytes)
        load += report_load
        schema += report_schema
        acceptance += report_accept
        rows.append({
            "topology": item.label,
            "tp": item.tp,
            "cp": item.cp,
            "file": item.file,
            "schema_valid": report is not None and not report_schema,
            "accepted": report is not None and not report_accept,
            "failures": [str(f) for f in report_load + report_schema + report_accept],
        })
    if run.planned:
        acceptance += unplanned_findings(run.root, {item.label for item in run.planned})
    return rows, (load, schema, acceptance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="run directory to validate")
    parser.add_argument("--output", required=True, type=Path, help="where to write validation.json")
    parser.add_argument("--schemas", type=Path, default=None, help="schema directory (default: the repository's schemas/)")
    args = parser.parse_args(argv)
    schema_dir = args.schemas or schemas.repo_schema_dir()
    if not args.run_dir.is_dir():
        print(f"validate: --run-dir {args.run_dir} is not a directory", file=sys.stderr)
        return 2
    if not schema_dir.is_dir():
        print(f"validate: --schemas {schema_dir} is not a directory", file=sys.stderr)
        return 2
    validation = validate_run(Run.load(args.run_dir), schema_dir)
    result, found = validation.result, validation.findings
    return finish_gate(
        "validation", args.output, result, "validation", found,
        f"validation passed: {len(result['files'])} files and {len(result['reports'])} reports "
        f"valid against {schema_dir} and accepted",
        schema_dir,
    )
