"""Backend ``cpu-vocab-parallel-logp-ws2``: the eager backend with its chunk loops in compiled C.

The per-rank compute (tile partials of the forward, the local gradient of the backward)
runs in ``rl_engine/logprob/backends/fused_cpu/_fused_cpu.c``: per (row, tile), one pass upcasts the tile into
an L1-resident buffer with its max, and one pass computes ``E`` and accumulates the lane
sums ``G`` and ``G*`` in vector registers, then folds the 128 lanes with ``F``; one pass per
row for the gradient (recompute ``E(x - lse)``, scale, add the target term, canonical NaN,
round once). It follows ``docs/arithmetic.md`` (``rl-engine-arith/2``) operation for
operation, every fusedMultiplyAdd included: the FMA instruction in the AVX2 and AVX-512
variants, a correctly rounded software one in the baseline; everything else (validation, the
all-gather of partials, the merge, autograd) is the eager backend's code, so the two backends
give the same bytes (``tests/test_fused_cpu.py``).

Why C through ctypes: the kernel needs nothing but IEEE binary32 arithmetic, integer bit
operations and threads, so plain C compiled by setuptools during ``pip install`` (no torch
headers, so pip's isolated build environment needs setuptools alone, never a CUDA torch) is
enough; ``-ffp-contract=off -fno-fast-math`` pin the operations (the only fused
multiply-adds are those the source writes). numba would add llvmlite and
a JIT cache on disk, and its LLVM may contract multiply-adds unless every function is
configured carefully. ctypes releases the GIL during the call; the C code splits rows
between ``torch.get_num_threads()`` pthreads.

Fail closed: if the compiled module is missing or does not load, :func:`kernel_unavailable`
says why, the registry marks the backend unavailable and ``dispatch`` raises
``BackendUnavailableError`` with that reason. Nothing falls back to the eager code.
"""

from __future__ import annotations

import ctypes
import importlib.util
import numbers
from dataclasses import dataclass
from functools import lru_cache

import torch

from rl_engine.arith.tiles import rows_finite
from rl_engine.logprob.backends.eager.vocab_parallel import (
    BackwardTerms,
    LocalEngine,
    VocabParallelLogprob,
    real_local_columns,
)
from rl_engine.logprob.backends.fused_cpu.fused_kept import (
    KernelCall,
    fused_kept_backward,
    fused_kept_cut,
    fused_kept_partials,
)
from rl_engine.logprob.backends.fused_cpu.operands import c_operand, gradient_operands, partials_buffers, ptr
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.tables import FUSED_CPU_BACKEND

FUSED_CPU_ID = FUSED_CPU_BACKEND
MODULE = "rl_engine.logprob.backends.fused_cpu._fused_cpu"
ABI_VERSION = 6
ISA_AUTO, ISA_BASELINE, ISA_AVX2, ISA_AVX512 = 0, 1, 2, 3
ISA_NAMES = {"auto": ISA_AUTO, "baseline": ISA_BASELINE, "avx2": ISA_AVX2, "avx512": ISA_AVX512}
MAX_THREADS = 256  # the size of the kernel's job table (run_split in _fused_cpu.c)
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_STATUS = {
    1: "bad arguments, or an instruction set this CPU lacks (isa=)",
    2: (
        "a kernel thread flushes subnormal numbers to zero (FTZ/DAZ); rl-engine-arith/2 needs "
        "IEEE gradual underflow: call torch.set_flush_denormal(False) before the logprob op"
    ),
    3: "out of memory for a tile buffer",
    4: "a kernel thread failed to start",
}


class FusedKernelError(RuntimeError):
    """The compiled kernel could not load, or a call to it failed; the message says why."""


@dataclass(frozen=True)
class FusedKernel:
    """The loaded shared object and its typed entry points."""

    path: str
    lib: ctypes.CDLL

    def check(self, status: int, what: str) -> None:
        if status != 0:
            reason = _STATUS.get(status, f"status {status}")
            if status == 2:
                raise LogprobContractError(f"{FUSED_CPU_ID} {what}: {reason}")
            raise FusedKernelError(f"{FUSED_CPU_ID} {what} failed: {reason}")

    def selected_isa(self, isa: int = ISA_AUTO) -> int:
        return int(self.lib.rle_selected_isa(isa))


