"""Run names: ``<campaign>-<short commit>[-dirty]-case-<case hash>``.

A run directory ``results/<name>/`` and its archive ``results/<name>.tar.gz`` are named by what
determines their evidence, so two campaigns never share a directory or an archive:

* the campaign (config ``campaign``), the short commit of the tested tree and ``-dirty`` when
  the tree had changes (or ``nogit`` when no git state could be read);
* the case hash, which the case module owns (:func:`rl_engine.campaign.case.case_hash`, built
  from the config by :meth:`~rl_engine.campaign.case.Case.run_hash`): every field of the plan's
  ``case``, the topologies in plan order, and the focused regression's test files and extra
  pytest arguments. On a capture, the case's ``capture`` record counts without its ``path``: the
  same bytes at another path are the same case, so moving the file keeps the run name. With a
  ``parity:`` section, :func:`parity_identity` (both captures' SHA-256 and the verb's options, no
  paths) counts too; without one nothing is added, so a run without parity keeps its name.

Everything the hash covers is recorded in the evidence (``plan.json``'s ``case`` and
``topologies``, ``regression.json``'s ``tests`` and ``command``, ``parity.json``), so the hash
can be computed again from an archive (:func:`evidence_case_hash`), and ``verify`` checks that
the name an archive carries is the name of its evidence. What does not change the evidence (the
campaign's wall-clock limits ``topology_timeout_s`` and ``regression.timeout_s``) is not part of
it, so a rerun with a longer limit completes the same run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from rl_engine.campaign import case as case_module  # case_module.case_hash: the one builder (a test spies on it)
from rl_engine.campaign.case import CASE_HASH_CHARS, CaseHashError
from rl_engine.record.suite_imports import PLUGIN as SUITE_IMPORTS_PLUGIN

NOGIT = "nogit"
NAME = re.compile(
    r"^(?P<campaign>.+)-(?P<commit>[0-9a-f]{7,40}|nogit)(?P<dirty>-dirty)?-case-(?P<case>[0-9a-f]{%d})$"
    % CASE_HASH_CHARS
)
# regression.json's command: python -m pytest -q -rs <tests...> <pytest args...> --junitxml=<file>
PYTEST_PREFIX = ("python", "-m", "pytest", "-q", "-rs")
SUITE_PLUGIN = ("-p", SUITE_IMPORTS_PLUGIN)  # the verb's own plugin (what the suite loaded), not an extra argument
JUNIT_FLAG = "--junitxml="


class RunNameError(ValueError):
    """A run name or evidence that cannot name a case; names what is wrong and the fix."""


@dataclass(frozen=True)
class RunName:
    """The parts of ``<campaign>-<commit>[-dirty]-case-<hash>``."""

    campaign: str
    commit: str  # short commit, or "nogit"
    dirty: bool
    case: str

    def __post_init__(self) -> None:
        if not self.campaign:
            raise RunNameError("RunName.campaign must be a non-empty string")
        if self.commit != NOGIT and not re.fullmatch(r"[0-9a-f]{7,40}", self.commit):
            raise RunNameError(f"RunName.commit={self.commit!r} must be a short hex commit or {NOGIT!r}")
        if self.commit == NOGIT and self.dirty:
            raise RunNameError("RunName.dirty must be False when the commit is 'nogit' (no git state read)")
        if not re.fullmatch(r"[0-9a-f]{%d}" % CASE_HASH_CHARS, self.case):
            raise RunNameError(f"RunName.case={self.case!r} must be {CASE_HASH_CHARS} hex digits")

    def __str__(self) -> str:
        return f"{self.campaign}-{self.commit}{'-dirty' if self.dirty else ''}-case-{self.case}"

    @classmethod
    def parse(cls, name: str) -> "RunName":
        match = NAME.match(name)
        if not match:
            raise RunNameError(
                f"{name!r} is not a run name <campaign>-<short commit>[-dirty]-case-<{CASE_HASH_CHARS} hex digits>"
            )
        return cls(match["campaign"], match["commit"], match["dirty"] is not None, match["case"])


def parity_identity(rollout_sha256: Any, trainer_sha256: Any, ratio_bounds: Any, num_vocab_tiles: Any,
                    backend: Any) -> dict[str, Any]:
    """What a parity stage compares and how (no paths): its part of the resolved case."""
    bounds = [float(b) if isinstance(b, (int, float)) and not isinstance(b, bool) else b
              for b in (ratio_bounds if isinstance(ratio_bounds, (list, tuple)) else [ratio_bounds])]
    return {"rollout_sha256": rollout_sha256, "trainer_sha256": trainer_sha256, "ratio_bounds": bounds,
            "num_vocab_tiles": num_vocab_tiles, "backend": backend}


def report_parity_identity(report: Any) -> dict[str, Any] | None:
    """:func:`parity_identity` of a parity.json (None when it is not an object: other rows fail it)."""
    if not isinstance(report, Mapping):
        return None
    captures = report.get("captures") if isinstance(report.get("captures"), Mapping) else {}
    sides = [captures.get(side) if isinstance(captures.get(side), Mapping) else {} for side in ("rollout", "trainer")]
    ratio = report.get("importance_ratio") if isinstance(report.get("importance_ratio"), Mapping) else {}
    return parity_identity(sides[0].get("sha256"), sides[1].get("sha256"), ratio.get("bounds"),
                           report.get("num_vocab_tiles"), report.get("backend"))


def pytest_args_of(regression: Mapping[str, Any]) -> list[str]:
    """The extra pytest arguments recorded in ``regression.json``'s ``command``.

    The regression verb writes ``python -m pytest -q -rs -p rl_engine.record.suite_imports <tests>
    <extra args> --junitxml=<file>`` (a record written without that plugin has no ``-p ...``); the
    plugin records what the suite loaded and is no argument of the case. Anything else is refused
    (:class:`RunNameError`), never guessed.
    """
    command, tests = regression.get("command"), regression.get("tests")
    if not isinstance(command, str) or not isinstance(tests, list):
        raise RunNameError("regression.json: command and tests must be a string and a list")
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise RunNameError(f"regression.json: command: not a shell command ({exc})") from None
    start = len(PYTEST_PREFIX)
    if tuple(argv[start:start + len(SUITE_PLUGIN)]) == SUITE_PLUGIN:
        start += len(SUITE_PLUGIN)
    head = start + len(tests)
    if (tuple(argv[: len(PYTEST_PREFIX)]) != PYTEST_PREFIX or argv[start:head] != tests
            or len(argv) <= head or not argv[-1].startswith(JUNIT_FLAG)):
        raise RunNameError("regression.json: command is not 'python -m pytest -q -rs [-p "
                           f"{SUITE_IMPORTS_PLUGIN}] <tests> [args] --junitxml=<file>' as the regression verb "
                           f"writes it: {command!r}")
    return argv[head:-1]


def evidence_case_hash(plan: Mapping[str, Any], regression: Mapping[str, Any], parity: Any = None) -> str:
    """The case hash (:func:`rl_engine.campaign.case.case_hash`) of the evidence: ``plan.json``'s case
    and topologies, ``regression.json``'s tests and extra pytest arguments, and ``parity.json``'s
    identity when the run holds one (pass its JSON as ``parity``). What cannot be read is refused
    (:class:`RunNameError`), never guessed."""
    case, entries = plan.get("case"), plan.get("topologies")
    if not isinstance(case, Mapping) or not isinstance(entries, list):
        raise RunNameError("plan.json: case and topologies must be an object and a list")
    identity = None if parity is None else report_parity_identity(parity)
    if parity is not None and identity is None:
        raise RunNameError("parity.json: must be an object (the parity stage's report)")
    try:
        return case_module.case_hash(case, entries, regression.get("tests") or [], pytest_args_of(regression), identity)
    except CaseHashError as exc:
        raise RunNameError(str(exc)) from None


__all__ = [
    "NOGIT", "RunName", "RunNameError", "evidence_case_hash", "parity_identity", "pytest_args_of", "report_parity_identity",
]
