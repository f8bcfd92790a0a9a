"""What a run directory holds, and how its files are read for checking.

A run directory (``results/<name>/``, or the top folder of an extracted archive) holds
``environment.json``, ``regression.json``, ``case.json``, ``plan.json`` and one ``tp<T>-cp<C>.json`` report
per planned topology with its raw ``*.f32`` tensors (:func:`evidence_files` names every file
of that evidence, as the evidence itself names them); an extracted archive's top folder also
holds :data:`ARCHIVE_ONLY` (``SHA256SUMS``, ``REVIEWING.md``, ``schemas/``), which ``archive``
adds. Every check in :mod:`rl_engine.evidence` reads it through this module, so the workflow's gates and the reviewer's verifier see the
same files the same way.

Problems are :class:`Finding` values that name the file (or topology), the field (a dotted
JSON path) and what is wrong; nothing here raises on bad evidence.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rl_engine import jsonio, schemas

REPORT_NAME = re.compile(r"^tp([1-9][0-9]*)-cp([1-9][0-9]*)\.json$")
WHOLE_FILE = "(file)"
TOO_DEEP = "JSON nested too deeply to be an rl_engine artifact"

ENVIRONMENT = "environment.json"
ENVIRONMENT_TEXT = "environment.txt"
REGRESSION = "regression.json"
CASE = "case.json"
PLAN = "plan.json"
VALIDATION = "validation.json"
CROSSCHECK = "crosscheck.json"
SUMMARY = "SUMMARY.md"

# what ``archive`` adds beside the run's own files (never in a run directory)
SUMS = "SHA256SUMS"
REVIEWING = "REVIEWING.md"
SCHEMA_DIR = "schemas"
ARCHIVE_ONLY: frozenset[str] = frozenset({SUMS, REVIEWING, SCHEMA_DIR})


@dataclass(frozen=True)
class Finding:
    """One failed check: where (file or topology), which field, and what is wrong."""

    where: str
    field: str
    message: str

    def __post_init__(self) -> None:
        for name in ("where", "field", "message"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"Finding.{name} must be a non-empty string")

    def __str__(self) -> str:
        return f"{self.where}: {self.field}: {self.message}"


@dataclass(frozen=True)
class PlannedReport:
    """A report the plan promises: its label ``tp<T>-cp<C>`` and where it lies in the run."""

    label: str
    tp: int
    cp: int
    path: Path
    command: str | None

    @property
    def file(self) -> str:
        return self.path.name


def field_path(parts: tuple[str | int, ...] | list[str | int]) -> str:
    """``("drift", "fp32_oracle", "lse", "max_abs")`` -> ``drift.fp32_oracle.lse.max_abs``."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or WHOLE_FILE


class _NonFinite:
    def __init__(self, literal: str) -> None:
        self.literal = literal


def _non_finite_paths(value: Any) -> list[tuple[str, str]]:
    leaves = jsonio.find_leaves(value, lambda leaf: isinstance(leaf, _NonFinite))
    return [(field_path(parts), leaf.literal) for parts, leaf in leaves]


def load_json(path: Path, where: str | None = None) -> tuple[Any, list[Finding]]:
    """Read a strict-JSON artifact; on failure return ``None`` and findings naming the field.

    A ``NaN``/``Infinity`` literal is located and reported by its JSON path, so a reviewer
    reads ``tp2-cp1.json: drift.fp32_oracle.lse.max_abs: non-finite literal NaN`` rather than
    a bare parse error.
    """
    label = where or path.name
    if path.is_symlink():
        return None, [Finding(label, WHOLE_FILE, f"{path.name} is a symbolic link; evidence files must be regular files")]
    if not path.is_file():
        return None, [Finding(label, WHOLE_FILE, f"file is missing ({path.name} not found in the run directory)")]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        return None, [Finding(label, WHOLE_FILE, f"not UTF-8 text ({exc.reason} at byte {exc.start})")]
    try:
        return jsonio.loads(text), []
    except jsonio.StrictJSONError as exc:
        return None, _strict_findings(label, text, exc)
    except json.JSONDecodeError as exc:
        return None, [Finding(label, f"line {exc.lineno} column {exc.colno}", f"invalid JSON: {exc.msg}")]
    except RecursionError:
        return None, [Finding(label, WHOLE_FILE, TOO_DEEP)]


def _strict_findings(label: str, text: str, exc: jsonio.StrictJSONError) -> list[Finding]:
    """Each NaN/Infinity literal by its JSON path; otherwise (an overflowing number, an absurd integer,
    or a document too deep to walk) the strict parser's own reason, for the whole file."""
    try:
        lenient = json.loads(text, parse_constant=_NonFinite)
        located = _non_finite_paths(lenient)
    except RecursionError:
        return [Finding(label, WHOLE_FILE, TOO_DEEP)]
    except ValueError:  # e.g. an integer past Python's digit limit: the strict reason says it
        located = []
    if not located:
        return [Finding(label, WHOLE_FILE, str(exc))]
    return [Finding(label, field, f"non-finite literal {literal} is not strict JSON (statistics must be finite)")
            for field, literal in located]


