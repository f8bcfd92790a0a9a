"""Independent full-vocabulary oracles. Shares no code with the vocab-parallel backend.

* :func:`fp32_oracle` is the guide's reference: FP32 ``log_softmax`` over the real columns
  of the unsharded logits upcast to FP32.
* :func:`fp64_oracle` computes the same in FP64 on the dtype-rounded inputs, which
  isolates the kernel's own error from the rounding of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OracleOutput:
    """Selected logprob (0.0 on inactive rows), LSE and entropy of every row."""

    selected_logp: torch.Tensor
    lse: torch.Tensor
    entropy: torch.Tensor


def _oracle(
    logits: torch.Tensor,
    targets: torch.Tensor,
    active: torch.Tensor,
    real_vocab: int,
    dtype: torch.dtype,
) -> OracleOutput:
    if logits.dim() != 2 or logits.shape[1] < real_vocab:
        raise ValueError(
            f"oracle needs full logits [tokens, >= real_vocab={real_vocab}], got {tuple(logits.shape)}"
        )
    real = logits[:, :real_vocab].to(dtype)
    logsm = torch.log_softmax(real, dim=-1)
    lse = torch.logsumexp(real, dim=-1)
    safe = torch.where(active, targets, torch.zeros_like(targets))
    selected = logsm.gather(1, safe.unsqueeze(1)).squeeze(1)
    selected = torch.where(active, selected, torch.zeros_like(selected))
    entropy = -(logsm.exp() * logsm).sum(dim=-1)
    return OracleOutput(selected, lse, entropy)


def fp32_oracle(
    logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, real_vocab: int
) -> OracleOutput:
    """FP32 ``log_softmax`` over the real columns of the unsharded logits."""
    return _oracle(logits, targets, active, real_vocab, torch.float32)


def fp64_oracle(
    logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, real_vocab: int
) -> OracleOutput:
    """FP64 on the inputs as the candidate sees them (already rounded to their dtype)."""
    return _oracle(logits, targets, active, real_vocab, torch.float64)
