"""The run directory: every file name of a run, the stage list, and :meth:`Run.load` (one owner).

Two concerns, one module each. :mod:`rl_engine.rundir.names` is the one place a run's file names
are written and the stages are listed (:class:`Topology`, :func:`stages`): the campaign, the
Snakefile's rules, the gates and the archive all name their files from it.
:mod:`rl_engine.rundir.load` reads a run's evidence once (:class:`Run`, :class:`Finding`,
:func:`load_json`), so every gate, the summary, the archive and the reviewer's verifier see the
same documents and the same loading findings.

Import from here (``from rl_engine.rundir import PLAN, Run``): this package re-exports both
modules' names. No torch, no campaign import.
"""

from __future__ import annotations

from rl_engine.rundir.load import (
    DOCUMENTS,  # noqa: F401 (public, outside __all__)
    HELD_FILE_BYTES,  # noqa: F401 (public, outside __all__)
    OPTIONAL_DOCUMENTS,
    TOO_DEEP,  # noqa: F401 (public, outside __all__)
    WHOLE_FILE,  # noqa: F401 (public, outside __all__)
    Finding,
    PlannedReport,
    Run,
    field_path,
    get,
    is_number,
    load_json,
    non_finite_numbers,
    planned_reports,
)
from rl_engine.rundir.names import (
    ARCHIVE_ONLY,
    ARCHIVE_SUFFIX,  # noqa: F401 (public, outside __all__)
    CAPTURE,
    CASE,
    CRATE,
    CROSSCHECK,
    ENVIRONMENT,
    ENVIRONMENT_TEXT,
    JUNIT,
    LOGS,  # noqa: F401 (public, outside __all__)
    PARITY_JSON,
    PARITY_PNG,
    PLAN,
    PYTEST_LOG,
    REGRESSION,
    REPORT_NAME,  # noqa: F401 (public, outside __all__)
    REVIEWING,
    SCHEMA_DIR,
    SOURCES_SUFFIX,
    SPEC_DOC,
    STATEMENT,
    STEM,
    SUMMARY,
    SUMS,
    TENSOR_NAMES,
    TOPOLOGY_FILE,  # noqa: F401 (public, outside __all__)
    VALIDATION,
    WORKFLOW_DIR,
    WORKFLOW_FILE,
    Stage,
    Topology,
    inside,
    report_tensors,
    run_stages,
    stages,
    topology_rule_files,
)

__all__ = [
    "ARCHIVE_ONLY", "CAPTURE", "OPTIONAL_DOCUMENTS", "PARITY_JSON", "PARITY_PNG", "SOURCES_SUFFIX", "SPEC_DOC", "CASE",
    "CRATE", "CROSSCHECK", "ENVIRONMENT", "ENVIRONMENT_TEXT", "Finding", "JUNIT", "PLAN",
    "PYTEST_LOG", "PlannedReport", "REGRESSION", "REVIEWING", "Run", "SCHEMA_DIR", "STATEMENT", "SUMMARY", "SUMS", "Stage",
    "STEM", "TENSOR_NAMES", "Topology", "topology_rule_files", "VALIDATION", "WORKFLOW_DIR",
    "WORKFLOW_FILE", "field_path", "get", "inside", "is_number", "load_json",
    "non_finite_numbers", "planned_reports", "report_tensors", "run_stages", "stages",
]
