"""Independent full-vocabulary oracles. Shares no code with the vocab-parallel backend.

* :func:`fp32_oracle` is the guide's reference: FP32 ``log_softmax`` over the real columns
  of the unsharded logits upcast to FP32.
* :func:`fp64_oracle` computes the same in FP64 on the dtype-rounded inputs, which
  isolates the kernel's own error from the rounding of its inputs.
* :func:`processed_fp64_oracle`: the processed logprob (top-k, top-p, min-p; docs/arithmetic.md
  section 13) in FP64, its kept set found with FP64 sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OracleOutput:
    """Selected logprob (0.0 on inactive rows), LSE and entropy of every row."""

    selected_logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor


def _oracle(
    logits: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    real_vocab: int,
    dtype: torch.dtype,
) -> OracleOutput:
    if logits.dim() != 2 or logits.shape[1] < real_vocab:
        raise ValueError(
            f"oracle needs full logits [tokens, >= real_vocab={real_vocab}], got {tuple(logits.shape)}"
        )
    real = logits[:, :real_vocab].to(dtype)
    logsm = torch.log_softmax(real, dim=-1)
    lse = torch.logsumexp(real, dim=-1)
    safe = torch.where(active, targets, torch.zeros_like(targets))
    selected = logsm.gather(1, safe.unsqueeze(1)).squeeze(1)
    selected = torch.where(active, selected, torch.zeros_like(selected))
    entropy = -(logsm.exp() * logsm).sum(dim=-1)
    return OracleOutput(selected, lse, entropy)


def fp32_oracle(
    logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, real_vocab: int
) -> OracleOutput:
    """FP32 ``log_softmax`` over the real columns of the unsharded logits."""
    return _oracle(logits, targets, active, real_vocab, torch.float32)


def fp64_oracle(
    logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, real_vocab: int
) -> OracleOutput:
    """FP64 on the inputs as the candidate sees them (already rounded to their dtype)."""
    return _oracle(logits, targets, active, real_vocab, torch.float64)


def processed_fp64_oracle(
    x32: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, real_vocab: int,
    top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
) -> tuple[OracleOutput, torch.Tensor]:
    """Section 13's processed logprob in FP64, from the definition rather than its binary32 steps.

    ``x32``: the tempered binary32 logits (``[rows, >= real_vocab]``); ``top_k`` int64, ``top_p``
    and ``min_p`` (their binary32 values) per row. Per row: ``B`` the max; min-p keeps
    ``x - B >= log(min_p)``; top-k the first ``k`` of those in key order (``torch.sort``, stable:
    ties by the lower id); top-p the shortest prefix whose FP64 ``cumsum`` of ``exp(x - B)``
    reaches ``top_p`` times the total (vLLM's sorted cumulative sum, in FP64). Returns the FP64
    logprob (``-inf`` for a dropped active target), LSE and entropy of the kept set, and the kept
    set (bool ``[rows, real_vocab]``). A row with a non-finite max keeps everything.
    """
    x = x32[:, :real_vocab].to(torch.float64)
    rows = x.shape[0]
    keep = torch.ones(rows, real_vocab, dtype=torch.bool)
    for r in range(rows):
        xr = x[r]
        big = xr.max()
        k, p, mp = int(top_k[r]), float(top_p[r]), float(min_p[r])
        if not torch.isfinite(big) or (k == 0 and p == 1.0 and mp == 0.0):
            continue
        member = (xr - big >= math.log(mp)) if mp > 0 else torch.ones(real_vocab, dtype=torch.bool)
        _, order = torch.sort(xr, descending=True, stable=True)
        prefix = order[member[order]]
        if k > 0:
            prefix = prefix[:k]
        if p < 1.0:
            cum = torch.cumsum(torch.exp(xr[prefix] - big), dim=0)
            n = int(torch.searchsorted(cum, p * float(cum[-1]), side="left")) + 1
            prefix = prefix[: min(n, len(prefix))]
        keep[r] = False
        keep[r, prefix] = True
    masked = torch.where(keep, x, torch.full_like(x, -math.inf))
    out = _oracle(masked, targets, active, real_vocab, torch.float64)
    logsm = torch.log_softmax(masked, dim=-1)
    entropy = -torch.where(keep, logsm.exp() * logsm, torch.zeros_like(x)).sum(dim=-1)  # no 0 * -inf
    return OracleOutput(out.selected_logp, out.lse, entropy), keep
