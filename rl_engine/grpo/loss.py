"""The GRPO loss op on the deterministic vocab-parallel logprob.

Per rank: local policy logits ``[local_tokens, local_vocab]`` (TP-sharded vocabulary,
CP-split positions, DP-split sequences), action ids, old logprobs and the active (response)
mask for the same rows, the DP shard's per-sequence rewards and, optionally, reference
logits with the policy's layout. Steps:

1. local checks (shapes, dtypes, finite old logprobs and rewards, action ids), then
   :func:`preflight` on the world group: contract, backend, input validity and the (integer)
   active-token count of every sequence agreed by every rank, or all raise; an all-inactive
   batch, or an empty sequence under ``sequence_mean``, is rejected there too;
2. selected logprobs through the dispatched logprob op (the reference without autograd),
   validated with ``on_invalid="nan"``: the op's forward judges the real columns of the logits
   in the pass that reads them (no second read of the logits) and gives an active row with a
   non-finite real logit a NaN logp instead of raising in its TP group alone;
3. :func:`gather_global`: every rank's rows placed in global token order (transport only);
   every rank then holds the same NaN and raises the same error (one host sync), before the
   objective and before any backward;
4. the objective on the global batch (:mod:`rl_engine.grpo.objective`), identical on every
   rank and in a single process.

The returned ``loss`` differentiates to this rank's logits: each rank's gradient is the
derivative of the *global* loss with respect to its own logits, so no gradient collective is
needed inside the op (a DP trainer sums parameter gradients across DP ranks as usual).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.grpo.contract import GRPOContract, GRPOContractError
from rl_engine.grpo.exchange import gather_global, inputs_digest, local_active_counts, preflight
from rl_engine.grpo.objective import (
    check_active_counts,
    group_advantages,
    ordered_sum,
    reduce_tokens,
    token_terms,
)
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.registry import dispatch
from rl_engine.tables import AUTO

# auto: the fastest backend on the logits' device (Triton on cuda, fused C on cpu), every one
# the same bytes; the choice and its reason are in the output's provenance
DEFAULT_BACKEND = AUTO


@dataclass(frozen=True)
class SequenceStats:
    """Per-sequence statistics of the global batch, ``[num_sequences]`` each (detached)."""

    reward: torch.Tensor  # fp32
    advantage: torch.Tensor  # fp32
    active_tokens: torch.Tensor  # int64
    clipped_tokens: torch.Tensor  # int64: active tokens on the clipped branch
    policy_loss_sum: torch.Tensor  # fp32: sum of -min(r A, clip(r) A) over active tokens
    kl_sum: torch.Tensor | None  # fp32: sum of the KL estimator; None without a reference

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "reward": self.reward,
            "advantage": self.advantage,
            "active_tokens": self.active_tokens,
            "clipped_tokens": self.clipped_tokens,
            "policy_loss_sum": self.policy_loss_sum,
        }
        if self.kl_sum is not None:
            out["kl_sum"] = self.kl_sum
        return out


@dataclass(frozen=True)
class GRPOOutput:
    """What one loss call returns on every rank (global values; ``loss`` is differentiable)."""

    loss: torch.Tensor  # 0-d fp32: reduction of policy + beta * kl
    policy_loss: torch.Tensor  # 0-d fp32: the same reduction of the policy term (detached)
    kl: torch.Tensor | None  # 0-d fp32: the same reduction of the KL term; None without reference
    advantages: torch.Tensor  # [num_sequences] fp32
    clip_fraction: torch.Tensor  # 0-d fp32: clipped active tokens / active tokens
    ratio: torch.Tensor  # [num_sequences, seq_len] fp32: exp(logp - old_logp), 1 on inactive
    sequence_stats: SequenceStats
    active_tokens: int
    provenance: dict[str, Any]


def _check_local_inputs(
    contract: GRPOContract,
    logits: torch.Tensor,
    actions: torch.Tensor,
    old_logp: torch.Tensor,
    rewards: torch.Tensor,
    active: torch.Tensor,
    ref_logits: torch.Tensor | None,
    advantages: torch.Tensor | None = None,
) -> str | None:
    """Every local check of the inputs; returns the first problem (None when all pass)."""
    lp = contract.logprob
    try:
        lp.check_inputs(logits, actions, active)
        if ref_logits is not None:
            lp.check_inputs(ref_logits, actions, active)
        lp.check_targets(actions, active)
    except LogprobContractError as exc:
        which = "" if ref_logits is None else " (policy or reference logits)"
        return f"{exc}{which}"
    if old_logp.dtype != torch.float32 or tuple(old_logp.shape) != (lp.num_tokens,):
        return (
            f"old_logp must be float32 of shape [{lp.num_tokens}] (this rank's token rows), got "
            f"dtype={old_logp.dtype} shape={tuple(old_logp.shape)}"
        )
    local_seqs = contract.local_num_sequences
    if rewards.dtype != torch.float32 or tuple(rewards.shape) != (local_seqs,):
        return (
            f"rewards must be float32 of shape [{local_seqs}] (one per sequence of dp_rank="
            f"{contract.dp_rank}, sequences {list(contract.sequence_range)}), got "
            f"dtype={rewards.dtype} shape={tuple(rewards.shape)}"
        )
    if advantages is not None and (not isinstance(advantages, torch.Tensor) or advantages.dtype != torch.float32
                                   or tuple(advantages.shape) != (local_seqs,)):
        got = (f"dtype={advantages.dtype} shape={tuple(advantages.shape)}" if isinstance(advantages, torch.Tensor)
               else type(advantages).__name__)
        return (
            f"advantages must be float32 of shape [{local_seqs}] (one per sequence of dp_rank="
            f"{contract.dp_rank}, like rewards), got {got}; or leave it out and the loss computes "
            f"them from the rewards ({contract.advantage_mode})"
        )
    held = [("old_logp", old_logp), ("rewards", rewards)] + ([("advantages", advantages)] if advantages is not None else [])
    for name, tensor in held:
        if tensor.device != logits.device:
            return (
                f"{name}.device={tensor.device} differs from logits.device={logits.device}; "
                "move every input to the same device"
            )
    bad_old = active & ~torch.isfinite(old_logp)
    if bool(bad_old.any()):
        row = int(bad_old.nonzero()[0, 0])
        return (
            f"old_logp[{row}]={float(old_logp[row])} (global token "
            f"{contract.global_token_indices[row]}) is not finite on an active token; fix the "
            "rollout's logprobs or mark the token inactive"
        )
    for name, values in held[1:]:
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            return (
                f"{name}[{i}]={float(values[i])} (global sequence "
                f"{contract.sequence_range[0] + i}) is not finite; fix the "
                f"{'reward function' if name == 'rewards' else 'advantage estimate'}"
            )
    if contract.beta > 0.0 and ref_logits is None:
        return (
            f"beta={contract.beta} > 0 needs reference logits; pass ref_logits= or set beta=0"
        )
    return None  # the logits' real columns: judged by the op's forward (_refuse_non_finite_logits)


def _refuse_non_finite_logits(batch: Any, contract: GRPOContract) -> None:
    """Raise, on every rank alike, when an active token's logp is NaN in the global batch.

    The op (``on_invalid="nan"``) gives exactly the active rows whose real logit columns hold a
    non-finite value a NaN logp (finite logits give a finite logp); after the global gather
    every rank holds the same batch, so every rank raises the same error, naming the row of the
    policy's (or else the reference's) logits, on the ranks that hold it. One host sync.
    """
    policy = batch.active & torch.isnan(batch.logp.detach())
    bad = policy if batch.ref_logp is None else policy | (batch.active & torch.isnan(batch.ref_logp))
    if not bool(bad.any()):
        return
    name, found = "logits", policy
    if not bool(found.any()):
        name, found = "ref_logits", bad
    token = int(found.reshape(-1).nonzero()[0, 0])
    for rank in range(contract.world_size):
        held = contract.rank_token_indices(rank)
        if token in held:
            dp_rank, cp_rank, _ = contract.coords(rank)
            row = held.index(token)
            break
    else:  # every global token is some rank's: a token no rank holds is a contract that does not cover the batch
        raise GRPOContractError(f"{name}: global token {token} is held by no rank of the contract "
                                f"(world_size={contract.world_size}); build the contract from this batch's mesh")
    raise GRPOContractError(
        f"{name} row {row} (global token {token}; the logits of dp_rank={dp_rank}, cp_rank={cp_rank}) is "
        f"active and holds a non-finite value in its real columns on a tp_rank of that TP group; fix the "
        "producer or mark the token inactive"
    )


class GRPOLoss:
    """The GRPO loss op. Holds the dispatched logprob op (dispatch is cached; the op's
    agreement step runs on every call, so the cache never changes the collectives)."""

    def __init__(self, backend: str = DEFAULT_BACKEND) -> None:
        self.requested_backend = backend
        self._dispatches: dict[tuple[str, str], Any] = {}

    def _dispatch(self, contract: GRPOContract, device: torch.device) -> Any:
        key = (contract.logprob.cross_rank_fingerprint(), device.type)
        if key not in self._dispatches:
            self._dispatches[key] = dispatch(self.requested_backend, contract.logprob, device.type)
        return self._dispatches[key]

    def __call__(
        self,
        logits: torch.Tensor,
        actions: torch.Tensor,
        old_logp: torch.Tensor,
        rewards: torch.Tensor,
        active: torch.Tensor,
        contract: GRPOContract,
        *,
        ref_logits: torch.Tensor | None = None,
        tp_group: Any = None,
        world_group: Any = None,
        chunk_rows: int | None = None,
        advantages: torch.Tensor | None = None,
    ) -> GRPOOutput:
        """``advantages`` (float32, one per sequence of this DP shard, like ``rewards``): the
        trainer's own, used as given; left out, they are computed from the global rewards by the
        contract's ``advantage_mode``. Every TP and CP rank of a DP shard passes the same."""
        if not isinstance(contract, GRPOContract):
            raise GRPOContractError(f"contract={contract!r} must be a GRPOContract")
        chosen = self._dispatch(contract, logits.device)
        active_per_sequence = _agreed_active_counts(
            contract, chosen, world_group, logits, actions, old_logp, rewards, active, ref_logits,
            advantages,
        )
        logp, ref_logp = _selected_logps(
            chosen.op, contract, logits, ref_logits, actions, active, tp_group, chunk_rows
        )
        batch = gather_global(logp, old_logp, active, ref_logp, rewards, contract, world_group,
                              advantages)
        _refuse_non_finite_logits(batch, contract)
        advantages = (batch.advantages if batch.advantages is not None
                      else group_advantages(batch.rewards, contract))
        terms = token_terms(
            batch.logp, batch.old_logp, batch.ref_logp, batch.active, advantages, contract
        )
        loss = reduce_tokens(terms.total, active_per_sequence, contract)
        policy_loss, kl, clip_fraction, stats = _diagnostics(
            terms, batch.rewards, advantages, active_per_sequence, contract
        )
        return GRPOOutput(
            loss=loss,
            policy_loss=policy_loss,
            kl=kl,
            advantages=advantages,
            clip_fraction=clip_fraction,
            ratio=terms.ratio,
            sequence_stats=stats,
            active_tokens=int(active_per_sequence.sum()),
            provenance={**_provenance(chosen, contract),
                        "advantages": "given" if batch.advantages is not None else contract.advantage_mode},
        )


