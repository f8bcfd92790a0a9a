"""Backend ``triton-vocab-parallel-logp-ws2``: the eager backend with its chunk loops in Triton.

The per-rank compute runs in the Triton kernels of :mod:`rl_engine.logprob.backends.triton.triton_kernels`
(the forward's tile partials, one program per (row, tile); the merge of the partials, the
logprob and the canonical NaN, one program per block of rows; the backward's per-row terms; the
fused backward, one program per (row, block of columns)). At TP = 1 a forward is two launches
and nothing else that computes on the device (``tests/test_host_syncs.py``); at TP > 1 the
exchange of partials, the owner's target logit and the validation verdict are the eager
backend's code before the merge kernel. Autograd and the rank agreement are shared, so logp, LSE,
entropy and gradient are the bytes of ``pytorch-vocab-parallel-logp-ws2``
(``tests/test_triton_backend.py``, ``tests/test_triton_merge.py``).

Two modes, chosen explicitly, never by a fallback:

* ``compiled`` (the default): ``triton.jit`` kernels on CUDA tensors; every launch passes
  ``enable_fp_fusion=False`` (no multiply-add contracted into an FMA: the only FMAs are the
  ``tl.fma`` the kernels write, where ``docs/arithmetic.md`` has one).
* ``interpreter``: Triton's interpreter runs the same kernel source on CPU tensors through
  NumPy, one IEEE operation at a time. It is selected by ``TritonLogprob(mode="interpreter")``
  or, for processes a launcher starts (torchrun ranks), by the environment variable
  ``RL_ENGINE_TRITON_MODE=interpreter``; the mode is part of the backend's provenance
  (:func:`triton_mode`, recorded in each campaign report's ``dispatch`` section). Triton's own
  ``TRITON_INTERPRET=1`` is not read: it would turn every ``triton.jit`` of the process into
  an interpreted function, including other libraries'. The interpreter must compute ``tl.fma``
  with one rounding (Triton 3.6's computes ``a * b + c`` with two): :func:`load_kernels`
  probes it on a case where the two differ, and refuses an interpreter that rounds twice.

Fail closed: without Triton, without CUDA (compiled mode), or when a kernel does not compile,
:func:`triton_unavailable` gives the reason, the registry marks the backend unavailable and
``dispatch`` raises ``BackendUnavailableError``; a launch that fails raises
:class:`TritonKernelError`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import struct
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rl_engine.arith.division import kernel_bounds, split_reciprocal
from rl_engine.arith.portable import LOG_POLY
from rl_engine.arith.temperature import inverse_temperature
from rl_engine.logprob.backends.eager.vocab_parallel import (
    BackwardTerms,
    LocalEngine,
    VocabParallelLogprob,
    real_local_columns,
)
from rl_engine.logprob.backends.triton.triton_kept import (
    TritonCall,
    triton_kept_backward,
    triton_kept_cut,
    triton_kept_partials,
)
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.tables import TRITON_BACKEND, TRITON_MODE_ENV

TRITON_ID = TRITON_BACKEND
MODES: tuple[str, ...] = ("compiled", "interpreter")
MODE_ENV = TRITON_MODE_ENV
MODE_DEVICES: dict[str, str] = {"compiled": "cuda", "interpreter": "cpu"}
# Oldest Triton the kernels are tested with (tests/test_triton_versions.py); newest: the
# installed one (3.9.0 when written).
MIN_TRITON = (3, 6)
BACKWARD_BLOCK = 2048  # columns of one backward program (4 warps, 16 columns a thread)
BACKWARD_WARPS = 4
FORWARD_WARPS = 1  # one warp per (row, tile): 128 lanes, 4 consecutive columns a thread
TARGET_ROWS = 128  # rows of one program of the target kernel
TARGET_WARPS = 1
KERNEL_FILE = Path(__file__).with_name("triton_kernels.py")
# fma(a, b, c) with one rounding is 0x1.000002p+0; a*b+c rounded twice (binary64, then binary32)
# is 0x1.000004p+0 (docs/arithmetic.md section 1)
FMA_PROBE = (float.fromhex("0x1.000002p-12"), float.fromhex("0x1.fffffcp-13"), float.fromhex("0x1.000002p+0"))
FMA_PROBE_RESULT = float.fromhex("0x1.000002p+0")
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
    if mode == "interpreter":
        _require_single_rounding_fma(triton.__version__)
    return module


def _probe_fma(a_ptr, out_ptr):  # type: ignore[no-untyped-def]
    import triton.language as tl

    a = tl.load(a_ptr + tl.arange(0, 4))
    b = tl.load(a_ptr + 4 + tl.arange(0, 4))
    c = tl.load(a_ptr + 8 + tl.arange(0, 4))
    tl.store(out_ptr + tl.arange(0, 4), tl.fma(a, b, c))


def _require_single_rounding_fma(version: str) -> None:
    """Refuse an interpreter whose ``tl.fma`` rounds twice (it would not compute the spec's bytes)."""
    from triton.runtime.interpreter import InterpretedFunction

    a, b, c = FMA_PROBE
    src = torch.tensor([a] * 4 + [b] * 4 + [c] * 4, dtype=torch.float32)
    out = torch.empty(4, dtype=torch.float32)
    InterpretedFunction(_probe_fma)[(1,)](src, out)
    if float(out[0]) != FMA_PROBE_RESULT:
        raise TritonKernelError(
            f"Triton {version}'s interpreter computes tl.fma({a.hex()}, {b.hex()}, {c.hex()}) as "
            f"{float(out[0]).hex()}, not the fused multiply-add's {FMA_PROBE_RESULT.hex()}: it rounds "
            "twice, so it cannot compute rl-engine-arith/2's bytes; the interpreter mode needs a "
            "Triton whose interpreter rounds fma once (3.9 does); compiled kernels are not affected"
        )


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


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def _raw(logits: torch.Tensor) -> torch.Tensor:
    """The logits as the kernels read them: binary32 as is, bf16 and binary16 as int16 bits."""
    x = logits.detach()
    if x.dim() != 2 or x.stride(1) != 1 or x.stride(0) < x.shape[1]:
        x = x.contiguous()
    return x if x.dtype == torch.float32 else x.view(torch.int16)


def _launch(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], meta: dict[str, Any],
            warps: int) -> None:
    try:
        kernel[grid](*args, **meta, num_warps=warps, enable_fp_fusion=False)
    except Exception as exc:  # noqa: BLE001 - compile or launch failure: raise with the reason
        raise TritonKernelError(f"{TRITON_ID}: kernel {getattr(kernel, '__name__', kernel)} "
                                f"failed: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class Launch:
    """One kernel launch: the kernel's name, grid, arguments, constants and warps per program
    (what the backend launches, and what :mod:`rl_engine.logprob.backends.triton.triton_aot` compiles)."""

    kernel: str
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    meta: dict[str, Any]
    warps: int

    def run(self, kernels: ModuleType) -> None:
        _launch(getattr(kernels, self.kernel), self.grid, self.args, self.meta, self.warps)


def division_args(t32: float) -> tuple[float, float, float, int, float]:
    """``(T32, r, hi, lo_key, shift_min)``, the kernels' arguments for the division by ``T32``
    (:func:`rl_engine.arith.division.kernel_bounds`; ``lo_key = 2 * bits(lo) - 2``, the backward's
    integer key of the smallest magnitude in the domain); neutral without a temperature."""
    if t32 == 1.0:
        return 1.0, 1.0, math.inf, 0, 0.0
    hi, lo, shift_min = kernel_bounds(t32)
    return t32, inverse_temperature(t32), hi, 2 * struct.unpack("<I", struct.pack("<f", lo))[0] - 2, shift_min


def row_division_args(row_t32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                       torch.Tensor]:
    """:func:`division_args` of every row's ``T32`` (binary32 ``[rows]``), as tensors on its device:
    ``(T32, r, hi, lo_key, shift_min)``, binary32 but ``lo_key`` (int64); the neutral values on rows
    at ``T32 = 1``. Computed on the device with exact operations (one IEEE division for ``r``, the rest
    integer operations on the bits: every bound is a power of two), so no host copy: the same values
    as :func:`rl_engine.arith.division.kernel_bounds` (tested on many temperatures)."""
    t = row_t32.detach().to(torch.float32).contiguous()
    inv = torch.ones_like(t) / t  # r = RN32(1 / T32): a tensor by a tensor is a true division everywhere
    b = ((t.view(torch.int32) >> 23) & 0xFF) - 127  # T32 = B * 2**b, B in [1, 2) (T32 is normal)
    low = torch.clamp(b - 125, min=-102)  # lo = 2**low: max(2**-102, 2**(b - 125))
    lo_bits = (low + 127) << 23
    hi_bits = torch.where(b <= 0, (254 + b) << 23, torch.full_like(b, 0x7F800000))  # 2**(127 + b), else inf
    r_bits = inv.view(torch.int32)
    er = ((r_bits >> 23) & 0xFF) - 127  # r = R * 2**er
    # tiny = 2**ceil(log2(2 * max(lo * r, 2**-126))): lo * r = R * 2**(er + low), so the ceiling is
    # er + low + 1, one more when R > 1; and at least -125
    tiny = torch.clamp(er + low + 1 + ((r_bits & 0x7FFFFF) != 0).to(torch.int32), min=-125)
    shift_bits = (tiny + 30 + 127) << 23  # shift_min = 2**(SHIFT_MARGIN + tiny)
    one = t == 1.0
    hi = torch.where(one, torch.full_like(t, math.inf), hi_bits.to(torch.int32).view(torch.float32))
    lo_key = torch.where(one, 0, 2 * lo_bits.to(torch.int64) - 2)
    shift_min = torch.where(one, 0.0, shift_bits.to(torch.int32).view(torch.float32))
    return t, torch.where(one, 1.0, inv), hi, lo_key, shift_min


def split_args(t32: float, logits_dtype: torch.dtype) -> tuple[float, float] | None:
    """``(r_hi, r_lo)`` of the split quotient (:func:`rl_engine.arith.division.split_reciprocal`) for
    one temperature and bf16 or binary16 logits, or ``None`` where Markstein's step divides (binary32
    logits, a temperature the check refuses). The forward and the backward divide the exact upcast
    logit by them."""
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(logits_dtype)
    return None if name is None else split_reciprocal(t32, name)


def forward_launch(
    x: torch.Tensor, contract: LogprobContract, m: torch.Tensor, s: torch.Tensor,
    t: torch.Tensor | None, bad: torch.Tensor | None, with_entropy: bool, validate: bool,
    logits_dtype: torch.dtype, row_t32: torch.Tensor | None = None,
) -> Launch:
    """The forward launch: one program (one warp) per (row, tile); ``row_t32``: a temperature per row
    (each program loads its row's division arguments)."""
    width = contract.tile_width
    tiles = contract.local_tile_count
    real_local = real_local_columns(contract)
    tempered = contract.tempered or row_t32 is not None
    split = None
    if row_t32 is None:
        t32, inv_t, hi, _, shift_min = division_args(contract.temperature32)
        if tempered:
            split = split_args(contract.temperature32, logits_dtype)
    else:
        t32, inv_t, hi, _, shift_min = row_division_args(row_t32)
    r_hi, r_lo = split if split is not None else (1.0, 0.0)
    args = (x, m, s, t if t is not None else m, bad if bad is not None else m, x.stride(0), real_local,
            t32, inv_t, hi, shift_min, r_hi, r_lo)
    meta = {"TILES": tiles, "WIDTH": width, "DTYPE": _DTYPE_CODES[logits_dtype],
            "WITH_ENTROPY": with_entropy, "VALIDATE": validate,
            "PADDED": real_local < contract.local_grid_width, "TEMPERED": tempered,
            "ROW_T": row_t32 is not None, "SPLIT": split is not None}
    return Launch("forward_partials_kernel", (x.shape[0] * tiles,), args, meta, FORWARD_WARPS)


def backward_launches(
    x: torch.Tensor, lse: torch.Tensor, terms: BackwardTerms, out: torch.Tensor,
    logits_dtype: torch.dtype,
) -> list[Launch]:
    """The backward's launches, in stream order: the whole blocks of ``BACKWARD_BLOCK`` columns
    (no mask), the last partial block (masked), then the target column of every row."""
    rows, local_vocab = x.shape
    dtype = _DTYPE_CODES[logits_dtype]
    lse = lse.detach().float().contiguous()
    coef = terms.coef.float().contiguous()
    padded = terms.real_local < local_vocab
    whole, rest = divmod(local_vocab, BACKWARD_BLOCK)
    found = []
    entropy_grad = terms.g_ent is not None
    gent = terms.g_ent.float().contiguous() if entropy_grad else lse  # (unread without ENTROPY_GRAD)
    mb = terms.mb.float().contiguous() if entropy_grad else lse
    common = (x, lse, coef, out, gent, mb, x.stride(0), local_vocab, terms.real_local)
    tempered = terms.tempered
    per_row = terms.row_t32 is not None
    divide = division_args(terms.t32) if not per_row else row_division_args(terms.row_t32)
    split = split_args(terms.t32, logits_dtype) if tempered and not per_row else None
    divide = (*divide, *(split if split is not None else (1.0, 0.0)))
    if whole:
        found.append(Launch("backward_kernel", (rows * whole,), common + (0, *divide),
                            {"BLOCKS": whole, "BLOCK": BACKWARD_BLOCK, "DTYPE": dtype, "MASKED": False,
                             "PADDED": padded, "TEMPERED": tempered, "ENTROPY_GRAD": entropy_grad, "ROW_T": per_row,
                             "SPLIT": split is not None},
                            BACKWARD_WARPS))
    if rest:
        found.append(Launch("backward_kernel", (rows,), common + (whole * BACKWARD_BLOCK, *divide),
                            {"BLOCKS": 1, "BLOCK": next_pow2(rest), "DTYPE": dtype, "MASKED": True,
                             "PADDED": padded, "TEMPERED": tempered, "ENTROPY_GRAD": entropy_grad, "ROW_T": per_row,
                             "SPLIT": split is not None},
                            BACKWARD_WARPS))
    target = (x, lse, coef, terms.target_col.to(torch.int64).contiguous(),
              terms.target_add.float().contiguous(), out, gent, mb, rows, x.stride(0), local_vocab,
              terms.real_local, divide[0] if per_row else terms.t32)
    found.append(Launch("backward_target_kernel", (-(-rows // TARGET_ROWS),), target,
                        {"ROWS": TARGET_ROWS, "DTYPE": dtype, "TEMPERED": tempered, "ENTROPY_GRAD": entropy_grad,
                         "ROW_T": per_row}, TARGET_WARPS))
    return found


MERGE_ROWS = 16  # rows of one program of the merge kernel
MERGE_WARPS = 4


def merge_launch(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None, active: torch.Tensor,
    logp: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None, *, t32: float = 1.0,
    x: torch.Tensor | None = None, targets: torch.Tensor | None = None, bad: torch.Tensor | None = None,
    flags: torch.Tensor | None = None, real_vocab: int = 0, logits_dtype: torch.dtype = torch.float32,
    target_logit: torch.Tensor | None = None, poison: torch.Tensor | None = None,
) -> Launch:
    """The merge's one launch (:func:`merge_kernel`, section 6 steps 5-10) over ``[rows, tiles]``
    partials in global tile order. With ``x`` and ``targets`` (one rank holds every column) it reads
    the target logit itself, and with ``bad`` validates: ``flags`` gets each row's refusal (bit 0
    non-finite, bit 1 target out of range), or, without ``flags``, such a row's logprob is NaN
    (``on_invalid="nan"``). Otherwise ``target_logit`` is the logit copied from its owner rank and
    ``poison`` (optional) the rows whose logprob is NaN."""
    rows, tiles = m.shape
    read = x is not None
    if read and targets is None:
        raise TritonKernelError("merge_launch: x needs targets (the target logit is read from x)")
    if not read and target_logit is None:
        raise TritonKernelError("merge_launch: give x and targets, or the target_logit of every row")
    validate = read and bad is not None
    poisoned = (validate and flags is None) or (not read and poison is not None)
    cols = max(2, next_pow2(tiles))
    stand_in = m  # an argument the constants make the kernel never read
    args = (m, s, t if t is not None else stand_in, bad if bad is not None else stand_in,
            x if read else stand_in, targets if read else stand_in, active,
            target_logit if target_logit is not None else stand_in, poison if poison is not None else stand_in,
            logp, lse, entropy if entropy is not None else stand_in, flags if flags is not None else stand_in,
            rows, x.stride(0) if read else 0, x.shape[1] if read else 0, real_vocab, t32, *LOG_POLY)
    meta = {"TILES": tiles, "COLS": cols, "LEVELS": (tiles - 1).bit_length(), "ROWS": MERGE_ROWS,
            "DTYPE": _DTYPE_CODES[logits_dtype], "WITH_ENTROPY": t is not None, "READ_TARGET": read,
            "VALIDATE": validate, "POISON": poisoned, "TEMPERED": t32 != 1.0}
    return Launch("merge_kernel", (-(-rows // MERGE_ROWS),), args, meta, MERGE_WARPS)


def triton_forward(
    logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, contract: LogprobContract,
    with_entropy: bool, validate: bool, on_invalid: str, mode: str = "compiled",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(logp, lse, entropy, flags)`` of a rank that holds every column (TP = 1) in two launches:
    the tile partials and the merge, which reads the target logit and, validating, the partials'
    ``bad`` flags. ``flags`` (validating with ``on_invalid="raise"``, rows present): per row, bit 0
    an active row with a non-finite real logit, bit 1 an active target outside the real vocabulary,
    for the caller's one host read; with ``on_invalid="nan"`` such rows get a NaN logprob instead."""
    k = load_kernels(mode)
    x = _raw(logits)
    rows = x.shape[0]
    tiles = contract.local_tile_count  # whole tiles: the last may reach past the vocabulary (section 6)
    dev = logits.device
    m = torch.empty(rows, tiles, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else None
    validate = validate and rows > 0
    bad = torch.empty(rows, tiles, dtype=torch.int8, device=dev) if validate else None
    logp = torch.empty(rows, dtype=torch.float32, device=dev)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if with_entropy else None
    # zeros, though the merge writes every row: a launch that did not run leaves no refusal behind
    flags = torch.zeros(rows, dtype=torch.int8, device=dev) if validate and on_invalid == "raise" else None
    if rows:
        forward_launch(x, contract, m, s, t, bad, with_entropy, validate, logits.dtype).run(k)
        merge_launch(m, s, t, active.contiguous(), logp, lse, entropy, t32=contract.temperature32, x=x,
                     targets=targets.contiguous(), bad=bad, flags=flags, real_vocab=contract.real_vocab_size,
                     logits_dtype=logits.dtype).run(k)
    return logp, lse, entropy, flags


def triton_merge(
    m: torch.Tensor, s: torch.Tensor, t: torch.Tensor | None, target_logit: torch.Tensor,
    active: torch.Tensor, poisoned: torch.Tensor | None, mode: str = "compiled",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logp, lse, entropy)`` from the gathered partials and the owners' target logits (TP > 1),
    in one launch of the merge kernel."""
    k = load_kernels(mode)
    m, s = m.contiguous(), s.contiguous()
    t = t.contiguous() if t is not None else None
    logp = torch.empty(m.shape[0], dtype=torch.float32, device=m.device)
    lse = torch.empty_like(logp)
    entropy = torch.empty_like(logp) if t is not None else None
    if m.shape[0]:
        merge_launch(m, s, t, active.contiguous(), logp, lse, entropy, target_logit=target_logit.contiguous(),
                     poison=poisoned.contiguous() if poisoned is not None else None).run(k)
    return logp, lse, entropy


TERMS_ROWS = 128  # rows of one program of the backward's terms kernel
TERMS_WARPS = 4


def terms_launch(
    targets: torch.Tensor, active: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor | None,
    grad_lse: torch.Tensor | None, vocab_start: int, local_vocab: int, out: BackwardTerms,
    grad_entropy: torch.Tensor | None = None, entropy: torch.Tensor | None = None,
) -> Launch:
    """The launch of :func:`backward_terms_kernel` that writes ``out``'s tensors (its ``g_ent`` and
    ``mb`` with ``grad_entropy``)."""
    rows = lse.shape[0]
    stand_in = out.coef  # an argument the constants make the kernel never read
    entropy_grad = grad_entropy is not None
    args = (grad_logp if grad_logp is not None else stand_in, grad_lse if grad_lse is not None else stand_in,
            grad_entropy if entropy_grad else stand_in, active, targets, lse,
            entropy if entropy_grad else stand_in, out.coef, out.target_col, out.target_add,
            out.g_ent if out.g_ent is not None else stand_in, out.mb if out.mb is not None else stand_in, rows,
            grad_logp.stride(0) if grad_logp is not None else 0, grad_lse.stride(0) if grad_lse is not None else 0,
            grad_entropy.stride(0) if grad_entropy is not None else 0, vocab_start, local_vocab)
    meta = {"ROWS": TERMS_ROWS, "HAS_LOGP": grad_logp is not None, "HAS_LSE": grad_lse is not None,
            "ENTROPY_GRAD": entropy_grad}
    return Launch("backward_terms_kernel", (-(-rows // TERMS_ROWS),), args, meta, TERMS_WARPS)


def empty_terms(rows: int, device: torch.device, real_local: int, t32: float, entropy_grad: bool) -> BackwardTerms:
    """Uninitialised :class:`BackwardTerms` for ``rows`` rows, for :func:`terms_launch` to write."""
    coef = torch.empty(rows, dtype=torch.float32, device=device)
    return BackwardTerms(coef, torch.empty(rows, dtype=torch.int64, device=device), torch.empty_like(coef),
                         real_local, t32, torch.empty_like(coef) if entropy_grad else None,
                         torch.empty_like(coef) if entropy_grad else None)


def triton_backward_terms(
    targets: torch.Tensor, active: torch.Tensor, lse: torch.Tensor, grad_logp: torch.Tensor | None,
    grad_lse: torch.Tensor | None, contract: LogprobContract, local_vocab: int,
    grad_entropy: torch.Tensor | None = None, entropy: torch.Tensor | None = None, mode: str = "compiled",
) -> BackwardTerms:
    """:func:`rl_engine.logprob.backends.eager.vocab_parallel.backward_terms` in one launch of
    :func:`backward_terms_kernel` (the same values, tested bytewise)."""
    if grad_entropy is not None and (entropy is None or entropy.shape != lse.shape):
        raise LogprobContractError("an entropy gradient needs the forward's entropy: call with compute_entropy=True")
    k = load_kernels(mode)
    rows = lse.shape[0]
    terms = empty_terms(rows, lse.device, real_local_columns(contract), contract.temperature32,
                        grad_entropy is not None)
    if rows:
        terms_launch(targets.contiguous(), active.contiguous(), lse.contiguous(), grad_logp, grad_lse,
                     contract.vocab_start, local_vocab, terms, grad_entropy,
                     entropy.contiguous() if entropy is not None else None).run(k)
    return terms


def triton_partials(
    logits: torch.Tensor, contract: LogprobContract, with_entropy: bool, validate: bool,
    mode: str = "compiled", row_t32: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(m, s, t, finite)`` of the local shard: what the eager ``_local_partials`` returns
    (``row_t32``: each row's ``T32`` in place of the contract's temperature)."""
    k = load_kernels(mode)
    x = _raw(logits)
    rows = x.shape[0]
    tiles = contract.local_tile_count
    dev = logits.device
    m = torch.empty(rows, tiles, dtype=torch.float32, device=dev)
    s = torch.empty_like(m)
    t = torch.empty_like(m) if with_entropy else None
    bad = torch.zeros(rows, tiles, dtype=torch.int8, device=dev) if validate else None
    if rows and tiles:
        forward_launch(x, contract, m, s, t, bad, with_entropy, validate, logits.dtype, row_t32).run(k)
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
        for launch in backward_launches(x, lse, terms, out, logits.dtype):
            launch.run(k)
    return grad


EXP_BLOCK = 1024


def _elementwise(kernel: str, x: torch.Tensor, mode: str, constants: tuple[Any, ...] = (),
                 meta: dict[str, int] | None = None) -> torch.Tensor:
    """One launch of the elementwise ``kernel`` over a binary32 tensor (``BLOCK`` values a program)."""
    k = load_kernels(mode)
    src = x.detach().contiguous()
    out = torch.empty_like(src)
    n = src.numel()
    if n:
        Launch(kernel, (-(-n // EXP_BLOCK),), (src, out, n, *constants), {"BLOCK": EXP_BLOCK, **(meta or {})}, 4).run(k)
    return out


def triton_exp(y: torch.Tensor, mode: str = "compiled") -> torch.Tensor:
    """``E(y)`` of a binary32 tensor in one launch of :func:`exp_kernel` (the merge's weights)."""
    return _elementwise("exp_kernel", y, mode)


def triton_log(x: torch.Tensor, mode: str = "compiled") -> torch.Tensor:
    """``L(x)`` of a binary32 tensor in one launch of :func:`log_kernel` (the merge's ``L(sum)``)."""
    return _elementwise("log_kernel", x, mode, LOG_POLY)


def triton_divide(x: torch.Tensor, t32: float, dtype: torch.dtype, markstein: bool = True,
                  mode: str = "compiled") -> torch.Tensor:
    """``x / T32`` of a binary32 tensor by :func:`divide_kernel`: Markstein's sequence for a logit of
    ``dtype`` (one step for bf16 and binary16, two for binary32), or the IEEE division. Not on the op's
    path (the kernels divide inline): the division's tests run the sequence through it."""
    return _elementwise("divide_kernel", x, mode, (t32, inverse_temperature(t32)),
                        {"DTYPE": _DTYPE_CODES[dtype], "DIVIDE": 1 if markstein else 2})


def _refuse_row_temperature(row_t32: Any) -> None:
    """Processed logprobs with a temperature per row are not in the Triton kernels yet: refused by
    name (nothing falls back)."""
    if row_t32 is not None:
        raise LogprobContractError(
            f"backend {TRITON_ID!r} does not compute processed logprobs (top_k / top_p / min_p) with a "
            "temperature per row yet; pass one temperature for the call, or request backend="
            "'cpu-vocab-parallel-logp-ws2' or 'pytorch-vocab-parallel-logp-ws2'")


class TritonEngine(LocalEngine):
    """:class:`LocalEngine` on the Triton kernels (``chunk_rows`` is not used: one launch)."""

    supports_processed = True  # section 13: triton_kept.py

    def __init__(self, mode: str = "compiled") -> None:
        self.mode = check_mode(mode)

    def exp(self, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return triton_exp(y, self.mode)

    def log(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return triton_log(x, self.mode)

    def kept_call(self) -> TritonCall:
        """How the processed launches (:mod:`rl_engine.logprob.backends.triton.triton_kept`) run in this mode."""
        kernels = load_kernels(self.mode)
        return TritonCall(
            run=lambda spec: Launch(*spec).run(kernels), raw=_raw,
            backward=lambda logits, lse, terms: triton_backward(logits, lse, terms, self.mode),
            dtype_codes=_DTYPE_CODES, forward_warps=FORWARD_WARPS, backward_warps=BACKWARD_WARPS,
            backward_block=BACKWARD_BLOCK,
        )

    def local_partials(self, logits, contract, chunk_rows, with_entropy, validate,  # type: ignore[override]
                       row_t32=None, keep=None):
        if keep is not None:  # processed logprobs (section 13): the masked forward
            _refuse_row_temperature(row_t32)
            return triton_kept_partials(self.kept_call(), logits, contract, with_entropy, validate, keep)[:4]
        return triton_partials(logits, contract, with_entropy, validate, self.mode, row_t32)

    def local_backward(self, logits, lse, terms, chunk_rows):  # type: ignore[override]
        if terms.keep is not None:
            _refuse_row_temperature(terms.row_t32)
            return triton_kept_backward(self.kept_call(), logits, lse, terms)
        return triton_backward(logits, lse, terms, self.mode)

    def kept_cut(self, logits, contract, sampling, group, chunk_rows, row_t32=None):  # type: ignore[override]
        """Section 13's cut by the search on the key (:func:`~rl_engine.logprob.backends.triton.triton_kept.triton_kept_cut`):
        ``B`` from the raw forward's tile maxima of this shard. A temperature per row is refused here
        (every TP rank alike: the agreement step compared the per-row temperatures)."""
        _refuse_row_temperature(row_t32)
        m, _, _, _ = triton_partials(logits, contract, False, False, self.mode)
        local_max = m.amax(dim=1) if m.shape[1] else torch.full((logits.shape[0],), float("-inf"), device=logits.device)
        return triton_kept_cut(self.kept_call(), logits, contract, sampling, group, local_max)
    def backward_terms(self, logits, targets, active, lse, grad_logp, grad_lse, contract,  # type: ignore[override]
                       grad_entropy=None, entropy=None):
        return triton_backward_terms(targets, active, lse, grad_logp, grad_lse, contract, logits.shape[1],
                                     grad_entropy, entropy, self.mode)

    def single_rank_forward(self, logits, targets, active, contract, chunk_rows, with_entropy,  # type: ignore[override]
                            validate, on_invalid):
        return triton_forward(logits, targets, active, contract, with_entropy, validate, on_invalid, self.mode)

    def merge(self, m, s, t, target_logit, active, poisoned):  # type: ignore[override]
        return triton_merge(m, s, t, target_logit, active, poisoned, self.mode)


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
    "row_division_args",
    "split_args",
    "mode_device",
    "triton_backward",
    "triton_backward_terms",
    "triton_forward",
    "triton_merge",
    "triton_mode",
    "triton_log",
    "triton_partials",
    "triton_unavailable",
]
