"""The logprob from the last hidden state and the lm_head weight, without the whole logits.

``selected_logprob_from_hidden(hidden, weight, targets, ...)`` is what a fused lm_head computes
(TRL's ``fused_lm_head``, Liger's chunked losses): the logits of ``chunk_tokens`` active tokens at
a time go through the logprob op and are dropped; the backward makes each chunk's logits again,
takes the op's gradient to them and turns it into the gradients of ``hidden`` and ``weight``
(:mod:`rl_engine.logprob.hidden_chunks`). With ``keep_logits=True`` the forward keeps them instead
(the memory of the whole logits, as a naive head holds them) and the backward makes no product
again: one product fewer of the four, the same bytes.

The bits. The logits are the fixed-order product of :mod:`rl_engine.logprob.head_matmul` on the
CPU (``matmul="auto"``; ``docs/arithmetic.md`` section 12): a logit's bits depend on its row of
``hidden`` and its row of ``weight`` alone, so the logprob, LSE and entropy of a token are the same
bytes at any chunk size, whichever other tokens are in the batch or active, at any TP degree (a
shard's columns are the same products) and thread count. With ``matmul="library"`` (and on a GPU,
where no fixed-order kernel is written) the logits are ``torch.matmul``'s, the model's own head's
bits, and those promises hold only where that GEMM happens to give a row the same bits whatever
else is multiplied with it. Only active rows are computed; inactive rows get ``+0`` logprob, LSE
and entropy (no logits are made for them, so they have no LSE) and a ``+0`` gradient row.

Under autocast (``torch.autocast(device, dtype)`` enabled on ``hidden``'s device, as TRL's
``bf16=True`` runs the model) the logits are made as autocast makes the model's own head's: both
operands cast to the autocast dtype, the logits in that dtype; then the op's arithmetic. The
gradients come back in the inputs' own dtypes.

The weight's gradient: the chunks' ``grad_logits.T @ hidden`` added in binary32 and rounded once
to the weight's dtype (``grad_weight_fp32=True``, the default: one binary32 copy of the weight's
gradient while the backward runs), or added in the compute dtype with one rounding per chunk
(``False``: Liger's chunked losses; measured at 4096 and 16384 bf16 tokens, 4.8e-3 and 9.4e-3
relative error against float64, where the default has 1.66e-3, the bf16 rounding of the exact value).

Under TP (``group=``): ``weight`` is this rank's shard of the vocabulary (an even split, as
``ColwiseParallel``/Megatron's column-parallel lm_head holds it), ``hidden`` is whole on every rank;
each chunk's logits are the rank's columns and go through the TP op. ``weight``'s gradient is the
shard's; ``hidden``'s is the rank's partial product, summed over the group by one all-reduce per
backward with ``hidden_grad="all_reduce"`` (the default under TP: its bits are that sum's), or left
to a framework that reduces it already (``"partial"``: Megatron's
``copy_to_tensor_model_parallel_region``). Every TP rank agrees on the active rows first (one small
all-gather), so the ranks cut the same chunks. A DTensor weight (FSDP2, a TP plan) is resolved by
:mod:`rl_engine.logprob.hidden_dtensor`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import group_geometry
from rl_engine.logprob.agreement import UNKNOWN, CallRecord, agree, record_device, tensor_digest
from rl_engine.logprob.api import DTYPE_NAMES, resolve_vocab_tiles, split_temperature, trainer_inputs
from rl_engine.logprob.backends.eager.vocab_parallel import LogprobOutput
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.head_matmul import choose_matmul
from rl_engine.logprob.hidden_chunks import HeadPlan, active_rows, backward_chunks, forward_chunks
from rl_engine.logprob.hidden_dtensor import HeadWeight, head_weight, is_dtensor
from rl_engine.logprob.op_settings import HeadGradSettings, HeadOpSettings, settings_text
from rl_engine.logprob.processed import sampling_from
from rl_engine.logprob.registry import dispatch
from rl_engine.tables import AUTO, MAX_TP

DEFAULT_CHUNK_TOKENS = 256
HIDDEN_GRADS = ("all_reduce", "partial")
CALL = "selected_logprob_from_hidden"
AGREED_FIELDS = ("tokens", "active", "chunk_tokens", "matmul", "hidden_grad", "sampling")


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
        plan: HeadPlan,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        compute = weight if weight.dtype == plan.compute_dtype else weight.detach().to(plan.compute_dtype)
        logp, lse, entropy, kept, logits = forward_chunks(hidden, compute, targets, rows, plan)
        ctx.save_for_backward(hidden, compute, targets, rows, lse, entropy, kept, logits)
        ctx.plan, ctx.weight_dtype = plan, weight.dtype
        ctx.set_materialize_grads(False)  # an output the loss does not use gives None, not zeros
        if not plan.compute_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.mark_non_differentiable(kept)
        return logp, lse, entropy, kept

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
        grad_entropy: torch.Tensor | None, _grad_kept: Any = None,
    ) -> tuple[Any, ...]:
        hidden, compute, targets, rows, lse, entropy, kept, logits = ctx.saved_tensors
        if not ctx.plan.compute_entropy:
            grad_entropy = None
        grad_hidden, grad_weight = backward_chunks(
            hidden, compute, targets, rows, lse, entropy, grad_logp, grad_lse, grad_entropy, ctx.plan,
            ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.weight_dtype,
            kept if ctx.plan.sampling is not None else None, logits)
        return grad_hidden, grad_weight, None, None, None


def compute_dtype_of(hidden: torch.Tensor) -> tuple[torch.dtype, str | None]:
    """The logits' dtype: autocast's where it is enabled on ``hidden``'s device, else the inputs'."""
    device = hidden.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return dtype, DTYPE_NAMES.get(dtype, str(dtype))
    return hidden.dtype, None


def _check_inputs(hidden: Any, weight: torch.Tensor, compute_dtype: torch.dtype | None, autocast: str | None,
                  grad_weight_fp32: Any, hidden_grad: str, chunk_tokens: Any, keep_logits: Any) -> None:
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_NAMES:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise LogprobContractError(f"{name} must be a bf16, fp16 or fp32 tensor, got {got}")
    if hidden.dim() not in (2, 3) or hidden.shape[-1] != weight.shape[1]:
        raise LogprobContractError(
            f"hidden.shape={tuple(hidden.shape)} and weight.shape={tuple(weight.shape)} must be "
            "[tokens or batch, seq, hidden_size] and [vocab, hidden_size] with one hidden_size")
    if hidden.shape[-1] == 0:
        raise LogprobContractError(
            f"hidden.shape={tuple(hidden.shape)} and weight.shape={tuple(weight.shape)} have hidden_size 0: the "
            "logits would be sums of nothing; pass the model's last hidden state and its lm_head weight")
    if (autocast is None and hidden.dtype != weight.dtype) or hidden.device != weight.device:
        raise LogprobContractError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, {weight.device}) must "
            "share a dtype (the logits') and a device; cast one of them (under autocast the logits take "
            "autocast's dtype)")
    if compute_dtype not in DTYPE_NAMES:
        raise LogprobContractError(f"autocast's dtype {compute_dtype} is not one of {list(DTYPE_NAMES)}")
    if not isinstance(grad_weight_fp32, bool):
        raise LogprobContractError(f"grad_weight_fp32={grad_weight_fp32!r} must be True or False")
    if not isinstance(keep_logits, bool):
        raise LogprobContractError(
            f"keep_logits={keep_logits!r} must be True (keep the forward's logits for the backward: the memory of the "
            "whole logits) or False (the default: make each chunk's logits again in the backward)")
    if hidden_grad not in HIDDEN_GRADS:
        raise LogprobContractError(f"hidden_grad={hidden_grad!r} must be one of {HIDDEN_GRADS}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise LogprobContractError(f"chunk_tokens={chunk_tokens!r} must be a positive integer (default "
                                   f"{DEFAULT_CHUNK_TOKENS})")


def _grad_wanted(hidden: Any, weight: Any) -> bool:
    """Whether autograd will record the call: grad mode on and an input requiring a gradient."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden, weight))