def _agreed_active_counts(
    contract: GRPOContract, chosen: Any, world_group: Any, logits: torch.Tensor, actions: torch.Tensor,
    old_logp: torch.Tensor, rewards: torch.Tensor, active: torch.Tensor, ref_logits: torch.Tensor | None,
    advantages: torch.Tensor | None = None,
) -> torch.Tensor:
    """Judge this rank's inputs, agree on the verdict and the inputs' digest with the whole world
    group (every rank raises together), and return the active tokens of each sequence."""
    local_error = _check_local_inputs(
        contract, logits, actions, old_logp, rewards, active, ref_logits, advantages
    )
    counts = None if local_error is not None else local_active_counts(contract, active)
    digest = (
        None if local_error is not None
        else inputs_digest(actions, active, contract.logprob.ignore_index)
    )
    active_per_sequence = preflight(
        contract, chosen.actual_backend, world_group, logits.device, local_error, counts,
        digest, advantages is not None,
    )
    check_active_counts(active_per_sequence, contract)
    return active_per_sequence


def _selected_logps(
    op: Any, contract: GRPOContract, logits: torch.Tensor, ref_logits: torch.Tensor | None,
    actions: torch.Tensor, active: torch.Tensor, tp_group: Any, chunk_rows: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The policy's selected logprobs (with their gradient) and the reference's (without)."""
    # on_invalid="nan": the other inputs were judged in _agreed_active_counts and agreed on by
    # the whole world group (actions and mask included); the logits' real columns are judged by
    # the op's forward in the pass that reads them, and a bad active row comes back as a NaN logp
    # (raising here would stop only this TP group, after its exchange, and leave the CP and DP
    # peers waiting in gather_global). The op's own agreement step then always passes.
    logp = op(
        logits, actions, active, contract.logprob,
        group=tp_group, validate=True, on_invalid="nan", chunk_rows=chunk_rows,
    ).selected_logp
    ref_logp = None
    if ref_logits is not None:
        with torch.no_grad():
            ref_logp = op(
                ref_logits.detach(), actions, active, contract.logprob,
                group=tp_group, validate=True, on_invalid="nan", chunk_rows=chunk_rows,
            ).selected_logp
    return logp, ref_logp


def _diagnostics(
    terms: Any, rewards: torch.Tensor, advantages: torch.Tensor, active_per_sequence: torch.Tensor,
    contract: GRPOContract,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, SequenceStats]:
    """Without gradient: the policy loss and KL alone, the clip fraction and the per-sequence stats."""
    with torch.no_grad():
        policy = terms.policy.detach()
        kl_terms = terms.kl.detach() if terms.kl is not None else None
        policy_loss = reduce_tokens(policy, active_per_sequence, contract)
        kl = reduce_tokens(kl_terms, active_per_sequence, contract) if kl_terms is not None else None
        clipped_per_sequence = terms.clipped.sum(dim=1)
        total_active = int(active_per_sequence.sum())
        clip_fraction = (
            clipped_per_sequence.sum().to(torch.float32) / float(total_active)
        )
        stats = SequenceStats(
            reward=rewards,
            advantage=advantages,
            active_tokens=active_per_sequence,
            clipped_tokens=clipped_per_sequence,
            policy_loss_sum=ordered_sum(policy),
            kl_sum=ordered_sum(kl_terms) if kl_terms is not None else None,
        )
    return policy_loss, kl, clip_fraction, stats


def _provenance(chosen: Any, contract: GRPOContract) -> dict[str, Any]:
    return {
        **chosen.provenance(),
        "grpo_contract_fingerprint": contract.cross_rank_fingerprint(),
        "logprob_contract_fingerprint": contract.logprob.cross_rank_fingerprint(),
        "mesh": {
            "dp": contract.dp_world_size,
            "cp": contract.cp_world_size,
            "tp": contract.tp_world_size,
            "cp_layout": contract.logprob.cp_layout,
        },
        "summation_order": contract.summation_order,
    }


__all__ = ["DEFAULT_BACKEND", "GRPOLoss", "GRPOOutput", "SequenceStats"]
