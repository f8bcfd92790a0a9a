"""Backend ``pytorch-vocab-parallel-logp-ws2``: deterministic vocab-parallel selected logprob.

Forward, per TP rank, in bounded row chunks (nothing of size ``tokens x vocab`` in FP32):
upcast, tile max, in-place exp and fixed-fold sum give FP32 ``(max, sum exp)`` per owned
tile. One all-gather moves every rank's partials and target logits (transport only);
every rank merges the ``[tokens, num_tiles]`` partials in global tile order. The target
logit is copied from the rank that owns its column. Backward recomputes the softmax from
the stored low-precision logits, chunk by chunk, and writes only the local gradient.
Both chunk loops reuse one FP32 workspace per worker and share the chunks out between
``torch.get_num_threads()`` single-threaded workers (:mod:`rl_engine.logprob.backends.eager.chunk_threads`):
one join per loop instead of one parallel region per operation and chunk.

TP decides who computes which tile, never how numbers are grouped, so the bytes of the
logprob, the LSE, the entropy and the gradient do not depend on the TP degree, the chunk
size, the number of rows or the thread count.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.arith.portable import (
    ArithmeticEnvironmentError,
    canonical_nan_,
    require_gradual_underflow,
    rounded,
)
from rl_engine.arith.portable import exp as portable_exp
from rl_engine.arith.portable import log as portable_log
from rl_engine.arith.tiles import (
    NEG_INF,
    ChunkWorkspace,
    GradWorkspace,
    chunk_rows_for_device,
    merge_tiles,
    rows_finite,
    temperature_divisor,
)
from rl_engine.distributed.mesh import group_geometry
from rl_engine.logprob.agreement import UNKNOWN, CallRecord, agree, record_device, tensor_digest
from rl_engine.logprob.backends.eager.chunk_threads import for_each_chunk
from rl_engine.logprob.contract import RANK_LOCAL_FIELDS, LogprobContract, LogprobContractError
from rl_engine.logprob.processed import KeptCut, Sampling, kept_cut
from rl_engine.logprob.row_temperature import row_temperature32
from rl_engine.logprob.storage import require_readable
from rl_engine.tables import EAGER_BACKEND

BACKEND_ID = EAGER_BACKEND


@dataclass(frozen=True)
class LogprobOutput:
    """FP32 results for the local tokens: selected logprob (0 on inactive rows), LSE, entropy.

    ``provenance`` is the backend choice when the call went through a dispatch
    (:func:`rl_engine.logprob.api.selected_logprob`): requested and actual backend, the reason,
    the mode, every rejection; ``None`` when an op was called directly.

    ``target_kept`` (processed logprobs, ``docs/arithmetic.md`` section 13): per token, whether
    the target is in the kept set (False only on an active row whose target the sampler's
    top-k / top-p / min-p removed: its logp is ``-inf``); ``None`` for a call without sampling
    parameters, where every target is kept.
    """

    selected_logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor | None
    provenance: dict[str, Any] | None = None
    target_kept: torch.Tensor | None = None


def check_group(contract: LogprobContract, group: Any) -> None:
    """The TP group must match the contract's size and rank (a local check, raises here)."""
    if contract.tp_world_size > 1 and group is None:
        raise LogprobContractError(
            f"tp_world_size={contract.tp_world_size} needs a TP process group; pass the "
            "mesh's TP group as group="
        )
    size, rank = group_geometry(group)
    if size != contract.tp_world_size:
        raise LogprobContractError(
            f"TP group size {size} disagrees with tp_world_size={contract.tp_world_size}; "
            "build the contract from the mesh that owns the group"
        )
    if rank != contract.tp_rank:
        raise LogprobContractError(
            f"rank {rank} in the TP group disagrees with tp_rank={contract.tp_rank}; "
            "build the contract from the mesh that owns the group"
        )


CONTRACT_FIELDS: tuple[str, ...] = tuple(
    sorted({k for k in LogprobContract(1, 1, 1, 1, 1).to_dict() if k not in RANK_LOCAL_FIELDS} | {"temperature"})
)
CALL = "selected_logprob"
AGREEMENT_HINTS: dict[str, str] = {
    "contract.": "Build every rank's contract from the same config and the mesh "
    "(LogprobContract.from_mesh).",
    "cp_rank": "The ranks of one TP group hold the same tokens, so they share cp_rank: pass "
    "the mesh's TP group and build the contract from the mesh.",
    "backend": "Dispatch the same backend id on every rank.",
    "compute_entropy": "Pass the same compute_entropy on every rank.",
    "validate": "Pass the same validate on every rank.",
    "on_invalid": "Pass the same on_invalid on every rank.",
    "sampling": "Pass the same top_k, top_p and min_p (per row) on every TP rank.",
    "targets": "Every TP rank of a CP rank must get the same targets on its active rows "
    "(inactive rows are ignored): take them from the same batch.",
    "active": "Every TP rank of a CP rank must get the same active mask: take it from the "
    "same batch.",
    "row_temperature": "Every TP rank of a CP rank must get the same per-row temperatures (or none): "
    "take them from the same batch.",
}


# What a validated call does with an active row whose real columns hold a non-finite logit (or
# whose target is outside the real vocabulary): raise (the op's default), or give that row a NaN
# logp on every TP rank, with no host sync, for a caller that agrees on validity in a wider group
# after its own exchange (the GRPO loss: every rank sees the NaN after its global gather).
ON_INVALID: tuple[str, ...] = ("raise", "nan")


