"""A small NumPy reference of processed logprobs (docs/arithmetic.md section 13) for the fused C
and Triton tests: the kept set by a sort and a bisection on the prefix length, then section 6
and 7 of ``rl_engine.spec_numpy`` on the masked logits. Written from the definition alone,
sharing no code with the kernels."""

from __future__ import annotations

import numpy as np
import torch

from rl_engine.arith import spec_numpy as sn

F32 = np.float32


def tempered(x: torch.Tensor, t32: float) -> np.ndarray:
    """Section 6 step 0 on a torch tensor of logits: ``f32(x) / T32`` (skipped at 1)."""
    x32 = x.float().numpy().copy()
    return x32 if F32(t32) == F32(1.0) else np.divide(x32, F32(t32))


def _z(e_full: np.ndarray, tiles: int) -> np.float32:
    """``Z``: the lane sum ``G`` per tile, then ``F`` over the tiles in order."""
    per_tile = sn.lane_sum(e_full.reshape(tiles, -1))
    return F32(sn.fold(per_tile))


def kept_mask(x: np.ndarray, real: int, tiles: int, top_k: np.ndarray, p32: np.ndarray,
              mp32: np.ndarray) -> np.ndarray:
    """Bool ``[rows, padded]``: section 13's kept set K of each row of tempered binary32 logits."""
    rows, vp = x.shape
    mask = np.zeros((rows, vp), bool)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for r in range(rows):
            xr = x[r, :real]
            big = xr.max() if real else F32(-np.inf)
            if np.isnan(xr).any() or not np.isfinite(big):
                mask[r, :real] = True  # no filtering
                continue
            cols = np.arange(real)
            if mp32[r] > 0:
                lmp = sn.log32(np.array([mp32[r]], F32))[0]
                cols = cols[np.subtract(xr, big) >= lmp]
            order = cols[np.lexsort((cols, -xr[cols].astype(np.float64)))]  # key order
            if top_k[r] > 0:
                order = order[: top_k[r]]
            if p32[r] < 1:
                e = sn.exp32(np.subtract(xr[order], big))

                def z(n: int, order: np.ndarray = order, e: np.ndarray = e) -> np.float32:
                    full = np.zeros(vp, F32)
                    full[order[:n]] = e[:n]
                    return _z(full, tiles)

                tau = np.multiply(F32(p32[r]), z(len(order)))
                lo, hi = 0, len(order)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if z(mid) >= tau:
                        hi = mid
                    else:
                        lo = mid
                order = order[:hi]
            mask[r, order] = True
    return mask


def masked(x: np.ndarray, mask: np.ndarray, real: int) -> np.ndarray:
    out = np.where(mask, x, F32(-np.inf)).astype(F32)
    out[:, real:] = x[:, real:]
    return out


def forward(x: np.ndarray, mask: np.ndarray, targets: np.ndarray, active: np.ndarray, real: int,
            tiles: int, with_entropy: bool = True):
    """Section 13 step 4: ``(logp, lse, entropy, target_kept)``."""
    logp, lse, ent = sn.forward(masked(x, mask, real), "float32", targets, active, real, tiles, with_entropy)
    kept = mask[np.arange(len(targets)), np.clip(targets, 0, x.shape[1] - 1)] | ~active
    return logp, lse, ent, kept


def backward(x: np.ndarray, mask: np.ndarray, targets: np.ndarray, active: np.ndarray, lse: np.ndarray,
             grad_logp: np.ndarray, grad_lse: np.ndarray, real: int, tiles: int, t32: float,
             dtype: str, grad_entropy=None, entropy=None) -> np.ndarray:
    """Section 13 step 5: section 7 on the masked logits, ``gl = 0`` where the target is dropped,
    ``+0`` on dropped columns; the gradient divided by ``T32`` and rounded once to ``dtype``."""
    kept = mask[np.arange(len(targets)), np.clip(targets, 0, x.shape[1] - 1)]
    gl = np.where(kept, grad_logp, F32(0.0)).astype(F32)
    g = sn.backward(masked(x, mask, real), "float32", targets, active, lse, gl, grad_lse, real, tiles,
                    grad_entropy=grad_entropy, entropy=entropy)
    g = np.where(mask[:, : g.shape[1]] | (np.arange(g.shape[1]) >= real), g, F32(0.0)).astype(F32)
    if F32(t32) != F32(1.0):
        g = np.divide(g, F32(t32))
    name = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
    return sn._round_to(sn.canon_nan(g), name)
