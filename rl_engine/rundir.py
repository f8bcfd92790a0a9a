"""The run directory: every file name of a run, the stage list, and :meth:`Run.load` (one owner).

A run directory (``results/<name>/``, or the top folder of an extracted archive) holds
``environment.json`` (+ ``environment.txt``), ``regression.json`` with the pytest log and JUnit
XML it names, ``case.json``, ``plan.json`` and one ``tp<T>-cp<C>.json`` report per planned
topology with its raw ``tp<T>-cp<C>.<name>.f32`` tensors, ``validation.json``,
``crosscheck.json``, ``SUMMARY.md`` and the stages' logs under ``logs/``, and, when the config
asks for them, ``capture.safetensors`` (the case's captured file, ``inputs.archive: true``) and
``parity.json`` with ``parity.png`` (a ``parity:`` section); an extracted
archive's top folder also holds :data:`ARCHIVE_ONLY` (``SHA256SUMS``, ``REVIEWING.md``,
``schemas/``), which ``archive`` adds. Beside the run directory lie the archive
(``results/<name>.tar.gz`` and its ``.sha256``), the verifier's ``results/<name>.verify.json``
and those two stages' logs under ``results/logs/``.

This module is the one place those names are written: :class:`Topology` names a topology's
report, tensors and log; :func:`stages` lists the workflow's stages in order with their outputs
and logs (the Snakefile's targets, the archive's declared logs and the closing table all come
from it); :meth:`Run.load` reads a run's evidence once, so every gate, the summary, the archive
and the reviewer's verifier see the same documents and the same loading findings.

Problems are :class:`Finding` values that name the file (or topology), the field (a dotted
JSON path) and what is wrong; nothing here raises on bad evidence. No torch, no campaign
import: the campaign's plan and runner name their files from here too.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from rl_engine import jsonio

WHOLE_FILE = "(file)"
TOO_DEEP = "JSON nested too deeply to be an rl_engine artifact"

ENVIRONMENT = "environment.json"
ENVIRONMENT_TEXT = "environment.txt"
REGRESSION = "regression.json"
PYTEST_LOG = "pytest-focused.log"
JUNIT = "pytest-junit.xml"
CASE = "case.json"
PLAN = "plan.json"
VALIDATION = "validation.json"
CROSSCHECK = "crosscheck.json"
SUMMARY = "SUMMARY.md"
LOGS = "logs"
CAPTURE = "capture.safetensors"  # the case's captured file, when config inputs.archive is true (capture stage)
PARITY_JSON = "parity.json"  # the parity stage's report, when config.yaml has a parity: section
PARITY_PNG = "parity.png"  # and its histogram

# what ``archive`` adds beside the run's own files (never in a run directory)
SUMS = "SHA256SUMS"
REVIEWING = "REVIEWING.md"
SCHEMA_DIR = "schemas"
SPEC_DOC = "arithmetic.md"  # the arithmetic specification the archive packs (rl_engine.evidence.spec_doc)
ARCHIVE_ONLY: frozenset[str] = frozenset({SUMS, REVIEWING, SCHEMA_DIR, SPEC_DOC})
SOURCES_SUFFIX = "-sources.sha256"  # results/logs/<name>-sources.sha256: the engine's source digest file
ARCHIVE_SUFFIX = ".tar.gz"

TENSOR_NAMES: tuple[str, ...] = ("logp", "lse", "entropy")  # each report's raw <stem>.<name>.f32 files
REPORT_NAME = re.compile(r"^tp([1-9][0-9]*)-cp([1-9][0-9]*)\.json$")
TOPOLOGY_FILE = re.compile(r"^tp([1-9][0-9]*)-cp([1-9][0-9]*)\.")
STEM = "tp{tp}-cp{cp}"  # a topology's label and the stem of its files (also the topology rule's wildcards)


def _report(stem: str) -> str:
    return f"{stem}.json"


def _tensors(stem: str) -> dict[str, str]:
    return {name: f"{stem}.{name}.f32" for name in TENSOR_NAMES}


def _log(stem: str) -> str:
    return f"{LOGS}/{stem}.log"


@dataclass(frozen=True)
class Topology:
    """One TP x CP topology and the names of its files in the run directory."""

    tp: int
    cp: int

    def __post_init__(self) -> None:
        for name in ("tp", "cp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} is {value!r}; it must be an integer >= 1")

    @classmethod
    def of_file(cls, name: str) -> Topology | None:
        """The topology a ``tp<T>-cp<C>.*`` file belongs to (None for any other name)."""
        match = TOPOLOGY_FILE.match(name)
        return cls(int(match.group(1)), int(match.group(2))) if match else None

    @property
    def world_size(self) -> int:
        return self.tp * self.cp

    @property
    def stem(self) -> str:
        """``tp<T>-cp<C>``: the topology's label and the stem of every file of it."""
        return STEM.format(tp=self.tp, cp=self.cp)

    @property
    def report(self) -> str:
        return _report(self.stem)

    @property
    def tensors(self) -> dict[str, str]:
        """The raw tensor files by name (``logp``, ``lse``, ``entropy``)."""
        return _tensors(self.stem)

    @property
    def log(self) -> str:
        """The topology rule's log, relative to the run directory."""
        return _log(self.stem)

    @property
    def outputs(self) -> tuple[str, ...]:
        return (self.report, *self.tensors.values())


