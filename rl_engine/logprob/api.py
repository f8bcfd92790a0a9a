"""What a trainer calls: the one-call TP=1 logprob and the gather into global token order.

* :func:`selected_logprob`: the common single-rank case (no TP, no CP) in one call, with the
  contract built from the tensors themselves.
* :func:`gather_tokens`: per-token values of this CP rank (``[contract.num_tokens, ...]``,
  for example ``out.selected_logp``) placed, with every other CP rank's, at their global
  token indices (``sequence * seq_len + position``). Transport only: nothing is added.
  Differentiable: the backward hands this rank the gradient rows of its own tokens (each
  rank computes the same global loss, so no gradient collective is needed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rl_engine.distributed.bounds import AUTO_TILES, AUTO_TILES_RULE, BoundsError, auto_vocab_tiles, token_indices
from rl_engine.distributed.mesh import group_geometry
from rl_engine.logprob.agreement import UNKNOWN, CallRecord, agree, record_device
from rl_engine.logprob.backends.eager.vocab_parallel import LogprobOutput, vocab_parallel_backward
from rl_engine.logprob.contract import LOGITS_DTYPES, LogprobContract, LogprobContractError
from rl_engine.logprob.op_settings import LogitsOpSettings, settings_text
from rl_engine.logprob.processed import sampling_from
from rl_engine.logprob.registry import dispatch
from rl_engine.logprob.row_temperature import is_dtensor, is_row_temperature, row_temperature32
from rl_engine.logprob.storage import require_readable
from rl_engine.tables import AUTO, MAX_TP

DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in LOGITS_DTYPES.items()}


TARGET_DTYPES = (torch.int64, torch.int32)
MASK_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def trainer_inputs(targets: Any, active: Any, lead: tuple[int, ...],
                   ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A trainer's ``(targets, mask)`` as the op takes them, ``(int64, bool)``, each converted exactly.

    ``targets``: int64 or int32 token ids. ``active``: bool, or an integer mask holding only 0
    and 1 (an attention or loss mask); ``None`` makes every token whose target is not
    ``ignore_index`` active, as ``cross_entropy(ignore_index=-100)`` does. Anything else raises
    :class:`LogprobContractError` naming the field, the value and the fix.
    """
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise LogprobContractError(f"ignore_index={ignore_index!r} must be an integer (default -100)")
    for name, tensor in (("targets", targets), ("active", active)):
        if tensor is None and name == "active":
            continue
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != lead:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise LogprobContractError(
                f"{name}.shape={got} must equal logits.shape[:-1]={lead} (one per token)"
            )
    if targets.dtype not in TARGET_DTYPES:
        raise LogprobContractError(
            f"targets.dtype={targets.dtype} is not a token-id type; pass int64 or int32 ids "
            "(float or bool targets are refused, never rounded)"
        )
    targets = targets.to(torch.int64)  # exact from int32
    if active is None:
        return targets, targets != ignore_index
    if active.dtype == torch.bool:
        return targets, active
    if active.dtype not in MASK_INT_DTYPES:
        raise LogprobContractError(
            f"active.dtype={active.dtype} is not a mask type; pass a bool mask or an integer one of 0 "
            "and 1 (a float mask is refused: a weight is not a mask)"
        )
    bad = (active != 0) & (active != 1)
    if active.numel() and bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise LogprobContractError(
            f"active{list(index)}={int(active[index])} is not 0 or 1; an integer mask holds only 0 "
            "(inactive) and 1 (active): pass active.bool() if any non-zero means active"
        )
    return targets, active == 1


