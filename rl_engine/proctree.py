"""Stopping a launched runner and everything it started, read from Linux ``/proc``.

``torchrun`` starts each rank in a session of its own, so signalling torchrun's process
group does not reach the ranks: if torchrun dies before it has shut them down, they keep
running (and rank 0 could still write a report). :func:`stop_tree` therefore notes every
descendant (pid and start time, so a reused pid is never signalled) before it signals, asks
the group to stop, gives it a grace period, then SIGKILLs the group and every noted or newly
found descendant, and waits until none of them can run again.

:func:`supervise` is the one wait of a supervised child (``launch``, single and multi node, and
the focused regression): it waits under :class:`StopSignals` with a time limit and, on the limit
or a stop signal, stops the child's tree before it says which.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

PROC = "/proc"
EXIT_TIMEOUT = 124  # a supervised child that ran past its time limit (what GNU timeout exits with)
KILL_GRACE_S = 5.0  # how long a stopped tree's group has after SIGTERM, before SIGKILL
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
SETTLE_S = 10.0  # how long stop_tree waits for SIGKILLed processes to be gone
_POLL_S = 0.02


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, start time in clock ticks)`` of ``pid``; None when it does not exist."""
    try:
        with open(f"{PROC}/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    # the command name may hold spaces and parentheses: the fields start after the last ")"
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def alive(pid: int, start: int | None = None) -> bool:
    """``pid`` exists and is not a zombie (and, given ``start``, is the process started then)."""
    stat = _stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    return start is None or stat[2] == start


def descendants(root: int) -> set[tuple[int, int]]:
    """Every live process below ``root`` as ``(pid, start time)``; empty without ``/proc``."""
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        entries = os.listdir(PROC)
    except OSError:
        return set()
    for name in entries:
        if not name.isdigit():
            continue
        stat = _stat(int(name))
        if stat is not None and stat[0] not in ("Z", "X"):
            children.setdefault(stat[1], []).append((int(name), stat[2]))
    found: set[tuple[int, int]] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child[0])
    return found


def _signal(pid: int, start: int, sig: signal.Signals) -> None:
    if alive(pid, start):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_tree(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM ``proc``'s group and descendants, SIGKILL what is left after ``grace_s``.

    ``proc`` must lead its own process group (``start_new_session=True``). Returns once
    ``proc`` is reaped and every signalled descendant is gone or a zombie (bounded by
    :data:`SETTLE_S`; a process that survives SIGKILL that long is beyond our reach).
    """
    noted = descendants(proc.pid)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for pid, start in sorted(noted):
            _signal(pid, start, sig)
        if wait is not None:
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
            # what the survivors started meanwhile (their parent may be gone: keep the old notes)
            for pid, start in list(noted):
                if alive(pid, start):
                    noted |= descendants(pid)
            if proc.poll() is None:
                noted |= descendants(proc.pid)
    proc.wait()
    deadline = time.monotonic() + SETTLE_S
    while any(alive(pid, start) for pid, start in noted) and time.monotonic() < deadline:
        time.sleep(_POLL_S)


__all__ = ["alive", "descendants", "stop_tree"]


# ----- supervision ------------------------------------------------------------------------------
class SupervisionError(RuntimeError):
    """A supervisor that cannot handle the stop signals (it is not in the main thread)."""


class Stopped(BaseException):
    """Raised in the main thread by a stop signal once :class:`StopSignals` is armed."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """Handlers for :data:`STOP_SIGNALS` while a launch runs; the previous ones come back after.

    Before :meth:`arm` (and after :meth:`disarm`) a signal is only recorded; while armed, the
    first one raises :class:`Stopped` and disarms, so the cleanup it starts is never cut
    short by a second signal. ``received`` keeps every signal seen.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = signals
        self.received: list[int] = []
        self._armed = False
        self._previous: dict[signal.Signals, Any] = {}

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signum)
        if self._armed:
            self._armed = False
            raise Stopped(signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            raise SupervisionError("a supervisor must run in the main thread: it handles SIGTERM, SIGHUP and SIGINT")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        self._armed = False
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def arm(self) -> None:
        """From now on, raise when a signal comes; raise at once for one that came before."""
        self._armed = True  # first, so a signal between the two lines raises in the handler
        if self.received:
            self._armed = False
            raise Stopped(self.received[0])

    def disarm(self) -> None:
        self._armed = False


@dataclass(frozen=True)
class Outcome:
    """How a supervised child ended: its exit code, or the time limit, or the stop signal received."""

    code: int | None = None
    timed_out: bool = False
    signum: int | None = None


def supervise(proc: subprocess.Popen[Any], timeout_s: float | None, stops: StopSignals,
              stop: Callable[[], None]) -> Outcome:
    """Wait for ``proc`` (armed against ``stops`` while waiting) at most ``timeout_s``.

    On the time limit or a stop signal, ``stop()`` (which stops the child's tree) runs before this
    returns; on any other exception it runs and the exception goes on. A signal that comes after
    the wait is only recorded in ``stops.received``, for the caller to settle.
    """
    try:
        stops.arm()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stops.disarm()
            stop()
            return Outcome(timed_out=True)
        stops.disarm()
        return Outcome(code=code)
    except Stopped as stopped:
        stop()
        return Outcome(signum=stopped.signum)
    except BaseException:
        stops.disarm()
        stop()
        raise
