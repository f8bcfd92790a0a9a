"""Fixed-grouping FP32 tile arithmetic shared by the forward and backward of the backend.

Every reduction here is built from elementwise operations whose grouping depends only on
the tile width or the tile count, never on the number of rows, the chunk size, the
thread count or which rank computes the tile. ``torch.sum`` is not used: on the CPU it
splits a long row across threads when there are few rows, which changes the bits.

The exp and log are the portable ones of :mod:`rl_engine.arith.portable`: every number is
the one ``docs/arithmetic.md`` (sections 6-8) defines, on any IEEE-754 device. A tile's sums
are the lane sums ``G`` of section 4 (:class:`LanePlan`: 128 lanes, each in column order,
then the fold ``F``); the merge across tiles is ``F``.

Speed without changing a bit: a :class:`ChunkWorkspace` owns one cache-sized FP32 chunk
buffer per call and replays, chunk after chunk, the same in-place operations on
precomputed views of it (upcast, tile max, shift, exp, lane sums). Nothing is allocated
inside the chunk loop (but the rare elements an exact fused multiply-add must round to odd)
and nothing of size ``tokens x vocab`` in FP32 exists.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch

from rl_engine.arith.portable import (
    _MIDPOINT,
    _MIDPOINT_MASK,
    ExpScratch,
    FmaScratch,
    _odd_rounded,
    canonical_nan_,
    exp,
    exp_into,
    log,
    round_into,
)

NEG_INF = float("-inf")
# Rows per chunk aim at this many bytes of FP32 per chunk buffer: the chunk stays in the
# per-core L2 cache while it is upcast, shifted, exponentiated and folded.
CHUNK_TARGET_BYTES = 2 << 20
LANES = 128  # L of the lane sum G (docs/arithmetic.md section 4)


def fold_sum_(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dimension of ``x`` in place with a fixed pairwise fold.

    Level by level, element ``i < h`` gets ``x[i] + x[w - h + i]`` with ``h = w // 2``;
    the grouping is a function of the last dimension's size alone. ``x`` is clobbered and
    the result is a view of its first column.
    """
    width = x.shape[-1]
    while width > 1:
        half = width // 2
        x[..., :half].add_(x[..., width - half : width])
        width -= half
    return x[..., 0]


def fold_sum(x: torch.Tensor) -> torch.Tensor:
    """Out-of-place :func:`fold_sum_`."""
    return fold_sum_(x.clone()).clone()


class FoldPlan:
    """:func:`fold_sum_` of one fixed tensor, as precomputed view pairs replayed on demand.

    Same levels, same grouping, same bits as :func:`fold_sum_`; building the views once
    per buffer instead of once per chunk removes the Python slicing from the chunk loop,
    and the last level writes straight into the caller's output.
    """

    __slots__ = ("_steps", "_last", "_single")

    def __init__(self, x: torch.Tensor) -> None:
        steps: list[tuple[torch.Tensor, torch.Tensor]] = []
        width = x.shape[-1]
        while width > 2:
            half = width // 2
            steps.append((x[..., :half], x[..., width - half : width]))
            width -= half
        self._steps = steps
        self._last = (x[..., 0], x[..., 1]) if width == 2 else None
        self._single = x[..., 0]

    def run_into(self, out: torch.Tensor) -> torch.Tensor:
        """Fold the planned tensor (clobbering it) and write its sums into ``out``."""
        for dst, src in self._steps:
            dst.add_(src)
        if self._last is None:
            return out.copy_(self._single)
        return torch.add(self._last[0], self._last[1], out=out)


