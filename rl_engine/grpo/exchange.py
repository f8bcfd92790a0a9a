"""Cross-rank agreement and the gather of per-token terms into global token order.

Two collectives, both transport only (nothing is added across ranks):

1. :func:`preflight`: every rank of the loss's world group all-gathers a digest of its GRPO
   contract fingerprint and backend id, a flag saying whether its local inputs passed
   validation and its per-sequence active-token counts (integers). A disagreement or a bad
   input on any rank raises on every rank, before any floating-point collective.
2. :func:`gather_global`: every rank all-gathers its local per-token values (selected
   logprob, old logprob, active mask, reference logprob) and its DP shard's rewards, and
   places each rank's rows at their global token indices (``sequence * seq_len + position``).
   The values replicated across TP (and, for rewards, across CP) ranks are checked to be
   byte-identical. The backward of the placement hands each rank the gradient rows of its
   own tokens: no collective, no sum.

The world group's ranks are ordered TP fastest: ``rank = (dp * cp + cp_rank) * tp + tp_rank``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import group_geometry
from rl_engine.grpo.contract import GRPOContract, GRPOContractError
from rl_engine.tensorio import tensor_bytes

DIGEST_BYTES = 32
INPUT_DIGEST_BYTES = 16
COUNTS_AT = DIGEST_BYTES + 1 + INPUT_DIGEST_BYTES


def check_world_group(contract: GRPOContract, group: Any) -> None:
    """The world group must be the contract's dp x cp x tp world with this rank in its place."""
    if contract.world_size > 1 and group is None:
        raise GRPOContractError(
            f"dp*cp*tp={contract.world_size} ranks need the loss's world group; pass "
            "world_group= (e.g. mesh.world_group, ranks ordered TP fastest)"
        )
    size, rank = group_geometry(group)
    if size != contract.world_size:
        raise GRPOContractError(
            f"world group size {size} disagrees with dp_world_size*cp_world_size*tp_world_size="
            f"{contract.dp_world_size}*{contract.cp_world_size}*{contract.tp_world_size}="
            f"{contract.world_size}; build the contract from the mesh that owns the group"
        )
    if rank != contract.rank:
        raise GRPOContractError(
            f"rank {rank} in the world group disagrees with the contract's coordinates "
            f"(dp_rank={contract.dp_rank}, cp_rank={contract.logprob.cp_rank}, "
            f"tp_rank={contract.logprob.tp_rank} -> rank {contract.rank}, TP fastest); build "
            "the contract from the mesh's coordinates"
        )


def preflight_token(contract: GRPOContract, backend_id: str, advantages_given: bool = False) -> bytes:
    """Digest of what every rank must agree on: the GRPO contract, the backend id and whether the
    trainer gives its own advantages (the gather's layout depends on it)."""
    text = f"{contract.cross_rank_fingerprint()}|backend={backend_id}"
    if advantages_given:
        text += "|advantages=given"
    return hashlib.sha256(text.encode("utf-8")).digest()


def inputs_digest(actions: torch.Tensor, active: torch.Tensor, ignore_index: int) -> bytes:
    """16 bytes identifying this rank's actions (on active rows) and mask; TP peers must match.

    The logprob op's own agreement step checks the same thing, but only within a TP group: a
    TP group that raised there would leave the other groups waiting in :func:`gather_global`.
    Checked here, in the world group's preflight, every rank raises together.
    """
    digest = hashlib.sha256(tensor_bytes(actions.masked_fill(~active, ignore_index)))
    digest.update(tensor_bytes(active))
    return digest.digest()[:INPUT_DIGEST_BYTES]


def local_active_counts(contract: GRPOContract, active: torch.Tensor) -> torch.Tensor:
    """Active tokens of each local sequence on this rank (its CP positions only), int64."""
    return active.reshape(contract.local_num_sequences, -1).sum(dim=1)


