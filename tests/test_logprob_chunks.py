"""The backend's chunk machinery: fold plans, the chunk workspace and the chunk runner.

Bitwise claims compare bytes (``tensor_bytes`` / ``fingerprint``). The backend's own
invariances (TP, CP, chunk size, rows, threads) are tested in test_vocab_parallel_logp.py;
here: the pieces those invariances rest on, and the side effects the runner must not have.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from rl_engine.arith import spec_numpy
from rl_engine.arith.portable import exp as portable_exp
from rl_engine.arith.tiles import ChunkWorkspace, FoldPlan, fold_sum_, merge_tiles, rows_finite
from rl_engine.logprob.backends.eager.chunk_threads import for_each_chunk
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.contract import LogprobContract
from rl_engine.tensorio import fingerprint, tensor_bytes


@pytest.mark.parametrize("width", [1, 2, 3, 7, 64, 593, 2374])
def test_fold_plan_gives_the_bytes_of_fold_sum(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(5, 3, width, generator=g) * 1e3
    want = fold_sum_(x.clone()).clone()
    buf = x.clone()
    out = torch.empty(5, 3)
    FoldPlan(buf).run_into(out)
    assert tensor_bytes(out) == tensor_bytes(want)
    # negative control: another grouping (a plain left-to-right sum) gives other bytes
    if width >= 64:
        serial = x[..., 0].clone()
        for i in range(1, width):
            serial += x[..., i]
        assert tensor_bytes(serial) != tensor_bytes(want)


def _reference_partials(
    chunk: torch.Tensor, width: int, real: int, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The straightforward out-of-place sequence the workspace must reproduce bit for bit."""
    rows, vocab = chunk.shape
    xf = chunk.float()
    finite = torch.isfinite(xf[:, :real]).all(dim=1)
    xf[:, real:] = float("-inf")
    xv = xf.view(rows, vocab // width, width)
    m = xv.amax(dim=-1) + 0.0
    shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    y = (xv - shift.unsqueeze(-1)).contiguous()
    e = portable_exp(y)  # the spec's E, not a library exp
    # the lane sums G and G* of section 4, from the NumPy implementation (no shared code)
    s = torch.from_numpy(spec_numpy.lane_sum(e.numpy()))
    t = None
    if entropy:
        yc = torch.clamp(y, min=float.fromhex("-0x1.6p+6"))  # max(y, LO): -inf padding becomes LO
        t = torch.from_numpy(spec_numpy.lane_fma_sum(e.numpy(), yc.numpy()))
    return m, s, t, finite


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("width, real", [(64, 512), (64, 500), (64, 300), (1025, 4100), (1025, 3000),
                                         (2374, 4748)])
@pytest.mark.parametrize("chunk_rows", [1, 4, 6])
def test_workspace_matches_the_reference_sequence_including_non_finite(
    entropy: bool, width: int, real: int, chunk_rows: int
) -> None:
    vocab = 4 * width if width > 64 else 512
    tiles = vocab // width
    g = torch.Generator().manual_seed(real)
    x = (torch.randn(6, vocab, generator=g) * 4).to(torch.bfloat16)
    x[1, 3] = float("nan")
    x[2, 70] = float("inf")
    x[3, :] = float("-inf")
    x[4, :64] = -0.0
    x[5, 100] = float("-inf")
    ws = ChunkWorkspace(chunk_rows, vocab, width, real, entropy, x.device)
    m, s = torch.empty(6, tiles), torch.empty(6, tiles)
    t = torch.empty(6, tiles) if entropy else None
    row_min = torch.empty(6)
    for start in range(0, 6, chunk_rows):
        stop = min(6, start + chunk_rows)
        ws.partials(x[start:stop], m[start:stop], s[start:stop],
                    None if t is None else t[start:stop], row_min[start:stop])
    rm, rs, rt, rf = _reference_partials(x, width, real, entropy)
    assert tensor_bytes(m) == tensor_bytes(rm)
    assert tensor_bytes(s) == tensor_bytes(rs)
    if entropy:
        assert t is not None and rt is not None and tensor_bytes(t) == tensor_bytes(rt)
    finite = rows_finite(m, row_min, width, real)
    assert finite.tolist() == rf.tolist()
    assert finite.tolist() == [True, False, False, False, True, False]


def test_workspace_reuse_leaves_no_trace_between_chunks() -> None:
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(4, 256, generator=g) * 3).to(torch.bfloat16)
    b = (torch.randn(2, 256, generator=g) * 3).to(torch.bfloat16)
    fresh = []
    for x in (a, b):
        m, s = torch.empty(x.shape[0], 4), torch.empty(x.shape[0], 4)
        ChunkWorkspace(4, 256, 64, 256, False, x.device).partials(x, m, s, None, None)
        fresh.append((tensor_bytes(m), tensor_bytes(s)))
    ws = ChunkWorkspace(4, 256, 64, 256, False, a.device)
    for x, want in zip((a, b), fresh):
        m, s = torch.empty(x.shape[0], 4), torch.empty(x.shape[0], 4)
        ws.partials(x, m, s, None, None)
        assert (tensor_bytes(m), tensor_bytes(s)) == want
    lse, _ = merge_tiles(m, s, None)
    assert bool(torch.isfinite(lse).all())


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows, chunk_rows", [(0, 4), (1, 4), (10, 3), (10, 10), (17, 1)])
def test_every_chunk_runs_exactly_once(threads: int, rows: int, chunk_rows: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seen = torch.zeros(rows, dtype=torch.int64)
        workspaces: list[object] = []
        lock = threading.Lock()

        def make() -> object:
            ws = object()
            with lock:
                workspaces.append(ws)
            return ws

        def work(ws: object, start: int, stop: int) -> None:
            assert not torch.is_grad_enabled()
            assert stop - start <= chunk_rows and start % chunk_rows == 0
            seen[start:stop] += 1

        for_each_chunk(rows, chunk_rows, make, work)
        assert seen.tolist() == [1] * rows
        chunks = -(-rows // chunk_rows)
        assert len(workspaces) == (min(threads, chunks) if rows else 0)
    finally:
        torch.set_num_threads(before)


def _thread_count_seen_by_a_new_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_runner_leaves_the_thread_settings_as_it_found_them() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert _thread_count_seen_by_a_new_thread() == 2
        inside: list[int] = []
        for_each_chunk(8, 1, lambda: None, lambda ws, a, b: inside.append(torch.get_num_threads()))
        assert set(inside) == {1}  # workers run single-threaded operations
        assert torch.get_num_threads() == 2
        assert _thread_count_seen_by_a_new_thread() == 2
        # negative control: without the restore, a worker's setting leaks into new threads
        leak = threading.Thread(target=lambda: torch.set_num_threads(1))
        leak.start()
        leak.join()
        assert _thread_count_seen_by_a_new_thread() == 1
    finally:
        torch.set_num_threads(before)


def test_a_worker_error_reaches_the_caller() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def work(ws: Any, start: int, stop: int) -> None:
            if start == 6:
                raise RuntimeError("chunk 6 failed")

        with pytest.raises(RuntimeError, match="chunk 6 failed"):
            for_each_chunk(10, 2, lambda: None, work)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_backend_under_inference_mode_gives_the_same_bytes() -> None:
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(24, 1024, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 1000, (24,), generator=g)
    active = torch.ones(24, dtype=torch.bool)
    c = LogprobContract(real_vocab_size=1000, padded_vocab_size=1024, num_vocab_tiles=16,
                        num_sequences=1, seq_len=24)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plain = VocabParallelLogprob()(x, targets, active, c, chunk_rows=2, compute_entropy=True)
        with torch.inference_mode():
            inf = VocabParallelLogprob()(x, targets, active, c, chunk_rows=2, compute_entropy=True)
    finally:
        torch.set_num_threads(before)
    assert plain.entropy is not None and inf.entropy is not None
    for a, b in ((plain.selected_logp, inf.selected_logp), (plain.lse, inf.lse),
                 (plain.entropy, inf.entropy)):
        assert fingerprint(a.detach()) == fingerprint(b)


def test_unthreaded_runs_every_chunk_inline_on_the_callers_thread() -> None:
    """Accelerator tensors take ``threaded=False``: one workspace, the caller's thread only."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads_seen: set[int] = set()
        made: list[int] = []
        order: list[int] = []

        def work(ws: object, start: int, stop: int) -> None:
            threads_seen.add(threading.get_ident())
            order.append(start)

        for_each_chunk(10, 3, lambda: made.append(1), work, threaded=False)
        assert threads_seen == {threading.get_ident()}
        assert made == [1] and order == [0, 3, 6, 9]
        # negative control: threaded, the same loop uses more than one workspace
        made.clear()
        for_each_chunk(10, 3, lambda: made.append(1), work)
        assert len(made) == 2
    finally:
        torch.set_num_threads(before)
