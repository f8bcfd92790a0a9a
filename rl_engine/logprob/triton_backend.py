"""Backend ``triton-vocab-parallel-logp-ws2``: the eager backend with its chunk loops in Triton.

The per-rank compute runs in the Triton kernels of :mod:`rl_engine.logprob.triton_kernels`
(the forward's tile partials, one program per (row, tile); the fused backward, one program
per (row, block of columns)); validation, the all-gather of partials, the merge, autograd and
the rank agreement are the eager backend's code, so logp, LSE, entropy and gradient are the
bytes of ``pytorch-vocab-parallel-logp-ws2`` (``tests/test_triton_backend.py``).

Two modes, chosen explicitly, never by a fallback:

* ``compiled`` (the default): ``triton.jit`` kernels on CUDA tensors; every launch passes
  ``enable_fp_fusion=False`` (no multiply-add contracted into an FMA).
* ``interpreter``: Triton's interpreter runs the same kernel source on CPU tensors through
  NumPy, one IEEE operation at a time. It is selected by ``TritonLogprob(mode="interpreter")``
  or, for processes a launcher starts (torchrun ranks), by the environment variable
  ``RL_ENGINE_TRITON_MODE=interpreter``; the mode is part of the backend's provenance
  (:func:`triton_mode`, recorded in each campaign report's ``dispatch`` section). Triton's own
  ``TRITON_INTERPRET=1`` is not read: it would turn every ``triton.jit`` of the process into
  an interpreted function, including other libraries'.

Fail closed: without Triton, without CUDA (compiled mode), or when a kernel does not compile,
:func:`triton_unavailable` gives the reason, the registry marks the backend unavailable and
``dispatch`` raises ``BackendUnavailableError``; a launch that fails raises
:class:`TritonKernelError`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rl_engine.tables import TRITON_BACKEND, TRITON_MODE_ENV
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.vocab_parallel import (
    BackwardTerms,
    LocalEngine,
    VocabParallelLogprob,
    real_local_columns,
)

TRITON_ID = TRITON_BACKEND
MODES: tuple[str, ...] = ("compiled", "interpreter")
MODE_ENV = TRITON_MODE_ENV
MODE_DEVICES: dict[str, str] = {"compiled": "cuda", "interpreter": "cpu"}
# Oldest Triton the kernels are tested with (tests/test_triton_versions.py); newest: the
# installed one (3.9.0 when written).
MIN_TRITON = (3, 6)
BACKWARD_BLOCK = 4096
KERNEL_FILE = Path(__file__).with_name("triton_kernels.py")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class TritonKernelError(RuntimeError):
    """Triton is missing or too old, a kernel does not compile, or a launch failed."""


def env_mode() -> str:
    """The mode named by ``RL_ENGINE_TRITON_MODE`` (``compiled`` when unset); a bad value raises."""
    mode = os.environ.get(MODE_ENV, "compiled")
    if mode not in MODES:
        raise LogprobContractError(
            f"{MODE_ENV}={mode!r} is not one of {list(MODES)}; unset it for compiled kernels "
            "on CUDA, or set it to 'interpreter' to run the kernels on CPU tensors"
        )
    return mode


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise LogprobContractError(f"mode={mode!r} is not one of {list(MODES)}")
    return str(mode)


def triton_mode() -> str:
    """The mode this process runs the backend in (recorded in the reports' provenance)."""
    return env_mode()


def mode_device(mode: str | None = None) -> str:
    """The device the backend serves in ``mode`` (default: the environment's mode)."""
    return MODE_DEVICES[check_mode(mode or env_mode())]


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@lru_cache(maxsize=None)
def load_kernels(mode: str) -> ModuleType:
    """The kernel module in ``mode`` (loaded once per mode and process), or TritonKernelError."""
    check_mode(mode)
    try:
        import triton
    except ImportError as exc:
        raise TritonKernelError(
            f"Triton is not installed ({exc}); install it (pip install 'triton>=3.6', or the "
            "Triton your CUDA torch pins)"
        ) from None
    if _version(triton.__version__) < MIN_TRITON:
        raise TritonKernelError(
            f"Triton {triton.__version__} is older than the oldest tested, "
            f"{'.'.join(map(str, MIN_TRITON))}; upgrade it"
        )
    name = f"rl_engine.logprob._triton_kernels_{mode}"
    spec = importlib.util.spec_from_file_location(name, KERNEL_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.KERNEL_MODE = mode  # type: ignore[attr-defined]
    sys.modules[name] = module  # Triton reads a jit function's module by name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to build the kernels is a reason
        sys.modules.pop(name, None)
        raise TritonKernelError(f"the Triton kernels do not load in {mode} mode: {exc}") from None
    return module


def triton_unavailable(mode: str | None = None) -> str | None:
    """Why the backend cannot run here (None when it can): the registry's availability."""
    try:
        mode = check_mode(mode or env_mode())
        load_kernels(mode)
    except (TritonKernelError, LogprobContractError) as exc:
        return str(exc)
    if mode == "compiled" and not torch.cuda.is_available():
        return "compiled Triton kernels need CUDA, which is not available on this machine"
    return None


def levels(width: int) -> int:
    """``log2`` of the slots a tile of ``width`` columns occupies (the next power of two)."""
    return max(0, math.ceil(math.log2(width))) if width > 1 else 0


@lru_cache(maxsize=64)
def _slot_table(width: int, device: str) -> torch.Tensor:
    from rl_engine.logprob.triton_kernels import fold_slots

    return torch.tensor(fold_slots(width), dtype=torch.int32, device=device)


def _raw(logits: torch.Tensor) -> torch.Tensor:
    """The logits as the kernels read them: binary32 as is, bf16 and binary16 as int16 bits."""
    x = logits.detach()
    if x.dim() != 2 or x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        x = x.contiguous()
    return x if x.dtype == torch.float32 else x.view(torch.int16)


def _launch(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], meta: dict[str, Any]) -> None:
    try:
        kernel[grid](*args, **meta, enable_fp_fusion=False)
    except Exception as exc:  # noqa: BLE001 - compile or launch failure: raise with the reason
        raise TritonKernelError(f"{TRITON_ID}: kernel {getattr(kernel, '__name__', kernel)} "
                                f"failed: {type(exc).__name__}: {exc}") from exc


Launch = tuple[tuple[int, ...], tuple[Any, ...], dict[str, Any]]


def forward_launch(
    x: torch.Tensor, contract: LogprobContract, m: torch.Tensor, s: torch.Tensor,
    t: torch.Tensor | None, bad: torch.Tensor | None, with_entropy: bool, validate: bool,
    logits_dtype: torch.dtype,
) -> Launch:
    """Grid, arguments and constants of one forward launch (also what the PTX check compiles)."""
    width = contract.tile_width
    tiles = contract.local_vocab_size // width
    args = (x, _slot_table(width, str(x.device)), m, s, t if t is not None else m,
            bad if bad is not None else m, x.stride(0), real_local_columns(contract))
    meta = {"TILES": tiles, "WIDTH": width, "LEVELS": levels(width),
            "DTYPE": _DTYPE_CODES[logits_dtype], "WITH_ENTROPY": with_entropy,
            "VALIDATE": validate}
    return (x.shape[0] * tiles,), args, meta


def backward_launch(
    x: torch.Tensor, lse: torch.Tensor, terms: BackwardTerms, out: torch.Tensor,
    logits_dtype: torch.dtype,
) -> Launch:
    """Grid, arguments and constants of one backward launch (also what the PTX check compiles)."""
    rows, local_vocab = x.shape
    block = min(BACKWARD_BLOCK, 1 << levels(local_vocab))
    blocks = -(-local_vocab // block)
    args = (x, lse.detach().float().contiguous(), terms.coef.float().contiguous(),
            terms.target_col.to(torch.int64).contiguous(), terms.target_add.float().contiguous(),
            out, x.stride(0), local_vocab, terms.real_local)
    meta = {"BLOCKS": blocks, "BLOCK": block, "DTYPE": _DTYPE_CODES[logits_dtype]}
    return (rows * blocks,), args, meta


def triton_partials(
    logits: torch.Tensor, contract: LogprobContract, with_entropy: bool, validate: bool,
    mode: str = "compiled",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(m, s, t, finite)`` of the local shard: what the eager ``_local_partials`` returns."""
    k = load_kernels(mode)
    x = _raw(logits)
    rows = x.shape[0]
    tiles = contract.local_vocab_size // contract.tile_width
    dev = logits.device
    m = torch.empty(rows, tiles, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else None
    bad = torch.zeros(rows, tiles, dtype=torch.int8, device=dev) if validate else None
    if rows and tiles:
        grid, args, meta = forward_launch(x, contract, m, s, t, bad, with_entropy, validate,
                                          logits.dtype)
        _launch(k.forward_partials_kernel, grid, args, meta)
    finite = None
    if bad is not None:
        finite = bad.amax(dim=1) == 0 if tiles else torch.ones(rows, dtype=torch.bool, device=dev)
    return m, s, t, finite


def triton_backward(
    logits: torch.Tensor, lse: torch.Tensor, terms: BackwardTerms, mode: str = "compiled"
) -> torch.Tensor:
    """The local gradient (sections 7-8), with the ``coef == 0`` overrides and zero padding."""
    k = load_kernels(mode)
    x = _raw(logits)
    rows, local_vocab = x.shape
    grad = torch.empty((rows, local_vocab), dtype=logits.dtype, device=logits.device)
    if rows and local_vocab:
        out = grad if grad.dtype == torch.float32 else grad.view(torch.int16)
        grid, args, meta = backward_launch(x, lse, terms, out, logits.dtype)
        _launch(k.backward_kernel, grid, args, meta)
    return grad


class TritonEngine(LocalEngine):
    """:class:`LocalEngine` on the Triton kernels (``chunk_rows`` is not used: one launch)."""

    def __init__(self, mode: str = "compiled") -> None:
        self.mode = check_mode(mode)

    def local_partials(self, logits, contract, chunk_rows, with_entropy, validate):  # type: ignore[override]
        return triton_partials(logits, contract, with_entropy, validate, self.mode)

    def local_backward(self, logits, lse, terms, chunk_rows):  # type: ignore[override]
        return triton_backward(logits, lse, terms, self.mode)


class TritonLogprob(VocabParallelLogprob):
    """The callable op of backend ``triton-vocab-parallel-logp-ws2``.

    ``mode`` (default: ``RL_ENGINE_TRITON_MODE``, else ``compiled``) picks compiled kernels on
    CUDA tensors or the interpreter on CPU tensors; logits on another device are refused.
    Building it loads the kernels, so a missing Triton raises here, not at the first call.
    """

    backend_id = TRITON_ID

    def __init__(self, mode: str | None = None) -> None:
        super().__init__()
        self.mode = check_mode(mode) if mode is not None else env_mode()
        load_kernels(self.mode)
        self.devices = frozenset({MODE_DEVICES[self.mode]})
        self._engine = TritonEngine(self.mode)

    def engine(self) -> LocalEngine:
        return self._engine


__all__ = [
    "MODES",
    "MODE_ENV",
    "TRITON_ID",
    "TritonEngine",
    "TritonKernelError",
    "TritonLogprob",
    "load_kernels",
    "mode_device",
    "triton_backward",
    "triton_mode",
    "triton_partials",
    "triton_unavailable",
]
