"""Fault injection for the failure tests of the workflow: ``RL_ENGINE_FAULT``.

A fault only ever makes a run fail; it never makes a failing run pass. Values:

* ``perturb:<T>x<C>``: in topology ``T x C``, rank 0 moves the first active token's
  selected logprob of the reassembled candidate by ``1e-3 + 2 * (atol + rtol * |ref|)``
  (``ref`` the FP32 oracle's value) before fingerprints and drift are computed, so the
  drift check fails and the report is written with ``passed=false``;
* ``kill:<T>x<C>:<rank>``: that rank SIGKILLs itself once the mesh is up;
* ``hang:<T>x<C>:<rank>``: that rank sleeps forever once the mesh is up.

A fault for another topology does nothing in this one (but is still recorded); a value
that does not parse is an error before anything starts.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Mapping

ENV_VAR = "RL_ENGINE_FAULT"
_PATTERN = re.compile(r"^(perturb):([1-9][0-9]*)x([1-9][0-9]*)$|^(kill|hang):([1-9][0-9]*)x([1-9][0-9]*):([0-9]+)$")


class FaultError(ValueError):
    """An ``RL_ENGINE_FAULT`` value that does not parse."""


@dataclass(frozen=True)
class Fault:
    kind: str
    tp: int
    cp: int
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("perturb", "kill", "hang"):
            raise FaultError(f"fault kind {self.kind!r} is unknown; use perturb, kill or hang")
        if (self.rank is None) != (self.kind == "perturb"):
            raise FaultError(f"fault {self.kind!r} {'takes no' if self.kind == 'perturb' else 'needs a'} rank")
        if self.rank is not None and not 0 <= self.rank < self.tp * self.cp:
            raise FaultError(
                f"{ENV_VAR} rank {self.rank} does not exist in topology {self.tp}x{self.cp} "
                f"(ranks 0..{self.tp * self.cp - 1})"
            )

    @property
    def text(self) -> str:
        base = f"{self.kind}:{self.tp}x{self.cp}"
        return base if self.rank is None else f"{base}:{self.rank}"

    def applies(self, tp: int, cp: int) -> bool:
        return (self.tp, self.cp) == (tp, cp)

    def trigger_after_mesh(self, tp: int, cp: int, rank: int) -> None:
        """Kill or hang this process if the fault names it; otherwise return."""
        if not self.applies(tp, cp) or self.rank != rank:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)


def parse_fault(text: str) -> Fault:
    match = _PATTERN.match(text.strip())
    if match is None:
        raise FaultError(
            f"{ENV_VAR}={text!r} does not parse; use perturb:<T>x<C>, kill:<T>x<C>:<rank> "
            "or hang:<T>x<C>:<rank>"
        )
    if match.group(1):
        return Fault("perturb", int(match.group(2)), int(match.group(3)))
    return Fault(match.group(4), int(match.group(5)), int(match.group(6)), int(match.group(7)))


def fault_from_env(environ: Mapping[str, str] | None = None) -> Fault | None:
    """The fault in ``RL_ENGINE_FAULT``; None when unset or empty."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return parse_fault(text) if text.strip() else None


__all__ = ["ENV_VAR", "Fault", "FaultError", "fault_from_env", "parse_fault"]
