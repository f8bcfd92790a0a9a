"""Fixed-grouping FP32 tile arithmetic shared by the forward and backward of the backend.

Every reduction here is built from elementwise operations whose grouping depends only on
the tile width or the tile count, never on the number of rows, the chunk size, the
thread count or which rank computes the tile. ``torch.sum`` is not used: on the CPU it
splits a long row across threads when there are few rows, which changes the bits.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


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


def canonical_zero_(x: torch.Tensor) -> torch.Tensor:
    """Turn ``-0.0`` into ``+0.0`` in place (``-0.0 + 0.0 == +0.0``), so a tile's max has one sign."""
    return x.add_(0.0)


def chunk_tile_partials(
    chunk: torch.Tensor,
    tile_width: int,
    real_local: int,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """FP32 ``(max, sum exp, sum exp * shifted)`` of each tile of a chunk of rows.

    ``chunk`` is ``[rows, local_vocab]`` in the logits dtype; columns ``>= real_local`` are
    padding and never count. Returns ``m [rows, tiles]`` (``-inf`` for a tile that is all
    padding), ``s`` and, when asked, ``t = sum(exp(y) * y)`` with ``y = x - shift``,
    plus a per-row flag that every real column is finite.
    """
    rows, local_vocab = chunk.shape
    tiles = local_vocab // tile_width
    xf = chunk.to(torch.float32, copy=True)  # never write into the caller's logits
    finite = torch.isfinite(xf[:, :real_local]).all(dim=1)
    if real_local < local_vocab:
        xf[:, real_local:] = NEG_INF
    xv = xf.view(rows, tiles, tile_width)
    m = canonical_zero_(xv.amax(dim=-1))
    shift = torch.where(m == NEG_INF, torch.zeros_like(m), m)
    xv.sub_(shift.unsqueeze(-1))
    t = None
    if with_entropy:
        y = xf.clone()
        y[:, real_local:] = 0.0  # padding: exp(y) == 0 there, and 0 * 0 keeps it out
        xv.exp_()
        t = fold_sum_(y.mul_(xf).view(rows, tiles, tile_width)).clone()
    else:
        xv.exp_()
    s = fold_sum_(xv).clone()
    return m, s, t, finite


def merge_tiles(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge ``[rows, num_tiles]`` partials in global tile order: LSE and, if given, entropy."""
    big = m.amax(dim=-1, keepdim=True)
    weight = torch.exp(m - big)
    total = fold_sum_(s * weight)
    lse = big.squeeze(-1) + torch.log(total)
    entropy = None
    if t is not None:
        shift = torch.where(m == NEG_INF, torch.zeros_like(m), m)
        mean_x = fold_sum_(weight * (t + shift * s)) / total
        entropy = lse - mean_x
    return lse, entropy


def default_chunk_rows(local_vocab: int, target_bytes: int = 4 << 20) -> int:
    """Rows per chunk so one FP32 chunk stays near ``target_bytes`` (cache sized)."""
    return max(1, min(4096, target_bytes // max(1, 4 * local_vocab)))


def num_chunks(rows: int, chunk_rows: int) -> int:
    return math.ceil(rows / chunk_rows) if rows else 0