def preflight(
    contract: GRPOContract,
    backend_id: str,
    group: Any,
    device: torch.device,
    local_error: str | None,
    active_counts: torch.Tensor | None,
    input_digest: bytes | None = None,
    advantages_given: bool = False,
) -> torch.Tensor:
    """Agree on contract, backend and input validity, or every rank raises.

    One all-gather of an int64 row per rank: the 32 digest bytes, an error flag, the 16 bytes
    of :func:`inputs_digest` (TP peers must hold the same actions and mask) and the
    rank's per-sequence active-token counts (``active_counts``, from
    :func:`local_active_counts`; ignored when ``local_error`` is set). Returns the exact
    integer active-token count of every global sequence, the same on every rank.
    """
    check_world_group(contract, group)
    if local_error is None and active_counts is None:
        raise GRPOContractError("internal: preflight needs the active counts of valid inputs")
    slot = max(end - start for start, end in contract.dp_sequence_bounds or ())
    mine = torch.zeros(COUNTS_AT + slot, dtype=torch.int64, device=device)
    mine[:DIGEST_BYTES] = torch.tensor(
        list(preflight_token(contract, backend_id, advantages_given)), dtype=torch.int64, device=device
    )
    mine[DIGEST_BYTES] = 0 if local_error is None else 1
    if local_error is None and input_digest is not None:
        mine[DIGEST_BYTES + 1 : COUNTS_AT] = torch.tensor(
            list(input_digest), dtype=torch.int64, device=device
        )
    if local_error is None and active_counts is not None:
        mine[COUNTS_AT : COUNTS_AT + active_counts.numel()] = active_counts
    if contract.world_size == 1:
        if local_error is not None:
            raise GRPOContractError(local_error)
        rows = [mine]
    else:
        rows = [torch.empty_like(mine) for _ in range(contract.world_size)]
        dist.all_gather(rows, mine, group=group)
    digests = [bytes(row[:DIGEST_BYTES].cpu().tolist()).hex()[:16] for row in rows]
    if len(set(digests)) != 1:
        raise GRPOContractError(
            "GRPO preflight mismatch: the contract fingerprint or backend id differs between "
            f"ranks (per rank: {digests}; this rank {contract.rank} has beta={contract.beta}, "
            f"clip_eps_low={contract.clip_eps_low}, clip_eps_high={contract.clip_eps_high}, "
            f"num_vocab_tiles={contract.logprob.num_vocab_tiles}, backend={backend_id}, advantages="
            f"{'given' if advantages_given else contract.advantage_mode}); build every rank's contract "
            "from the same config, and give advantages= on every rank or on none"
        )
    if local_error is not None:
        raise GRPOContractError(f"rank {contract.rank}: {local_error}")
    bad = [rank for rank, row in enumerate(rows) if int(row[DIGEST_BYTES])]
    if bad:
        raise GRPOContractError(
            f"ranks {bad} rejected their local inputs (their errors say why); every rank "
            "stops before any numerical collective"
        )
    differ = [
        rank for rank, row in enumerate(rows)
        if not torch.equal(
            row[DIGEST_BYTES + 1 : COUNTS_AT],
            rows[_source_rank(contract, rank, False)][DIGEST_BYTES + 1 : COUNTS_AT],
        )
    ]
    if differ:
        where = ", ".join(
            "rank {} (dp={}, cp={}, tp={})".format(r, *contract.coords(r)) for r in differ
        )
        raise GRPOContractError(
            f"{where} hold actions (on active tokens) or an active mask that differ from their "
            "TP group's rank 0; give every TP rank of a CP rank the same actions and mask. "
            "Every rank stops before any numerical collective"
        )
    counts = torch.zeros(contract.num_sequences, dtype=torch.int64, device=device)
    assert contract.dp_sequence_bounds is not None
    for rank, row in enumerate(rows):
        dp_rank, _, tp_rank = contract.coords(rank)
        if tp_rank == 0:  # each CP rank adds the counts of its positions (exact integers)
            start, end = contract.dp_sequence_bounds[dp_rank]
            counts[start:end] += row[COUNTS_AT : COUNTS_AT + end - start]
    return counts