def get(obj: Any, parts: tuple[str | int, ...]) -> tuple[bool, Any]:
    """``(True, value)`` when every key/index of ``parts`` exists, else ``(False, None)``."""
    cur = obj
    for part in parts:
        if isinstance(part, int):
            if not isinstance(cur, list) or not -len(cur) <= part < len(cur):
                return False, None
            cur = cur[part]
        else:
            if not isinstance(cur, dict) or part not in cur:
                return False, None
            cur = cur[part]
    return True, cur


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def non_finite_numbers(value: Any) -> list[str]:
    """JSON paths of every non-finite float inside ``value`` (for in-memory objects)."""
    return [field_path(parts) for parts, _ in jsonio.find_leaves(value, jsonio.is_non_finite_float)]


def planned_reports(plan: Any, run_dir: Path) -> tuple[list[PlannedReport], list[Finding]]:
    """The reports a plan promises, located by file name inside ``run_dir``.

    The plan names each report by its file name, beside the plan.
    """
    found: list[Finding] = []
    ok, entries = get(plan, ("topologies",))
    if not ok or not isinstance(entries, list) or not entries:
        return [], [Finding(PLAN, "topologies", "must be a non-empty list of planned topologies")]
    planned: list[PlannedReport] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        where = field_path(("topologies", index))
        if not isinstance(entry, dict):
            found.append(Finding(PLAN, where, "must be an object"))
            continue
        output, tp, cp = entry.get("output"), entry.get("tp"), entry.get("cp")
        name = output.replace("\\", "/").rsplit("/", 1)[-1] if isinstance(output, str) else ""
        match = REPORT_NAME.match(name)
        if not match:
            found.append(Finding(PLAN, f"{where}.output", f"{output!r} does not end in a tp<T>-cp<C>.json file name"))
            continue
        if (int(match.group(1)), int(match.group(2))) != (tp, cp):
            found.append(Finding(PLAN, f"{where}.output", f"file {name} does not match tp={tp!r} cp={cp!r}"))
            continue
        label = name[: -len(".json")]
        if label in seen:
            found.append(Finding(PLAN, f"{where}.output", f"topology {label} is planned twice"))
            continue
        seen.add(label)
        command = entry.get("command")
        planned.append(PlannedReport(label, tp, cp, run_dir / name, command if isinstance(command, str) else None))
    return planned, found


def _inside(name: Any) -> bool:
    """A plain relative POSIX path that stays inside the directory it is joined to."""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    pure = PurePosixPath(name)
    return not pure.is_absolute() and all(part not in ("", ".", "..") for part in pure.parts)


def evidence_files(run_dir: Path) -> tuple[list[str], list[Finding]]:
    """The run's evidence files (paths relative to ``run_dir``, sorted), named by the evidence itself.

    ``environment.json`` and ``environment.txt``; ``regression.json`` and the pytest log and JUnit
    XML it names; ``case.json``, ``plan.json``, every report the plan lists and every raw tensor file each report
    records; ``validation.json`` and ``crosscheck.json``. Not ``SUMMARY.md``, the logs under
    ``logs/`` or what an archive adds. This is what ``SUMMARY.md``'s artifact table lists and
    what an archive must hold besides ``SUMMARY.md`` for ``verify`` to check every claim; a file
    lying in the run directory that no evidence names (a leftover, a note) is not evidence.
    Unreadable ``regression.json``, ``plan.json`` or reports are findings (their names still count);
    a name that is not a plain relative path inside the run (absolute, ``..``, a backslash) is left
    out, so nothing outside the run directory is ever read as its evidence (the gates fail it).
    """
    names = {ENVIRONMENT, ENVIRONMENT_TEXT, REGRESSION, CASE, PLAN, VALIDATION, CROSSCHECK}
    found: list[Finding] = []
    regression, regression_found = load_json(run_dir / REGRESSION)
    found += regression_found
    for key in ("log", "junit"):
        name = regression.get(key) if isinstance(regression, dict) else None
        if _inside(name):
            names.add(name)
    plan, plan_found = load_json(run_dir / PLAN)
    found += plan_found
    planned, planned_found = planned_reports(plan, run_dir) if plan is not None else ([], [])
    found += planned_found
    for item in planned:
        names.add(item.file)
        report, report_found = load_json(item.path)
        found += report_found
        ok, tensors = get(report, ("tensors",))
        for entry in tensors.values() if ok and isinstance(tensors, dict) else ():
            if isinstance(entry, dict) and _inside(entry.get("path")):
                names.add(entry["path"])
    return sorted(names), found


def finish_gate(
    verb: str,
    output: Path,
    result: dict[str, Any],
    schema_name: str,
    found: list[Finding],
    passed_message: str,
    schema_dir: Path | None = None,
) -> int:
    """Write a gate's schema-valid result, then report it: 0 passed, 1 findings or bad result.

    The result file is written either way (it is evidence of what failed); the findings go to
    stderr, one per line, naming file or topology and field.
    """
    try:
        schemas.write_validated(output, result, schema_name, schema_dir)
    except schemas.ArtifactSchemaError as exc:
        print(f"{verb}: {exc}", file=sys.stderr)
        return 1
    if found:
        print(f"{verb} FAILED ({len(found)} problems):", file=sys.stderr)
        for finding in found:
            print(f"  {finding}", file=sys.stderr)
        return 1
    print(passed_message)
    return 0