def _agreement_group(weight: Any, group: Any) -> Any:
    """The group whose ranks must make this call together: the TP group, or a data-parallel
    DTensor weight's mesh (its gather pairs every rank of it); ``None`` when there is none."""
    if group is not None:
        return group
    if is_dtensor(weight) and weight.device_mesh.ndim == 1:
        return weight.device_mesh.get_group(0)
    return None


@dataclass(frozen=True)
class Prepared:
    """A checked call: its plan, the weight as resolved, the flat targets and active mask, the token
    count, the shape of the per-token outputs, and the provenance of the choices made."""

    plan: HeadPlan
    weight: HeadWeight
    targets: torch.Tensor
    active: torch.Tensor
    tokens: int
    lead: tuple[int, ...]
    provenance: dict[str, Any]

    def __post_init__(self) -> None:
        if self.targets.shape != (self.tokens,) or self.active.shape != (self.tokens,):
            raise LogprobContractError(f"targets {tuple(self.targets.shape)} and active {tuple(self.active.shape)} "
                                       f"must hold one value per token ({self.tokens})")


def prepare(hidden: Any, resolved: HeadWeight, targets: Any, active: Any, *, num_vocab_tiles: int | str,
            real_vocab_size: int | None, compute_entropy: bool, validate: bool, chunk_tokens: int, backend: str,
            ignore_index: int, max_tp: int, grad_weight_fp32: bool, temperature: Any, hidden_grad: str,
            matmul: str, compute_dtype: torch.dtype | None, autocast: str | None,
            top_k: Any = 0, top_p: Any = 1.0, min_p: Any = 0.0, keep_logits: bool = False,
            grad_wanted: bool = True) -> Prepared:
    """Every local check of a call, and its plan (no collective; raises LogprobContractError). The
    plan keeps the logits where ``keep_logits`` asks and a gradient is wanted (``grad_wanted``)."""
    meta = resolved.meta
    _check_inputs(hidden, meta, compute_dtype, autocast, grad_weight_fp32, hidden_grad, chunk_tokens, keep_logits)
    lead = tuple(hidden.shape[:-1])
    targets, active = trainer_inputs(targets, active, lead, ignore_index)
    temperature, row_t32 = split_temperature(temperature, lead, hidden.device, validate)
    sampling = sampling_from(top_k, top_p, min_p, lead, hidden.device)
    group = resolved.group
    tp, tp_rank = group_geometry(group)
    tiles = resolve_vocab_tiles(num_vocab_tiles, resolved.vocab, max_tp)
    tokens = hidden.reshape(-1, hidden.shape[-1]).shape[0]
    contract = LogprobContract(
        real_vocab_size=resolved.vocab if real_vocab_size is None else real_vocab_size,
        padded_vocab_size=resolved.vocab, num_vocab_tiles=tiles["resolved"], num_sequences=1, seq_len=tokens,
        tp_world_size=tp, tp_rank=tp_rank, vocab_shard_bounds=resolved.shard_bounds,
        logits_dtype=DTYPE_NAMES[compute_dtype], ignore_index=ignore_index, temperature=temperature)
    if (contract.vocab_start, contract.vocab_end) != resolved.rows:
        raise LogprobContractError(
            f"weight.shape[0]={meta.shape[0]} is not this rank's share of the vocabulary {resolved.vocab} split "
            f"into {tp} tile-aligned shards ({contract.vocab_end - contract.vocab_start} rows); shard the lm_head "
            "evenly")
    choice = choose_matmul(matmul, hidden.device)
    chosen = dispatch(backend, contract, hidden.device.type, processed=sampling is not None,
                      row_temperature=row_t32 is not None)
    plan = HeadPlan(contract, chosen.op, chunk_tokens, compute_entropy, validate, choice, compute_dtype,
                    grad_weight_fp32, group, tp > 1 and hidden_grad == "all_reduce",
                    None if row_t32 is None else row_t32.reshape(-1), sampling, keep_logits and grad_wanted)
    provenance = {**chosen.provenance(), "num_vocab_tiles": tiles, "chunk_tokens": chunk_tokens,
                  "matmul": choice.record(), "autocast": autocast, "grad_weight_fp32": grad_weight_fp32,
                  "keep_logits": {"requested": keep_logits, "kept": plan.keep_logits}}
    if resolved.record is not None:
        provenance["dtensor_weight"] = resolved.record
    return Prepared(plan, resolved, targets.reshape(-1), active.reshape(-1), tokens, lead, provenance)


