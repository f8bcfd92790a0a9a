"""The run directory's names: every file name of a run and the stage list (one owner).

A run directory (``results/<name>/``, or the top folder of an extracted archive) holds
``environment.json`` (+ ``environment.txt``), ``regression.json`` with the pytest log and JUnit
XML it names, ``case.json``, ``plan.json`` and one ``tp<T>-cp<C>.json`` report per planned
topology with its raw ``tp<T>-cp<C>.<name>.f32`` tensors, ``validation.json``,
``crosscheck.json``, ``SUMMARY.md`` and the stages' logs under ``logs/``, and, when the config
asks for them, ``capture.safetensors`` (the case's captured file, ``inputs.archive: true``) and
``parity.json`` with ``parity.png`` (a ``parity:`` section); an extracted
archive's top folder also holds :data:`ARCHIVE_ONLY` (``SHA256SUMS``, ``REVIEWING.md``,
``schemas/``, ``arithmetic.md``, ``provenance.intoto.json``, ``ro-crate-metadata.json`` and the
workflow's definition under ``workflow/``), which ``archive`` adds. Beside the run directory lie the archive
(``results/<name>.tar.gz`` and its ``.sha256``), the verifier's ``results/<name>.verify.json``
and those two stages' logs under ``results/logs/``.

This module is the one place those names are written: :class:`Topology` names a topology's
report, tensors and log; :func:`stages` lists the workflow's stages in order with their outputs
and logs (the Snakefile's targets, the archive's declared logs and the closing table all come
from it). The stages stay here because a stage is its files: its outputs and log are names of
the run like the others. Reading a run (:mod:`rl_engine.rundir.load`) takes its names from here.

No torch, no campaign import: the campaign's plan and runner name their files from here too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

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
STATEMENT = "provenance.intoto.json"  # the in-toto statement with the SLSA provenance predicate (evidence.provenance)
CRATE = "ro-crate-metadata.json"  # the Workflow Run RO-Crate's metadata file (evidence.crate)
WORKFLOW_DIR = "workflow"  # the workflow's definition the archive packs: the Snakefile and its rules
ARCHIVE_ONLY: frozenset[str] = frozenset({SUMS, REVIEWING, SCHEMA_DIR, SPEC_DOC, STATEMENT, CRATE, WORKFLOW_DIR})
# a packed file of the workflow's definition: workflow/Snakefile and workflow/rules/<rule file>.smk
WORKFLOW_FILE = re.compile(r"^workflow/(Snakefile|rules/[A-Za-z0-9_-]+\.smk)$")
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