def check_on_invalid(value: Any) -> None:
    if not isinstance(value, str) or value not in ON_INVALID:
        raise LogprobContractError(
            f"on_invalid={value!r} must be one of {list(ON_INVALID)}: 'raise' (the default) refuses an "
            "active row with a non-finite real logit; 'nan' gives it a NaN logp for the caller to refuse"
        )


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise LogprobContractError(
            f"{name}={value!r} must be True or False (got {type(value).__name__})"
        )


def check_chunk_rows(chunk_rows: Any) -> None:
    """``chunk_rows`` is ``None`` (the cache-sized default) or a positive integer."""
    if chunk_rows is None:
        return
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral):
        raise LogprobContractError(
            f"chunk_rows={chunk_rows!r} must be a positive integer or None (got "
            f"{type(chunk_rows).__name__}); it sets how many rows are computed at a time and "
            "never changes a byte: pass e.g. chunk_rows=16, or None for the default"
        )
    if chunk_rows < 1:
        raise LogprobContractError(f"chunk_rows={chunk_rows} must be >= 1 (or None)")


def call_record(
    contract: Any,
    backend_id: str,
    targets: Any,
    active: Any,
    compute_entropy: Any,
    validate: Any,
    verdict: str | None,
    on_invalid: Any = "raise",
    row_t32: Any = None,
    sampling: Sampling | None = None,
) -> CallRecord:
    """This rank's agreement record: its verdict and every per-call field TP peers share.

    Targets are digested with inactive rows replaced by ``ignore_index`` (the op never reads
    them, so peers may hold different garbage there). Fields a rank could not compute
    (its verdict says why) are ``?``.
    """
    fields: list[tuple[str, str]] = [("backend", str(backend_id))]
    if isinstance(contract, LogprobContract):
        shared = contract.to_dict()
        fields += [
            (f"contract.{k}", json.dumps(shared.get(k, 1.0) if k == "temperature" else shared[k],
                                         separators=(",", ":")))
            for k in CONTRACT_FIELDS
        ]
        fields.append(("cp_rank", str(contract.cp_rank)))
    else:
        fields += [(f"contract.{k}", UNKNOWN) for k in CONTRACT_FIELDS]
        fields.append(("cp_rank", UNKNOWN))
    for name, flag in (("compute_entropy", compute_entropy), ("validate", validate)):
        fields.append((name, json.dumps(flag) if isinstance(flag, bool) else UNKNOWN))
    fields.append(("on_invalid", on_invalid if on_invalid in ON_INVALID else UNKNOWN))
    if verdict is None:
        effective = targets.masked_fill(~active, contract.ignore_index)
        fields += [("targets", tensor_digest(effective)), ("active", tensor_digest(active)),
                   ("row_temperature", "none" if row_t32 is None else tensor_digest(row_t32))]
        if sampling is not None:
            fields.append(("sampling", sampling.digest()))
    else:
        fields += [("targets", UNKNOWN), ("active", UNKNOWN), ("row_temperature", UNKNOWN)]
        if sampling is not None:
            fields.append(("sampling", UNKNOWN))
    return CallRecord(CALL, verdict, tuple(fields))


def real_local_columns(contract: LogprobContract) -> int:
    """Number of real (non-padding) columns in this rank's shard: local columns ``[0, n)``."""
    return max(0, min(contract.local_vocab_size, contract.real_vocab_size - contract.vocab_start))


def real_rows_finite(logits: torch.Tensor, contract: LogprobContract) -> torch.Tensor:
    """Per local row, whether every real column of this rank's shard is finite (bool ``[rows]``).

    The stand-alone form of the check the forward fuses into its chunk loop with
    ``validate=True``, for a caller that must know before any collective (the tests' oracle). It
    is a second read of the logits: a caller that can refuse after its own exchange passes
    ``on_invalid="nan"`` to the op instead (the GRPO loss). One min/max reduction over the real
    columns (both propagate NaN), nothing of the logits' size allocated; padding columns never count.
    """
    real = real_local_columns(contract)
    if real == 0:
        return torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    low, high = torch.aminmax(logits.detach()[:, :real], dim=1)
    return torch.isfinite(low) & torch.isfinite(high)


