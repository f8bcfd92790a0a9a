"""What the fused C kernels may read and what their tile partials are written into.

Shared by the raw kernels (``fused_cpu``) and the processed ones (``fused_kept``): the kernels read
raw memory, so every operand is checked to lie inside its storage, has its neg bit resolved (a
``torch._neg_view`` would be read un-negated) and rows of unit column stride.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.storage import require_readable


def ptr(t: torch.Tensor | None) -> int | None:
    """The data pointer the kernel takes, or ``None`` (a NULL) for an absent operand."""
    return None if t is None else t.data_ptr()


def row_major(logits: torch.Tensor) -> torch.Tensor:
    """Rows with unit column stride (the kernel reads rows at a row stride)."""
    if logits.dim() == 2 and logits.stride(1) == 1 and logits.stride(0) >= logits.shape[1]:
        return logits
    return logits.contiguous()


def c_operand(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the kernel may read: inside its storage (checked), the neg bit resolved, unit stride
    (conj bits exist only on complex tensors, which the dtype checks refuse)."""
    require_readable(name, tensor)
    return row_major(tensor.detach().resolve_neg())


def partials_buffers(rows: int, contract: LogprobContract, with_entropy: bool,
                     validate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(m, s, t, row_min)`` for the local shard's whole tiles: ``t`` only with the entropy,
    ``row_min`` (the validation aid) only when validating."""
    m = torch.empty(rows, contract.local_tile_count, dtype=torch.float32)
    t = torch.empty_like(m) if with_entropy else None
    row_min = torch.empty(rows, dtype=torch.float32) if validate else None
    return m, torch.empty_like(m), t, row_min


def gradient_operands(lse: torch.Tensor, terms: Any) -> tuple[torch.Tensor, ...]:
    """What the raw and the processed backward kernels read beside the logits, as their C operands:
    ``lse``, the per-row ``coef``, ``target_col``, ``target_add`` (float32 and int64, contiguous),
    then the optional entropy gradient, ``mb`` and per-row temperature (``None`` where absent)."""
    def optional(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else c_operand(name, t.float())

    return (c_operand("lse", lse.float()), c_operand("coef", terms.coef.float()),
            c_operand("target_col", terms.target_col.to(torch.int64)),
            c_operand("target_add", terms.target_add.float()), optional("grad_entropy", terms.g_ent),
            optional("mb", terms.mb), optional("temperature", terms.row_t32))


__all__ = ["c_operand", "gradient_operands", "partials_buffers", "ptr", "row_major"]