def selected_logprob(
    logits: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor | None = None,
    *,
    num_vocab_tiles: int | str = AUTO_TILES,
    real_vocab_size: int | None = None,
    compute_entropy: bool = False,
    validate: bool = True,
    chunk_rows: int | None = None,
    backend: str = AUTO,
    ignore_index: int = -100,
    max_tp: int = MAX_TP,
    temperature: float | torch.Tensor = 1.0,
    top_k: Any = 0,
    top_p: Any = 1.0,
    min_p: Any = 0.0,
) -> LogprobOutput:
    """Selected-token logprob of full-vocabulary logits on one rank (TP=1, CP=1).

    ``logits`` is ``[tokens, vocab]`` or ``[batch, seq, vocab]`` in bf16, fp16 or fp32;
    ``targets`` (int64 or int32) and ``active`` (bool, or an integer mask of 0 and 1) have the
    logits' shape without the vocabulary; without ``active``, every token whose target is not
    ``ignore_index`` (default -100) is active. Row ``i`` of the logits predicts token ``i + 1``
    of the sequence: pass the logits of positions ``0 .. T-2`` with the ids of ``1 .. T-1``
    (docs/trainer.md). Columns ``>= real_vocab_size`` (default: every column) are
    padding. ``num_vocab_tiles`` must divide the vocabulary; it is part of the numerical
    identity (another tile count gives other bytes), so pick it once for a run. The default,
    ``"auto"``, is :func:`rl_engine.distributed.bounds.auto_vocab_tiles` of the vocabulary and
    ``max_tp`` (default 8, the largest TP degree the run will use): the same count at every TP
    degree dividing ``max_tp``; ``out.provenance["num_vocab_tiles"]`` records the rule and the
    count. The outputs (FP32, shape of ``targets``) are the bytes the TP x CP op gives for the
    same logits.

    ``temperature`` (default 1.0): the logprob, LSE, entropy and gradient of the distribution at
    temperature ``T``, computed inside the arithmetic (docs/arithmetic.md section 6 step 0: every
    logit divided by ``T32 = RN32(T)`` after its exact upcast, the gradient divided by ``T32``: the
    bytes of ``selected_logprob(logits.float() / T32)`` and autograd's gradient through that
    division), so no divided copy of the logits is made; ``1.0`` gives exactly the bytes without a
    temperature. A tensor of the shape of ``targets`` gives each row its own temperature (a rollout
    batch mixes requests): bf16, fp16 or fp32 values taken exactly, float64 ones rounded once to
    binary32 like a number; each row's bytes are those of the call at that row's ``T32``, a row at 1
    those without a temperature (:mod:`rl_engine.logprob.row_temperature`; one host read of the
    tensor checks every value, naming the first refused one).

    ``top_k`` (0 = off), ``top_p`` (1 = off), ``min_p`` (0 = off): the processed logprob of the
    distribution the sampler drew from (docs/arithmetic.md section 13, vLLM's order: temperature,
    min-p, top-k, top-p), each a Python number for every row or a tensor of shape
    ``logits.shape[:-1]`` (a rollout batch mixes requests). The LSE, entropy and gradient are those
    of the kept set; an active token whose target the sampler removed has logp ``-inf`` and
    ``out.target_kept`` False (zero gradient through its logp). All off: the raw bytes, and
    ``out.target_kept`` is None. The same bytes at every TP degree.

    ``logits`` may be a DTensor sharded on the vocabulary (``Shard(-1)`` on one mesh dimension,
    ``Replicate`` on any other: loss parallel, a ``ColwiseParallel`` lm_head with
    ``use_local_output=False``): the mesh dimension's group is the TP group, each rank's columns
    are its shard's (``torch.chunk``'s split, which must fall on tile boundaries), the outputs
    are plain tensors equal on every rank, and the gradient reaches the DTensor as a DTensor.
    ``targets`` and ``active`` are then plain tensors or replicated DTensors.

    ``backend`` (default ``auto``) names the backend; ``auto`` takes the fastest registered
    one available on the logits' device (Triton on cuda, the fused C kernel on cpu, the eager
    one otherwise): every backend gives the same bytes (tested), and the choice and its reason
    are in ``out.provenance``. An explicit id that cannot serve the call raises
    ``BackendUnavailableError``; nothing falls back.
    """
    if is_dtensor(logits):  # sharded on the vocabulary: its mesh gives the group and the columns
        return _dtensor_call(logits, targets, active, num_vocab_tiles, real_vocab_size, compute_entropy,
                             validate, chunk_rows, backend, ignore_index, max_tp, temperature,
                             (top_k, top_p, min_p))
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (2, 3):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise LogprobContractError(
            f"logits={shape} must be a tensor of shape [tokens, vocab] or [batch, seq, vocab]"
        )
    if logits.dtype not in DTYPE_NAMES:
        raise LogprobContractError(
            f"logits.dtype={logits.dtype} is not supported; use one of "
            f"{list(DTYPE_NAMES)} (accumulation is FP32 whatever the input)"
        )
    lead = tuple(logits.shape[:-1])
    if torch.compiler.is_compiling():  # one registered op: its checks run outside the graph
        _refuse_compiled_sampling(top_k, top_p, min_p)
        return _compiled_call(logits, targets, active, lead, num_vocab_tiles, real_vocab_size,
                              compute_entropy, validate, backend, ignore_index, max_tp, chunk_rows, temperature)
    require_readable("logits", logits)  # before the reshape, which cannot view sparse memory
    targets, active = trainer_inputs(targets, active, lead, ignore_index)
    temperature, row_t32 = split_temperature(temperature, lead, logits.device, validate)
    sampling = sampling_from(top_k, top_p, min_p, lead, logits.device)
    vocab = logits.shape[-1]
    tiles = resolve_vocab_tiles(num_vocab_tiles, vocab, max_tp)
    num_sequences, seq_len = (1, lead[0]) if len(lead) == 1 else lead
    contract = LogprobContract(
        real_vocab_size=vocab if real_vocab_size is None else real_vocab_size,
        padded_vocab_size=vocab,
        num_vocab_tiles=tiles["resolved"],
        num_sequences=num_sequences,
        seq_len=seq_len,
        logits_dtype=DTYPE_NAMES[logits.dtype],
        ignore_index=ignore_index,
        temperature=temperature,
    )
    chosen = dispatch(backend, contract, logits.device.type, processed=sampling is not None,
                      row_temperature=row_t32 is not None)
    out = chosen.op(
        logits.reshape(-1, vocab), targets.reshape(-1), active.reshape(-1), contract,
        compute_entropy=compute_entropy, validate=validate, chunk_rows=chunk_rows,
        **({} if row_t32 is None else {"temperature": row_t32.reshape(-1)}),
        **({"sampling": sampling} if sampling is not None else {}),
    )
    return LogprobOutput(
        out.selected_logp.reshape(lead),
        out.lse.reshape(lead),
        out.entropy.reshape(lead) if out.entropy is not None else None,
        {**chosen.provenance(), "num_vocab_tiles": tiles},
        out.target_kept.reshape(lead) if out.target_kept is not None else None,
    )