def selected_logprob_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor | None = None,
    *,
    num_vocab_tiles: int | str = "auto",
    real_vocab_size: int | None = None,
    compute_entropy: bool = False,
    validate: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    backend: str = AUTO,
    ignore_index: int = -100,
    max_tp: int = MAX_TP,
    grad_weight_fp32: bool = True,
    temperature: float | torch.Tensor = 1.0,
    group: Any = None,
    hidden_grad: str = "all_reduce",
    matmul: str = "auto",
    weight_grad_reduce: str = "mean",
    top_k: Any = 0,
    top_p: Any = 1.0,
    min_p: Any = 0.0,
    keep_logits: bool = False,
) -> LogprobOutput:
    """Selected-token logprob of ``hidden @ weight.T`` made ``chunk_tokens`` active tokens at a time.

    ``hidden`` is ``[tokens, hidden_size]`` or ``[batch, seq, hidden_size]``, ``weight``
    ``[vocab, hidden_size]`` (the lm_head's; its rows past ``real_vocab_size`` are padding), both
    in bf16, fp16 or fp32 and of one dtype (the logits'; under autocast, autocast's dtype is);
    ``targets``, ``active``, ``num_vocab_tiles``, ``ignore_index``, ``backend`` and ``temperature`` as
    in :func:`rl_engine.logprob.api.selected_logprob`. The whole ``[tokens, vocab]`` logits never
    exist: at most ``chunk_tokens`` rows of them, and of their gradient. Differentiable to ``hidden``
    and ``weight``. ``matmul``: ``"auto"`` (the fixed-order product on the CPU, the library's
    elsewhere), ``"fixed"`` or ``"library"``. ``weight`` may be a DTensor: sharded for data
    parallelism (FSDP2, ``group=None``) it is gathered and its gradient reduced over its mesh
    (``weight_grad_reduce``: ``"mean"`` or ``"sum"``); sharded on the vocabulary over the TP mesh
    whose group is ``group`` it is the rank's shard. See the module docstring for the bits.
    ``top_k``, ``top_p``, ``min_p``: the processed logprob of section 13 of docs/arithmetic.md, as in
    :func:`rl_engine.logprob.api.selected_logprob` (``out.target_kept``); the backward finds each
    chunk's kept set again from the same logits. ``keep_logits``: keep the forward's logits of the
    active rows for the backward, which then makes no product again (one of the four products of a
    forward+backward): ``active tokens x weight.shape[0] x itemsize`` bytes held from the forward to
    the backward (the compute dtype's itemsize: 4 in fp32; 1,244,659,712 bytes for 2048 fp32 tokens
    at vocabulary 151936, as much as the naive head's binary32 logits), instead of one chunk's.
    The outputs and every gradient are the same bytes either way; without a gradient wanted (under
    ``torch.no_grad()``, or neither input requiring one) nothing is kept.
    """
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise LogprobContractError(
            f"group={group!r} is not a torch.distributed ProcessGroup; pass the TP group of a vocabulary-sharded "
            "lm_head (e.g. mesh.tp_group), or None for a whole lm_head")
    options = dict(num_vocab_tiles=num_vocab_tiles, real_vocab_size=real_vocab_size,
                   compute_entropy=compute_entropy, validate=validate, chunk_tokens=chunk_tokens, backend=backend,
                   ignore_index=ignore_index, max_tp=max_tp, grad_weight_fp32=grad_weight_fp32,
                   temperature=temperature, hidden_grad=hidden_grad, matmul=matmul, keep_logits=keep_logits)
    if torch.compiler.is_compiling() and group is None and not is_dtensor(weight) and not is_dtensor(hidden):
        from rl_engine.logprob.api import _refuse_compiled_sampling

        _refuse_compiled_sampling(top_k, top_p, min_p)
        return compiled_from_hidden(hidden, weight, targets, active, **options)
    together = _agreement_group(weight, group)
    failure: LogprobContractError | None = None
    fields: dict[str, str] = {}
    try:  # local checks record a verdict: under TP or a DTensor's mesh every rank raises it together
        resolved = head_weight(weight, group, weight_grad_reduce)
        compute_dtype, autocast = compute_dtype_of(hidden) if isinstance(hidden, torch.Tensor) else (None, None)
        call = prepare(hidden, resolved, targets, active, compute_dtype=compute_dtype, autocast=autocast,
                       top_k=top_k, top_p=top_p, min_p=min_p, grad_wanted=_grad_wanted(hidden, weight), **options)
        if call.plan.group is not None:  # the TP ranks cut the same chunks only if they agree on the active rows
            fields = {"tokens": str(call.tokens), "active": tensor_digest(call.active),
                      "chunk_tokens": str(chunk_tokens), "matmul": call.plan.matmul.used, "hidden_grad": hidden_grad,
                      "sampling": call.plan.sampling.digest() if call.plan.sampling is not None else "off"}
    except LogprobContractError as exc:
        failure = exc
    if group_geometry(together)[0] > 1:
        names = AGREED_FIELDS if group is not None else ()
        verdict = None if failure is None else str(failure)
        agree(CallRecord(CALL, verdict, tuple((name, fields.get(name, UNKNOWN)) for name in names)),
              together, record_device(hidden), role="TP" if group is not None else "DP",
              hints={"active": "Give every TP rank the same targets and mask."})
    elif failure is not None:
        raise failure
    with torch.autocast(hidden.device.type, enabled=False):
        logp, lse, entropy, kept = _FromHidden.apply(hidden.reshape(call.tokens, -1), call.weight.tensor(),
                                                     call.targets, active_rows(call.active), call.plan)
    lead = call.lead
    return LogprobOutput(logp.reshape(lead), lse.reshape(lead), entropy.reshape(lead) if compute_entropy else None,
                         call.provenance, kept.reshape(lead) if call.plan.sampling is not None else None)



