"""Fixed-grouping FP32 tile arithmetic shared by the forward and backward of the backend.

Every reduction here is built from elementwise operations whose grouping depends only on
the tile width or the tile count, never on the number of rows, the chunk size, the
thread count or which rank computes the tile. ``torch.sum`` is not used: on the CPU it
splits a long row across threads when there are few rows, which changes the bits.

The exp and log are the portable ones of :mod:`rl_engine.logprob.portable`: every number is
the one ``docs/arithmetic.md`` (sections 6-8) defines, on any IEEE-754 device.

Speed without changing a bit: a :class:`ChunkWorkspace` owns one cache-sized FP32 chunk
buffer per call and replays, chunk after chunk, the same in-place operations on
precomputed views of it (upcast, tile max, shift, exp, pairwise fold). Nothing is
allocated inside the chunk loop and nothing of size ``tokens x vocab`` in FP32 exists.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rl_engine.logprob.portable import (
    ExpScratch,
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


def canonical_zero_(x: torch.Tensor) -> torch.Tensor:
    """Turn ``-0.0`` into ``+0.0`` in place (``-0.0 + 0.0 == +0.0``), so a tile's max has one sign."""
    return x.add_(0.0)


class _ChunkViews(NamedTuple):
    buf: torch.Tensor  # [rows, local_vocab] FP32
    tiles: torch.Tensor  # the same memory as [rows, tiles, tile_width]
    real: torch.Tensor  # real columns
    padding: torch.Tensor | None  # padding columns, if any
    shift: torch.Tensor  # [rows, tiles]
    shift_per_tile: torch.Tensor  # [rows, tiles, 1]
    fold: FoldPlan
    exp_buf: torch.Tensor | None
    exp_fold: FoldPlan | None
    scratch: ExpScratch


class ChunkWorkspace:
    """Reusable FP32 buffers of one forward call and the views its chunk loop replays.

    ``partials`` computes, for one chunk of rows in the logits dtype, the FP32 ``(max,
    sum exp, sum exp * shifted)`` of every local tile, in place in the workspace: upcast,
    padding to ``-inf``, tile max, canonical zero, shift (``0`` for an all ``-inf`` tile),
    exp and fixed fold. ``t = sum(exp(y) * y)`` with ``y = x - shift`` and ``y = 0`` on
    padding columns.
    """

    def __init__(
        self,
        chunk_rows: int,
        local_vocab: int,
        tile_width: int,
        real_local: int,
        with_entropy: bool,
        device: torch.device,
    ) -> None:
        if local_vocab % tile_width:
            raise ValueError(f"local_vocab={local_vocab} is not a multiple of tile_width={tile_width}")
        self.chunk_rows = chunk_rows
        self.local_vocab = local_vocab
        self.tile_width = tile_width
        self.tiles = local_vocab // tile_width
        self.real_local = real_local
        self.with_entropy = with_entropy
        self.buf = torch.empty(chunk_rows, local_vocab, dtype=torch.float32, device=device)
        self.exp_buf = torch.empty_like(self.buf) if with_entropy else None
        self.shift = torch.empty(chunk_rows, self.tiles, dtype=torch.float32, device=device)
        self.scratch = ExpScratch((chunk_rows, local_vocab), device)
        self._views: dict[int, _ChunkViews] = {}

    def views(self, rows: int) -> _ChunkViews:
        """The views of the buffers for a chunk of ``rows`` rows (built once per row count)."""
        found = self._views.get(rows)
        if found is None:
            buf = self.buf[:rows]
            shape = (rows, self.tiles, self.tile_width)
            exp_buf = self.exp_buf[:rows] if self.exp_buf is not None else None
            shift = self.shift[:rows]
            found = _ChunkViews(
                buf=buf,
                tiles=buf.view(shape),
                real=buf[:, : self.real_local],
                padding=buf[:, self.real_local :] if self.real_local < self.local_vocab else None,
                shift=shift,
                shift_per_tile=shift.unsqueeze(-1),
                fold=FoldPlan(buf.view(shape)),
                exp_buf=exp_buf,
                exp_fold=FoldPlan(exp_buf.view(shape)) if exp_buf is not None else None,
                scratch=self.scratch.rows(rows),
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
    ) -> None:
        """Write the chunk's tile partials into ``m_out``, ``s_out`` (and ``t_out``).

        ``row_min_out``, when given, receives the minimum over each row's real columns
        (a validation aid: with the tile maxima it tells whether a row is all finite).
        """
        v = self.views(chunk.shape[0])
        v.buf.copy_(chunk)
        if row_min_out is not None and self.real_local > 0:
            torch.amin(v.real, dim=1, out=row_min_out)
        if v.padding is not None:
            v.padding.fill_(NEG_INF)
        torch.amax(v.tiles, dim=-1, out=m_out)
        canonical_zero_(m_out)
        # shift = m, except 0 for an all -inf tile (as ``where(m == -inf, 0, m)``), one op
        torch.nan_to_num(m_out, nan=math.nan, posinf=math.inf, neginf=0.0, out=v.shift)
        v.tiles.sub_(v.shift_per_tile)
        if self.with_entropy:
            assert v.exp_buf is not None and v.exp_fold is not None and t_out is not None
            exp_into(v.buf, v.exp_buf, v.scratch)
            if v.padding is not None:
                v.padding.fill_(0.0)  # y = 0 on padding: exp == 0 there, and 0 * 0 keeps it out
            v.buf.mul_(v.exp_buf)
            v.fold.run_into(t_out)
            v.exp_fold.run_into(s_out)
        else:
            exp_into(v.buf, v.buf, v.scratch)
            v.fold.run_into(s_out)