def split_temperature(temperature: Any, lead: tuple[int, ...], device: torch.device,
                      validate: bool = True) -> tuple[Any, torch.Tensor | None]:
    """``(the contract's temperature, the rows' T32 or None)``: a number goes to the contract (which
    checks it); a tensor is each row's (:func:`rl_engine.logprob.row_temperature.row_temperature32`),
    with the contract's temperature 1. Its values are read on the host only with ``validate``."""
    if is_dtensor(temperature) or is_row_temperature(temperature):
        return 1.0, row_temperature32(temperature, lead, device, check_values=validate)
    return temperature, None


def _refuse_compiled_sampling(top_k: Any, top_p: Any, min_p: Any) -> None:
    """Processed logprobs are not in the registered op yet: refuse them under ``torch.compile``."""
    off = (isinstance(top_k, int) and top_k == 0 and isinstance(top_p, (int, float)) and top_p == 1
           and isinstance(min_p, (int, float)) and min_p == 0)
    if not off:
        raise LogprobContractError(
            "top_k / top_p / min_p are not supported under torch.compile yet; call selected_logprob "
            "outside the compiled region (torch.compiler.disable) for processed logprobs")


def _replicated_local(name: str, value: Any) -> Any:
    """A plain tensor as it is; a DTensor that every rank holds whole (``Replicate`` placements)
    as its local tensor; any other placement raises naming it."""
    if not is_dtensor(value):
        return value
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in value.placements):
        raise LogprobContractError(
            f"{name} is a DTensor with placements {list(value.placements)}; the per-token inputs must be "
            f"whole on every rank: pass a plain tensor or {name}.redistribute(placements=[Replicate()])")
    return value.to_local()