class LanePlan:
    """The lane sums ``G`` (and ``G*``) of section 4 over the last dimension of fixed
    ``[..., w]`` views, as precomputed views replayed on demand.

    ``lanes`` is a ``[..., 128]`` buffer: lane ``l`` starts at ``+0`` and takes the columns
    ``l, l + 128, ...`` of the tile in order, one chunk of 128 columns after another (the last
    chunk may be partial: its missing lanes are left alone, which equals adding ``+0``); the
    128 lane sums are then folded by ``F`` (:class:`FoldPlan`) into the caller's output.
    """

    __slots__ = ("_lanes", "_chunks", "_fold", "_scratch")

    def __init__(self, width: int, lanes: torch.Tensor, scratch: FmaScratch | None) -> None:
        self._lanes = lanes
        full, rest = divmod(width, LANES)
        self._chunks = [(slice(k * LANES, (k + 1) * LANES), lanes, scratch) for k in range(full)]
        if rest:
            part = lanes[..., :rest]
            part_scratch = scratch.narrow(rest) if scratch is not None else None
            self._chunks.append((slice(full * LANES, width), part, part_scratch))
        self._fold = FoldPlan(lanes)
        self._scratch = scratch

    def sum_into(self, terms: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = G(terms)`` over the last dimension (``terms`` is left as it was)."""
        self._lanes.zero_()
        for cols, lanes, _ in self._chunks:
            lanes.add_(terms[..., cols])
        return self._fold.run_into(out)

    def fma_sum_into(self, u: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     prod: torch.Tensor | None = None, wide: torch.Tensor | None = None) -> torch.Tensor:
        """``out = G*(u, v)``: each lane ``fma(u_c, v_c, lane)`` in column order, then ``F``.

        The products ``u_c * v_c`` are exact in binary64 (``prod`` and ``wide``: binary64
        buffers of ``u``'s shape, or allocated); each step adds one chunk's products to the
        lanes in binary64 and rounds the sums once to binary32: the fma, except where a sum sits
        on a binary32 midpoint (:func:`rl_engine.arith.portable.fma_into`). Those lanes are
        noted and, at the end, recomputed with every fma rounded to odd first. A lane's result
        below ``2**-125`` is an exact binary64 sum (its terms ``e * max(y, LO)`` are ``<= 0``, so
        nothing cancels, and a tiny one needs a tiny ``y``, where ``e = 1``), so only the
        midpoint test is needed (the tests hold this to the NumPy ``fma32``).
        """
        assert self._scratch is not None, "build the plan with an FmaScratch for G*"
        if prod is None or wide is None:
            prod = torch.empty(u.shape, dtype=torch.float64, device=u.device)
            wide = torch.empty_like(prod)
        prod.copy_(u)
        wide.copy_(v)
        prod.mul_(wide)  # exact: 24 x 24 bits
        odd = self._scratch.tiny  # the lanes whose binary64 sum met a midpoint at some step
        odd.zero_()
        self._lanes.zero_()
        for cols, lanes, scratch in self._chunks:
            acc = scratch.sum64
            acc.copy_(lanes)
            acc.add_(prod[..., cols])
            lanes.copy_(acc)
            torch.bitwise_and(acc.view(torch.int64), _MIDPOINT_MASK, out=scratch.bits)
            torch.eq(scratch.bits, _MIDPOINT, out=scratch.flag)
            odd[..., : lanes.shape[-1]].logical_or_(scratch.flag)
        if bool(odd.any()):
            self._exact_lanes(u, v, odd.nonzero(as_tuple=True))
        return self._fold.run_into(out)

    def _exact_lanes(self, u: torch.Tensor, v: torch.Tensor, idx: tuple[torch.Tensor, ...]) -> None:
        """Recompute the lanes at ``idx`` (``[..., lane]`` indices) with every fma exact."""
        *lead, lane = idx
        width = u.shape[-1]
        acc = torch.zeros(lane.shape, dtype=torch.float32, device=u.device)
        for start in range(0, width, LANES):
            col = lane + start
            valid = col < width
            col = torch.where(valid, col, torch.zeros_like(col))
            a = torch.where(valid, u[(*lead, col)], torch.zeros_like(acc))  # fma(0, 0, lane) = lane
            b = torch.where(valid, v[(*lead, col)], torch.zeros_like(acc))
            acc = _odd_rounded(a, b, acc, acc).to(torch.float32)
        self._lanes[idx] = acc


def lane_sum(x: torch.Tensor) -> torch.Tensor:
    """``G`` over the last dimension of a binary32 tensor (allocating; section 4)."""
    lanes = torch.empty(x.shape[:-1] + (LANES,), dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    return LanePlan(x.shape[-1], lanes, None).sum_into(x, out)


def lane_fma_sum(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``G*(u, v)`` over the last dimension of two binary32 tensors (allocating; section 4)."""
    lanes = torch.empty(u.shape[:-1] + (LANES,), dtype=torch.float32, device=u.device)
    out = torch.empty(u.shape[:-1], dtype=torch.float32, device=u.device)
    scratch = FmaScratch(tuple(lanes.shape), u.device)
    return LanePlan(u.shape[-1], lanes, scratch).fma_sum_into(u, v, out)


def canonical_zero_(x: torch.Tensor) -> torch.Tensor:
    """Turn ``-0.0`` into ``+0.0`` in place (``-0.0 + 0.0 == +0.0``), so a tile's max has one sign."""
    return x.add_(0.0)


class _ChunkViews(NamedTuple):
    buf: torch.Tensor  # [rows, local_vocab] FP32
    stored: torch.Tensor  # the chunk's own columns (all but the grid's padding past the vocabulary)
    tiles: torch.Tensor  # the same memory as [rows, tiles, tile_width]
    real: torch.Tensor  # real columns
    padding: torch.Tensor | None  # padding columns, if any
    shift: torch.Tensor  # [rows, tiles]
    shift_per_tile: torch.Tensor  # [rows, tiles, 1]
    exp_tiles: torch.Tensor  # E(y) as [rows, tiles, tile_width]
    yc_tiles: torch.Tensor  # max(y, LO) (E's step 1) as [rows, tiles, tile_width]
    sums: LanePlan
    scratch: ExpScratch


class ChunkWorkspace:
    """Reusable FP32 buffers of one forward call and the views its chunk loop replays.

    ``partials`` computes, for one chunk of rows in the logits dtype, the FP32 ``(max,
    sum exp, sum exp * shifted)`` of every local tile, in place in the workspace: upcast,
    padding to ``-inf``, tile max, canonical zero, shift (``0`` for an all ``-inf`` tile),
    exp and lane sums: ``s = G(E(y))`` and ``t = G*(E(y), max(y, LO))`` with
    ``y = x - shift`` (section 6 steps 1-4).
    """

    def __init__(
        self,
        chunk_rows: int,
        local_vocab: int,
        tile_width: int,
        real_local: int,
        with_entropy: bool,
        device: torch.device,
        t32: float = 1.0,
        vocab_start: int | None = None,
        stored: int | None = None,
    ) -> None:
        if local_vocab % tile_width:
            raise ValueError(f"local_vocab={local_vocab} is not a multiple of tile_width={tile_width}")
        # the chunk's own columns; the rest of the buffer up to whole tiles is the grid's padding past
        # the vocabulary (docs/arithmetic.md section 6), filled with -inf like every padding column
        self.stored = local_vocab if stored is None else stored
        if not real_local <= self.stored <= local_vocab:
            raise ValueError(f"stored={self.stored} must lie in [real_local={real_local}, local_vocab={local_vocab}]")
        self.chunk_rows = chunk_rows
        self.local_vocab = local_vocab
        self.tile_width = tile_width
        self.tiles = local_vocab // tile_width
        self.real_local = real_local
        self.with_entropy = with_entropy
        # section 6 step 0: x' = x / T32 after the upcast (skipped when T32 = 1); a float32 tensor on
        # the device, so that CUDA divides too (a Python float divisor is a reciprocal multiply there)
        self.divisor = temperature_divisor(t32, device)
        # processed logprobs (section 13): the global ids of the local columns, for the kept set's cut
        self.cols = _column_ids(vocab_start, local_vocab, device)
        self.buf = torch.empty(chunk_rows, local_vocab, dtype=torch.float32, device=device)
        self.exp_buf = torch.empty_like(self.buf)
        self.shift = torch.empty(chunk_rows, self.tiles, dtype=torch.float32, device=device)
        self.scratch = ExpScratch((chunk_rows, local_vocab), device)
        self.lanes = torch.empty(chunk_rows, self.tiles, LANES, dtype=torch.float32, device=device)
        self.lane_scratch = FmaScratch((chunk_rows, self.tiles, LANES), device) if with_entropy else None
        self._views: dict[int, _ChunkViews] = {}

    def views(self, rows: int) -> _ChunkViews:
        """The views of the buffers for a chunk of ``rows`` rows (built once per row count)."""
        found = self._views.get(rows)
        if found is None:
            buf = self.buf[:rows]
            shape = (rows, self.tiles, self.tile_width)
            shift = self.shift[:rows]
            scratch = self.scratch.rows(rows)
            lane_scratch = self.lane_scratch.rows(rows) if self.lane_scratch is not None else None
            found = _ChunkViews(
                buf=buf,
                stored=buf[:, : self.stored],
                tiles=buf.view(shape),
                real=buf[:, : self.real_local],
                padding=buf[:, self.real_local :] if self.real_local < self.local_vocab else None,
                shift=shift,
                shift_per_tile=shift.unsqueeze(-1),
                exp_tiles=self.exp_buf[:rows].view(shape),
                yc_tiles=scratch.yc.view(shape),
                sums=LanePlan(self.tile_width, self.lanes[:rows], lane_scratch),
                scratch=scratch,
            )
            self._views[rows] = found
        return found

    def partials(
        self,
        chunk: torch.Tensor,
        m_out: torch.Tensor,
        s_out: torch.Tensor,
        t_out: torch.Tensor | None,
        row_min_out: torch.Tensor | None,
        row_t32: torch.Tensor | None = None,
        keep: Any = None,
    ) -> None:
        """Write the chunk's tile partials into ``m_out``, ``s_out`` (and ``t_out``).

        ``row_min_out``, when given, receives the minimum over each row's real columns
        (a validation aid: with the tile maxima it tells whether a row is all finite).
        ``row_t32``, when given, holds the chunk's rows' ``T32`` (a temperature per row, in place
        of the workspace's one). ``keep`` (section 13, a :class:`rl_engine.logprob.processed.KeptCut`;
        typed ``Any``: ``arith/`` sits below ``logprob/``): the columns its cut drops read as ``-inf``
        after step 0; then ``row_min_out`` is NaN on a row whose real maximum is not finite (the tile
        maxima no longer show it), so that the check sees the logits as given.
        """
        v = self.views(chunk.shape[0])
        v.stored.copy_(chunk)
        divisor = self.divisor if row_t32 is None else row_t32.unsqueeze(1)
        if divisor is not None:
            v.stored.div_(divisor)  # binary32 division by T32 (IEEE, correctly rounded)
        if keep is not None:
            assert self.cols is not None, "build the workspace with vocab_start for a kept set"
            if row_min_out is not None and self.real_local > 0:
                # the check reads the logits before the cut drops any: min, or NaN when the max is not finite
                low, high = torch.aminmax(v.real, dim=1)
                row_min_out.copy_(torch.where(torch.isfinite(high), low, math.nan))
            v.buf.masked_fill_(keep.dropped(v.buf, self.cols), NEG_INF)
        elif row_min_out is not None and self.real_local > 0:
            torch.amin(v.real, dim=1, out=row_min_out)
        if v.padding is not None:
            v.padding.fill_(NEG_INF)
        torch.amax(v.tiles, dim=-1, out=m_out)
        canonical_zero_(m_out)
        # shift = m, except 0 for an all -inf tile (as ``where(m == -inf, 0, m)``), one op
        torch.nan_to_num(m_out, nan=math.nan, posinf=math.inf, neginf=0.0, out=v.shift)
        v.tiles.sub_(v.shift_per_tile)  # y (padding: -inf, so E(y) = +0 and max(y, LO) = LO)
        exp_into(v.buf, self.exp_buf[: v.buf.shape[0]], v.scratch)  # E(y); scratch.yc = max(y, LO)
        v.sums.sum_into(v.exp_tiles, s_out)
        if self.with_entropy:
            assert t_out is not None
            shape = v.exp_tiles.shape
            v.sums.fma_sum_into(v.exp_tiles, v.yc_tiles, t_out,
                                v.scratch.s64.view(shape), v.scratch.r64.view(shape))


class GradWorkspace:
    """Reusable FP32 chunk buffer (and exp scratch) of one backward call."""

    def __init__(self, chunk_rows: int, local_vocab: int, device: torch.device, t32: float = 1.0,
                 vocab_start: int | None = None) -> None:
        self.buf = torch.empty(chunk_rows, local_vocab, dtype=torch.float32, device=device)
        self.scratch = ExpScratch((chunk_rows, local_vocab), device)
        self.divisor = temperature_divisor(t32, device)  # T32 (section 6 step 0, section 7 step 2)
        self.cols = _column_ids(vocab_start, local_vocab, device)  # section 13's kept set

    def softmax_times(
        self,
        chunk: torch.Tensor,
        lse: torch.Tensor,
        coef: torch.Tensor,
        target_col: torch.Tensor,
        target_add: torch.Tensor,
        out: torch.Tensor,
        g_ent: torch.Tensor | None = None,
        mb: torch.Tensor | None = None,
        row_t32: torch.Tensor | None = None,
        keep: Any = None,
    ) -> None:
        """``out = coef * E(x - lse)``, plus ``target_add`` at ``target_col`` in FP32, divided by
        the workspace's ``T32`` (the temperature, skipped when 1; with ``row_t32``, each row's), NaN
        made canonical, rounded once to ``out``'s dtype (``docs/arithmetic.md`` sections 7-8; ``x`` is
        the chunk divided by ``T32``).

        Adding ``-0.0`` is the identity for every FP32 value, so rows that own no target
        carry ``-0.0`` in ``target_add`` and keep their bits. ``scatter_add_`` adds exactly
        one value to one element per row: a single rounded addition.

        ``keep`` (section 13): the columns its cut drops read as ``-inf`` after step 0 and get ``+0``.
        """
        rows = chunk.shape[0]
        buf = self.buf[:rows]
        sc = self.scratch.rows(rows)
        buf.copy_(chunk)
        divisor = self.divisor if row_t32 is None else row_t32.unsqueeze(1)
        if divisor is not None:
            buf.div_(divisor)  # section 6 step 0
        dropped = None
        if keep is not None:
            assert self.cols is not None, "build the workspace with vocab_start for a kept set"
            dropped = keep.dropped(buf, self.cols)
            buf.masked_fill_(dropped, NEG_INF)
        x = buf.clone() if g_ent is not None else None  # the entropy term reads x after E overwrote buf
        buf.sub_(lse.unsqueeze(1))
        exp_into(buf, buf, sc)
        if g_ent is not None:
            assert x is not None and mb is not None
            ge = g_ent.unsqueeze(1)
            term = (ge * buf) * (mb.unsqueeze(1) - x)  # (g_ent * p) * (Mb - x), section 7 step 1
            use = (ge != 0) & (buf != 0)  # p == 0 or g_ent == 0: no term (no 0 * inf)
            buf.mul_(coef.unsqueeze(1))
            buf.copy_(torch.where(use, buf + term, buf))
        else:
            buf.mul_(coef.unsqueeze(1))
        buf.scatter_add_(1, target_col.unsqueeze(1), target_add.unsqueeze(1))
        if divisor is not None:
            buf.div_(divisor)  # section 7 step 2: the chain rule of the division by T32
        if dropped is not None:
            buf.masked_fill_(dropped, 0.0)  # section 13 step 5: +0 outside the kept set
        canonical_nan_(buf, sc.mask)
        round_into(buf, out, sc.ka)


def _column_ids(vocab_start: int | None, local_vocab: int, device: torch.device) -> torch.Tensor | None:
    """Global ids of the local columns (int64), or None without a kept set."""
    if vocab_start is None:
        return None
    return torch.arange(vocab_start, vocab_start + local_vocab, dtype=torch.int64, device=device)


def temperature_divisor(t32: float, device: torch.device) -> torch.Tensor | None:
    """``T32`` as a 0-dim binary32 tensor on ``device`` (None for ``T32 = 1``: no division).

    Dividing by a tensor on the device is a true division everywhere; dividing by a Python float
    is one on the CPU (tested bytewise) but, on CUDA, a multiply by ``RN32(1 / T32)``. Made by a fill
    on the device (``T32`` is a binary32 value: exact), not copied from host memory: on CUDA a copy
    from pageable memory waits for the stream, a host sync in every tempered call."""
    if t32 == 1.0:
        return None
    return torch.full((), t32, dtype=torch.float32, device=device)


def rows_finite(
    m: torch.Tensor, row_min: torch.Tensor, tile_width: int, real_local: int
) -> torch.Tensor:
    """Per row: every real column is finite, from the tile maxima and the real-column minimum.

    Max and min both propagate NaN, so a row is all finite exactly when its largest real
    value is below ``+inf`` and its smallest above ``-inf``.
    """
    if real_local <= 0:
        return torch.ones(m.shape[0], dtype=torch.bool, device=m.device)
    real_tiles = math.ceil(real_local / tile_width)
    top = m[:, :real_tiles].amax(dim=1)
    return torch.isfinite(top) & torch.isfinite(row_min)


# Elements of one block of the merge on the CPU: below ATen's grain size (32768), so each of the
# merge's small elementwise operations runs inline on the calling thread instead of waking
# torch's thread pool (on a loaded machine each wake-up waits for a descheduled thread).
MERGE_BLOCK_ELEMENTS = 16384


ExpFn = Callable[[torch.Tensor], torch.Tensor]


def merge_tiles(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None, exp_fn: ExpFn = exp, log_fn: ExpFn = log
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge ``[rows, num_tiles]`` partials in global tile order: LSE and, if given, entropy.

    ``docs/arithmetic.md`` section 6, steps 5-8: a row whose tiles are all ``-inf`` has
    ``LSE = -inf`` (the shift is 0, the weighted sum 0 and ``L(0) = -inf``). ``exp_fn`` computes
    ``E`` on a binary32 tensor: the portable one, or an engine's compiled one (the same bytes,
    its tests say). On the CPU the rows go in blocks of :data:`MERGE_BLOCK_ELEMENTS` elements
    (rows never mix, so the bytes are the same for any block).
    """
    rows = m.shape[0]
    block = max(1, MERGE_BLOCK_ELEMENTS // max(1, m.shape[-1]))
    if m.device.type != "cpu" or rows <= block:
        return _merge_rows(m, s, t, exp_fn, log_fn)
    parts = [_merge_rows(m[r:r + block], s[r:r + block], None if t is None else t[r:r + block], exp_fn, log_fn)
             for r in range(0, rows, block)]
    lse = torch.cat([p[0] for p in parts])
    return lse, (None if t is None else torch.cat([p[1] for p in parts]))  # type: ignore[misc]


def _merge_rows(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None, exp_fn: ExpFn, log_fn: ExpFn
) -> tuple[torch.Tensor, torch.Tensor | None]:
    big = m.amax(dim=-1, keepdim=True)
    big_shift = torch.where(big == NEG_INF, torch.zeros_like(big), big)
    weight = exp_fn((m - big_shift).contiguous())
    total = fold_sum_(s * weight)
    lse = big_shift.squeeze(-1) + log_fn(total)
    entropy = None
    if t is not None:
        shift = torch.where(m == NEG_INF, torch.zeros_like(m), m)
        mean_x = fold_sum_(weight * (t + shift * s)) / total
        entropy = lse - mean_x
    return lse, entropy


def default_chunk_rows(local_vocab: int, target_bytes: int = CHUNK_TARGET_BYTES) -> int:
    """Rows per chunk so one FP32 chunk stays near ``target_bytes`` (cache sized)."""
    return max(1, min(4096, target_bytes // max(1, 4 * local_vocab)))


# Accelerators: a chunk's workspace may use at most this many bytes, and at most this share
# of the device's free memory; the chunk then holds hundreds of rows instead of a CPU
# cache's few (thousands of kernel launches fewer per call). Bytes never depend on it.
ACCELERATOR_CHUNK_BYTES = 1 << 30
ACCELERATOR_FREE_SHARE = 4  # at most 1/4 of the free memory
ACCELERATOR_MAX_ROWS = 16384
# Bytes per logit column of a chunk's workspace: the FP32 buffer and the entropy buffer (4 + 4),
# E's scratch (kf, q: 4 + 4; ka, kb: int32 4 + 4; a bool mask 1).
WORKSPACE_BYTES_PER_COLUMN = 25


def chunk_rows_for_device(
    local_vocab: int, device: torch.device | str, free_bytes: int | None = None
) -> int:
    """Rows per chunk of the eager chunk loops on ``device`` (the op's default ``chunk_rows``).

    * CPU: :func:`default_chunk_rows`, cache sized (about 2 MiB of FP32 per chunk: 3 rows at
      vocabulary 151936), because each chunk is upcast, shifted, exponentiated and folded
      while it sits in the core's L2.
    * An accelerator (CUDA or another non-CPU device): a memory budget. The workspace of one
      chunk (``WORKSPACE_BYTES_PER_COLUMN`` bytes per column) may use ``min(1 GiB, free / 4)``,
      where ``free`` is ``free_bytes`` or the device's free memory (``torch.cuda.mem_get_info``;
      devices without that query get the 1 GiB budget): 282 rows at vocabulary 151936 with
      plenty free, at least 1 row, at most ``ACCELERATOR_MAX_ROWS``.

    The chunk size decides only how rows are batched: the bytes of every output are the same
    for any chunk size (``tests/test_vocab_parallel_logp.py::test_chunk_size_invariance``).
    """
    if isinstance(local_vocab, bool) or not isinstance(local_vocab, int) or local_vocab < 1:
        raise ValueError(f"local_vocab={local_vocab!r} must be a positive integer")
    dev = torch.device(device)
    if dev.type == "cpu":
        return default_chunk_rows(local_vocab)
    if free_bytes is None and dev.type == "cuda" and torch.cuda.is_available():
        free_bytes, _total = torch.cuda.mem_get_info(dev)
    budget = ACCELERATOR_CHUNK_BYTES
    if free_bytes is not None:
        if free_bytes < 0:
            raise ValueError(f"free_bytes={free_bytes} must be >= 0")
        budget = min(budget, free_bytes // ACCELERATOR_FREE_SHARE)
    rows = budget // (WORKSPACE_BYTES_PER_COLUMN * local_vocab)
    return max(1, min(ACCELERATOR_MAX_ROWS, rows))
