"""The GRPO objective on global tensors: advantages, per-token terms and fixed-order reductions.

Everything here runs on the whole batch in global token order (``[num_sequences, seq_len]``)
and has no idea of the mesh: the loss op gathers the local pieces first (transport only), so
every rank evaluates exactly these operations on exactly these shapes, and a single process
evaluates the same. That is what makes the loss, the statistics and the per-token gradient
coefficients byte-identical whatever the TP, CP and DP degrees.

The exponentials are the portable ``E`` of ``docs/arithmetic.md`` (section 9), so the loss
bytes do not depend on the device's exp either. Sums use :func:`ordered_sum`, a pairwise fold whose grouping
depends only on the length of the summed dimension (never ``torch.sum``, which regroups with the thread count). Counts are
integer sums (exact in any order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.arith.portable import exp_differentiable
from rl_engine.arith.tiles import fold_sum
from rl_engine.grpo.contract import GRPOContract, GRPOContractError


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """FP32 sum of the last dimension in a fixed pairwise order (differentiable).

    Level by level element ``i < h`` gets ``x[i] + x[w - h + i]`` with ``h = w // 2``; the
    grouping is a function of the last dimension's size alone.
    """
    if x.dtype != torch.float32:
        raise GRPOContractError(f"ordered_sum needs float32, got {x.dtype}; accumulate in FP32")
    return fold_sum(x)


def group_advantages(rewards: torch.Tensor, contract: GRPOContract) -> torch.Tensor:
    """Advantages ``[num_sequences]`` from the global reward vector, group by group.

    ``group_mean``: ``r - mean(group)``. ``group_mean_std``: ``(r - mean) / (std + adv_eps)``
    with the unbiased (n - 1) standard deviation; a group of equal rewards gives exactly 0.
    """
    size = contract.group_size
    # Centre and scale in FP64 from the FP32 rewards: a group of n equal rewards r sums to
    # exactly n*r there (n <= 2**29), so the mean is exactly r and the advantage exactly 0;
    # in FP32 the fold's rounding would leave a tiny non-zero centre that the division by
    # (std + adv_eps) blows up. The result is rounded once to FP32.
    grouped = rewards.reshape(contract.num_groups, size).to(torch.float64)
    mean = fold_sum(grouped) / float(size)
    centered = grouped - mean.unsqueeze(1)
    if contract.advantage_mode == "group_mean":
        return centered.reshape(-1).to(torch.float32)
    assert contract.adv_eps is not None
    var = fold_sum(centered * centered) / float(size - 1)
    std = torch.sqrt(var)
    return (centered / (std + contract.adv_eps).unsqueeze(1)).reshape(-1).to(torch.float32)


@dataclass(frozen=True)
class TokenTerms:
    """Per-token terms on ``[num_sequences, seq_len]`` (exactly +0.0 on inactive tokens)."""

    policy: torch.Tensor  # -min(r A, clip(r) A), differentiable
    kl: torch.Tensor | None  # KL estimator, differentiable; None without a reference
    total: torch.Tensor  # policy + beta * kl (policy alone when beta == 0)
    ratio: torch.Tensor  # exp(logp - old_logp); exactly 1.0 on inactive tokens (detached)
    clipped: torch.Tensor  # bool: the clipped branch is active (its gradient is zero)


def token_terms(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    active: torch.Tensor,
    advantages: torch.Tensor,
    contract: GRPOContract,
) -> TokenTerms:
    """The clipped policy term and the KL term of every token of the global batch."""
    zeros = torch.zeros_like(old_logp)
    adv = advantages.unsqueeze(1).expand_as(old_logp)
    delta = torch.where(active, logp - torch.where(active, old_logp, zeros), zeros)
    ratio = exp_differentiable(delta)  # E of docs/arithmetic.md, not a library exp
    low = 1.0 - contract.clip_eps_low
    high = 1.0 + contract.clip_eps_high
    unclipped = ratio * adv
    clipped_obj = torch.clamp(ratio, low, high) * adv
    policy = torch.where(active, -torch.minimum(unclipped, clipped_obj), zeros)
    with torch.no_grad():
        clipped = active & (((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0)))
    kl = None
    if ref_logp is not None:
        ref = torch.where(active, ref_logp, zeros)
        if contract.kl_estimator == "k3":
            diff = ref - logp  # q - p, q the reference and p the policy logprob
            per_token = exp_differentiable(diff) - diff - 1.0
        else:
            per_token = logp - ref  # p - q (written so that p == q gives +0.0, not -0.0)
        kl = torch.where(active, per_token, zeros)
    if contract.beta > 0.0:
        if kl is None:
            raise GRPOContractError(
                f"beta={contract.beta} > 0 needs reference logits; pass ref_logits= or set beta=0"
            )
        total = policy + contract.beta * kl
    else:
        total = policy
    return TokenTerms(policy, kl, total, ratio.detach(), clipped)


def reduce_tokens(
    per_token: torch.Tensor, active_per_sequence: torch.Tensor, contract: GRPOContract
) -> torch.Tensor:
    """Reduce ``[num_sequences, seq_len]`` terms (zero on inactive tokens) to a 0-d FP32 loss.

    ``active_per_sequence`` is the int64 count of active tokens of each sequence.
    """
    per_sequence = ordered_sum(per_token)
    if contract.reduction == "token_mean":
        count = int(active_per_sequence.sum())
        return ordered_sum(per_sequence) / float(count)
    if contract.reduction == "sequence_mean":
        means = per_sequence / active_per_sequence.to(torch.float32)
        return ordered_sum(means) / float(contract.num_sequences)
    assert contract.constant_normalizer is not None
    return ordered_sum(per_sequence) / contract.constant_normalizer


def check_active_counts(active_per_sequence: torch.Tensor, contract: GRPOContract) -> None:
    """A loss needs active tokens; ``sequence_mean`` needs them in every sequence."""
    total = int(active_per_sequence.sum())
    if total == 0:
        raise GRPOContractError(
            "active mask has no active token in the whole batch; a GRPO loss over no response "
            "token is undefined: mark the response tokens active"
        )
    if contract.reduction == "sequence_mean":
        empty = (active_per_sequence == 0).nonzero().flatten().tolist()
        if empty:
            raise GRPOContractError(
                f"sequences {empty} have no active token but reduction='sequence_mean' divides "
                "by each sequence's active-token count; drop those sequences from the batch or "
                "use reduction='token_mean' or 'constant'"
            )


__all__ = [
    "TokenTerms",
    "check_active_counts",
    "group_advantages",
    "ordered_sum",
    "reduce_tokens",
    "token_terms",
]
