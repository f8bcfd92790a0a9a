"""The one timing loop of both modes: warm-up, then round-robin rounds.

Every (path, phase) is warmed up, then the repeats run round-robin (one of each per round,
the order rotating), so a busy spell on a shared machine hits every path alike. Under
torchrun every rank runs the same order, the ranks meet at a barrier before each call, and
the wall time spent inside ``all_gather`` and ``all_reduce`` (waiting for slower peers
included) is recorded beside each sample.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator

from rl_engine.benchmark.paths import Step

_TIMED_COLLECTIVES = ("all_gather", "all_reduce")


@contextmanager
def timed_collectives() -> Iterator[list[float]]:
    """Accumulate the wall time spent inside ``torch.distributed.all_gather``/``all_reduce``."""
    import torch.distributed as dist

    spent = [0.0]
    originals = {name: getattr(dist, name) for name in _TIMED_COLLECTIVES}

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return timed

    for name, original in originals.items():
        setattr(dist, name, wrap(original))
    try:
        yield spent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def time_round_robin(
    steps: dict[Hashable, tuple[Step, Step]], warmup: int, repeats: int,
    barrier: Callable[[], None] | None = None, sync: Callable[[], None] | None = None,
) -> tuple[dict[Hashable, list[float]], dict[Hashable, list[float]]]:
    """``(seconds, collective seconds)`` per key of ``steps`` (``(step, reset)`` pairs).

    ``sync`` (``torch.cuda.synchronize`` on a GPU) runs before the clock starts and before it
    stops, so a sample covers the kernels the step launched, not only their launch."""
    keys = list(steps)
    for step, reset in steps.values():
        for _ in range(warmup):
            kept = step()
            del kept
            reset()
    times: dict[Hashable, list[float]] = {key: [] for key in keys}
    comms: dict[Hashable, list[float]] = {key: [] for key in keys}
    # Each sample starts after a collection, so that no collector pause lands inside the clock.
    # The objects alive now (torch's modules, the inputs: hundreds of thousands) are collected
    # once and frozen, so that each collection below traverses only what the steps made since:
    # a full traversal costs 0.1 to 0.6 s in a process that imported torch, many times a step.
    gc.collect()
    gc.freeze()
    try:
        for round_index in range(repeats):
            shift = round_index % len(keys)
            for key in keys[shift:] + keys[:shift]:
                step, reset = steps[key]
                gc.collect()
                if barrier is not None:
                    barrier()
                with timed_collectives() as spent:
                    if sync is not None:
                        sync()
                    start = time.perf_counter()
                    kept = step()
                    if sync is not None:
                        sync()
                    elapsed = time.perf_counter() - start
                del kept
                reset()
                times[key].append(elapsed)
                comms[key].append(spent[0])
    finally:
        gc.unfreeze()
    return times, comms