def report_tensors(report: str | Path) -> dict[str, Path]:
    """The raw tensor files beside the report at ``report`` (a ``<stem>.json`` path), by name."""
    report = Path(report)
    return {name: report.with_name(file) for name, file in _tensors(report.stem).items()}


def topology_rule_files(run: str | Path) -> tuple[dict[str, str], str]:
    """The topology rule's outputs (``report`` and each tensor, by name) and log, with the
    wildcards ``{tp}`` and ``{cp}`` in place of the degrees."""
    stem = STEM.format(tp="{tp}", cp="{cp}")
    outputs = {"report": _report(stem), **_tensors(stem)}
    return {key: f"{Path(run) / name}" for key, name in outputs.items()}, f"{Path(run) / _log(stem)}"


def inside(name: Any) -> bool:
    """A plain relative POSIX path that stays inside the directory it is joined to.

    The one path-safety rule of the evidence: no absolute path, no ``..``, ``.`` or empty part,
    no backslash. Names the evidence records (tensor paths, the regression's log and JUnit XML,
    ``SHA256SUMS`` lines) are joined to the run directory only when this holds.
    """
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    pure = PurePosixPath(name)
    return not pure.is_absolute() and all(part not in ("", ".", "..") for part in pure.parts)


# ----- the stages -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One stage of the workflow: its rule, the label the closing table names, its outputs and log."""

    rule: str
    label: str
    outputs: tuple[Path, ...]
    log: Path

    def missing(self) -> list[Path]:
        return [p for p in self.outputs if not p.is_file()]


def stages(run: str | Path, topologies: list[Topology] | tuple[Topology, ...], *,
           capture: bool = False, parity: bool = False) -> list[Stage]:
    """Every stage of the run ``run`` (``results/<name>``) in workflow order.

    The run directory's own stages log under ``<run>/logs/``; the archive and its verification
    write beside the run directory and log under ``results/logs/``. Two stages exist only when
    the config asks for them: ``capture`` (config ``inputs.archive: true``: the case's captured
    file copied into the run as :data:`CAPTURE`, after the case) and ``parity`` (config
    ``parity:``: :data:`PARITY_JSON` and :data:`PARITY_PNG`, before the validation gate, which
    checks parity.json against its schema).
    """
    run = Path(run)
    results, name = run.parent, run.name
    logs = run / LOGS

    def own(rule: str, label: str, *outputs: str) -> Stage:
        return Stage(rule, label, tuple(run / o for o in outputs), logs / f"{rule}.log")

    out = [
        Stage("sources", "sources", (results / LOGS / f"{name}{SOURCES_SUFFIX}",), results / LOGS / f"{name}-sources.log"),
        own("environment", "environment", ENVIRONMENT, ENVIRONMENT_TEXT),
        own("regression", "regression", REGRESSION, PYTEST_LOG, JUNIT),
        own("case", "case", CASE),
        *([own("capture", "capture copy", CAPTURE)] if capture else []),
        own("plan", "plan", PLAN),
    ]
    out += [Stage("topology", f"topology {t.stem}", tuple(run / o for o in t.outputs), run / t.log)
            for t in topologies]
    out += [
        *([own("parity", "parity", PARITY_JSON, PARITY_PNG)] if parity else []),
        own("validation", "validation gate", VALIDATION),
        own("crosscheck", "crosscheck gate", CROSSCHECK),
        own("summary", "summary", SUMMARY),
        Stage("archive", "archive", (results / f"{name}{ARCHIVE_SUFFIX}", results / f"{name}{ARCHIVE_SUFFIX}.sha256"),
              results / LOGS / f"{name}-archive.log"),
        Stage("verify_archive", "verify_archive", (results / f"{name}.verify.json",),
              results / LOGS / f"{name}-verify.log"),
    ]
    return out


def run_stages(all_stages: list[Stage]) -> list[Stage]:
    """The stages whose logs lie in the run directory (what the archive packs as logs); the
    sources digest, the archive and its verification log under ``results/logs/``."""
    return [s for s in all_stages if s.rule not in ("sources", "archive", "verify_archive")]


# ----- reading evidence -------------------------------------------------------------------------
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


__all__ = [
    "ARCHIVE_ONLY", "CAPTURE", "OPTIONAL_DOCUMENTS", "PARITY_JSON", "PARITY_PNG", "SOURCES_SUFFIX", "SPEC_DOC", "CASE",
    "CROSSCHECK", "ENVIRONMENT", "ENVIRONMENT_TEXT", "Finding", "JUNIT", "PLAN",
    "PYTEST_LOG", "PlannedReport", "REGRESSION", "REVIEWING", "Run", "SCHEMA_DIR", "SUMMARY", "SUMS", "Stage",
    "STEM", "TENSOR_NAMES", "Topology", "topology_rule_files", "VALIDATION", "field_path", "get", "inside", "is_number", "load_json",
    "non_finite_numbers", "planned_reports", "report_tensors", "run_stages", "stages",
]