def _dtensor_call(logits: Any, targets: Any, active: Any, num_vocab_tiles: int | str,
                  real_vocab_size: int | None, compute_entropy: bool, validate: bool,
                  chunk_rows: int | None, backend: str, ignore_index: int, max_tp: int,
                  temperature: Any = 1.0, params: tuple[Any, Any, Any] = (0, 1.0, 0.0)) -> LogprobOutput:
    """The TP op on a DTensor's local shard, with the group and the columns its mesh gives."""
    from torch.distributed.tensor import Replicate, Shard

    if logits.dim() not in (2, 3) or logits.dtype not in DTYPE_NAMES:
        raise LogprobContractError(
            f"logits is a DTensor of shape {tuple(logits.shape)} and dtype {logits.dtype}; it must be "
            f"[tokens, vocab] or [batch, seq, vocab] in one of {list(DTYPE_NAMES)}")
    last = logits.dim() - 1
    placements = list(logits.placements)
    sharded = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim % logits.dim() == last]
    others = [p for i, p in enumerate(placements) if i not in sharded and not isinstance(p, Replicate)]
    if len(sharded) != 1 or others:
        raise LogprobContractError(
            f"logits is a DTensor with placements {placements}; the op takes logits sharded on the "
            "vocabulary (the last dimension) along one mesh dimension and replicated along any other: "
            "Shard(-1) (loss parallel, ColwiseParallel(use_local_output=False) on the lm_head), or "
            "redistribute them so")
    mesh, dim = logits.device_mesh, sharded[0]
    tp, tp_rank = mesh.size(dim), mesh.get_local_rank(dim)
    vocab, lead = logits.shape[-1], tuple(logits.shape[:-1])
    width = -(-vocab // tp)  # torch.chunk's split: ceil(vocab / tp) columns, the last rank the rest
    bounds = tuple((min(r * width, vocab), min((r + 1) * width, vocab)) for r in range(tp))
    targets, active = trainer_inputs(_replicated_local("targets", targets), _replicated_local("active", active),
                                     lead, ignore_index)
    local = logits.to_local()  # differentiable: the gradient comes back as a DTensor
    row_t32 = None
    if is_dtensor(temperature) or is_row_temperature(temperature):
        # the shape here (as the targets'); the values in the op's local checks, whose verdict every
        # rank of the TP group raises together
        row_t32 = _replicated_local("temperature", temperature)
        if tuple(row_t32.shape) != lead:
            raise LogprobContractError(f"temperature.shape={tuple(row_t32.shape)} must equal logits.shape[:-1]={lead} "
                                       "(one temperature per row, the shape of targets)")
        temperature = 1.0
    sampling = sampling_from(*(_replicated_local(n, v) for n, v in zip(("top_k", "top_p", "min_p"), params)),
                             lead, logits.device)
    tiles = resolve_vocab_tiles(num_vocab_tiles, vocab, max_tp)
    num_sequences, seq_len = (1, lead[0]) if len(lead) == 1 else lead
    contract = LogprobContract(
        real_vocab_size=vocab if real_vocab_size is None else real_vocab_size, padded_vocab_size=vocab,
        num_vocab_tiles=tiles["resolved"], num_sequences=num_sequences, seq_len=seq_len,
        tp_world_size=tp, tp_rank=tp_rank, vocab_shard_bounds=bounds,
        logits_dtype=DTYPE_NAMES[logits.dtype], ignore_index=ignore_index, temperature=temperature)
    chosen = dispatch(backend, contract, local.device.type, processed=sampling is not None,
                      row_temperature=row_t32 is not None)
    out = chosen.op(local.reshape(-1, local.shape[-1]), targets.reshape(-1), active.reshape(-1), contract,
                    group=mesh.get_group(dim), compute_entropy=compute_entropy, validate=validate,
                    chunk_rows=chunk_rows, **({} if row_t32 is None else {"temperature": row_t32.reshape(-1)}),
                    **({"sampling": sampling} if sampling is not None else {}))
    return LogprobOutput(
        out.selected_logp.reshape(lead), out.lse.reshape(lead),
        out.entropy.reshape(lead) if out.entropy is not None else None,
        {**chosen.provenance(), "num_vocab_tiles": tiles,
         "dtensor": {"mesh_dim": dim, "tp": tp, "tp_rank": tp_rank, "columns": list(bounds[tp_rank])}},
        out.target_kept.reshape(lead) if out.target_kept is not None else None,
    )


def _compiled_call(logits: torch.Tensor, targets: Any, active: Any, lead: tuple[int, ...],
                   num_vocab_tiles: int | str, real_vocab_size: int | None, compute_entropy: bool,
                   validate: bool, backend: str, ignore_index: int, max_tp: int,
                   chunk_rows: int | None, temperature: Any = 1.0) -> LogprobOutput:
    """Under ``torch.compile``: ``rl_engine::selected_logprob`` (:func:`selected_logprob_op`, below),
    whose real implementation is this function's eager path; no provenance in the graph. A per-row
    temperature is the op's tensor argument ``row_temperature`` (checked in the eager call); the rest
    is the op's settings text, built and checked while the graph is traced
    (:func:`rl_engine.logprob.op_settings.settings_text`): a constant of the graph, so another
    temperature is another text and a recompile, as the float argument specialized on its value was."""
    tiles = resolve_vocab_tiles(num_vocab_tiles, logits.shape[-1], max_tp)["resolved"]
    rows = temperature if isinstance(temperature, torch.Tensor) else None
    settings = settings_text(LogitsOpSettings, real_vocab_size=logits.shape[-1] if real_vocab_size is None
                             else real_vocab_size, num_vocab_tiles=tiles, ignore_index=ignore_index,
                             compute_entropy=compute_entropy, validate=validate, backend=backend,
                             chunk_rows=chunk_rows, temperature=1.0 if rows is not None else temperature)
    logp, lse, entropy = selected_logprob_op(logits, targets, active, rows, settings)
    return LogprobOutput(logp, lse, entropy if compute_entropy else None, None)


def selected_logprob_tp(
    logits: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    contract: LogprobContract,
    mesh: Any,
    *,
    backend: str = AUTO,
    compute_entropy: bool = False,
    validate: bool = True,
    chunk_rows: int | None = None,
    top_k: Any = 0,
    top_p: Any = 1.0,
    min_p: Any = 0.0,
) -> LogprobOutput:
    """This rank's selected-token logprob under TP x CP: its tokens (``contract.token_indices``)
    and its vocabulary columns (``contract.vocab_start:vocab_end``) of the logits.

    The backend is chosen by :func:`rl_engine.logprob.registry.dispatch` for ``mesh``'s device
    (``backend="auto"`` records its choice; an explicit id fails closed, nothing falls back) and
    runs over ``mesh.tp_group``; :func:`gather_tokens` over ``mesh.cp_group`` puts the tokens back
    in the global order. ``mesh`` is :func:`rl_engine.distributed.mesh.init_mesh`'s. ``top_k``,
    ``top_p``, ``min_p``: as in :func:`selected_logprob` (numbers, or one value per local row:
    shape ``targets.shape``), the same bytes at every TP degree.
    """
    sampling = sampling_from(top_k, top_p, min_p, tuple(targets.shape), logits.device)
    chosen = dispatch(backend, contract, mesh.device.type, processed=sampling is not None)
    return chosen.op(logits, targets, active, contract, group=mesh.tp_group, compute_entropy=compute_entropy,
                     validate=validate, chunk_rows=chunk_rows,
                     **({"sampling": sampling} if sampling is not None else {}))


def resolve_vocab_tiles(num_vocab_tiles: int | str, padded_vocab: int, max_tp: int = MAX_TP) -> dict[str, Any]:
    """``{"requested", "resolved", "rule", "max_tp"}``: an explicit count as given (the contract
    checks it), or ``"auto"`` resolved by :func:`rl_engine.distributed.bounds.auto_vocab_tiles`."""
    if num_vocab_tiles != AUTO_TILES:
        if isinstance(num_vocab_tiles, str):
            raise LogprobContractError(f"num_vocab_tiles={num_vocab_tiles!r} must be a positive integer or "
                                       f"{AUTO_TILES!r}")
        return {"requested": num_vocab_tiles, "resolved": num_vocab_tiles, "rule": "given", "max_tp": None}
    try:
        resolved = auto_vocab_tiles(padded_vocab, max_tp)
    except BoundsError as exc:
        raise LogprobContractError(str(exc)) from None
    return {"requested": AUTO_TILES, "resolved": resolved, "rule": AUTO_TILES_RULE, "max_tp": max_tp}


GATHER_CALL = "gather_tokens"
GATHER_HINTS = {
    "contract": "Build every rank's contract from the same config and the mesh "
    "(LogprobContract.from_mesh).",
    "dtype": "Gather the same output on every CP rank.",
    "row_shape": "Gather the same output on every CP rank.",
}


def _rank_index(contract: LogprobContract, cp_rank: int, device: torch.device) -> torch.Tensor:
    rows = token_indices(
        range(contract.num_sequences), contract.seq_len, contract.cp_world_size, cp_rank,
        contract.cp_layout,
    )
    return torch.tensor(rows, dtype=torch.int64, device=device)


class _GatherCPTokens(torch.autograd.Function):
    """One tensor's rows from every CP rank, placed in global token order; backward returns each rank its rows."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, local: torch.Tensor, contract: LogprobContract, group: Any
    ) -> torch.Tensor:
        size = contract.cp_world_size
        if size == 1:
            pieces = [local]
        else:
            wire = local.to(torch.uint8) if local.dtype == torch.bool else local.contiguous()
            pieces = [torch.empty_like(wire) for _ in range(size)]
            dist.all_gather(pieces, wire, group=group)
            pieces = [p.to(torch.bool) if local.dtype == torch.bool else p for p in pieces]
        out = local.new_empty((contract.global_num_tokens, *local.shape[1:]))
        for cp_rank, piece in enumerate(pieces):
            out[_rank_index(contract, cp_rank, local.device)] = piece
        ctx.index = _rank_index(contract, contract.cp_rank, local.device)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad[ctx.index], None, None


def gather_tokens(local: torch.Tensor, contract: LogprobContract, group: Any = None) -> torch.Tensor:
    """Every CP rank's per-token values in global token order: ``[num_sequences * seq_len, ...]``.

    ``local`` holds this rank's tokens in local row order (``[contract.num_tokens, ...]``, as
    the op returns them); ``group`` is the CP group (``mesh.cp_group``; ``None`` when CP=1).
    The TP ranks of a CP rank hold identical outputs, so the CP group alone is enough. Like
    the op, the call starts with the agreement step on the CP group: a rank whose input is
    wrong, or ranks that gather different things, raise on every CP rank.
    """
    verdict: str | None = None
    try:
        if not isinstance(contract, LogprobContract):
            raise LogprobContractError(f"contract={contract!r} must be a LogprobContract")
        if not isinstance(local, torch.Tensor) or local.dim() < 1:
            raise LogprobContractError(
                f"local={local!r} must be a tensor with one row per local token"
            )
        require_readable("local", local)
        if local.shape[0] != contract.num_tokens:
            raise LogprobContractError(
                f"local.shape={tuple(local.shape)} must start with num_tokens="
                f"{contract.num_tokens} (this CP rank's tokens, cp_rank={contract.cp_rank})"
            )
        if contract.cp_world_size > 1 and group is None:
            raise LogprobContractError(
                f"cp_world_size={contract.cp_world_size} needs the CP process group; pass "
                "group=mesh.cp_group"
            )
        size, rank = group_geometry(group)
        if (size, rank) != (contract.cp_world_size, contract.cp_rank):
            raise LogprobContractError(
                f"the CP group (size {size}, rank {rank}) disagrees with cp_world_size="
                f"{contract.cp_world_size}, cp_rank={contract.cp_rank}; pass group=mesh.cp_group "
                "and build the contract from the same mesh"
            )
    except LogprobContractError as exc:
        verdict = str(exc)
    size, _ = group_geometry(group)
    if size > 1:
        ok = verdict is None
        record = CallRecord(GATHER_CALL, verdict, (
            ("contract", contract.cross_rank_fingerprint() if ok else UNKNOWN),
            ("dtype", str(local.dtype).replace("torch.", "") if ok else UNKNOWN),
            ("row_shape", str(list(local.shape[1:])) if ok else UNKNOWN),
        ))
        agree(record, group, record_device(local), role="CP", hints=GATHER_HINTS)
    elif verdict is not None:
        raise LogprobContractError(verdict)
    return _GatherCPTokens.apply(local, contract, group)



# ---------------------------------------------------------------- the registered op
# The one-rank logprob as a registered op, so that ``torch.compile(fullgraph=True)`` keeps it whole.
#
# :func:`rl_engine.logprob.api.selected_logprob` checks its input with host reads (targets in the
# real vocabulary, an integer mask of 0 and 1, the thread's gradual underflow): each such read is
# a graph break under ``torch.compile``, and ``fullgraph=True`` refuses them. Under compilation the
# call goes instead to ``rl_engine::selected_logprob``, a custom op (``torch.library.custom_op``):
# the graph holds one opaque node whose fake implementation gives the output shapes, and at run
# time its real implementation is the eager call itself, every check included: the checks run
# outside the graph, the bytes are those of the eager call (tested), and a refusal raises the
# same :class:`~rl_engine.logprob.contract.LogprobContractError`. The gradient is a second op,
# ``rl_engine::selected_logprob_backward``, registered as the first one's autograd formula. Both take
# their tensors and one ``str``: the JSON text of a :class:`rl_engine.logprob.op_settings.LogitsOpSettings`
# (every other setting of the call), which the fake implementation, ``setup_context`` and the backward
# read by field name.
#
# What the compiled call does not carry: ``out.provenance`` is ``None`` (the backend choice is
# Python the graph does not hold: call once without compiling to record it), and a TP or CP group
# (the op with ``group=`` stays an eager call).

OP = "rl_engine::selected_logprob"
BACKWARD_OP = "rl_engine::selected_logprob_backward"


def _eager(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
           row_temperature: torch.Tensor | None, settings: LogitsOpSettings) -> Any:
    return selected_logprob(logits, targets, active, num_vocab_tiles=settings.num_vocab_tiles,
                            real_vocab_size=settings.real_vocab_size, compute_entropy=settings.compute_entropy,
                            validate=settings.validate, backend=settings.backend,
                            ignore_index=settings.ignore_index, chunk_rows=settings.chunk_rows,
                            temperature=settings.temperature if row_temperature is None else row_temperature)


@torch.library.custom_op(OP, mutates_args=())
def selected_logprob_op(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
                        row_temperature: torch.Tensor | None,
                        settings: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, lse, entropy)`` of :func:`rl_engine.logprob.api.selected_logprob` run eagerly,
    every check included (entropy empty without ``compute_entropy``). ``settings``: the text of a
    :class:`~rl_engine.logprob.op_settings.LogitsOpSettings` (its ``encode()``), the op's one
    non-tensor argument; ``row_temperature``: a temperature per row (the eager call's tensor
    ``temperature``), with the settings' ``temperature`` 1."""
    call = LogitsOpSettings.decode(settings)
    with torch.no_grad():
        out = _eager(logits, targets, active, row_temperature, call)
    entropy = out.entropy if out.entropy is not None else logits.new_empty(0, dtype=torch.float32)
    return out.selected_logp.clone(), out.lse.clone(), entropy.clone()


