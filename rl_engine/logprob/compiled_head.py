"""The fused head as a registered op, so that ``torch.compile(fullgraph=True)`` keeps it whole.

:func:`rl_engine.logprob.hidden.selected_logprob_from_hidden` reads from the host (the active
rows' indices, the checks of its inputs, the backend choice): each read is a graph break under
``torch.compile`` and ``fullgraph=True`` refuses them. Under compilation the call goes instead to
``rl_engine::selected_logprob_from_hidden``, a ``torch.library.custom_op`` whose fake
implementation gives the outputs' shapes (one float32 value per token: they do not depend on how
many rows are active) and whose real implementation is the eager call's own code
(:func:`rl_engine.logprob.hidden.prepare` and :mod:`rl_engine.logprob.hidden_chunks`), checks
included: the bytes are the eager call's and a refusal raises the same
:class:`~rl_engine.logprob.contract.LogprobContractError`. The gradient is a second op,
``rl_engine::selected_logprob_from_hidden_backward``, registered as the first one's autograd
formula, which recomputes each chunk's logits as the eager backward does.

Autocast is resolved when the graph is traced (the logits' dtype is an argument of the op), so the
op computes the same dtype whether or not autocast is active around the compiled code at run time.
What the compiled call does not carry: ``out.provenance`` is ``None`` (call once without compiling
to record it), and ``group=`` or a DTensor weight (those calls stay eager: a graph break).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.logprob.api import DTYPE_NAMES, resolve_vocab_tiles
from rl_engine.logprob.hidden_chunks import active_rows, backward_chunks, forward_chunks
from rl_engine.logprob.vocab_parallel import LogprobOutput

OP = "rl_engine::selected_logprob_from_hidden"
BACKWARD_OP = "rl_engine::selected_logprob_from_hidden_backward"


def _prepare(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
             real_vocab_size: int, num_vocab_tiles: int, ignore_index: int, compute_entropy: bool, validate: bool,
             backend: str, chunk_tokens: int, grad_weight_fp32: bool, temperature: float, matmul: str,
             autocast_dtype: torch.dtype | None, row_temperature: torch.Tensor | None = None) -> Any:
    from rl_engine.logprob.hidden import prepare  # it imports this module
    from rl_engine.logprob.hidden_dtensor import head_weight

    compute_dtype = hidden.dtype if autocast_dtype is None else autocast_dtype
    autocast = None if autocast_dtype is None else DTYPE_NAMES.get(autocast_dtype, str(autocast_dtype))
    return prepare(hidden, head_weight(weight, None, "mean"), targets, active, num_vocab_tiles=num_vocab_tiles,
                   real_vocab_size=real_vocab_size, compute_entropy=compute_entropy, validate=validate,
                   chunk_tokens=chunk_tokens, backend=backend, ignore_index=ignore_index, max_tp=1,
                   grad_weight_fp32=grad_weight_fp32,
                   temperature=temperature if row_temperature is None else row_temperature, hidden_grad="all_reduce",
                   matmul=matmul, compute_dtype=compute_dtype, autocast=autocast)


def _compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.detach() if weight.dtype == dtype else weight.detach().to(dtype)


@torch.library.custom_op(OP, mutates_args=())
def from_hidden_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
                   real_vocab_size: int, num_vocab_tiles: int, ignore_index: int, compute_entropy: bool,
                   validate: bool, backend: str, chunk_tokens: int, grad_weight_fp32: bool, temperature: float,
                   matmul: str, autocast_dtype: torch.dtype | None,
                   row_temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, lse, entropy)`` per token of the eager fused head (entropy empty without
    ``compute_entropy``), every check included; ``row_temperature``: a temperature per token (the
    eager call's tensor ``temperature``), with ``temperature`` 1."""
    call = _prepare(hidden, weight, targets, active, real_vocab_size, num_vocab_tiles, ignore_index, compute_entropy,
                    validate, backend, chunk_tokens, grad_weight_fp32, temperature, matmul, autocast_dtype,
                    row_temperature)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        logp, lse, entropy = forward_chunks(hidden.reshape(call.tokens, -1), _compute_weight(weight, call.plan.compute_dtype),
                                            call.targets, active_rows(call.active), call.plan)
    return logp.reshape(call.lead), lse.reshape(call.lead), \
        entropy.reshape(call.lead) if compute_entropy else entropy