@dataclass(frozen=True)
class GlobalBatch:
    """The batch in global order: ``[num_sequences, seq_len]`` token tensors, ``[num_sequences]`` rewards."""

    logp: torch.Tensor  # differentiable: its gradient flows back to this rank's rows
    old_logp: torch.Tensor
    active: torch.Tensor
    ref_logp: torch.Tensor | None
    rewards: torch.Tensor
    advantages: torch.Tensor | None = None  # the trainer's own, where it gave them


def _pack(columns: list[torch.Tensor], per_sequence: torch.Tensor) -> torch.Tensor:
    tokens = torch.stack(columns, dim=1).reshape(-1)
    return torch.cat([tokens, per_sequence.reshape(-1)])


def _source_rank(contract: GRPOContract, rank: int, replicated_over_cp: bool) -> int:
    dp_rank, cp_rank, _ = contract.coords(rank)
    return contract.rank_of(dp_rank, 0 if replicated_over_cp else cp_rank, 0)


def _check_replicas(
    pieces: list[torch.Tensor], contract: GRPOContract, num_columns: int, per_sequence: int
) -> None:
    """Values every TP rank (and, for rewards and given advantages, every CP rank) of a DP shard
    shares must match."""
    for rank, piece in enumerate(pieces):
        dp_rank, cp_rank, tp_rank = contract.coords(rank)
        tokens = len(contract.rank_token_indices(rank)) * num_columns
        if tp_rank:
            src = pieces[_source_rank(contract, rank, False)]
            if tensor_bytes(piece[:tokens]) != tensor_bytes(src[:tokens]):
                raise GRPOContractError(
                    f"rank {rank} (dp={dp_rank}, cp={cp_rank}, tp={tp_rank}) holds per-token "
                    "values (selected logprob, old logprob, mask or reference logprob) that "
                    "differ from its TP group's rank 0; give every TP rank the same old "
                    "logprobs, actions, mask and reference logits"
                )
        if tp_rank or cp_rank:
            src = pieces[_source_rank(contract, rank, True)]
            src_tokens = len(contract.rank_token_indices(_source_rank(contract, rank, True)))
            mine = piece[tokens : tokens + per_sequence * _local_sequences(contract, dp_rank)]
            theirs = src[src_tokens * num_columns : src_tokens * num_columns + mine.numel()]
            if tensor_bytes(mine) != tensor_bytes(theirs):
                raise GRPOContractError(
                    f"rank {rank} (dp={dp_rank}, cp={cp_rank}, tp={tp_rank}) holds rewards (or "
                    "advantages) that differ from those of its DP shard's first rank; give every "
                    "TP and CP rank of a DP shard the same rewards and advantages"
                )


def _local_sequences(contract: GRPOContract, dp_rank: int) -> int:
    assert contract.dp_sequence_bounds is not None
    start, end = contract.dp_sequence_bounds[dp_rank]
    return end - start


def _gather_pieces(
    packed: torch.Tensor, contract: GRPOContract, group: Any, num_columns: int, per_sequence: int
) -> list[torch.Tensor]:
    if contract.world_size == 1:
        return [packed]
    lengths = [
        len(contract.rank_token_indices(r)) * num_columns
        + per_sequence * _local_sequences(contract, contract.coords(r)[0])
        for r in range(contract.world_size)
    ]
    slot = max(lengths)
    buf = torch.zeros(slot, dtype=torch.float32, device=packed.device)
    buf[: packed.numel()] = packed
    out = [torch.empty_like(buf) for _ in range(contract.world_size)]
    dist.all_gather(out, buf, group=group)
    return [full[:n] for full, n in zip(out, lengths)]


