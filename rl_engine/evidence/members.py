"""What an evidence archive may hold, named by the evidence and the workflow's rules.

An archive holds the run's evidence (:func:`rl_engine.evidence.rundir.evidence_files`: the files
the evidence itself names), ``SUMMARY.md``, the stage logs the workflow's rules write
(``logs/<stage>.log``, one per stage of :data:`STAGE_LOGS` and one per planned topology), the
schemas ``validation.json`` records it was checked with (``schemas/<name>.schema.json``), and
what ``archive`` adds: ``REVIEWING.md`` and ``SHA256SUMS``. Any other member is content no
check reads (junk padding ``logs/``, a note beside the evidence): :func:`unexpected_members`
names each one, and ``verify`` fails them.
"""

from __future__ import annotations

from pathlib import Path

from rl_engine.evidence.rundir import (
    REPORT_NAME,
    REVIEWING,
    SCHEMA_DIR,
    SUMMARY,
    SUMS,
    VALIDATION,
    evidence_files,
    load_json,
)

# the stages whose rule writes ``{run}/logs/<stage>.log`` besides one log per topology
# (workflow/rules/*.smk; tests/test_verify.py checks the rules name no other run log)
STAGE_LOGS: tuple[str, ...] = ("environment", "regression", "case", "plan", "validation", "crosscheck", "summary")
SCHEMA_SUFFIX = ".schema.json"


def expected_members(root: Path) -> set[str]:
    """Every file (relative to ``root``) some rule of the workflow or ``archive`` produces for this run."""
    names, _ = evidence_files(root)  # unreadable evidence fails other rows; its names still count
    labels = [name[: -len(".json")] for name in names if REPORT_NAME.match(name)]
    allowed = {*names, SUMMARY, REVIEWING, SUMS, *(f"logs/{stem}.log" for stem in (*STAGE_LOGS, *labels))}
    recorded, _ = load_json(root / VALIDATION)
    used = recorded.get("schemas") if isinstance(recorded, dict) else None
    if isinstance(used, dict):
        allowed |= {f"{SCHEMA_DIR}/{name}{SCHEMA_SUFFIX}" for name in used if isinstance(name, str)}
    return allowed


def unexpected_members(root: Path, files: list[str]) -> list[str]:
    """One message per member of ``files`` (relative to ``root``) that no rule produces."""
    allowed = expected_members(root)
    return [f"{rel}: no rule of the workflow produces this file: an archive holds only the run's evidence, "
            f"{SUMMARY}, the stage logs, the schemas {VALIDATION} records, {REVIEWING} and {SUMS}; refused, since "
            "no check reads it (rebuild the archive with the archive verb from the workflow's declared files)"
            for rel in sorted(files) if rel not in allowed]
