"""Drop-ins for verl's ``verl.utils.torch_functional.logprobs_from_logits`` and
``entropy_from_logits``, with their signatures, on rl_engine's arithmetic.

verl divides the logits by the temperature before calling them (``logits.div_(temperature)``);
with these, pass the raw logits and ``temperature=`` instead, so the division happens inside the
arithmetic (docs/arithmetic.md section 6 step 0) and no second ``[batch, seq, vocab]`` tensor is
made. Both are differentiable (the entropy too: section 7 step 1) and their bytes do not depend on
how verl splits a batch into micro-batches. Every row is active: verl masks the result with its
``response_mask`` afterwards, as with its own functions.

verl's actor computes both from the same logits, one call after the other (``logprobs_from_logits``
then ``entropy_from_logits``, when ``calculate_entropy``): two passes over ``[tokens, vocab]`` forward
and two backward. :func:`logprobs_and_entropy_from_logits` is that call site in one pass (our op with
``compute_entropy=True``): the same bytes as the two calls, and one backward for both terms.

The output dtype: float32, whatever the logits' dtype (the arithmetic's binary32 results). verl's
``entropy_from_logits``, and its ``logprobs_from_logits`` without flash-attn (``log_softmax`` in the
logits' dtype), return the logits' dtype: bf16 for bf16 logits (with flash-attn its log-probs are
float32). ``cast_to_logits_dtype=True`` returns ours rounded once to the logits' dtype (to nearest,
ties to even), for code that expects verl's dtype; the gradient flows through that cast.

``temperature`` is a number (verl's ``temperature``, one for the batch) or a tensor of the labels'
shape (one per token: a batch whose rows were sampled at different temperatures), as
:func:`rl_engine.logprob.api.selected_logprob` takes it.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.logprob.api import selected_logprob
from rl_engine.logprob.contract import LogprobContractError

AUTO = "auto"


def _check_cast(cast_to_logits_dtype: Any) -> None:
    if not isinstance(cast_to_logits_dtype, bool):
        raise LogprobContractError(f"cast_to_logits_dtype={cast_to_logits_dtype!r} must be True or False (True: the "
                                   "outputs in the logits' dtype, as verl's own functions give them; False: float32)")


def _out(value: torch.Tensor, logits: torch.Tensor, cast_to_logits_dtype: bool) -> torch.Tensor:
    return value.to(logits.dtype) if cast_to_logits_dtype else value


def _all_active(labels: torch.Tensor) -> torch.Tensor:
    return torch.ones(labels.shape, dtype=torch.bool, device=labels.device)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True, *,
                         num_vocab_tiles: int | str = AUTO, temperature: float | torch.Tensor = 1.0,
                         backend: str = AUTO,
                         real_vocab_size: int | None = None, cast_to_logits_dtype: bool = False) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``labels``: ``[..., vocab]`` logits, ``[...]`` labels
    (``inplace_backward`` is accepted for verl's signature; this backward never writes the logits).
    Float32, or the logits' dtype with ``cast_to_logits_dtype=True``."""
    del inplace_backward
    _check_cast(cast_to_logits_dtype)
    out = selected_logprob(logits, labels, _all_active(labels), num_vocab_tiles=num_vocab_tiles,
                           temperature=temperature, backend=backend, real_vocab_size=real_vocab_size)
    return _out(out.selected_logp, logits, cast_to_logits_dtype)


def entropy_from_logits(logits: torch.Tensor, *, num_vocab_tiles: int | str = AUTO,
                        temperature: float | torch.Tensor = 1.0,
                        backend: str = AUTO, real_vocab_size: int | None = None,
                        cast_to_logits_dtype: bool = False) -> torch.Tensor:
    """The entropy of ``softmax(logits / temperature)`` per row, differentiable. Float32, or the
    logits' dtype with ``cast_to_logits_dtype=True``."""
    _check_cast(cast_to_logits_dtype)
    lead = logits.shape[:-1]
    ids = torch.zeros(lead, dtype=torch.int64, device=logits.device)
    out: Any = selected_logprob(logits, ids, _all_active(ids), num_vocab_tiles=num_vocab_tiles,
                                temperature=temperature, backend=backend, real_vocab_size=real_vocab_size,
                                compute_entropy=True)
    return _out(out.entropy, logits, cast_to_logits_dtype)


def logprobs_and_entropy_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True, *,
                                     num_vocab_tiles: int | str = AUTO, temperature: float | torch.Tensor = 1.0,
                         backend: str = AUTO,
                                     real_vocab_size: int | None = None,
                                     cast_to_logits_dtype: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs_from_logits(logits, labels), entropy_from_logits(logits))`` from one pass of the op
    (``compute_entropy=True``): the same bytes as the two calls, and one backward for a loss that uses
    both (``entropy_coeff``). Float32, or the logits' dtype with ``cast_to_logits_dtype=True``."""
    del inplace_backward
    _check_cast(cast_to_logits_dtype)
    out: Any = selected_logprob(logits, labels, _all_active(labels), num_vocab_tiles=num_vocab_tiles,
                                temperature=temperature, backend=backend, real_vocab_size=real_vocab_size,
                                compute_entropy=True)
    return (_out(out.selected_logp, logits, cast_to_logits_dtype),
            _out(out.entropy, logits, cast_to_logits_dtype))


__all__ = ["entropy_from_logits", "logprobs_and_entropy_from_logits", "logprobs_from_logits"]
