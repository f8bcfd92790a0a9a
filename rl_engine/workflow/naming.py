"""A run's name and case file from a checked config: ``<campaign>-<short commit>[-dirty]-case-<hash>``
(:mod:`rl_engine.campaign.casename`), the hash being the case's own
(:meth:`rl_engine.campaign.case.Case.run_hash`), and the case rule's JSON.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_engine.campaign.case import (
    Case,
    case_document,
)
from rl_engine.campaign.casename import NOGIT, RunName
from rl_engine.record.gitstate import GitStateError, read_git_state
from rl_engine.workflow.config import config_capture, config_parity, config_topologies


def config_case_hash(config: dict[str, Any]) -> str:
    """The case hash (:meth:`rl_engine.campaign.case.Case.run_hash`) of a checked config (a capture's
    path does not count; a ``parity:`` section's captures and options do, by hash)."""
    regression = config["regression"]
    case = Case.from_config(config, config_capture(config))
    return case.run_hash(config["topologies"], regression["tests"], regression.get("pytest_args", []), config_parity(config))


def run_name(config: dict[str, Any], repo: str | Path) -> str:
    """``<campaign>-<short commit>[-dirty]-case-<hash>``; ``nogit`` for the commit when git cannot be read.

    The case hash (:func:`config_case_hash`) covers every value that determines the evidence, so
    a changed topology list, seed or device is a new run directory and a new archive, and never
    meets the files of another campaign. Dirty means what environment.json's ``git.dirty`` means
    (:mod:`rl_engine.record.gitstate`: a changed tracked file or an untracked file that is not
    ignored), so the two always agree. Stable across reruns of the same tree and case, so a
    rerun completes the same run directory.
    """
    digest = config_case_hash(config)
    try:
        state = read_git_state(repo)
    except GitStateError:
        return str(RunName(config["campaign"], NOGIT, False, digest))
    return str(RunName(config["campaign"], state.short_commit, state.dirty, digest))


def config_case(config: dict[str, Any]) -> dict[str, Any]:
    """The case file's JSON of a checked config: what the case rule writes to case.json."""
    topologies = tuple((t.tp, t.cp) for t in config_topologies(config))
    return case_document(Case.from_config(config, config_capture(config)), topologies)
