"""The processes a test looks for, read from Linux ``/proc``.

The process tree itself (descendants, liveness by pid and start time) is the engine's own
reader, :mod:`rl_engine.proctree`, which ``launch`` and the regression stop a tree with; the
tests use it directly. What only the tests ask is here: which live processes name a run, a
plan or a file in their command line (a process left behind is found by what it runs, even
after its parent is gone), a process's parent, and its environment (on a Slurm node, which
node or job it belongs to).
"""

from __future__ import annotations

import os
from pathlib import Path

from rl_engine.proctree import PROC, alive


def mentioning(needle: str) -> dict[int, str]:
    """``{pid: command line}`` of every live process (zombies excluded), other than this one, whose
    command line (arguments joined by spaces) contains ``needle``."""
    found = {}
    for entry in Path(PROC).iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline and alive(int(entry.name)):
            found[int(entry.name)] = cmdline
    return found


def parent(pid: int) -> int:
    """The parent of ``pid`` (raises :class:`OSError` when it does not exist)."""
    # the command name may hold spaces and parentheses: the fields start after the last ")"
    return int(Path(f"{PROC}/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with; empty when it cannot be read."""
    try:
        raw = Path(f"{PROC}/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