def _assemble(
    pieces: list[torch.Tensor], contract: GRPOContract, num_columns: int, per_sequence: int
) -> tuple[torch.Tensor, torch.Tensor]:
    device = pieces[0].device
    tokens = torch.empty(
        contract.global_num_tokens, num_columns, dtype=torch.float32, device=device
    )
    rewards = torch.empty(per_sequence, contract.num_sequences, dtype=torch.float32, device=device)
    filled = torch.zeros(contract.global_num_tokens, dtype=torch.bool, device=device)
    assert contract.dp_sequence_bounds is not None
    for rank, piece in enumerate(pieces):
        dp_rank, cp_rank, tp_rank = contract.coords(rank)
        if tp_rank:
            continue
        index = torch.tensor(contract.rank_token_indices(rank), dtype=torch.int64, device=device)
        rows = index.numel()
        tokens[index] = piece[: rows * num_columns].reshape(rows, num_columns)
        filled[index] = True
        if cp_rank == 0:
            start, end = contract.dp_sequence_bounds[dp_rank]
            values = piece[rows * num_columns : rows * num_columns + per_sequence * (end - start)]
            rewards[:, start:end] = values.reshape(per_sequence, end - start)
    if not bool(filled.all()):  # pragma: no cover - guarded by the contract's layout checks
        raise GRPOContractError("internal: the ranks' token indices do not cover the batch")
    return tokens, rewards


class _GatherGlobalBatch(torch.autograd.Function):
    """The loss's per-token columns (logp with its autograd link, the other columns, the rewards) from
    every rank of the group, in global order: what :func:`gather_global` returns as a GlobalBatch."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        local_logp: torch.Tensor,
        local_rest: torch.Tensor,
        local_rewards: torch.Tensor,
        contract: GRPOContract,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        columns = [local_logp.detach()] + list(local_rest.unbind(1))
        num_columns = len(columns)
        per_sequence = local_rewards.shape[0]  # rewards, and the trainer's advantages where given
        packed = _pack(columns, local_rewards)
        pieces = _gather_pieces(packed, contract, group, num_columns, per_sequence)
        _check_replicas(pieces, contract, num_columns, per_sequence)
        tokens, rewards = _assemble(pieces, contract, num_columns, per_sequence)
        shape = (contract.num_sequences, contract.seq_len)
        logp = tokens[:, 0].reshape(shape).contiguous()
        rest = tokens[:, 1:].reshape(*shape, num_columns - 1).contiguous()
        ctx.index = torch.tensor(
            contract.global_token_indices, dtype=torch.int64, device=local_logp.device
        )
        ctx.mark_non_differentiable(rest, rewards)
        return logp, rest, rewards

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor, _grad_rest: Any, _grad_rewards: Any
    ) -> tuple[Any, ...]:
        return grad_logp.reshape(-1)[ctx.index], None, None, None, None


def gather_global(
    local_logp: torch.Tensor,
    local_old_logp: torch.Tensor,
    local_active: torch.Tensor,
    local_ref_logp: torch.Tensor | None,
    local_rewards: torch.Tensor,
    contract: GRPOContract,
    group: Any,
    local_advantages: torch.Tensor | None = None,
) -> GlobalBatch:
    """All ranks' token values placed in global order; ``logp`` keeps the autograd link. The
    rewards (and the trainer's advantages, where given) travel per sequence in the same gather."""
    zeros = torch.zeros_like(local_old_logp)
    rest = [
        torch.where(local_active, local_old_logp, zeros),
        local_active.to(torch.float32),
    ]
    if local_ref_logp is not None:
        rest.append(torch.where(local_active, local_ref_logp.detach(), zeros))
    per_sequence = [local_rewards.detach()]
    if local_advantages is not None:
        per_sequence.append(local_advantages.detach())
    logp, rest_global, rewards = _GatherGlobalBatch.apply(
        local_logp, torch.stack(rest, dim=1), torch.stack(per_sequence), contract, group
    )
    return GlobalBatch(
        logp=logp,
        old_logp=rest_global[..., 0],
        active=rest_global[..., 1] != 0,
        ref_logp=rest_global[..., 2] if local_ref_logp is not None else None,
        rewards=rewards[0],
        advantages=rewards[1] if local_advantages is not None else None,
    )


__all__ = [
    "GlobalBatch",
    "check_world_group",
    "gather_global",
    "inputs_digest",
    "local_active_counts",
    "preflight",
    "preflight_token",
]
