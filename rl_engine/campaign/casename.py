"""Run names: ``<campaign>-<short commit>[-dirty]-case-<case hash>``, and the case hash itself.

A run directory ``results/<name>/`` and its archive ``results/<name>.tar.gz`` are named by what
determines their evidence, so two campaigns never share a directory or an archive:

* the campaign (config ``campaign``), the short commit of the tested tree and ``-dirty`` when
  the tree had changes (or ``nogit`` when no git state could be read);
* :func:`case_hash`: the first :data:`CASE_HASH_CHARS` hex digits of the SHA-256 of the
  *resolved case* (:func:`resolved_case`): every field of the plan's ``case`` (device, dist
  backend, dtype, backend, vocabulary, tiles, shapes, seed, CP layout, logit scale, tolerances,
  threads per rank, process-group timeout), the topologies in plan order, and the focused
  regression's test files and extra pytest arguments. On a capture, the case's ``capture``
  record counts without its ``path``: the same bytes (SHA-256, size, shape, metadata, whether
  the archive holds them) at another path are the same case, so moving the file keeps the run
  name (the path stays in the evidence, for information and for the ranks to find the file).
  With a ``parity:`` section, :func:`parity_identity` (both captures' SHA-256 and the verb's
  options, no paths) counts too; without one nothing is added, so a run without parity keeps
  the name it had before parity existed.

Everything in the resolved case is recorded in the evidence (``plan.json``'s ``case`` and
``topologies``, ``regression.json``'s ``tests`` and ``command``), so the hash can be computed
again from an archive (:func:`evidence_resolved_case`), and ``verify`` checks that the name an
archive carries is the name of its evidence. What does not change the evidence (the campaign's
wall-clock limits ``topology_timeout_s`` and ``regression.timeout_s``) is not part of it, so a
rerun with a longer limit completes the same run.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

# Case fields that are floats: an integer in the config (logit_scale: 1) and the float in
# plan.json (1.0) are the same case.
from rl_engine.campaign.case import FLOAT_FIELDS

CASE_HASH_CHARS = 8
NOGIT = "nogit"
NAME = re.compile(
    r"^(?P<campaign>.+)-(?P<commit>[0-9a-f]{7,40}|nogit)(?P<dirty>-dirty)?-case-(?P<case>[0-9a-f]{%d})$"
    % CASE_HASH_CHARS
)
# regression.json's command: python -m pytest -q -rs <tests...> <pytest args...> --junitxml=<file>
PYTEST_PREFIX = ("python", "-m", "pytest", "-q", "-rs")
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


def _topology_label(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        return f"{item.get('tp')}x{item.get('cp')}"
    tp, cp = item
    return f"{tp}x{cp}"


CAPTURE_INFO_KEYS = ("path",)  # of a case's capture record: recorded, not part of the case's identity


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


def resolved_case(case: Mapping[str, Any], topologies: Sequence[Any], tests: Sequence[str],
                  pytest_args: Sequence[str], parity: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The values that determine a run's evidence, in one canonical JSON-ready object.

    ``case``: the plan's case (the runner's :class:`~rl_engine.campaign.case.Case` fields; a
    capture record without :data:`CAPTURE_INFO_KEYS`); ``topologies``: ``"<tp>x<cp>"`` strings,
    ``(tp, cp)`` pairs or plan entries, in plan order; ``parity``: :func:`parity_identity`, or
    None for a run without a parity stage (then no key is added).
    """
    normalized: dict[str, Any] = {}
    for key in sorted(case):
        value = case[key]
        if key in FLOAT_FIELDS and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = float(value)
        if key == "capture" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in CAPTURE_INFO_KEYS}
        normalized[key] = value
    resolved = {
        "case": normalized,
        "topologies": [_topology_label(t) for t in topologies],
        "regression": {"tests": list(tests), "pytest_args": list(pytest_args)},
    }
    if parity is not None:
        resolved["parity"] = dict(parity)
    return resolved


def case_hash(resolved: Mapping[str, Any]) -> str:
    """First :data:`CASE_HASH_CHARS` hex digits of the SHA-256 of the canonical JSON of ``resolved``."""
    try:
        text = json.dumps(resolved, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise RunNameError(f"the resolved case is not strict JSON: {exc}") from None
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:CASE_HASH_CHARS]


def pytest_args_of(regression: Mapping[str, Any]) -> list[str]:
    """The extra pytest arguments recorded in ``regression.json``'s ``command``.

    The regression verb writes ``python -m pytest -q -rs <tests> <extra args> --junitxml=<file>``;
    anything else is refused (:class:`RunNameError`), never guessed.
    """
    command, tests = regression.get("command"), regression.get("tests")
    if not isinstance(command, str) or not isinstance(tests, list):
        raise RunNameError("regression.json: command and tests must be a string and a list")
    try:
        argv = shlex.split(command)
    except ValueError as exc:
        raise RunNameError(f"regression.json: command: not a shell command ({exc})") from None
    head = len(PYTEST_PREFIX) + len(tests)
    if (tuple(argv[: len(PYTEST_PREFIX)]) != PYTEST_PREFIX or argv[len(PYTEST_PREFIX):head] != tests
            or len(argv) <= head or not argv[-1].startswith(JUNIT_FLAG)):
        raise RunNameError("regression.json: command is not 'python -m pytest -q -rs <tests> [args] "
                           f"--junitxml=<file>' as the regression verb writes it: {command!r}")
    return argv[head:-1]


def evidence_resolved_case(plan: Mapping[str, Any], regression: Mapping[str, Any],
                           parity: Any = None) -> dict[str, Any]:
    """:func:`resolved_case` computed from ``plan.json`` and ``regression.json`` (and ``parity.json``'s
    JSON when the run holds one: pass it as ``parity``)."""
    case, entries = plan.get("case"), plan.get("topologies")
    if not isinstance(case, Mapping) or not isinstance(entries, list):
        raise RunNameError("plan.json: case and topologies must be an object and a list")
    identity = None if parity is None else report_parity_identity(parity)
    if parity is not None and identity is None:
        raise RunNameError("parity.json: must be an object (the parity stage's report)")
    return resolved_case(case, entries, regression.get("tests") or [], pytest_args_of(regression), identity)


__all__ = [
    "CAPTURE_INFO_KEYS", "CASE_HASH_CHARS", "NOGIT", "RunName", "RunNameError", "case_hash", "evidence_resolved_case",
    "parity_identity", "pytest_args_of", "report_parity_identity", "resolved_case",
]
