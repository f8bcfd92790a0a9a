"""The logprob from the last hidden state and the lm_head weight, without the whole logits.

``selected_logprob_from_hidden(hidden, weight, targets, ...)`` is what a fused lm_head computes
(TRL's ``fused_lm_head``, Liger's chunked losses): the logits of ``chunk_tokens`` tokens at a
time, ``hidden[rows] @ weight.T`` in the inputs' dtype, go through the logprob op and are
dropped; the backward makes each chunk's logits again, takes the op's gradient to them (one
rounding to their dtype, as the op's own backward) and turns it into the gradients of ``hidden``
(``grad_logits @ weight``, row by row) and ``weight`` (``grad_logits.T @ hidden`` added chunk by
chunk into the weight's gradient: in the weight's dtype by default, one rounding per chunk, as
Liger's chunked losses do; with ``grad_weight_fp32=True`` in binary32, rounded once at the end,
at the cost of a binary32 copy of the weight).

The bits. The logprob, LSE and entropy are the op's arithmetic (``docs/arithmetic.md``) on each
chunk's logits, so they are the bytes of :func:`rl_engine.logprob.api.selected_logprob` on
``hidden @ weight.T`` wherever the matmul gives each row the bits it gives that row in the whole
product (row invariance: measured on the CPU in ``tests/test_from_hidden.py``; a GEMM that picks
its blocking from the row count may not have it). The logits' own bits are the matmul's: the
arithmetic's guarantees start at them. ``hidden``'s gradient is, by the same property, the
materialised path's; ``weight``'s is a sum over tokens in another order (chunk by chunk), so it
equals the materialised one only to within rounding (bitwise with one chunk).

Under TP (``group=``): ``weight`` is this rank's shard of the vocabulary, ``[padded_vocab / TP,
hidden_size]`` (an even split, as ``ColwiseParallel``/Megatron's column-parallel lm_head hold it),
``hidden`` is whole on every rank; each chunk's logits are the rank's columns and go through the TP
op (the same bytes as TP=1 on the concatenated shards' logits: the arithmetic does not depend on
the TP degree). ``weight``'s gradient is the shard's. ``hidden``'s gradient is the rank's partial
product ``grad_logits_shard @ weight_shard``; with ``hidden_grad="all_reduce"`` (the default under
TP) the ranks' partials are summed by one all-reduce over ``group`` per backward, the gradient of
the whole lm_head (its bits are that sum's: a column-parallel head's input gradient is a sum over
ranks in any framework, not a TP-invariant quantity); ``hidden_grad="partial"`` leaves the sum to a
framework that reduces it already (Megatron's ``copy_to_tensor_model_parallel_region``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import group_geometry
from rl_engine.logprob.api import DTYPE_NAMES, resolve_vocab_tiles, trainer_inputs
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.registry import dispatch
from rl_engine.logprob.vocab_parallel import LogprobOutput, vocab_parallel_backward
from rl_engine.tables import AUTO, MAX_TP

DEFAULT_CHUNK_TOKENS = 256


HIDDEN_GRADS = ("all_reduce", "partial")


def _chunk_contract(contract: LogprobContract, rows: int) -> LogprobContract:
    return LogprobContract(
        real_vocab_size=contract.real_vocab_size, padded_vocab_size=contract.padded_vocab_size,
        num_vocab_tiles=contract.num_vocab_tiles, num_sequences=1, seq_len=rows,
        tp_world_size=contract.tp_world_size, tp_rank=contract.tp_rank,
        logits_dtype=contract.logits_dtype, ignore_index=contract.ignore_index, temperature=contract.temperature)


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
        active: torch.Tensor, contract: LogprobContract, op: Any, chunk_tokens: int,
        compute_entropy: bool, validate: bool, grad_weight_fp32: bool, group: Any, reduce_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = hidden.shape[0]
        logp = hidden.new_empty(tokens, dtype=torch.float32)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if compute_entropy else hidden.new_empty(0, dtype=torch.float32)
        for start in range(0, tokens, chunk_tokens):
            end = min(start + chunk_tokens, tokens)
            logits = hidden[start:end] @ weight.T
            out = op(logits, targets[start:end], active[start:end], _chunk_contract(contract, end - start),
                     group=group, compute_entropy=compute_entropy, validate=validate)
            logp[start:end] = out.selected_logp
            lse[start:end] = out.lse
            if compute_entropy:
                entropy[start:end] = out.entropy
            del logits, out
        ctx.save_for_backward(hidden, weight, targets, active, lse, entropy)
        ctx.contract, ctx.op, ctx.chunk_tokens = contract, op, chunk_tokens
        ctx.grad_weight_fp32 = grad_weight_fp32
        ctx.group, ctx.reduce_hidden = group, reduce_hidden
        ctx.set_materialize_grads(False)  # an output the loss does not use gives None, not zeros
        if not compute_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, lse, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> tuple[Any, ...]:
        hidden, weight, targets, active, lse, entropy = ctx.saved_tensors
        if entropy.shape != lse.shape:
            grad_entropy = None
        contract, op, chunk = ctx.contract, ctx.op, ctx.chunk_tokens
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        accumulate = torch.float32 if ctx.grad_weight_fp32 else weight.dtype
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if want_weight else None
        with torch.no_grad():
            for start in range(0, hidden.shape[0], chunk):
                end = min(start + chunk, hidden.shape[0])
                rows = slice(start, end)
                logits = hidden[rows] @ weight.T
                part = _chunk_contract(contract, end - start)
                grad_logits = vocab_parallel_backward(
                    logits, targets[rows], active[rows], lse[rows],
                    None if grad_logp is None else grad_logp[rows],
                    None if grad_lse is None else grad_lse[rows], part,
                    op.default_chunk_rows(part, logits.device), op.engine(),
                    None if grad_entropy is None else grad_entropy[rows], entropy[rows] if grad_entropy is not None else None)
                del logits
                if grad_hidden is not None:
                    grad_hidden[rows] = grad_logits @ weight
                if grad_weight is not None and ctx.grad_weight_fp32:
                    grad_weight.addmm_(grad_logits.T.float(), hidden[rows].float())
                elif grad_weight is not None:
                    grad_weight.addmm_(grad_logits.T, hidden[rows])
                del grad_logits
        if grad_hidden is not None and ctx.reduce_hidden:
            import torch.distributed as dist

            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=ctx.group)  # the ranks' partial products
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None, None, None, None, None, None, None, None, None, None)


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
    grad_weight_fp32: bool = False,
    temperature: float = 1.0,
    group: Any = None,
    hidden_grad: str = "all_reduce",
) -> LogprobOutput:
    """Selected-token logprob of ``hidden @ weight.T`` made ``chunk_tokens`` tokens at a time.

    ``hidden`` is ``[tokens, hidden_size]`` or ``[batch, seq, hidden_size]``, ``weight``
    ``[vocab, hidden_size]`` (the lm_head's; its rows past ``real_vocab_size`` are padding), both
    in bf16, fp16 or fp32 and of one dtype (the logits' dtype); ``targets``, ``active``,
    ``num_vocab_tiles``, ``ignore_index``, ``backend`` and ``temperature`` as in
    :func:`rl_engine.logprob.api.selected_logprob`. The whole ``[tokens, vocab]`` logits never
    exist: at most ``chunk_tokens`` rows of them, and of their gradient. Differentiable to
    ``hidden`` and ``weight``. See the module docstring for the bits.
    """
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in DTYPE_NAMES:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise LogprobContractError(f"{name} must be a bf16, fp16 or fp32 tensor, got {got}")
    if hidden.dim() not in (2, 3) or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise LogprobContractError(
            f"hidden.shape={tuple(hidden.shape)} and weight.shape={tuple(weight.shape)} must be "
            "[tokens or batch, seq, hidden_size] and [vocab, hidden_size] with one hidden_size")
    if hidden.shape[-1] == 0:
        raise LogprobContractError(
            f"hidden.shape={tuple(hidden.shape)} and weight.shape={tuple(weight.shape)} have hidden_size 0: the "
            "logits would be sums of nothing; pass the model's last hidden state and its lm_head weight")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise LogprobContractError(
            f"group={group!r} is not a torch.distributed ProcessGroup; pass the TP group of a vocabulary-sharded "
            "lm_head (e.g. mesh.tp_group), or None for a whole lm_head")
    if hidden.dtype != weight.dtype or hidden.device != weight.device:
        raise LogprobContractError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, {weight.device}) must "
            "share a dtype (the logits') and a device; cast one of them")
    if not isinstance(grad_weight_fp32, bool):
        raise LogprobContractError(f"grad_weight_fp32={grad_weight_fp32!r} must be True or False")
    if hidden_grad not in HIDDEN_GRADS:
        raise LogprobContractError(f"hidden_grad={hidden_grad!r} must be one of {HIDDEN_GRADS}")
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise LogprobContractError(f"chunk_tokens={chunk_tokens!r} must be a positive integer (default "
                                   f"{DEFAULT_CHUNK_TOKENS})")
    lead = tuple(hidden.shape[:-1])
    targets, active = trainer_inputs(targets, active, lead, ignore_index)
    tp, tp_rank = group_geometry(group)
    vocab = weight.shape[0] * tp  # the shards are equal (an even split of the padded vocabulary)
    tiles = resolve_vocab_tiles(num_vocab_tiles, vocab, max_tp)
    tokens = hidden.reshape(-1, hidden.shape[-1]).shape[0]
    contract = LogprobContract(
        real_vocab_size=vocab if real_vocab_size is None else real_vocab_size, padded_vocab_size=vocab,
        num_vocab_tiles=tiles["resolved"], num_sequences=1, seq_len=tokens, tp_world_size=tp, tp_rank=tp_rank,
        logits_dtype=DTYPE_NAMES[hidden.dtype], ignore_index=ignore_index, temperature=temperature)
    if contract.vocab_end - contract.vocab_start != weight.shape[0]:
        raise LogprobContractError(
            f"weight.shape[0]={weight.shape[0]} is not this rank's share of the vocabulary {vocab} split into "
            f"{tp} tile-aligned shards ({contract.vocab_end - contract.vocab_start} rows); shard the lm_head evenly")
    chosen = dispatch(backend, contract, hidden.device.type)
    logp, lse, entropy = _FromHidden.apply(
        hidden.reshape(tokens, -1), weight, targets.reshape(-1), active.reshape(-1), contract, chosen.op,
        chunk_tokens, compute_entropy, validate, grad_weight_fp32, group, tp > 1 and hidden_grad == "all_reduce")
    return LogprobOutput(
        logp.reshape(lead), lse.reshape(lead), entropy.reshape(lead) if compute_entropy else None,
        {**chosen.provenance(), "num_vocab_tiles": tiles, "chunk_tokens": chunk_tokens},
    )


__all__ = ["DEFAULT_CHUNK_TOKENS", "selected_logprob_from_hidden"]
