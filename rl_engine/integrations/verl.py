"""Drop-ins for verl's ``verl.utils.torch_functional.logprobs_from_logits`` and
``entropy_from_logits``, with their signatures, on rl_engine's arithmetic.

verl divides the logits by the temperature before calling them (``logits.div_(temperature)``);
with these, pass the raw logits and ``temperature=`` instead, so the division happens inside the
arithmetic (docs/arithmetic.md section 6 step 0) and no second ``[batch, seq, vocab]`` tensor is
made. Both are differentiable (the entropy too: section 7 step 1) and their bytes do not depend on
how verl splits a batch into micro-batches. Every row is active: verl masks the result with its
``response_mask`` afterwards, as with its own functions.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.logprob.api import selected_logprob

AUTO = "auto"


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True, *,
                         num_vocab_tiles: int | str = AUTO, temperature: float = 1.0, backend: str = AUTO,
                         real_vocab_size: int | None = None) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``labels``: ``[..., vocab]`` logits, ``[...]`` labels
    (``inplace_backward`` is accepted for verl's signature; this backward never writes the logits)."""
    del inplace_backward
    active = torch.ones(labels.shape, dtype=torch.bool, device=labels.device)
    return selected_logprob(logits, labels, active, num_vocab_tiles=num_vocab_tiles, temperature=temperature,
                            backend=backend, real_vocab_size=real_vocab_size).selected_logp


def entropy_from_logits(logits: torch.Tensor, *, num_vocab_tiles: int | str = AUTO, temperature: float = 1.0,
                        backend: str = AUTO, real_vocab_size: int | None = None) -> torch.Tensor:
    """The entropy of ``softmax(logits / temperature)`` per row, differentiable."""
    lead = logits.shape[:-1]
    ids = torch.zeros(lead, dtype=torch.int64, device=logits.device)
    active = torch.ones(lead, dtype=torch.bool, device=logits.device)
    out: Any = selected_logprob(logits, ids, active, num_vocab_tiles=num_vocab_tiles, temperature=temperature,
                                backend=backend, real_vocab_size=real_vocab_size, compute_entropy=True)
    return out.entropy


__all__ = ["entropy_from_logits", "logprobs_from_logits"]