# ---------------------------------------------------------------- the registered op
# The fused head as a registered op, so that ``torch.compile(fullgraph=True)`` keeps it whole.
#
# :func:`rl_engine.logprob.hidden.selected_logprob_from_hidden` reads from the host (the active
# rows' indices, the checks of its inputs, the backend choice): each read is a graph break under
# ``torch.compile`` and ``fullgraph=True`` refuses them. Under compilation the call goes instead to
# ``rl_engine::selected_logprob_from_hidden``, a ``torch.library.custom_op`` whose fake
# implementation gives the outputs' shapes (one float32 value per token: they do not depend on how
# many rows are active) and whose real implementation is the eager call's own code
# (:func:`rl_engine.logprob.hidden.prepare` and :mod:`rl_engine.logprob.hidden_chunks`), checks
# included: the bytes are the eager call's and a refusal raises the same
# :class:`~rl_engine.logprob.contract.LogprobContractError`. The gradient is a second op,
# ``rl_engine::selected_logprob_from_hidden_backward``, registered as the first one's autograd
# formula, which recomputes each chunk's logits as the eager backward does, or, with the settings'
# ``keep_logits``, reads the forward op's fourth output: the active rows' logits, whose row count the
# fake implementation gives as a size known only when the op runs.
#
# Autocast is resolved when the graph is traced (the logits' dtype name is a field of the op's settings,
# :class:`rl_engine.logprob.op_settings.HeadOpSettings`, the op's one non-tensor argument as its JSON
# text), so the op computes the same dtype whether or not autocast is active around the compiled code
# at run time.
# What the compiled call does not carry: ``out.provenance`` is ``None`` (call once without compiling
# to record it), and ``group=`` or a DTensor weight (those calls stay eager: a graph break).