class GradWorkspace:
    """Reusable FP32 chunk buffer (and exp scratch) of one backward call."""

    def __init__(self, chunk_rows: int, local_vocab: int, device: torch.device) -> None:
        self.buf = torch.empty(chunk_rows, local_vocab, dtype=torch.float32, device=device)
        self.scratch = ExpScratch((chunk_rows, local_vocab), device)

    def softmax_times(
        self,
        chunk: torch.Tensor,
        lse: torch.Tensor,
        coef: torch.Tensor,
        target_col: torch.Tensor,
        target_add: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """``out = coef * E(x - lse)``, plus ``target_add`` at ``target_col`` in FP32, NaN made
        canonical, rounded once to ``out``'s dtype (``docs/arithmetic.md`` sections 7-8).

        Adding ``-0.0`` is the identity for every FP32 value, so rows that own no target
        carry ``-0.0`` in ``target_add`` and keep their bits. ``scatter_add_`` adds exactly
        one value to one element per row: a single rounded addition.
        """
        rows = chunk.shape[0]
        buf = self.buf[:rows]
        sc = self.scratch.rows(rows)
        buf.copy_(chunk)
        buf.sub_(lse.unsqueeze(1))
        exp_into(buf, buf, sc)
        buf.mul_(coef.unsqueeze(1))
        buf.scatter_add_(1, target_col.unsqueeze(1), target_add.unsqueeze(1))
        canonical_nan_(buf, sc.mask)
        round_into(buf, out, sc.ka)


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


def merge_tiles(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge ``[rows, num_tiles]`` partials in global tile order: LSE and, if given, entropy.

    ``docs/arithmetic.md`` section 6, steps 5-8: a row whose tiles are all ``-inf`` has
    ``LSE = -inf`` (the shift is 0, the weighted sum 0 and ``L(0) = -inf``).
    """
    big = m.amax(dim=-1, keepdim=True)
    big_shift = torch.where(big == NEG_INF, torch.zeros_like(big), big)
    weight = exp(m - big_shift)
    total = fold_sum_(s * weight)
    lse = big_shift.squeeze(-1) + log(total)
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
