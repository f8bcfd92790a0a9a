"""Tensor bytes: the one definition of a tensor's fingerprint and of the raw ``*.f32`` files.

A fingerprint is the SHA-256 of the tensor's bytes, contiguous and little-endian, so
``sha256sum file.f32`` equals the fingerprint recorded in a report. Bitwise comparisons
in this project compare these bytes, never ``allclose`` or ``torch.equal``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

from rl_engine.jsonio import atomic_write_bytes

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.bool: "bool",
}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Little-endian bytes of a tensor in row-major order."""
    t = tensor.detach().to("cpu").contiguous().reshape(-1)  # 0-d tensors cannot be viewed as bytes
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    if sys.byteorder != "little" and t.element_size() > 1:  # pragma: no cover - big endian hosts
        import numpy as np

        raw = np.frombuffer(raw, dtype=t.numpy().dtype).byteswap().tobytes()
    return raw


def fingerprint(tensor: torch.Tensor) -> str:
    """SHA-256 hex digest of :func:`tensor_bytes`."""
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def write_raw(path: str | os.PathLike[str], tensor: torch.Tensor) -> str:
    """Write the tensor's raw little-endian bytes atomically; return their SHA-256."""
    data = tensor_bytes(tensor)
    atomic_write_bytes(path, data)
    return hashlib.sha256(data).hexdigest()


def read_raw_f32(path: str | os.PathLike[str]) -> torch.Tensor:
    """Read a raw little-endian float32 file written by :func:`write_raw`."""
    return f32_from_bytes(Path(path).read_bytes(), path)


def f32_from_bytes(data: bytes, where: str | os.PathLike[str]) -> torch.Tensor:
    """The float32 values of raw little-endian bytes (a file :func:`write_raw` wrote, already read)."""
    if len(data) % 4:
        raise ValueError(f"{where}: {len(data)} bytes is not a whole number of float32 values")
    return torch.frombuffer(bytearray(data), dtype=torch.float32).clone()