OP = "rl_engine::selected_logprob_from_hidden"
BACKWARD_OP = "rl_engine::selected_logprob_from_hidden_backward"


def _prepare(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
             row_temperature: torch.Tensor | None, settings: HeadOpSettings) -> Any:
    return prepare(hidden, head_weight(weight, None, "mean"), targets, active,
                   num_vocab_tiles=settings.num_vocab_tiles, real_vocab_size=settings.real_vocab_size,
                   compute_entropy=settings.compute_entropy, validate=settings.validate,
                   chunk_tokens=settings.chunk_tokens, backend=settings.backend, ignore_index=settings.ignore_index,
                   max_tp=1, grad_weight_fp32=settings.grad_weight_fp32,
                   temperature=settings.temperature if row_temperature is None else row_temperature,
                   hidden_grad="all_reduce", matmul=settings.matmul,
                   compute_dtype=hidden.dtype if settings.autocast is None else settings.autocast_dtype,
                   autocast=settings.autocast, keep_logits=settings.keep_logits)


def _compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.detach() if weight.dtype == dtype else weight.detach().to(dtype)


@torch.library.custom_op(OP, mutates_args=())
def from_hidden_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
                   row_temperature: torch.Tensor | None,
                   settings: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, lse, entropy, logits)`` per token of the eager fused head (entropy empty without
    ``compute_entropy``; ``logits`` the active rows' ``[rows, vocab]`` logits with the settings'
    ``keep_logits``, else empty), every check included. ``settings``: the text of a
    :class:`~rl_engine.logprob.op_settings.HeadOpSettings` (its ``encode()``), the op's one non-tensor
    argument; ``row_temperature``: a temperature per token (the eager call's tensor ``temperature``),
    with the settings' ``temperature`` 1."""
    head = HeadOpSettings.decode(settings)
    call = _prepare(hidden, weight, targets, active, row_temperature, head)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        logp, lse, entropy, _, logits = forward_chunks(
            hidden.reshape(call.tokens, -1), _compute_weight(weight, call.plan.compute_dtype), call.targets,
            active_rows(call.active), call.plan)
    return logp.reshape(call.lead), lse.reshape(call.lead), \
        entropy.reshape(call.lead) if head.compute_entropy else entropy, \
        hidden.new_empty(0, dtype=call.plan.compute_dtype) if logits is None else logits


@from_hidden_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
      row_temperature: torch.Tensor | None,
      settings: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    per_token = hidden.new_empty(hidden.shape[:-1], dtype=torch.float32)
    head = HeadOpSettings.decode(settings)
    entropy = torch.empty_like(per_token) if head.compute_entropy else hidden.new_empty(0, dtype=torch.float32)
    dtype = hidden.dtype if head.autocast is None else head.autocast_dtype
    if head.keep_logits:  # the active rows: how many is known when the op runs
        logits = hidden.new_empty(torch.library.get_ctx().new_dynamic_size(), weight.shape[0], dtype=dtype)
    else:
        logits = hidden.new_empty(0, dtype=dtype)
    return per_token, torch.empty_like(per_token), entropy, logits


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def from_hidden_backward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            active: torch.Tensor | None, lse: torch.Tensor, entropy: torch.Tensor,
                            grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
                            grad_entropy: torch.Tensor | None, row_temperature: torch.Tensor | None,
                            logits: torch.Tensor | None, settings: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``hidden`` and ``weight`` (empty where not wanted): the eager backward.
    ``settings``: the text of a :class:`~rl_engine.logprob.op_settings.HeadGradSettings` (the
    forward's settings and the gradients wanted); the forward's checks of the values are not redone.
    ``logits``: the forward op's kept logits (its fourth output) with ``keep_logits``, else ``None``."""
    grads = HeadGradSettings.decode(settings)
    head = dataclasses.replace(grads.head, validate=False)
    call = _prepare(hidden, weight, targets, active, row_temperature, head)
    flat = (lambda t: None if t is None else t.reshape(-1))  # noqa: E731 - four uses below
    with torch.autocast(hidden.device.type, enabled=False):
        grad_hidden, grad_weight = backward_chunks(
            hidden.reshape(call.tokens, -1), _compute_weight(weight, call.plan.compute_dtype), call.targets,
            active_rows(call.active), flat(lse), flat(entropy) if head.compute_entropy else None, flat(grad_logp),
            flat(grad_lse), flat(grad_entropy) if head.compute_entropy else None, call.plan, grads.want_hidden,
            grads.want_weight, weight.dtype, None, logits if head.keep_logits else None)
    return (hidden.new_empty(0) if grad_hidden is None else grad_hidden.reshape(hidden.shape),
            weight.new_empty(0) if grad_weight is None else grad_weight)


@from_hidden_backward_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
      lse: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
      grad_entropy: torch.Tensor | None, row_temperature: torch.Tensor | None, logits: torch.Tensor | None,
      settings: str) -> tuple[torch.Tensor, torch.Tensor]:
    grads = HeadGradSettings.decode(settings)
    return (torch.empty_like(hidden) if grads.want_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if grads.want_weight else weight.new_empty(0))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, targets, active, rows, settings = inputs
    ctx.save_for_backward(hidden, weight, targets, active, output[1], output[2], rows, output[3])
    ctx.settings = HeadOpSettings.decode(settings)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
              grad_entropy: torch.Tensor | None, _grad_logits: Any = None) -> tuple[Any, ...]:
    hidden, weight, targets, active, lse, entropy, row_temperature, logits = ctx.saved_tensors
    want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grads = HeadGradSettings(ctx.settings, want_hidden, want_weight)
    grad_hidden, grad_weight = from_hidden_backward_op(
        hidden, weight, targets, active, lse, entropy, grad_logp, grad_lse,
        grad_entropy if ctx.settings.compute_entropy else None, row_temperature,
        logits if ctx.settings.keep_logits else None, grads.encode())
    return grad_hidden if want_hidden else None, grad_weight if want_weight else None, None, None, None, None