_c_i64 = ctypes.c_int64
_c_p = ctypes.c_void_p


def _load() -> FusedKernel:
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise FusedKernelError(
            f"the compiled module {MODULE} is not built; run `pip install -e .` (or "
            "`python setup.py build_ext --inplace` in a checkout) with a C compiler available"
        )
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as exc:
        raise FusedKernelError(f"{spec.origin} does not load: {exc}") from None
    try:
        version = int(lib.rle_abi_version())
    except AttributeError as exc:
        raise FusedKernelError(f"{spec.origin} lacks the kernel entry points: {exc}") from None
    if version != ABI_VERSION:
        raise FusedKernelError(
            f"{spec.origin} has kernel ABI {version}, this code needs {ABI_VERSION}; rebuild it "
            "(`pip install -e .` or `python setup.py build_ext --inplace`)"
        )
    lib.rle_forward_partials.restype = ctypes.c_int
    lib.rle_forward_partials.argtypes = [
        _c_p, ctypes.c_int, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64,
        _c_p, _c_p, _c_p, _c_p, ctypes.c_float, _c_p, ctypes.c_int, ctypes.c_int,
    ]
    lib.rle_backward.restype = ctypes.c_int
    lib.rle_backward.argtypes = [
        _c_p, ctypes.c_int, _c_i64, _c_i64, _c_i64, _c_i64,
        _c_p, _c_p, _c_p, _c_p, _c_p, ctypes.c_float, _c_p, _c_p, _c_p, ctypes.c_int, ctypes.c_int,
    ]
    lib.rle_forward_kept.restype = ctypes.c_int
    lib.rle_forward_kept.argtypes = [
        _c_p, ctypes.c_int, _c_i64, _c_i64, _c_i64, _c_i64, _c_i64,
        _c_p, _c_p, _c_p, _c_p, ctypes.c_float, _c_p, _c_p, _c_p, _c_p, _c_p, ctypes.c_int, ctypes.c_int,
    ]
    lib.rle_backward_kept.restype = ctypes.c_int
    lib.rle_backward_kept.argtypes = [
        _c_p, ctypes.c_int, _c_i64, _c_i64, _c_i64, _c_i64,
        _c_p, _c_p, _c_p, _c_p, _c_p, ctypes.c_float, _c_p, _c_p, _c_p, _c_p, _c_p, ctypes.c_int, ctypes.c_int,
    ]
    lib.rle_kept_candidates.restype = ctypes.c_int
    lib.rle_kept_candidates.argtypes = [
        _c_p, ctypes.c_int, _c_i64, _c_i64, _c_i64, ctypes.c_float, _c_p,
        _c_p, _c_p, _c_p, _c_i64, _c_p, _c_p, _c_p, _c_p, ctypes.c_int, ctypes.c_int,
    ]
    for name in ("rle_round_f16_array", "rle_round_bf16_array", "rle_upcast_f16_array"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [_c_p, _c_p, _c_i64]
    lib.rle_elementwise_array.restype = ctypes.c_int
    lib.rle_elementwise_array.argtypes = [
        ctypes.c_int, _c_p, _c_p, _c_p, _c_p, _c_i64, ctypes.c_int,
    ]
    lib.rle_selected_isa.restype = ctypes.c_int
    lib.rle_selected_isa.argtypes = [ctypes.c_int]
    return FusedKernel(spec.origin, lib)


@lru_cache(maxsize=1)
def _cached() -> FusedKernel | FusedKernelError:
    try:
        return _load()
    except FusedKernelError as exc:
        return exc


def load_kernel() -> FusedKernel:
    """The compiled kernel (loaded once per process), or :class:`FusedKernelError` with the reason."""
    found = _cached()
    if isinstance(found, FusedKernelError):
        raise found
    return found


def kernel_unavailable() -> str | None:
    """Why the kernel cannot be used here (None when it can): the registry's availability."""
    found = _cached()
    return str(found) if isinstance(found, FusedKernelError) else None


def check_threads(threads: object) -> None:
    """``threads`` is ``None`` or an integer in ``[1, MAX_THREADS]``."""
    if threads is None:
        return
    fix = (f"pass an integer in [1, {MAX_THREADS}], or None for torch.get_num_threads() "
           "at each call (thread counts never change a byte)")
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise LogprobContractError(
            f"threads={threads!r} must be an integer (got {type(threads).__name__}); {fix}"
        )
    if threads < 1:
        raise LogprobContractError(f"threads={threads} must be >= 1; {fix}")
    if threads > MAX_THREADS:
        raise LogprobContractError(
            f"threads={threads} exceeds the kernel's maximum of {MAX_THREADS} threads; {fix}"
        )


def _threads(threads: int | None) -> int:
    """The kernel's thread count: ``threads``, or ``torch.get_num_threads()`` up to MAX_THREADS."""
    check_threads(threads)
    return min(torch.get_num_threads(), MAX_THREADS) if threads is None else int(threads)


def fused_partials(
    logits: torch.Tensor,
    contract: LogprobContract,
    with_entropy: bool,
    validate: bool,
    *,
    threads: int | None = None,
    isa: str = "auto",
    row_t32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(m, s, t, finite)`` of the local shard: what the eager ``_local_partials`` returns
    (``row_t32``: each row's ``T32``, binary32 ``[rows]``, in place of the contract's temperature)."""
    kernel = load_kernel()
    rt = None if row_t32 is None else c_operand("temperature", row_t32.float())
    x = c_operand("logits", logits)
    rows = x.shape[0]
    width = contract.tile_width
    real_local = real_local_columns(contract)
    m, s, t, row_min = partials_buffers(rows, contract, with_entropy, validate)
    if rows:
        status = kernel.lib.rle_forward_partials(
            x.data_ptr(), _DTYPE_CODES[x.dtype], rows, x.stride(0), contract.local_grid_width,
            width, real_local, m.data_ptr(), s.data_ptr(), ptr(t), ptr(row_min),
            1.0 if rt is not None else contract.temperature32, ptr(rt), _threads(threads), ISA_NAMES[isa],
        )
        kernel.check(status, "forward")
    finite = rows_finite(m, row_min, width, real_local) if row_min is not None else None
    return m, s, t, finite


def fused_backward(
    logits: torch.Tensor,
    lse: torch.Tensor,
    terms: BackwardTerms,
    *,
    threads: int | None = None,
    isa: str = "auto",
) -> torch.Tensor:
    """The local gradient (section 7-8), with the ``coef == 0`` overrides and zero padding."""
    kernel = load_kernel()
    x = c_operand("logits", logits)
    rows, local_vocab = x.shape
    grad = torch.empty((rows, local_vocab), dtype=x.dtype)
    if rows:
        lse_c, coef, col, add, g_ent, mb, rt = gradient_operands(lse, terms)
        status = kernel.lib.rle_backward(
            x.data_ptr(), _DTYPE_CODES[x.dtype], rows, x.stride(0), local_vocab,
            terms.real_local, lse_c.data_ptr(), coef.data_ptr(), col.data_ptr(),
            add.data_ptr(), grad.data_ptr(), 1.0 if rt is not None else terms.t32, ptr(g_ent), ptr(mb), ptr(rt),
            _threads(threads),
            ISA_NAMES[isa],
        )
        kernel.check(status, "backward")
    return grad


E_OP = 2  # rle_elementwise_array's op: E, the general form


def fused_exp(y: torch.Tensor, *, isa: str = "auto") -> torch.Tensor:
    """``E(y)`` (section 3, the general form) of a binary32 CPU tensor, by the compiled kernel."""
    if y.dtype != torch.float32 or y.device.type != "cpu":
        raise LogprobContractError(f"fused_exp takes a binary32 CPU tensor, got {y.dtype} on {y.device}")
    src = c_operand("y", y).contiguous()
    out = torch.empty_like(src)
    if src.numel():
        kernel = load_kernel()
        kernel.check(kernel.lib.rle_elementwise_array(E_OP, src.data_ptr(), None, None, out.data_ptr(),
                                                      src.numel(), ISA_NAMES[isa]), "E")
    return out


class FusedCpuEngine(LocalEngine):
    """:class:`LocalEngine` on the compiled kernel (``chunk_rows`` is not used: rows stream)."""

    supports_processed = True  # section 13: fused_kept.py

    def __init__(self, threads: int | None = None, isa: str = "auto") -> None:
        if isa not in ISA_NAMES:
            raise LogprobContractError(f"isa={isa!r} is not one of {sorted(ISA_NAMES)}")
        if load_kernel().selected_isa(ISA_NAMES[isa]) < 0:
            raise LogprobContractError(
                f"isa={isa!r} is not supported by this CPU (avx2 and avx512 also need FMA3); use "
                "isa='auto' (the widest this CPU has) or 'baseline' (every variant gives the same "
                "bytes)"
            )
        check_threads(threads)
        self.threads = threads
        self.isa = isa

    def kernel_call(self) -> KernelCall:
        """The loaded library with this engine's threads and instruction set, for the processed
        kernels of :mod:`rl_engine.logprob.backends.fused_cpu.fused_kept`."""
        kernel = load_kernel()
        return KernelCall(kernel.lib, kernel.check, _threads(self.threads), ISA_NAMES[self.isa], _DTYPE_CODES)

    def local_partials(self, logits, contract, chunk_rows, with_entropy, validate,  # type: ignore[override]
                       row_t32=None, keep=None):
        if keep is not None:  # processed logprobs (section 13): the masked forward
            return fused_kept_partials(self.kernel_call(), logits, contract, with_entropy, validate, keep,
                                       row_t32=row_t32)
        return fused_partials(
            logits, contract, with_entropy, validate, threads=self.threads, isa=self.isa, row_t32=row_t32
        )

    def local_backward(self, logits, lse, terms, chunk_rows):  # type: ignore[override]
        if terms.keep is not None:
            return fused_kept_backward(self.kernel_call(), logits, lse, terms)
        return fused_backward(logits, lse, terms, threads=self.threads, isa=self.isa)

    def kept_cut(self, logits, contract, sampling, group, chunk_rows, row_t32=None):  # type: ignore[override]
        """Section 13's cut by the compiled kernels (:func:`~rl_engine.logprob.backends.fused_cpu.fused_kept.fused_kept_cut`):
        ``B`` from the raw forward's tile maxima of this shard (``row_t32``: each row's ``T32``)."""
        m, _, _, _ = fused_partials(logits, contract, False, False, threads=self.threads, isa=self.isa,
                                    row_t32=row_t32)
        local_max = m.amax(dim=1) if m.shape[1] else torch.full((logits.shape[0],), float("-inf"))
        return fused_kept_cut(self.kernel_call(), logits, contract, sampling, group, local_max, row_t32)

    def exp(self, y: torch.Tensor) -> torch.Tensor:
        """``E`` of the merge by the kernel's own vector ``E`` (the same bytes as the portable
        one: tests/test_fused_cpu.py), on the calling thread, whose gradual underflow the op
        checked before it started."""
        return fused_exp(y, isa=self.isa)


class FusedCpuLogprob(VocabParallelLogprob):
    """The callable op of backend ``cpu-vocab-parallel-logp-ws2`` (CPU tensors only).

    Same call, same validation, same exchange and merge as ``pytorch-vocab-parallel-logp-ws2``;
    ``threads`` (an integer in ``[1, MAX_THREADS]``; default ``torch.get_num_threads()`` at call
    time, at most ``MAX_THREADS``) and ``isa`` (``auto``, ``baseline``, ``avx2``, ``avx512``: the
    same bytes, tests compare them) select how the kernel runs. Building it loads the kernel
    and checks both options, so a missing kernel, a bad thread count or an instruction set
    this CPU lacks raises here, never after the agreement step of a call.
    """

    backend_id = FUSED_CPU_ID
    devices = frozenset({"cpu"})

    def __init__(self, threads: int | None = None, isa: str = "auto") -> None:
        super().__init__()
        load_kernel()
        self._engine = FusedCpuEngine(threads, isa)

    def engine(self) -> LocalEngine:
        return self._engine


__all__ = [
    "FUSED_CPU_ID",
    "FusedCpuEngine",
    "FusedCpuLogprob",
    "FusedKernel",
    "FusedKernelError",
    "MAX_THREADS",
    "check_threads",
    "fused_backward",
    "fused_exp",
    "fused_partials",
    "kernel_unavailable",
    "load_kernel",
]
