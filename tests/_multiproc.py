"""Run a function on N real processes joined by a gloo process group (for tests).

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), runs ``fn(rank, *args)`` and sends back its return value or its error.
A worker that hangs or dies is killed at ``timeout_s`` and reported, never waited on.

Processes start from a fork server that has imported torch once (about 0.1 s for eight
workers instead of several seconds of spawn-and-import each); every worker still is a
separate process with its own gloo process group, and gets the parent's environment as it
is at the call. Return values travel as plain-pickled bytes: tensors are copied, not
handed over as shared-memory file descriptors, which would need the worker alive after it
has exited. Once one rank fails, the others get ``failure_grace_s`` to report (a peer
blocked in a collective with the failed rank would otherwise hold the run until
``timeout_s``), then they are killed.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback
from typing import Any, Callable, Mapping

import torch.multiprocessing as mp

PRELOAD: tuple[str, ...] = ("torch", "torch.distributed")


class WorkerError(RuntimeError):
    """One or more workers raised, died or timed out; carries each rank's message."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        lines = [f"rank {rank}: {msg}" for rank, msg in sorted(failures.items())]
        super().__init__("distributed workers failed:\n" + "\n".join(lines))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    environ: Mapping[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    import torch

    torch.set_num_threads(threads)
    try:
        value = fn(rank, *args)
        results.put((rank, True, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _context() -> Any:
    """A fork server with torch preloaded where the platform has one, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        return ctx
    return mp.get_context("spawn")  # pragma: no cover - platforms without fork


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    threads: int = 1,
    failure_grace_s: float = 10.0,
) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``world_size`` processes; return the values in rank order.

    Raises :class:`WorkerError` naming every rank that raised, died or timed out.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive integer")
    if threads < 1:
        raise ValueError(f"threads={threads!r} must be >= 1")
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _run_once(fn, world_size, args, timeout_s, threads, failure_grace_s)
        except WorkerError as exc:
            # the port free_port() chose was taken before rank 0 bound it (another process on a
            # busy machine): the group never formed and nothing ran, so run again on a new port
            lost_port = any("address already in use" in text.lower() for text in exc.failures.values())
            if not lost_port or attempt == PORT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


PORT_ATTEMPTS = 3


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout_s: float, threads: int,
              failure_grace_s: float) -> list[Any]:
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, threads, fn, args, results, environ)
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(values) + len(failures) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, ok, value = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            dead = [
                r for r, p in enumerate(procs)
                if not p.is_alive() and p.exitcode not in (0, None)
                and r not in values and r not in failures
            ]
            for r in dead:
                failures[r] = f"process exited with code {procs[r].exitcode}"
            if dead:
                deadline = min(deadline, time.monotonic() + failure_grace_s)
            continue
        if ok:
            values[rank] = pickle.loads(value)
        else:
            failures[rank] = value
            deadline = min(deadline, time.monotonic() + failure_grace_s)
    for rank, proc in enumerate(procs):
        proc.join(timeout=max(0.0, deadline - time.monotonic()) if not failures else 5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
            if rank not in values and rank not in failures:
                failures[rank] = (
                    f"killed {failure_grace_s}s after another rank failed"
                    if failures else f"timed out after {timeout_s}s"
                )
    if failures:
        raise WorkerError(failures)
    return [values[r] for r in range(world_size)]
