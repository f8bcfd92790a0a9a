"""Fault injection for the failure tests of the workflow: ``RL_ENGINE_FAULT``.

A fault only ever makes a run fail; it never makes a failing run pass. Values:

* ``perturb:<T>x<C>``: in topology ``T x C``, rank 0 moves the first active token's
  selected logprob of the reassembled candidate by ``1e-3 + 2 * (atol + rtol * |ref|)``
  (``ref`` the FP32 oracle's value) before fingerprints and drift are computed, so the
  drift check fails and the report is written with ``passed=false``;
* ``kill:<T>x<C>:<rank>``: that rank SIGKILLs itself once the mesh is up;
* ``hang:<T>x<C>:<rank>``: that rank sleeps forever once the mesh is up;
* ``kill:<T>x<C>:<node>/<local rank>`` and ``hang:...``: the same for the rank with that
  ``LOCAL_RANK`` on the node of that name (:func:`rl_engine.campaign.nodes.node_name`), for a
  topology spanning nodes, where the global ranks a node gets are decided at rendezvous.

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
_PATTERN = re.compile(
    r"^(perturb):([1-9][0-9]*)x([1-9][0-9]*)$"
    r"|^(kill|hang):([1-9][0-9]*)x([1-9][0-9]*):(?:([A-Za-z0-9][A-Za-z0-9._-]*)/)?([0-9]+)$"
)


class FaultError(ValueError):
    """An ``RL_ENGINE_FAULT`` value that does not parse."""


@dataclass(frozen=True)
class Fault:
    kind: str
    tp: int
    cp: int
    rank: int | None = None
    node: str | None = None  # with a node, ``rank`` is the LOCAL_RANK on that node

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
        if self.node is not None and (self.rank is None or not self.node):
            raise FaultError(f"fault {self.kind!r} on node {self.node!r} needs a node name and a local rank")

    @property
    def text(self) -> str:
        base = f"{self.kind}:{self.tp}x{self.cp}"
        if self.rank is None:
            return base
        return f"{base}:{self.rank}" if self.node is None else f"{base}:{self.node}/{self.rank}"

    def applies(self, tp: int, cp: int) -> bool:
        return (self.tp, self.cp) == (tp, cp)

    def trigger_after_mesh(self, tp: int, cp: int, rank: int, node: str | None = None,
                           local_rank: int | None = None) -> None:
        """Kill or hang this process if the fault names it (by global rank, or node and local rank)."""
        if not self.applies(tp, cp):
            return
        if self.node is None and self.rank != rank:
            return
        if self.node is not None and (self.node != node or self.rank != local_rank):
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
            f"{ENV_VAR}={text!r} does not parse; use perturb:<T>x<C>, kill:<T>x<C>:<rank>, "
            "hang:<T>x<C>:<rank>, or kill|hang:<T>x<C>:<node>/<local rank>"
        )
    if match.group(1):
        return Fault("perturb", int(match.group(2)), int(match.group(3)))
    return Fault(match.group(4), int(match.group(5)), int(match.group(6)), int(match.group(8)), match.group(7))


def fault_from_env(environ: Mapping[str, str] | None = None) -> Fault | None:
    """The fault in ``RL_ENGINE_FAULT``; None when unset or empty."""
    text = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return parse_fault(text) if text.strip() else None


__all__ = ["ENV_VAR", "Fault", "FaultError", "fault_from_env", "parse_fault"]