@from_hidden_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
      real_vocab_size: int, num_vocab_tiles: int, ignore_index: int, compute_entropy: bool, validate: bool,
      backend: str, chunk_tokens: int, grad_weight_fp32: bool, temperature: float, matmul: str,
      autocast_dtype: torch.dtype | None,
      row_temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_token = hidden.new_empty(hidden.shape[:-1], dtype=torch.float32)
    entropy = torch.empty_like(per_token) if compute_entropy else hidden.new_empty(0, dtype=torch.float32)
    return per_token, torch.empty_like(per_token), entropy


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def from_hidden_backward_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            active: torch.Tensor | None, lse: torch.Tensor, entropy: torch.Tensor,
                            grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
                            grad_entropy: torch.Tensor | None, real_vocab_size: int, num_vocab_tiles: int,
                            ignore_index: int, compute_entropy: bool, backend: str, chunk_tokens: int,
                            grad_weight_fp32: bool, temperature: float, matmul: str,
                            autocast_dtype: torch.dtype | None, want_hidden: bool, want_weight: bool,
                            row_temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of ``hidden`` and ``weight`` (empty where not wanted): the eager backward."""
    call = _prepare(hidden, weight, targets, active, real_vocab_size, num_vocab_tiles, ignore_index, compute_entropy,
                    False, backend, chunk_tokens, grad_weight_fp32, temperature, matmul, autocast_dtype,
                    row_temperature)
    flat = (lambda t: None if t is None else t.reshape(-1))  # noqa: E731 - four uses below
    with torch.autocast(hidden.device.type, enabled=False):
        grad_hidden, grad_weight = backward_chunks(
            hidden.reshape(call.tokens, -1), _compute_weight(weight, call.plan.compute_dtype), call.targets,
            active_rows(call.active), flat(lse), flat(entropy) if compute_entropy else None, flat(grad_logp),
            flat(grad_lse), flat(grad_entropy) if compute_entropy else None, call.plan, want_hidden, want_weight,
            weight.dtype)
    return (hidden.new_empty(0) if grad_hidden is None else grad_hidden.reshape(hidden.shape),
            weight.new_empty(0) if grad_weight is None else grad_weight)


@from_hidden_backward_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
      lse: torch.Tensor, entropy: torch.Tensor, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
      grad_entropy: torch.Tensor | None, real_vocab_size: int, num_vocab_tiles: int, ignore_index: int,
      compute_entropy: bool, backend: str, chunk_tokens: int, grad_weight_fp32: bool, temperature: float,
      matmul: str, autocast_dtype: torch.dtype | None, want_hidden: bool,
      want_weight: bool, row_temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(hidden) if want_hidden else hidden.new_empty(0),
            torch.empty_like(weight) if want_weight else weight.new_empty(0))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, targets, active = inputs[:4]
    ctx.save_for_backward(hidden, weight, targets, active, output[1], output[2], inputs[15])
    (ctx.real_vocab_size, ctx.num_vocab_tiles, ctx.ignore_index, ctx.compute_entropy, _, ctx.backend,
     ctx.chunk_tokens, ctx.grad_weight_fp32, ctx.temperature, ctx.matmul, ctx.autocast_dtype) = inputs[4:15]
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
              grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
    hidden, weight, targets, active, lse, entropy, row_temperature = ctx.saved_tensors
    want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_hidden, grad_weight = from_hidden_backward_op(
        hidden, weight, targets, active, lse, entropy, grad_logp, grad_lse,
        grad_entropy if ctx.compute_entropy else None, ctx.real_vocab_size, ctx.num_vocab_tiles, ctx.ignore_index,
        ctx.compute_entropy, ctx.backend, ctx.chunk_tokens, ctx.grad_weight_fp32, ctx.temperature, ctx.matmul,
        ctx.autocast_dtype, want_hidden, want_weight, row_temperature)
    return (grad_hidden if want_hidden else None, grad_weight if want_weight else None) + (None,) * 14


from_hidden_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, active: Any, *,
                         num_vocab_tiles: int | str, real_vocab_size: int | None, compute_entropy: bool,
                         validate: bool, chunk_tokens: int, backend: str, ignore_index: int, max_tp: int,
                         grad_weight_fp32: bool, temperature: Any, hidden_grad: str,
                         matmul: str) -> LogprobOutput:
    """Under ``torch.compile``: ``rl_engine::selected_logprob_from_hidden``, with the tile count and the
    logits' dtype (autocast's, where it is enabled) resolved at tracing; no provenance in the graph."""
    from rl_engine.logprob.hidden import compute_dtype_of

    tiles = resolve_vocab_tiles(num_vocab_tiles, weight.shape[0], max_tp)["resolved"]
    compute_dtype, autocast = compute_dtype_of(hidden)
    rows = temperature if isinstance(temperature, torch.Tensor) else None  # a temperature per token
    logp, lse, entropy = from_hidden_op(
        hidden, weight, targets, active, weight.shape[0] if real_vocab_size is None else real_vocab_size, tiles,
        ignore_index, compute_entropy, validate, backend, chunk_tokens, grad_weight_fp32,
        1.0 if rows is not None else temperature, matmul, None if autocast is None else compute_dtype, rows)
    return LogprobOutput(logp, lse, entropy if compute_entropy else None, None)


__all__ = ["BACKWARD_OP", "OP", "compiled_from_hidden", "from_hidden_backward_op", "from_hidden_op"]