@selected_logprob_op.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
      row_temperature: torch.Tensor | None, settings: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_token = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    compute_entropy = LogitsOpSettings.decode(settings).compute_entropy
    entropy = torch.empty_like(per_token) if compute_entropy else logits.new_empty(0, dtype=torch.float32)
    return per_token, torch.empty_like(per_token), entropy


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def selected_logprob_backward_op(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
                                 lse: torch.Tensor, grad_logp: torch.Tensor | None,
                                 grad_lse: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                                 entropy: torch.Tensor | None, row_temperature: torch.Tensor | None,
                                 settings: str) -> torch.Tensor:
    """The gradient to the logits: the eager op's own backward (``vocab_parallel_backward`` with
    the backend's engine), one rounding to the logits' dtype; ``settings`` as the forward's."""
    call = LogitsOpSettings.decode(settings)
    vocab, lead = logits.shape[-1], tuple(logits.shape[:-1])
    targets, active = trainer_inputs(targets, active, lead, call.ignore_index)
    row_t32 = None if row_temperature is None else row_temperature32(row_temperature, lead, logits.device)
    num_sequences, seq_len = (1, lead[0]) if len(lead) == 1 else lead
    contract = LogprobContract(real_vocab_size=call.real_vocab_size, padded_vocab_size=vocab,
                               num_vocab_tiles=call.num_vocab_tiles, num_sequences=num_sequences,
                               seq_len=seq_len, logits_dtype=DTYPE_NAMES[logits.dtype],
                               ignore_index=call.ignore_index, temperature=call.temperature)
    op = dispatch(call.backend, contract, logits.device.type).op
    flat = logits.reshape(-1, vocab).resolve_neg()
    grad = vocab_parallel_backward(flat, targets.reshape(-1), active.reshape(-1), lse.reshape(-1),
                                   None if grad_logp is None else grad_logp.reshape(-1),
                                   None if grad_lse is None else grad_lse.reshape(-1), contract,
                                   op.default_chunk_rows(contract, logits.device), op.engine(),
                                   None if grad_entropy is None else grad_entropy.reshape(-1),
                                   None if entropy is None else entropy.reshape(-1),
                                   None if row_t32 is None else row_t32.reshape(-1))
    return grad.reshape(logits.shape)


