"""Coarse-grained parallelism for the backend's row-chunk loops.

A chunk of a few rows is small (cache sized), so every PyTorch operation on it would
otherwise be its own intra-op parallel region: thousands of fork/join barriers per call.
On a busy machine each barrier waits for a descheduled thread, and the loop slows down
by an order of magnitude. Here the chunks are shared out instead: ``torch.get_num_threads()``
worker threads each take the next chunk from a common counter and run single-threaded
operations on it in their own workspace, so the only barrier is the final join.

Which thread computes a chunk, and in which order, never changes a bit: every chunk
writes only its own rows, with operations whose grouping depends on the tile width alone.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

W = TypeVar("W")


def _single_threaded() -> None:
    torch.set_num_threads(1)


def for_each_chunk(
    rows: int,
    chunk_rows: int,
    make_workspace: Callable[[], W],
    work: Callable[[W, int, int], None],
    threaded: bool = True,
) -> None:
    """Call ``work(workspace, start, stop)`` once for every chunk ``[start, stop)`` of rows.

    With one intra-op thread, or a single chunk, everything runs inline on the caller's
    thread. Otherwise ``min(threads, chunks)`` workers share the chunks; each builds one
    workspace with ``make_workspace``. A worker's exception is re-raised here. ``work``
    always runs under ``torch.no_grad()`` (the chunk loops write into preallocated
    outputs and are never differentiated), and in inference mode exactly when the caller
    is (both modes are per thread, so the workers take them from the caller).
    ``threaded=False`` (accelerators: kernels are queued asynchronously on one stream)
    always runs inline.
    """
    starts = range(0, rows, chunk_rows)
    if not starts:
        return
    threads = torch.get_num_threads()
    workers = min(threads, len(starts)) if threaded else 1
    if workers <= 1:
        with torch.no_grad():
            ws = make_workspace()
            for start in starts:
                work(ws, start, min(rows, start + chunk_rows))
        return
    counter = itertools.count()  # next() is atomic under the GIL
    inference = torch.is_inference_mode_enabled()

    def drain() -> None:
        with torch.inference_mode(inference), torch.no_grad():
            ws = make_workspace()
            while (i := next(counter)) < len(starts):
                start = starts[i]
                work(ws, start, min(rows, start + chunk_rows))

    try:
        with ThreadPoolExecutor(max_workers=workers, initializer=_single_threaded) as pool:
            futures = [pool.submit(drain) for _ in range(workers)]
            for future in futures:
                future.result()
    finally:
        # set_num_threads in a worker also sets the default that new threads start from;
        # put the caller's value back so nothing outside this call sees the change.
        torch.set_num_threads(threads)
