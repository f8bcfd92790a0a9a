"""How often the Triton kernels' guard takes the IEEE division, counted on the host.

With a temperature the kernels divide by ``T32`` with Markstein's fused multiply-adds and compute a
tile (forward) or a block of columns (backward) again with the IEEE division when the guard says
the sequence may not be exact there (``docs/arithmetic.md``, "Dividing by T32 on a GPU"). The
roofline times the fast path only, so its prediction holds as long as the guard rarely fires.
:func:`guard_counts` evaluates the guard's conditions, as the kernels write them, for every
``(row, tile)`` program of the forward and every ``(row, block)`` program of the backward of one
call, in torch on the host, and counts the programs that take the IEEE path:

* forward, per tile: the largest real logit ``>= hi``, the smallest ``<= -hi``, or the tile's
  maximum divided by ``T32`` (the IEEE division) below ``sh_min`` in magnitude;
* backward, per block of ``BACKWARD_BLOCK`` columns (the last block's lanes past the shard read
  ``0``, as the masked kernel's do, and padding columns count: the kernel reads them): the largest
  ``|x|`` or ``|g|`` ``>= hi`` (a NaN ignored, as the kernels' maxima do), a ``g`` whose magnitude
  key (``2 * bits(|g|) - 2``, as an unsigned 32-bit integer) is below ``lo_key``, the row's ``|LSE| < sh_min``, or with the entropy's
  gradient ``g_ent != 0`` and ``|Mb| < sh_min``. ``g`` is section 7 step 1's value before the
  division: ``coef * E(x / T32 - LSE)`` (with the entropy term), computed with the portable ``E``.

``x / T32`` is the IEEE quotient here where the kernels use Markstein's sequence (or the split
quotient, ``rl_engine.arith.division.split_reciprocal``); they agree on the division's domain, so
a decision can differ only where a value lies outside it, which the guard's own conditions flag in
the cases the tests build. ``tests/test_guard_frequency.py``
compares these counts with the programs that really take the IEEE path under Triton's
interpreter (counted inside the kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.arith.portable import exp as portable_exp
from rl_engine.logprob.backends.eager.vocab_parallel import real_local_columns
from rl_engine.logprob.backends.triton.triton_backend import BACKWARD_BLOCK, division_args, next_pow2
from rl_engine.logprob.contract import LogprobContract


class GuardCountError(ValueError):
    """Inputs the count cannot take (no temperature: nothing is guarded)."""


@dataclass(frozen=True)
class GuardCounts:
    """Programs of one call that take the IEEE path, of all that could."""

    forward_tiles: int
    forward_ieee: int
    backward_blocks: int
    backward_ieee: int

    def to_dict(self) -> dict[str, Any]:
        return {"forward_tiles": self.forward_tiles, "forward_ieee": self.forward_ieee,
                "forward_share": self.forward_ieee / self.forward_tiles if self.forward_tiles else 0.0,
                "backward_blocks": self.backward_blocks, "backward_ieee": self.backward_ieee,
                "backward_share": self.backward_ieee / self.backward_blocks if self.backward_blocks else 0.0}


def _key(g: torch.Tensor) -> torch.Tensor:
    """``(bits(g) << 1) - 2`` as an unsigned 32-bit integer (in int64): ``2 |g| - 2`` in the bits."""
    bits = g.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return ((bits << 1) - 2) & 0xFFFFFFFF


def guard_counts(logits: torch.Tensor, contract: LogprobContract, lse: torch.Tensor, coef: torch.Tensor,
                 g_ent: torch.Tensor | None = None, mb: torch.Tensor | None = None) -> GuardCounts:
    """The guard's decisions for one rank's ``[rows, local_vocab]`` logits at the contract's temperature:
    the forward's tiles and the backward's blocks (``lse``, ``coef`` and, with the entropy's gradient,
    ``g_ent`` and ``Mb`` per row: the backward's terms)."""
    t32 = contract.temperature32
    if t32 == 1.0:
        raise GuardCountError("temperature=1: no division, nothing is guarded; count at another temperature")
    _, _, hi, lo_key, sh_min = division_args(t32)
    x = logits.detach().float()
    rows, local_vocab = x.shape
    width = contract.tile_width
    tiles = local_vocab // width
    real = real_local_columns(contract)
    real_cols = torch.arange(local_vocab, device=x.device) < real
    top = torch.where(real_cols, x, torch.full_like(x, float("-inf"))).view(rows, tiles, width).amax(dim=2)
    low = torch.where(real_cols, x, torch.full_like(x, float("inf"))).view(rows, tiles, width).amin(dim=2)
    divisor = torch.full((), t32, dtype=torch.float32, device=x.device)
    forward = (top >= hi) | (low <= -hi) | ((top / divisor).abs() < sh_min)
    whole, rest = divmod(local_vocab, BACKWARD_BLOCK)
    lanes = whole * BACKWARD_BLOCK + (next_pow2(rest) if rest else 0)
    wide = torch.zeros(rows, lanes, dtype=torch.float32, device=x.device)  # masked lanes read 0
    wide[:, :local_vocab] = x
    p = portable_exp((wide / divisor - lse.float().unsqueeze(1)).contiguous())
    g = coef.float().unsqueeze(1) * p
    if g_ent is not None:
        assert mb is not None
        ge = g_ent.float().unsqueeze(1)
        term = g + (ge * p) * (mb.float().unsqueeze(1) - wide / divisor)
        g = torch.where(ge != 0, torch.where(p != 0, term, g), g)
    blocks = [(0, whole * BACKWARD_BLOCK, BACKWARD_BLOCK)] if whole else []
    if rest:
        blocks.append((whole * BACKWARD_BLOCK, lanes, next_pow2(rest)))
    row_flag = lse.float().abs() < sh_min
    if g_ent is not None:
        assert mb is not None
        row_flag = row_flag | ((g_ent.float() != 0) & (mb.float().abs() < sh_min))
    backward_ieee = backward_blocks = 0
    for start, stop, block in blocks:
        n = (stop - start) // block
        # the kernels' maxima ignore a NaN operand (max.f32; the reduction's NaN is dropped)
        big = torch.fmax(wide[:, start:stop].abs(), g[:, start:stop].abs()).view(rows, n, block)
        big = torch.where(torch.isnan(big), torch.full_like(big, float("-inf")), big).amax(dim=2)
        small = _key(g[:, start:stop]).view(rows, n, block).amin(dim=2)
        ieee = (big >= hi) | (small < lo_key) | row_flag.unsqueeze(1)
        backward_ieee += int(ieee.sum())
        backward_blocks += rows * n
    return GuardCounts(rows * tiles, int(forward.sum()), backward_blocks, backward_ieee)


__all__ = ["GuardCountError", "GuardCounts", "guard_counts"]
