"""What an evidence archive may hold, named by the evidence and the workflow's stage list.

An archive holds the run's evidence (:meth:`rl_engine.rundir.Run.evidence_files`: the files the
evidence itself names), ``SUMMARY.md``, the logs of the run directory's stages
(:func:`rl_engine.rundir.run_stages` of :meth:`rl_engine.rundir.Run.stages`, the list the workflow's
archive rule packs: one per stage, one per planned topology, and the capture and parity stages' when
the evidence names them), the schemas ``validation.json`` records it was checked with
(``schemas/<name>.schema.json``), and what ``archive`` adds: ``REVIEWING.md``, the spec
``arithmetic.md``, the workflow's definition (``workflow/Snakefile`` and ``workflow/rules/<name>.smk``),
the RO-Crate ``ro-crate-metadata.json``, the statement ``provenance.intoto.json`` and ``SHA256SUMS``.
Any other member is content no check reads (junk padding ``logs/``, a note beside the evidence):
:func:`unexpected_members` names each one, and ``verify`` fails them.
"""

from __future__ import annotations

from rl_engine.rundir import (
    CRATE,
    REVIEWING,
    SCHEMA_DIR,
    SPEC_DOC,
    STATEMENT,
    SUMMARY,
    SUMS,
    VALIDATION,
    WORKFLOW_FILE,
    Run,
    run_stages,
)

SCHEMA_SUFFIX = ".schema.json"


def expected_members(run: Run) -> set[str]:
    """Every file (relative to the run directory) some rule of the workflow or ``archive`` produces for ``run``,
    but the workflow's definition, which :data:`rl_engine.rundir.WORKFLOW_FILE` names."""
    names, _ = run.evidence_files()  # unreadable evidence fails other rows; its names still count
    logs = {stage.log.relative_to(run.root).as_posix() for stage in run_stages(run.stages())}
    allowed = {*names, *logs, SUMMARY, REVIEWING, SUMS, SPEC_DOC, STATEMENT, CRATE}
    recorded = run.doc(VALIDATION)
    used = recorded.get("schemas") if isinstance(recorded, dict) else None
    if isinstance(used, dict):
        allowed |= {f"{SCHEMA_DIR}/{name}{SCHEMA_SUFFIX}" for name in used if isinstance(name, str)}
    return allowed


def unexpected_members(run: Run, files: list[str]) -> list[str]:
    """One message per member of ``files`` (relative to the run directory) that no rule produces."""
    allowed = expected_members(run)
    return [f"{rel}: no rule of the workflow produces this file: an archive holds only the run's evidence, "
            f"{SUMMARY}, the stage logs, the schemas {VALIDATION} records and what the archive verb adds ({REVIEWING}, "
            f"{SPEC_DOC}, the workflow's Snakefile and rules, {CRATE}, {STATEMENT}, {SUMS}); refused, since no check "
            "reads it (rebuild the archive with the archive verb from the workflow's declared files)"
            for rel in sorted(files) if rel not in allowed and not WORKFLOW_FILE.match(rel)]
