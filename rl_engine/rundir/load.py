"""Reading a run's evidence: :meth:`Run.load` and the strict-JSON loading every check shares.

:meth:`Run.load` reads a run's evidence once, so every gate, the summary, the archive and the
reviewer's verifier see the same documents and the same loading findings. The files it reads
are named by :mod:`rl_engine.rundir.names`, never here.

Problems are :class:`Finding` values that name the file (or topology), the field (a dotted
JSON path) and what is wrong; nothing here raises on bad evidence. No torch, no campaign import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_engine import jsonio
from rl_engine.rundir.names import (
    CAPTURE,
    CASE,
    CROSSCHECK,
    ENVIRONMENT,
    ENVIRONMENT_TEXT,
    PARITY_JSON,
    PARITY_PNG,
    PLAN,
    REGRESSION,
    REPORT_NAME,
    VALIDATION,
    Stage,
    Topology,
    inside,
    stages,
)

WHOLE_FILE = "(file)"
TOO_DEEP = "JSON nested too deeply to be an rl_engine artifact"


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


def load_json(path: Path, where: str | None = None,
              read: Callable[[Path], bytes] = Path.read_bytes) -> tuple[Any, list[Finding]]:
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
        text = read(path).decode("utf-8")
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


@dataclass(frozen=True)
class PlannedReport:
    """A report the plan promises: its topology, where it lies in the run and the plan's command."""

    topology: Topology
    path: Path
    command: str | None

    @property
    def label(self) -> str:
        return self.topology.stem

    @property
    def tp(self) -> int:
        return self.topology.tp

    @property
    def cp(self) -> int:
        return self.topology.cp

    @property
    def file(self) -> str:
        return self.path.name


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
        topology = Topology(int(match.group(1)), int(match.group(2)))
        if (topology.tp, topology.cp) != (tp, cp):
            found.append(Finding(PLAN, f"{where}.output", f"file {name} does not match tp={tp!r} cp={cp!r}"))
            continue
        if topology.stem in seen:
            found.append(Finding(PLAN, f"{where}.output", f"topology {topology.stem} is planned twice"))
            continue
        seen.add(topology.stem)
        command = entry.get("command")
        planned.append(PlannedReport(topology, run_dir / name, command if isinstance(command, str) else None))
    return planned, found


# a file of the run up to this size is held in memory once read (Run.file_bytes); a larger one is streamed
HELD_FILE_BYTES = 64 * 1024 * 1024
# the documents Run.load reads, in workflow order
DOCUMENTS: tuple[str, ...] = (ENVIRONMENT, REGRESSION, CASE, PLAN, VALIDATION, CROSSCHECK)
# the documents Run.load reads when they lie in the run (a stage the config may leave out)
OPTIONAL_DOCUMENTS: tuple[str, ...] = (PARITY_JSON,)


