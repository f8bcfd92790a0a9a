"""Checks that a tensor's memory is really there, before compiled code or a collective reads it.

A tensor is a view of a storage: shape and strides say which bytes it covers, and nothing in
torch stops the storage from shrinking afterwards (FSDP frees a parameter buffer with
``untyped_storage().resize_(0)``) or from never existing (zero tensors, meta and fake
tensors). Compiled code, a ctypes kernel or a collective reads the bytes the view
describes, so a view past its storage reads freed memory (garbage, or SIGSEGV) and a
layout other than strided has no such bytes at all. :func:`require_readable` refuses each
case with a :class:`LogprobContractError` naming the tensor; the op calls it in its local
checks, before the agreement step, so one rank's bad tensor stops every rank together.
"""

from __future__ import annotations

import torch

from rl_engine.logprob.errors import LogprobContractError


def last_byte(tensor: torch.Tensor) -> int:
    """One past the last byte of the storage that ``tensor`` covers (0 for an empty tensor)."""
    if tensor.numel() == 0:
        return 0
    last = tensor.storage_offset() + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())
    )
    return (last + 1) * tensor.element_size()


def require_readable(name: str, tensor: torch.Tensor) -> None:
    """``tensor`` is strided, has real storage, and every element it covers lies inside it."""
    if tensor.layout != torch.strided:
        raise LogprobContractError(
            f"{name}.layout={tensor.layout} is not supported: the op reads dense strided memory; "
            f"pass {name}.to_dense()"
        )
    if torch._is_zerotensor(tensor):
        raise LogprobContractError(
            f"{name} is a zero tensor (torch._efficientzerotensor) with no storage to read; "
            f"materialise it first ({name}.clone(), or torch.zeros(...))"
        )
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError) as exc:
        raise LogprobContractError(
            f"{name} ({type(tensor).__name__}) has no storage this op can read ({exc}); pass a "
            "plain dense tensor"
        ) from None
    if storage.device.type == "meta" or storage.device != tensor.device:
        raise LogprobContractError(
            f"{name} has no real storage (its storage is on device {storage.device}: a meta or "
            f"fake tensor, type {type(tensor).__name__}); pass a tensor with real data"
        )
    need, have = last_byte(tensor), storage.nbytes()
    if need > have:
        raise LogprobContractError(
            f"{name}: its last element needs {need} bytes of storage, which holds {have} "
            f"bytes (shape {list(tensor.shape)}, strides {list(tensor.stride())}, offset "
            f"{tensor.storage_offset()}): the storage was freed or shrunk after the tensor was "
            "made (e.g. untyped_storage().resize_() by FSDP); pass the tensor while its storage "
            "is allocated"
        )


__all__ = ["last_byte", "require_readable"]
