"""The one-rank logprob as a registered op, so that ``torch.compile(fullgraph=True)`` keeps it whole.

:func:`rl_engine.logprob.api.selected_logprob` checks its input with host reads (targets in the
real vocabulary, an integer mask of 0 and 1, the thread's gradual underflow): each such read is
a graph break under ``torch.compile``, and ``fullgraph=True`` refuses them. Under compilation the
call goes instead to ``rl_engine::selected_logprob``, a custom op (``torch.library.custom_op``):
the graph holds one opaque node whose fake implementation gives the output shapes, and at run
time its real implementation is the eager call itself, every check included: the checks run
outside the graph, the bytes are those of the eager call (tested), and a refusal raises the
same :class:`~rl_engine.logprob.contract.LogprobContractError`. The gradient is a second op,
``rl_engine::selected_logprob_backward``, registered as the first one's autograd formula.

What the compiled call does not carry: ``out.provenance`` is ``None`` (the backend choice is
Python the graph does not hold: call once without compiling to record it), and a TP or CP group
(the op with ``group=`` stays an eager call).
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.registry import dispatch
from rl_engine.logprob.vocab_parallel import vocab_parallel_backward

OP = "rl_engine::selected_logprob"
BACKWARD_OP = "rl_engine::selected_logprob_backward"


def _eager(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None, real_vocab_size: int,
           num_vocab_tiles: int, ignore_index: int, compute_entropy: bool, validate: bool,
           backend: str, chunk_rows: int | None, temperature: float,
           row_temperature: torch.Tensor | None = None) -> Any:
    from rl_engine.logprob.api import selected_logprob  # it imports this module

    return selected_logprob(logits, targets, active, num_vocab_tiles=num_vocab_tiles,
                            real_vocab_size=real_vocab_size, compute_entropy=compute_entropy,
                            validate=validate, backend=backend, ignore_index=ignore_index,
                            chunk_rows=chunk_rows,
                            temperature=temperature if row_temperature is None else row_temperature)


@torch.library.custom_op(OP, mutates_args=())
def selected_logprob_op(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
                        real_vocab_size: int, num_vocab_tiles: int, ignore_index: int,
                        compute_entropy: bool, validate: bool, backend: str, chunk_rows: int | None,
                        temperature: float = 1.0, row_temperature: torch.Tensor | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logp, lse, entropy)`` of :func:`rl_engine.logprob.api.selected_logprob` run eagerly,
    every check included (entropy empty without ``compute_entropy``); ``row_temperature``: a
    temperature per row (the eager call's tensor ``temperature``), with ``temperature`` 1."""
    with torch.no_grad():
        out = _eager(logits, targets, active, real_vocab_size, num_vocab_tiles, ignore_index,
                     compute_entropy, validate, backend, chunk_rows, temperature, row_temperature)
    entropy = out.entropy if out.entropy is not None else logits.new_empty(0, dtype=torch.float32)
    return out.selected_logp.clone(), out.lse.clone(), entropy.clone()


@selected_logprob_op.register_fake
def _(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None, real_vocab_size: int,
      num_vocab_tiles: int, ignore_index: int, compute_entropy: bool, validate: bool,
      backend: str, chunk_rows: int | None, temperature: float = 1.0,
      row_temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_token = logits.new_empty(logits.shape[:-1], dtype=torch.float32)
    entropy = torch.empty_like(per_token) if compute_entropy else logits.new_empty(0, dtype=torch.float32)
    return per_token, torch.empty_like(per_token), entropy


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def selected_logprob_backward_op(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor | None,
                                 lse: torch.Tensor, grad_logp: torch.Tensor | None,
                                 grad_lse: torch.Tensor | None, real_vocab_size: int, num_vocab_tiles: int,
                                 ignore_index: int,
                                 backend: str, temperature: float = 1.0, grad_entropy: torch.Tensor | None = None,
                                 entropy: torch.Tensor | None = None,
                                 row_temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient to the logits: the eager op's own backward (``vocab_parallel_backward`` with
    the backend's engine), one rounding to the logits' dtype."""
    from rl_engine.logprob.api import DTYPE_NAMES, trainer_inputs
    from rl_engine.logprob.row_temperature import row_temperature32

    vocab, lead = logits.shape[-1], tuple(logits.shape[:-1])
    targets, active = trainer_inputs(targets, active, lead, ignore_index)
    row_t32 = None if row_temperature is None else row_temperature32(row_temperature, lead, logits.device)
    num_sequences, seq_len = (1, lead[0]) if len(lead) == 1 else lead
    contract = LogprobContract(real_vocab_size=real_vocab_size, padded_vocab_size=vocab,
                               num_vocab_tiles=num_vocab_tiles, num_sequences=num_sequences,
                               seq_len=seq_len, logits_dtype=DTYPE_NAMES[logits.dtype],
                               ignore_index=ignore_index, temperature=temperature)
    op = dispatch(backend, contract, logits.device.type).op
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
      grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None, real_vocab_size: int,
      num_vocab_tiles: int, ignore_index: int, backend: str, temperature: float = 1.0,
      grad_entropy: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
      row_temperature: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty_like(logits)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    logits, targets, active, real_vocab_size, num_vocab_tiles, ignore_index, _, _, backend, _, temperature, rows = inputs
    ctx.save_for_backward(logits, targets, active, output[1], output[2], rows)
    ctx.fields = (real_vocab_size, num_vocab_tiles, ignore_index, backend, temperature)
    ctx.set_materialize_grads(False)


def _backward(ctx: Any, grad_logp: torch.Tensor | None, grad_lse: torch.Tensor | None,
              grad_entropy: torch.Tensor | None) -> tuple[Any, ...]:
    logits, targets, active, lse, entropy, rows = ctx.saved_tensors
    if entropy.shape != lse.shape:  # no entropy was computed
        grad_entropy = None
    grad = selected_logprob_backward_op(logits, targets, active, lse, grad_logp, grad_lse, *ctx.fields,
                                        grad_entropy, entropy if grad_entropy is not None else None, rows)
    return (grad,) + (None,) * 11


selected_logprob_op.register_autograd(_backward, setup_context=_setup_context)

__all__ = ["BACKWARD_OP", "OP", "selected_logprob_op", "selected_logprob_backward_op"]