def _local_partials(
    logits: torch.Tensor,
    contract: LogprobContract,
    chunk_rows: int,
    with_entropy: bool,
    validate: bool,
    row_t32: torch.Tensor | None = None,
    keep: KeptCut | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Tile partials of the local shard, one cache-sized chunk of rows at a time.

    One workspace serves every chunk (no allocation in the loop, no host sync). With
    ``validate`` the per-row "all real columns finite" flag comes from the tile maxima
    and one extra min pass on the chunk while it is in cache; otherwise it is ``None``.
    ``row_t32``: each row's ``T32`` (a temperature per row) in place of the contract's.
    """
    rows = logits.shape[0]
    width = contract.tile_width
    real_local = real_local_columns(contract)
    tiles = contract.local_tile_count
    m = torch.empty(rows, tiles, dtype=torch.float32, device=logits.device)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else None
    row_min = torch.empty(rows, dtype=torch.float32, device=logits.device) if validate else None

    def workspace() -> ChunkWorkspace:
        require_gradual_underflow(logits.device)  # per worker thread
        return ChunkWorkspace(
            min(chunk_rows, rows), contract.local_grid_width, width, real_local, with_entropy,
            logits.device, contract.temperature32, contract.vocab_start if keep is not None else None,
            stored=contract.local_vocab_size,
        )

    def work(ws: ChunkWorkspace, start: int, stop: int) -> None:
        ws.partials(
            logits[start:stop],
            m[start:stop],
            s[start:stop],
            t[start:stop] if t is not None else None,
            row_min[start:stop] if row_min is not None else None,
            row_t32[start:stop] if row_t32 is not None else None,
            keep.rows_slice(start, stop) if keep is not None else None,
        )

    for_each_chunk(rows, chunk_rows, workspace, work, threaded=logits.device.type == "cpu")
    finite = None
    if row_min is not None and keep is not None:  # row_min is NaN where the real max is not finite
        finite = torch.isfinite(row_min) if real_local > 0 else torch.ones(rows, dtype=torch.bool, device=logits.device)
    elif row_min is not None:
        finite = rows_finite(m, row_min, width, real_local)
    return m, s, t, finite


def _local_target_logit(
    logits: torch.Tensor, targets: torch.Tensor, contract: LogprobContract, row_t32: torch.Tensor | None = None
) -> torch.Tensor:
    local = targets - contract.vocab_start
    owned = (local >= 0) & (local < contract.local_vocab_size)
    index = torch.where(owned, local, torch.zeros_like(local)).unsqueeze(1)
    value = logits.gather(1, index).squeeze(1).float()
    divisor = temperature_divisor(contract.temperature32, value.device) if row_t32 is None else row_t32
    if divisor is not None:
        value = value / divisor  # section 6 step 0, as every engine scales its tiles
    return torch.where(owned, value, torch.zeros_like(value))


def _owner_rank(targets: torch.Tensor, contract: LogprobContract) -> torch.Tensor:
    """The TP rank whose shard holds each target (out-of-range targets clamped to the first or
    last): the number of shard ends at or below the target. Compared with the ends as Python
    integers, so no tensor is built from host data per call (on CUDA a ``torch.tensor(...,
    device=...)`` copy from pageable memory waits for the stream: a hidden host sync)."""
    assert contract.vocab_shard_bounds is not None
    clamped = targets.clamp(0, contract.padded_vocab_size - 1)
    owner = torch.zeros_like(clamped)
    for _, end in contract.vocab_shard_bounds[:-1]:  # the last end is above every clamped target
        owner += clamped >= end
    return owner


def _exchange(
    tile_pieces: list[torch.Tensor],
    target_value: torch.Tensor,
    contract: LogprobContract,
    group: Any,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One all-gather of every rank's ``[rows, own_tiles]`` partials and target logits.

    Returns each partial over all ``num_tiles`` in global tile order, and the target logit
    column of every TP rank (``[rows, tp]``). Transport only: nothing is added.
    """
    if contract.tp_world_size == 1:
        return tile_pieces, target_value.unsqueeze(1)
    assert contract.vocab_shard_bounds is not None
    width = contract.tile_width
    tiles_per_rank = [-(-end // width) - start // width for start, end in contract.vocab_shard_bounds]
    slot = max(tiles_per_rank)
    rows = target_value.shape[0]
    buf = torch.zeros(rows, slot * len(tile_pieces) + 1, dtype=torch.float32, device=target_value.device)
    for i, piece in enumerate(tile_pieces):
        buf[:, i * slot : i * slot + piece.shape[1]] = piece
    buf[:, -1] = target_value
    out = [torch.empty_like(buf) for _ in range(contract.tp_world_size)]
    dist.all_gather(out, buf, group=group)
    merged = [
        torch.cat([full[:, i * slot : i * slot + n] for full, n in zip(out, tiles_per_rank)], dim=1)
        for i in range(len(tile_pieces))
    ]
    return merged, torch.stack([full[:, -1] for full in out], dim=1)


def processed_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    contract: LogprobContract,
    group: Any,
    chunk_rows: int,
    with_entropy: bool,
    validate: bool,
    engine: "LocalEngine | None" = None,
    on_invalid: str = "raise",
    keep: KeptCut | None = None,
    row_t32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Forward without autograd: ``(selected_logp, lse, entropy, target_kept)`` in FP32 for the local
    rows, on the kept set ``keep`` (``docs/arithmetic.md`` section 13; ``None``: every column, the raw
    forward, and ``target_kept`` is ``None``).

    ``engine`` computes the local tile partials (default: the eager chunk loop); the exchange, the
    merge and everything after are the same for every engine. With ``validate`` and
    ``on_invalid="nan"`` an invalid active row gets logp NaN instead of a refusal (no host sync).
    ``row_t32`` (binary32 ``[rows]``, checked by the caller): each row's ``T32`` in place of the
    contract's temperature (:mod:`rl_engine.logprob.row_temperature`).

    An active row whose target the cut drops gets ``logp = -inf`` (never NaN) and
    ``target_kept`` False; the target logit is the owner's copy, so every rank decides alike.
    """
    engine = engine or EAGER_ENGINE
    if contract.tp_world_size == 1 and row_t32 is None and keep is None:
        whole = engine.single_rank_forward(logits, targets, active, contract, chunk_rows, with_entropy, validate,
                                           on_invalid)
        if whole is not None:
            logp, lse, entropy, flags = whole
            if flags is not None and bool(flags.any()):  # the call's one host sync
                if bool((flags & 2).any()):
                    contract.check_targets(targets, active)  # raises with the row and the value
                _refuse_non_finite(((flags & 1) != 0).unsqueeze(1), contract)
            return logp, lse, entropy, None
    extra: dict[str, Any] = {}
    if row_t32 is not None:
        extra["row_t32"] = row_t32
    if keep is not None:
        extra["keep"] = keep
    m, s, t, finite = engine.local_partials(logits, contract, chunk_rows, with_entropy, validate, **extra)
    target_value = _local_target_logit(logits, targets, contract, row_t32)
    check = validate and contract.num_tokens > 0
    if check:
        # A non-finite logit lives on one TP rank only. Its row's target-logit slot is sent
        # as NaN (an active row's slot is otherwise finite), so after the one exchange every
        # rank of the group raises; raising here alone would leave the peers blocked in it.
        assert finite is not None
        target_value.masked_fill_(active & ~finite, float("nan"))  # a fresh tensor
    pieces = [m, s] + ([t] if t is not None else [])
    merged, targets_by_rank = _exchange(pieces, target_value, contract, group)
    poisoned = None
    if check and on_invalid == "nan":
        out_of_range = active & ((targets < 0) | (targets >= contract.real_vocab_size))
        poisoned = (active & torch.isnan(targets_by_rank).any(dim=1)) | out_of_range
    elif check:
        bad = active.unsqueeze(1) & torch.isnan(targets_by_rank)
        if contract.tp_world_size == 1:
            # the targets' range check joins this one (the op's only host sync at TP = 1);
            # the targets are read only through masks and clamps until here
            out_of_range = active & ((targets < 0) | (targets >= contract.real_vocab_size))
            flagged = bool((bad.squeeze(1) | out_of_range).any())
            if flagged:
                contract.check_targets(targets, active)  # raises with the row and the value
        else:
            flagged = bool(bad.any())
        if flagged:
            _refuse_non_finite(bad, contract)
    m_all, s_all = merged[0], merged[1]
    t_all = merged[2] if t is not None else None
    if contract.tp_world_size == 1:
        target_logit = target_value  # this rank owns every column
    else:
        owner = _owner_rank(targets, contract).unsqueeze(1)
        target_logit = targets_by_rank.gather(1, owner).squeeze(1)
    if keep is None:
        logp, lse, entropy = engine.merge(m_all, s_all, t_all, target_logit, active, poisoned)
        return logp, lse, entropy, None
    lse, entropy = merge_tiles(m_all, s_all, t_all, engine.exp, engine.log)
    logp = (target_logit - lse).masked_fill_(~active, 0.0)
    target_kept = None
    if keep is not None:
        target_kept = ~(active & keep.dropped(target_logit.unsqueeze(1), targets.unsqueeze(1)).squeeze(1))
        logp.masked_fill_(~target_kept, float("-inf"))
    if poisoned is not None:
        logp.masked_fill_(poisoned, float("nan"))  # canonical below
    for out in (logp, lse, entropy):
        if out is not None:
            canonical_nan_(out)
    return logp, lse, entropy, target_kept


def _refuse_non_finite(bad: torch.Tensor, contract: LogprobContract) -> None:
    """Raise for the first active row with a non-finite real logit (``bad``: ``[rows, tp]``, which
    TP ranks saw one), naming the row, its global token and the ranks."""
    row = int(bad.any(dim=1).nonzero()[0, 0])
    ranks = bad[row].nonzero().squeeze(1).tolist()
    where = f"tp_rank={ranks[0]}" if len(ranks) == 1 else f"tp_ranks={ranks}"
    raise LogprobContractError(
        f"logits row {row} (global token {contract.token_indices[row]}) is active and "
        f"holds a non-finite value in its real columns on {where}; "
        "fix the producer or mark the row inactive"
    )



@dataclass(frozen=True)
class BackwardTerms:
    """Per-row terms of the backward (``docs/arithmetic.md`` section 7), shared by every engine.

    ``coef = g_lse - gl``; ``target_col`` is the local target column of rows that own an
    active target (``0`` elsewhere) and ``target_add`` is ``gl`` there, ``-0.0`` elsewhere
    (adding ``-0.0`` is the identity for every FP32 value).
    """

    coef: torch.Tensor
    target_col: torch.Tensor
    target_add: torch.Tensor
    real_local: int
    t32: float = 1.0  # the temperature's T32 (section 6 step 0; section 7 step 2)
    # the entropy gradient (section 7 step 1): g_ent per row and Mb = LSE - H; None without one
    g_ent: torch.Tensor | None = None
    mb: torch.Tensor | None = None
    # a temperature per row: each row's T32 (binary32 [rows]) in place of t32 (which is then 1)
    row_t32: torch.Tensor | None = None
    # processed logprobs (section 13): the kept set's cut and the global id of local column 0;
    # every column the cut drops gets +0
    keep: KeptCut | None = None
    vocab_start: int = 0

    @property
    def tempered(self) -> bool:
        """Whether section 6 step 0 and section 7 step 2 divide (a temperature, per call or per row)."""
        return self.row_t32 is not None or self.t32 != 1.0

    def zero_rows(self) -> torch.Tensor:
        """Rows the section 7 override writes as +0: coef == 0 and no entropy term."""
        zero = self.coef == 0
        return zero if self.g_ent is None else zero & (self.g_ent == 0)


def backward_terms(
    logits: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    contract: LogprobContract,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    row_t32: torch.Tensor | None = None,
    keep: KeptCut | None = None,
    target_kept: torch.Tensor | None = None,
) -> BackwardTerms:
    local_vocab = logits.shape[1]
    zeros = torch.zeros_like(lse)
    if target_kept is not None:
        active = active & target_kept  # a dropped target's logp is the constant -inf: gl = 0
    g_logp = torch.where(active, grad_logp, zeros) if grad_logp is not None else zeros
    g_lse = grad_lse if grad_lse is not None else zeros
    coef = g_lse - g_logp
    local_target = targets - contract.vocab_start
    owned = active & (local_target >= 0) & (local_target < local_vocab)
    target_col = torch.where(owned, local_target, torch.zeros_like(local_target))
    target_add = torch.where(owned, g_logp, torch.full_like(g_logp, -0.0))
    g_ent = mb = None
    if grad_entropy is not None:
        if entropy is None or entropy.shape != lse.shape:
            raise LogprobContractError("an entropy gradient needs the forward's entropy: call with compute_entropy=True")
        g_ent = grad_entropy.float().contiguous()
        mb = (lse - entropy).contiguous()  # Mb = LSE - H, one binary32 subtraction (section 7)
    return BackwardTerms(coef, target_col, target_add, real_local_columns(contract), contract.temperature32,
                         g_ent, mb, row_t32, keep, contract.vocab_start)


def _eager_backward(
    logits: torch.Tensor, lse: torch.Tensor, terms: BackwardTerms, chunk_rows: int
) -> torch.Tensor:
    rows, local_vocab = logits.shape
    coef, target_col, target_add = terms.coef, terms.target_col, terms.target_add
    grad = torch.empty_like(logits)

    def work(ws: GradWorkspace, start: int, stop: int) -> None:
        ws.softmax_times(
            logits[start:stop],
            lse[start:stop],
            coef[start:stop],
            target_col[start:stop],
            target_add[start:stop],
            grad[start:stop],
            None if terms.g_ent is None else terms.g_ent[start:stop],
            None if terms.mb is None else terms.mb[start:stop],
            None if terms.row_t32 is None else terms.row_t32[start:stop],
            None if terms.keep is None else terms.keep.rows_slice(start, stop),
        )

    def workspace() -> GradWorkspace:
        require_gradual_underflow(logits.device)  # per worker thread
        return GradWorkspace(min(chunk_rows, rows), local_vocab, logits.device, terms.t32,
                             terms.vocab_start if terms.keep is not None else None)

    for_each_chunk(
        rows,
        chunk_rows,
        workspace,
        work,
        threaded=logits.device.type == "cpu",
    )
    zero_rows = terms.zero_rows().nonzero().squeeze(1)  # one host sync per backward call
    if zero_rows.numel():
        grad.index_fill_(0, zero_rows, 0.0)
        at_target = target_add[zero_rows] + 0.0  # +0.0 + g
        divisor = (temperature_divisor(terms.t32, at_target.device) if terms.row_t32 is None
                   else terms.row_t32[zero_rows])
        if divisor is not None:
            at_target = at_target / divisor  # (+0 + gl) / T32
        at_target = rounded(canonical_nan_(at_target), grad.dtype)
        grad[zero_rows, target_col[zero_rows]] = at_target
    if terms.real_local < local_vocab:
        grad[:, terms.real_local:] = 0.0
    return grad


def check_sampling(sampling: Any, contract: LogprobContract, device: torch.device, backend_id: str,
                   engine: "LocalEngine") -> None:
    """``sampling`` is ``None`` or a :class:`Sampling` of the local rows on the logits' device, and
    the backend's engine computes processed logprobs (a local check, before any collective)."""
    if sampling is None:
        return
    if not isinstance(sampling, Sampling):
        raise LogprobContractError(
            f"sampling={sampling!r} must be a Sampling (rl_engine.logprob.processed.sampling_from) or None")
    if sampling.rows != contract.num_tokens:
        raise LogprobContractError(
            f"sampling has {sampling.rows} rows but the call has num_tokens={contract.num_tokens}: give one "
            "top_k / top_p / min_p per local row")
    if sampling.top_k.device != device:
        raise LogprobContractError(
            f"sampling is on {sampling.top_k.device}, the logits on {device}: move it to the logits' device")
    if not engine.supports_processed:
        raise LogprobContractError(
            f"backend {backend_id!r} does not compute processed logprobs (top_k / top_p / min_p) yet; "
            "nothing falls back: request backend='pytorch-vocab-parallel-logp-ws2' or turn the parameters off")


class _FirstOrderOnly(torch.autograd.Function):
    """Carries the op's gradient under ``create_graph=True``; differentiating it raises.

    The op's backward is hand-written and has no derivative of its own. Under
    ``create_graph=True`` its gradient is attached to this node (whose input is the logits),
    so a term built on it (a gradient penalty) raises when differentiated, instead of
    silently contributing nothing.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, holder: list[torch.Tensor]
    ) -> torch.Tensor:
        return holder.pop()  # the gradient, computed outside; ``logits`` only links the graph

    @staticmethod
    def backward(ctx: Any, _grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        raise LogprobContractError(
            "create_graph=True: the selected-logprob op is differentiable once; its gradient "
            "has no derivative (double backward, e.g. a gradient penalty through the logits "
            "of this op, is not supported). Build the penalty on a detached gradient, or on "
            "a path that does not go through this op"
        )


class LocalEngine:
    """The per-rank compute of a backend: local tile partials and the local gradient.

    Everything else (validation, exchange, merge, autograd) is shared. The eager engine
    runs PyTorch elementwise ops in cache-sized row chunks; a compiled engine
    (:mod:`rl_engine.logprob.backends.fused_cpu.fused_cpu`) must give the same bytes.

    Processed logprobs (section 13, :mod:`rl_engine.logprob.processed`): an engine with
    ``supports_processed`` gets the kept set as a :class:`~rl_engine.logprob.processed.KeptCut`
    in ``local_partials(..., keep=)`` and in ``BackwardTerms.keep`` (drop after step 0; ``+0``
    gradient on dropped columns), and finds it with :meth:`kept_cut`. An engine without it is
    never given one: the op refuses the call naming the backend.
    """

    supports_processed: bool = True

    def local_partials(
        self,
        logits: torch.Tensor,
        contract: LogprobContract,
        chunk_rows: int,
        with_entropy: bool,
        validate: bool,
        row_t32: torch.Tensor | None = None,
        keep: KeptCut | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(m, s, t, finite)``: the tile partials of the local shard (``row_t32``: each row's
        ``T32`` in place of the contract's temperature; ``keep``: the kept set's cut, section 13)."""
        return _local_partials(logits, contract, chunk_rows, with_entropy, validate, row_t32, keep)

    def kept_cut(
        self, logits: torch.Tensor, contract: LogprobContract, sampling: Sampling, group: Any, chunk_rows: int,
        row_t32: torch.Tensor | None = None,
    ) -> KeptCut:
        """The kept set's cut of every local row; runs collectives on ``group`` (every TP rank calls
        it in the same order). The eager search of :func:`rl_engine.logprob.processed.kept_cut`."""
        return kept_cut(logits, contract, sampling, group, chunk_rows, row_t32)

    def local_backward(
        self, logits: torch.Tensor, lse: torch.Tensor, terms: BackwardTerms, chunk_rows: int
    ) -> torch.Tensor:
        return _eager_backward(logits, lse, terms, chunk_rows)

    def backward_terms(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        active: torch.Tensor,
        lse: torch.Tensor,
        grad_logp: torch.Tensor | None,
        grad_lse: torch.Tensor | None,
        contract: LogprobContract,
        grad_entropy: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> BackwardTerms:
        """The backward's per-row terms (:func:`backward_terms`; a compiled engine may compute
        them in one launch)."""
        return backward_terms(logits, targets, active, lse, grad_logp, grad_lse, contract, grad_entropy, entropy)

    def single_rank_forward(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        active: torch.Tensor,
        contract: LogprobContract,
        chunk_rows: int,
        with_entropy: bool,
        validate: bool,
        on_invalid: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """The whole forward of a rank that holds every column (TP = 1) in the engine's own
        launches: ``(logp, lse, entropy, flags)``, ``flags`` per row (validating with
        ``on_invalid="raise"``: bit 0 an active row with a non-finite real logit, bit 1 an active
        target outside the real vocabulary; else None). ``None``: the engine has no such path and
        the shared steps below compute the forward (the same bytes either way: the shared steps
        are the definition, and an engine's tests compare its bytes with them)."""
        return None

    def merge(
        self,
        m: torch.Tensor,
        s: torch.Tensor,
        t: torch.Tensor | None,
        target_logit: torch.Tensor,
        active: torch.Tensor,
        poisoned: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Section 6 steps 5-10 on the gathered ``[rows, tiles]`` partials: ``(logp, lse, entropy)``
        with ``logp = x_target - LSE`` on active rows (``+0`` elsewhere), NaN on ``poisoned`` rows,
        every NaN canonical. A compiled engine may do it in one launch."""
        lse, entropy = merge_tiles(m, s, t, self.exp, self.log)
        logp = (target_logit - lse).masked_fill_(~active, 0.0)
        if poisoned is not None:
            logp.masked_fill_(poisoned, float("nan"))  # canonical below
        for out in (logp, lse, entropy):
            if out is not None:
                canonical_nan_(out)
        return logp, lse, entropy

    def exp(self, y: torch.Tensor) -> torch.Tensor:
        """``E`` (section 3) of a contiguous binary32 tensor, for the merge of the tile partials."""
        return portable_exp(y)

    def log(self, x: torch.Tensor) -> torch.Tensor:
        """``L`` (section 5) of a binary32 tensor, for the merge's ``L(sum)``."""
        return portable_log(x)


EAGER_ENGINE = LocalEngine()


def vocab_parallel_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    lse: torch.Tensor,
    grad_logp: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    contract: LogprobContract,
    chunk_rows: int,
    engine: LocalEngine | None = None,
    grad_entropy: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    row_t32: torch.Tensor | None = None,
    keep: KeptCut | None = None,
    target_kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Local logits gradient, recomputed chunk by chunk from the stored logits.

    ``d logp / dx = onehot(target) - softmax`` on active rows, ``d lse / dx = softmax``;
    padding columns get exactly zero. Rows with no upstream gradient (inactive rows of a
    logp-only loss) get exactly ``+0.0`` even when their logits are non-finite (``0 * nan``
    would be ``nan``). Each chunk is computed in one reused FP32 buffer and rounded once
    into the gradient; the target column is added in FP32 before rounding, by one
    ``scatter_add_`` per chunk (``-0.0`` on rows that own no target: the identity), so
    the loop has no host sync. Rows without upstream gradient are overwritten after the
    loop with what the FP32 sequence gives them (zeros, and ``0.0 + g`` at the target),
    which costs one index look-up per call instead of a masked pass per chunk.
    ``engine`` replaces the chunk loop (default: the eager one); the terms are shared. ``row_t32``:
    each row's ``T32`` (a temperature per row) in place of the contract's.
    """
    engine = engine or EAGER_ENGINE
    if row_t32 is None and keep is None and target_kept is None:
        terms = engine.backward_terms(logits, targets, active, lse, grad_logp, grad_lse, contract, grad_entropy,
                                      entropy)
    else:  # a temperature per row or a kept set: the shared terms carry them
        terms = backward_terms(logits, targets, active, lse, grad_logp, grad_lse, contract, grad_entropy, entropy,
                               row_t32, keep, target_kept)
    return engine.local_backward(logits, lse, terms, chunk_rows)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        active: torch.Tensor,
        contract: LogprobContract,
        group: Any,
        chunk_rows: int,
        with_entropy: bool,
        validate: bool,
        engine: LocalEngine,
        on_invalid: str,
        row_t32: torch.Tensor | None,
        sampling: Sampling | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        keep = (engine.kept_cut(logits, contract, sampling, group, chunk_rows,
                                **({} if row_t32 is None else {"row_t32": row_t32}))
                if sampling is not None else None)
        logp, lse, entropy, kept = processed_forward(
            logits, targets, active, contract, group, chunk_rows, with_entropy, validate, engine, on_invalid, keep,
            row_t32,
        )
        ctx.contract = contract
        ctx.row_t32 = row_t32  # not an autograd input: the op gives the temperature no gradient
        ctx.chunk_rows = chunk_rows
        ctx.engine = engine
        ctx.set_materialize_grads(False)  # an output the loss does not use gives None, not zeros
        if entropy is None:
            entropy = torch.empty(0, dtype=torch.float32, device=logits.device)
            ctx.mark_non_differentiable(entropy)
        if kept is None:
            kept = torch.empty(0, dtype=torch.bool, device=logits.device)
        ctx.mark_non_differentiable(kept)
        cut = (keep.value, keep.index) if keep is not None else (torch.empty(0), torch.empty(0))
        # the entropy: Mb of section 7; the cut and target_kept: section 13's masked backward
        ctx.save_for_backward(logits, targets, active, lse, entropy, kept, *cut)
        return logp, lse, entropy, kept

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor, grad_lse: torch.Tensor, grad_entropy: torch.Tensor | None,
        _grad_kept: Any = None,
    ) -> tuple[Any, ...]:
        logits, targets, active, lse, entropy, kept, cut_value, cut_index = ctx.saved_tensors
        keep = KeptCut(cut_value, cut_index) if kept.shape == lse.shape else None
        if grad_entropy is not None and entropy.shape != lse.shape:
            grad_entropy = None  # no entropy was computed: it carried no gradient
        # the saved logits' storage may have been freed since the forward (FSDP); no
        # collective follows, so raising here on one rank leaves no peer waiting
        require_readable("saved logits", logits)
        create_graph = torch.is_grad_enabled()  # the engine enables it for create_graph=True
        with torch.no_grad():
            grad = vocab_parallel_backward(
                logits.detach(), targets, active, lse.detach(),
                grad_logp.detach() if grad_logp is not None else None,
                grad_lse.detach() if grad_lse is not None else None,
                ctx.contract, ctx.chunk_rows, ctx.engine,
                grad_entropy.detach() if grad_entropy is not None else None, entropy.detach(),
                ctx.row_t32,
                keep, kept if keep is not None else None,
            )
        if create_graph and logits.requires_grad:
            grad = _FirstOrderOnly.apply(logits, [grad])
        return grad, None, None, None, None, None, None, None, None, None, None, None


class VocabParallelLogprob:
    """The callable op of backend ``pytorch-vocab-parallel-logp-ws2``.

    Every call with a TP group of more than one rank starts with the same collective on every
    rank: the agreement step of :mod:`rl_engine.logprob.agreement` (one all-gather of a
    1 KiB record carrying the rank's verdict on its own inputs and a digest of the contract,
    the backend, the flags, the targets and the mask). Local checks never raise before it, so
    a rank that rejects its input, or ranks that disagree, make every rank of the group raise
    the same :class:`LogprobContractError`; nothing is cached between calls, so a fresh op
    instance on one rank makes the same collectives as a reused one.
    """

    backend_id = BACKEND_ID
    devices: frozenset[str] = frozenset({"cpu", "cuda"})

    def engine(self) -> LocalEngine:
        """The per-rank compute (the eager chunk loops here; a compiled kernel in subclasses)."""
        return EAGER_ENGINE

    def default_chunk_rows(self, contract: LogprobContract, device: torch.device) -> int:
        """Cache-sized rows on a CPU, a memory budget on an accelerator (:func:`chunk_rows_for_device`)."""
        return chunk_rows_for_device(contract.local_vocab_size, device)

    def __call__(
        self,
        logits: torch.Tensor,
        targets: torch.Tensor,
        active: torch.Tensor,
        contract: LogprobContract,
        *,
        group: Any = None,
        compute_entropy: bool = False,
        validate: bool = True,
        chunk_rows: int | None = None,
        on_invalid: str = "raise",
        temperature: torch.Tensor | None = None,
        sampling: Sampling | None = None,
    ) -> LogprobOutput:
        """The op on this rank's rows. ``temperature`` (default ``None``: the contract's): a temperature
        per local row, a floating-point tensor of shape ``[contract.num_tokens]`` on the logits' device
        (:func:`rl_engine.logprob.row_temperature.row_temperature32` says what it accepts), with the
        contract's temperature 1; under CP each rank passes its own rows', and the ranks of a TP group
        must pass the same (the agreement step compares their digests). A refused value is this rank's
        verdict: every rank of the group raises it. ``sampling`` (per-row top-k / top-p / min-p of the
        local rows, or ``None``): the processed logprob of ``docs/arithmetic.md`` section 13; an engine
        without ``supports_processed`` refuses it."""
        verdict: str | None = None
        row_t32: torch.Tensor | None = None
        record: CallRecord | None = None
        try:
            if not isinstance(contract, LogprobContract):
                raise LogprobContractError(
                    f"contract={contract!r} must be a LogprobContract (e.g. "
                    "LogprobContract.from_mesh(mesh, ...))"
                )
            _flag("compute_entropy", compute_entropy)
            _flag("validate", validate)
            check_on_invalid(on_invalid)
            check_chunk_rows(chunk_rows)
            check_group(contract, group)
            contract.check_inputs(logits, targets, active)
            if temperature is not None and contract.tempered:
                raise LogprobContractError(
                    f"temperature is given per row and contract.temperature={contract.temperature!r}; pass one of "
                    "them: the per-row tensor with the contract's temperature 1.0, or no tensor")
            if temperature is not None:
                row_t32 = row_temperature32(temperature, (contract.num_tokens,), logits.device,
                                            check_values=validate)
            check_sampling(sampling, contract, logits.device, self.backend_id, self.engine())
            if logits.device.type not in self.devices:
                raise LogprobContractError(
                    f"logits.device={logits.device} is not served by backend {self.backend_id!r} "
                    f"(devices {sorted(self.devices)}); move the logits or dispatch another backend"
                )
            try:
                require_gradual_underflow(logits.device)
            except ArithmeticEnvironmentError as exc:
                raise LogprobContractError(str(exc)) from None
            size, _ = group_geometry(group)
            if validate and size > 1 and on_invalid == "raise":  # at TP = 1: in the forward's one sync
                contract.check_targets(targets, active)
            if size > 1:  # digests of the targets and the mask: inside the checks too
                record = call_record(
                    contract, self.backend_id, targets, active, compute_entropy, validate, None, on_invalid,
                    row_t32, sampling,
                )
        except LogprobContractError as exc:
            verdict = str(exc)
        except Exception as exc:  # noqa: BLE001 - a local failure must not leave peers waiting
            if group_geometry(group)[0] == 1:
                raise
            verdict = f"{type(exc).__name__} in the local checks: {exc}"
        size, _ = group_geometry(group)
        if size > 1:
            if verdict is not None or record is None:
                record = call_record(
                    contract, self.backend_id, targets, active, compute_entropy, validate, verdict, on_invalid,
                    row_t32, sampling,
                )
            agree(record, group, record_device(logits), role="TP", hints=AGREEMENT_HINTS)
        elif verdict is not None:
            raise LogprobContractError(verdict)
        if chunk_rows is None:
            chunk_rows = self.default_chunk_rows(contract, logits.device)
        # A negative view (torch._neg_view) must be read negated; torch 2.13's fp16 -> fp32
        # copy_ ignores the neg bit and compiled kernels read raw memory, so resolve it here
        # (a differentiable copy, only for such views).
        logits, targets, active = (t.resolve_neg() for t in (logits, targets, active))
        logp, lse, entropy, kept = _VocabParallelLogprob.apply(
            logits, targets, active, contract, group, int(chunk_rows), compute_entropy, validate,
            self.engine(), on_invalid, row_t32, sampling,
        )
        return LogprobOutput(logp, lse, entropy if compute_entropy else None, None,
                             kept if sampling is not None else None)


__all__ = [
    "BACKEND_ID",
    "BackwardTerms",
    "EAGER_ENGINE",
    "LocalEngine",
    "backward_terms",
    "LogprobOutput",
    "ON_INVALID",
    "VocabParallelLogprob",
    "call_record",
    "check_chunk_rows",
    "check_sampling",
    "processed_forward",
    "check_group",
    "real_local_columns",
    "real_rows_finite",
    "vocab_parallel_backward",
    "NEG_INF",
]