@dataclass(frozen=True)
class Run:
    """A run directory's evidence, read once: each document, the planned reports and what failed to load.

    ``documents`` maps each of :data:`DOCUMENTS` and each planned report's file name to its JSON
    (``None`` when it could not be read); ``load_findings`` holds, by the same names, why not.
    ``plan_findings`` are the plan's entries that name no readable report. A missing
    ``validation.json`` or ``crosscheck.json`` is a finding too; a gate that runs before them
    does not look at those.
    """

    root: Path
    documents: dict[str, Any] = field(default_factory=dict)
    load_findings: dict[str, tuple[Finding, ...]] = field(default_factory=dict)
    planned: tuple[PlannedReport, ...] = ()
    plan_findings: tuple[Finding, ...] = ()
    # the files read so far (the documents, by Run.load; the raw tensors, by their check), by path
    read_files: dict[Path, bytes] = field(default_factory=dict, repr=False, compare=False)
    # the SHA-256 of each file a check hashed, by path (a capture is hashed as a stream, never held)
    digests: dict[Path, str] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def load(cls, root: str | Path) -> Run:
        root = Path(root)
        documents: dict[str, Any] = {}
        findings: dict[str, tuple[Finding, ...]] = {}
        read_files: dict[Path, bytes] = {}

        def read(path: Path) -> bytes:  # kept: the checks that hash a document hash these bytes
            read_files[path] = path.read_bytes()
            return read_files[path]

        present = [name for name in OPTIONAL_DOCUMENTS if os.path.lexists(root / name)]
        for name in (*DOCUMENTS, *present):
            documents[name], found = load_json(root / name, read=read)
            findings[name] = tuple(found)
        planned: list[PlannedReport] = []
        plan_found: list[Finding] = []
        if documents[PLAN] is not None:
            planned, plan_found = planned_reports(documents[PLAN], root)
        for item in planned:
            documents[item.file], found = load_json(item.path, read=read)
            findings[item.file] = tuple(found)
        return cls(root, documents, findings, tuple(planned), tuple(plan_found), read_files)

    def doc(self, name: str) -> Any:
        """The JSON of ``name`` (a document or a planned report's file), ``None`` when unreadable."""
        return self.documents.get(name)

    def found(self, name: str) -> list[Finding]:
        """Why ``name`` could not be read (empty when it was)."""
        return list(self.load_findings.get(name, ()))

    def file_bytes(self, path: Path) -> bytes:
        """The bytes of a file of the run, read once: every later check, the recompute and the replay
        get the bytes the first reader hashed or parsed, not a second read of the disk."""
        if path not in self.read_files:
            self.read_files[path] = path.read_bytes()
        return self.read_files[path]

    def sha256(self, path: Path) -> str:
        """The SHA-256 of a file of the run, computed once: from :meth:`file_bytes` for a file of at most
        :data:`HELD_FILE_BYTES` (the documents, the raw tensors), as a stream for a larger one (a capture),
        whose bytes are never held."""
        if path not in self.digests:
            if path not in self.read_files and path.stat().st_size > HELD_FILE_BYTES:
                self.digests[path] = jsonio.sha256_file(path)
            else:
                self.digests[path] = jsonio.sha256_bytes(self.file_bytes(path))
        return self.digests[path]

    @property
    def environment(self) -> Any:
        return self.documents.get(ENVIRONMENT)

    @property
    def regression(self) -> Any:
        return self.documents.get(REGRESSION)

    @property
    def case(self) -> Any:
        return self.documents.get(CASE)

    @property
    def plan(self) -> Any:
        return self.documents.get(PLAN)

    @property
    def has_parity(self) -> bool:
        """The run holds a parity stage's report (config ``parity:``): parity.json lies in it."""
        return PARITY_JSON in self.documents

    @property
    def parity(self) -> Any:
        return self.documents.get(PARITY_JSON)

    @property
    def archives_capture(self) -> bool:
        """The case runs on a capture that the archive holds (config ``inputs.archive: true``)."""
        capture = self.plan_case().get("capture")
        return isinstance(capture, dict) and capture.get("archive") is True

    def stages(self) -> list[Stage]:
        """:func:`stages` of this run: its planned topologies and the optional stages its evidence names."""
        topologies = [item.topology for item in self.planned]
        return stages(self.root, topologies, capture=self.archives_capture, parity=self.has_parity)

    def report(self, item: PlannedReport) -> Any:
        return self.documents.get(item.file)

    def reports(self) -> list[tuple[PlannedReport, Any]]:
        """Every planned report with its JSON (``None`` when unreadable), in plan order."""
        return [(item, self.documents.get(item.file)) for item in self.planned]

    def plan_case(self) -> dict[str, Any]:
        """The plan's case (an empty object when the plan or its case cannot be read)."""
        case = self.plan.get("case") if isinstance(self.plan, dict) else None
        return case if isinstance(case, dict) else {}

    def evidence_files(self) -> tuple[list[str], list[Finding]]:
        """The run's evidence files (paths relative to the run directory, sorted), named by the evidence itself.

        ``environment.json`` and ``environment.txt``; ``regression.json`` and the pytest log and
        JUnit XML it names; ``case.json``, ``plan.json``, every report the plan lists and every raw
        tensor file each report records; ``validation.json`` and ``crosscheck.json``;
        :data:`CAPTURE` when the plan's case says the archive holds its capture; ``parity.json``
        and ``parity.png`` when the run holds a parity report. Not
        ``SUMMARY.md``, the logs under ``logs/`` or what an archive adds. This is what
        ``SUMMARY.md``'s artifact table lists and what an archive must hold besides ``SUMMARY.md``
        for ``verify`` to check every claim; a file lying in the run directory that no evidence
        names (a leftover, a note) is not evidence. Unreadable ``regression.json``, ``plan.json``
        or reports are findings (their names still count); a name that is not a plain relative
        path inside the run (:func:`inside`) is left out, so nothing outside the run directory is
        ever read as its evidence (the gates fail it).
        """
        names = {ENVIRONMENT, ENVIRONMENT_TEXT, REGRESSION, CASE, PLAN, VALIDATION, CROSSCHECK}
        if self.archives_capture:
            names.add(CAPTURE)
        if self.has_parity:
            names |= {PARITY_JSON, PARITY_PNG}
        found = self.found(REGRESSION) + self.found(PLAN) + list(self.plan_findings)
        regression = self.regression
        for key in ("log", "junit"):
            name = regression.get(key) if isinstance(regression, dict) else None
            if inside(name):
                names.add(name)
        for item, report in self.reports():
            names.add(item.file)
            found += self.found(item.file)
            ok, tensors = get(report, ("tensors",))
            for entry in tensors.values() if ok and isinstance(tensors, dict) else ():
                if isinstance(entry, dict) and inside(entry.get("path")):
                    names.add(entry["path"])
        return sorted(names), found
