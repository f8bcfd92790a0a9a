"""The fused head's logits ``hidden @ weight.T``: in a fixed order (our kernel), or the library's.

Why our own product: a library GEMM (MKL, oneDNN, cuBLAS) picks its blocking, its split of the
inner sum and its kernel from the shape and the thread count, so the bits of one logit depend on
how many rows are multiplied with it (measured: CPU binary32 is not row-invariant) and on the
width of the TP shard. The op's promise (the same bytes at any TP degree, chunk size and batch)
starts at the logits, so from hidden states it needs logits whose bits depend on the row of
``hidden`` and the row of ``weight`` alone. ``matmul="fixed"`` is that product
(``rl_engine/logprob/_head_gemm.c``, ``docs/arithmetic.md`` section 12): per element, ``s = +0``
then ``s = fma(h[k], w[k], s)`` for ``k = 0 .. H-1`` in binary32 (each input upcast exactly), NaN
canonical, one rounding to the inputs' dtype. ``matmul="library"`` is ``torch.matmul``: the
model's own head's bits, with no invariance promised.

``"auto"`` is ``"fixed"`` on the CPU and ``"library"`` elsewhere (no fixed-order GPU kernel is
written: ``docs/guarantee.md``); the choice and its reason go to the provenance. ``"fixed"`` where
it cannot run raises :class:`~rl_engine.logprob.contract.LogprobContractError`; nothing falls back.
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from functools import lru_cache

import torch

from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.storage import require_readable

MATMULS = ("auto", "fixed", "library")
MODULE = "rl_engine.logprob._head_gemm"
ABI_VERSION = 1
ISA_NAMES = {"auto": 0, "baseline": 1, "avx2": 2, "avx512": 3}
MAX_THREADS = 256
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATUS = {
    1: "bad arguments, or an instruction set this CPU lacks (isa=)",
    2: ("a kernel thread flushes subnormal numbers to zero (FTZ/DAZ), which changes the logits' bits: "
        "call torch.set_flush_denormal(False) first"),
    3: "out of memory for a panel buffer",
    4: "a kernel thread failed to start",
}


@dataclass(frozen=True)
class MatmulChoice:
    """The product a call uses, and why (recorded as ``provenance["matmul"]``)."""

    requested: str
    used: str
    reason: str

    def __post_init__(self) -> None:
        if self.requested not in MATMULS or self.used not in MATMULS[1:]:
            raise LogprobContractError(f"matmul: requested={self.requested!r}, used={self.used!r} are not "
                                       f"among {MATMULS}")

    def record(self) -> dict[str, str]:
        return {"requested": self.requested, "used": self.used, "reason": self.reason}


def _load() -> ctypes.CDLL:
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise LogprobContractError(
            f"the compiled module {MODULE} (the fused head's fixed-order logits) is not built; run "
            "`pip install -e .` (or `python setup.py build_ext --inplace` in a checkout), or pass "
            "matmul='library' (the library's product: no invariance promised)")
    lib = ctypes.CDLL(spec.origin)
    if int(lib.rle_head_abi_version()) != ABI_VERSION:
        raise LogprobContractError(f"{spec.origin} has another kernel ABI than {ABI_VERSION}; rebuild it "
                                   "(`pip install -e .` or `python setup.py build_ext --inplace`)")
    c_i64, c_p, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.rle_head_logits.restype = c_int
    lib.rle_head_logits.argtypes = [c_p, c_i64, c_p, c_i64, c_int, c_i64, c_i64, c_i64, c_p, c_i64, c_int, c_int]
    lib.rle_head_selected_isa.restype = c_int
    lib.rle_head_selected_isa.argtypes = [c_int]
    return lib


@lru_cache(maxsize=1)
def _cached() -> ctypes.CDLL | LogprobContractError:
    try:
        return _load()
    except (LogprobContractError, OSError, AttributeError) as exc:
        return exc if isinstance(exc, LogprobContractError) else LogprobContractError(f"{MODULE}: {exc}")


def load_head_kernel() -> ctypes.CDLL:
    """The compiled kernel (loaded once per process), or :class:`LogprobContractError` saying why not."""
    found = _cached()
    if isinstance(found, LogprobContractError):
        raise found
    return found


def selected_isa(isa: str = "auto") -> int:
    """The instruction set ``isa`` resolves to on this CPU (``ISA_NAMES``' codes), -1 if it lacks it."""
    return int(load_head_kernel().rle_head_selected_isa(ISA_NAMES[isa]))


def choose_matmul(matmul: str, device: torch.device) -> MatmulChoice:
    """``matmul`` resolved for ``device``: ``fixed`` on the CPU, ``library`` elsewhere for ``auto``."""
    if matmul not in MATMULS:
        raise LogprobContractError(f"matmul={matmul!r} must be one of {MATMULS} (default 'auto')")
    if device.type != "cpu":
        if matmul == "fixed":
            raise LogprobContractError(
                f"matmul='fixed' runs on the CPU only; the logits are on {device}, where no fixed-order "
                "kernel is written (docs/guarantee.md): pass matmul='library' or 'auto'")
        return MatmulChoice(matmul, "library", f"no fixed-order kernel on {device.type}" if matmul == "auto"
                            else "given")
    if matmul == "library":
        return MatmulChoice(matmul, "library", "given")
    load_head_kernel()
    return MatmulChoice(matmul, "fixed", "the CPU's fixed-order kernel" if matmul == "auto" else "given")


def fixed_logits(hidden: torch.Tensor, weight: torch.Tensor, *, threads: int | None = None,
                 isa: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, cols]`` logits of ``hidden`` ``[rows, H]`` and ``weight`` ``[cols, H]`` (CPU, one dtype
    of bf16, fp16, fp32) in the fixed order of ``docs/arithmetic.md`` section 12, in that dtype.
    ``out``: a ``[rows, cols]`` tensor of that dtype with unit column stride to write them into (a
    slice of the fused head's kept logits, so they are not made twice); each element's bits are the
    same wherever it is written."""
    if hidden.dtype != weight.dtype or hidden.dtype not in _DTYPE_CODES or hidden.device.type != "cpu" \
            or weight.device.type != "cpu" or hidden.dim() != 2 or weight.dim() != 2 \
            or hidden.shape[1] != weight.shape[1]:
        raise LogprobContractError(
            f"fixed_logits takes CPU hidden [rows, H] and weight [cols, H] of one dtype among bf16, fp16, fp32; "
            f"got {tuple(hidden.shape)} {hidden.dtype} on {hidden.device} and {tuple(weight.shape)} "
            f"{weight.dtype} on {weight.device}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int)
                                or not 1 <= threads <= MAX_THREADS):
        raise LogprobContractError(f"threads={threads!r} must be an integer in [1, {MAX_THREADS}] or None")
    lib = load_head_kernel()
    require_readable("hidden", hidden)
    require_readable("weight", weight)
    h = _unit_stride(hidden)
    w = _unit_stride(weight)
    if out is None:
        out = torch.empty(h.shape[0], w.shape[0], dtype=h.dtype)
    elif out.shape != (h.shape[0], w.shape[0]) or out.dtype != h.dtype or out.device.type != "cpu" \
            or out.stride(1) != 1 or out.stride(0) < max(1, out.shape[1]):
        raise LogprobContractError(
            f"fixed_logits' out must be a CPU {h.dtype} tensor of shape {(h.shape[0], w.shape[0])} with unit column "
            f"stride; got {tuple(out.shape)} {out.dtype} on {out.device} with strides {tuple(out.stride())}")
    count = min(torch.get_num_threads(), MAX_THREADS) if threads is None else threads
    status = lib.rle_head_logits(h.data_ptr(), h.stride(0), w.data_ptr(), w.stride(0), _DTYPE_CODES[h.dtype],
                                 h.shape[0], w.shape[0], h.shape[1], out.data_ptr(), out.stride(0), count,
                                 ISA_NAMES[isa])
    if status != 0:
        raise LogprobContractError(f"the fused head's fixed-order logits failed: {_STATUS.get(status, status)}")
    return out


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """Rows with unit column stride, the neg bit resolved (the kernel reads raw memory)."""
    t = tensor.detach().resolve_neg()
    if t.stride(1) == 1 and t.stride(0) >= t.shape[1] and t.storage_offset() >= 0:
        return t
    return t.contiguous()


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, choice: MatmulChoice,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The logits of the chosen product (no autograd: the fused head's backward is its own), written
    into ``out`` when given (the library's product is made whole and copied there, so its bits are
    those of the call without ``out``)."""
    if choice.used == "fixed":
        return fixed_logits(hidden, weight, out=out)
    logits = hidden @ weight.T
    if out is None:
        return logits
    return out.copy_(logits)


__all__ = ["MATMULS", "MatmulChoice", "choose_matmul", "fixed_logits", "head_logits", "load_head_kernel",
           "selected_isa"]