@selected_logprob_backward_op.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None, lse: torch.Tensor,
      grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None, grad_entropy: torch.Tensor | None,
      entropy: torch.Tensor | None, row_temperature: torch.Tensor | None, settings: str) -> torch.Tensor:
    LogitsOpSettings.decode(settings)
    return torch.empty_like(logits)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    logits, targets, active, rows, settings = inputs
    ctx.save_for_backward(logits, targets, active, output[1], output[2], rows)
    ctx.settings = LogitsOpSettings.decode(settings)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
              grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
    logits, targets, active, lse, entropy, rows = ctx.saved_tensors
    if not ctx.settings.compute_entropy:  # the entropy output is empty: nothing flows through it
        grad_entropy = None
    grad = selected_logprob_backward_op(logits, targets, active, lse, grad_logp, grad_lse, grad_entropy,
                                        entropy if grad_entropy is not None else None, rows,
                                        ctx.settings.encode())
    return grad, None, None, None, None


selected_logprob_op.register_autograd(_backward, setup_context=_setup_context)


__all__ = [
    "BACKWARD_OP",
    "OP",
    "gather_tokens",
    "resolve_vocab_tiles",
    "selected_logprob",
    "selected_logprob_backward_op",
    "selected_logprob_op",
    "split_temperature",
    "trainer_inputs",
]