from_hidden_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: Any, *,
                         num_vocab_tiles: int | str, real_vocab_size: int | None, compute_entropy: bool,
                         validate: bool, chunk_tokens: int, backend: str, ignore_index: int, max_tp: int,
                         grad_weight_fp32: bool, temperature: Any, hidden_grad: str,
                         matmul: str, keep_logits: bool) -> LogprobOutput:
    """Under ``torch.compile``: ``rl_engine::selected_logprob_from_hidden``, with the tile count and the
    logits' dtype (autocast's, where it is enabled) resolved at tracing into the op's one settings text
    (:func:`rl_engine.logprob.op_settings.settings_text`: another temperature is another text, a
    recompile); ``keep_logits`` too, False where no gradient is wanted (grad mode and ``requires_grad``
    are guarded); no provenance in the graph."""
    tiles = resolve_vocab_tiles(num_vocab_tiles, weight.shape[0], max_tp)["resolved"]
    _, autocast = compute_dtype_of(hidden)
    rows = temperature if isinstance(temperature, torch.Tensor) else None  # a temperature per token
    settings = settings_text(
        HeadOpSettings, real_vocab_size=weight.shape[0] if real_vocab_size is None else real_vocab_size,
        num_vocab_tiles=tiles, ignore_index=ignore_index, compute_entropy=compute_entropy, validate=validate,
        backend=backend, chunk_tokens=chunk_tokens, grad_weight_fp32=grad_weight_fp32,
        temperature=1.0 if rows is not None else temperature, matmul=matmul, autocast=autocast,
        keep_logits=keep_logits and _grad_wanted(hidden, weight) if isinstance(keep_logits, bool) else keep_logits)
    logp, lse, entropy, _ = from_hidden_op(hidden, weight, targets, active, rows, settings)
    return LogprobOutput(logp, lse, entropy if compute_entropy else None, None)


__all__ = [
    "BACKWARD_OP",
    "DEFAULT_CHUNK_TOKENS",
    "OP",
    "Prepared",
    "compiled_from_hidden",
    "compute_dtype_of",
    "from_hidden_op",
    "prepare",
    "selected_logprob_from_hidden",
]
