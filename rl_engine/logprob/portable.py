"""The candidate's portable arithmetic (``docs/arithmetic.md``, version ``rl-engine-arith/1``).

Every operation here is an IEEE-754 basic operation (binary32 add, subtract, multiply,
divide rounded to nearest even; comparisons; max/min; exact conversions; bit casts and
32-bit integer arithmetic), applied as one PyTorch elementwise kernel each, in the order
the document gives. No library ``exp``/``log`` and no library-grouped reduction: the bytes
are those any conforming device computes from the same input bytes.

:func:`exp_into` is the in-place chunk form of ``E`` (no allocation: the caller's
:class:`ExpScratch` holds its temporaries); :func:`exp` and :func:`log` are the
allocating forms used on per-row tensors and by the GRPO loss.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SPEC_VERSION = "rl-engine-arith/1"


def _f(hex_literal: str) -> float:
    """A binary32 constant from its hex-float spelling; refuses one that is not binary32."""
    value = float.fromhex(hex_literal)
    if torch.tensor(value, dtype=torch.float32).item() != value:
        raise ValueError(f"{hex_literal} is not exactly representable in binary32")
    return value


# Section 3: E(y)
EXP_LO = _f("-0x1.5cp+6")  # -87: below it E returns +0 (no subnormal result)
EXP_HI = _f("0x1.64p+6")  # 89: above ln(FLT_MAX), so +inf comes from the last multiply
LOG2E = _f("0x1.715476p+0")
SHIFTER = _f("0x1.8p+23")
LN2_HI = _f("0x1.62e4p-1")
LN2_LO = _f("0x1.7f7d1cp-20")
EXP_POLY = (  # C6 .. C2 (Horner, innermost first), then 1, 1
    _f("0x1.6a244cp-10"),
    _f("0x1.1239d4p-7"),
    _f("0x1.5558f2p-5"),
    _f("0x1.555492p-3"),
    _f("0x1.fffffcp-2"),
)
# Section 5: L(x)
SQRT2 = _f("0x1.6a09e6p+0")
LOG_POLY = (  # L4 .. L1 (Horner, innermost first)
    _f("0x1.e4bc8ep-3"),
    _f("0x1.242b1ap-2"),
    _f("0x1.999abcp-2"),
    _f("0x1.555554p-1"),
)
CANONICAL_NAN = float("nan")  # binary32 0x7FC00000
NEG_INF = float("-inf")


class ArithmeticEnvironmentError(RuntimeError):
    """The thread flushes subnormals (FTZ/DAZ): the specification's bytes cannot be computed."""


def flushes_subnormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormals (a one-element op runs inline)."""
    tiny = torch.tensor([2.0**-140], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


def require_gradual_underflow(device: torch.device | str = "cpu") -> None:
    """Raise unless this thread computes with IEEE subnormals (CPU only; CUDA has no FTZ mode here)."""
    if torch.device(device).type == "cpu" and flushes_subnormals():
        raise ArithmeticEnvironmentError(
            "this thread flushes subnormal numbers to zero (torch.set_flush_denormal(True) or "
            f"FTZ/DAZ set by other code); {SPEC_VERSION} needs IEEE gradual underflow: call "
            "torch.set_flush_denormal(False) before the logprob op"
        )


class ExpScratch:
    """Temporaries of :func:`exp_into` for tensors of one shape (reused chunk after chunk)."""

    __slots__ = ("kf", "q", "ka", "kb", "mask")

    def __init__(self, shape: tuple[int, ...], device: torch.device | str) -> None:
        self.kf = torch.empty(shape, dtype=torch.float32, device=device)
        self.q = torch.empty_like(self.kf)
        self.ka = torch.empty(shape, dtype=torch.int32, device=device)
        self.kb = torch.empty_like(self.ka)
        self.mask = torch.empty(shape, dtype=torch.bool, device=device)

    def rows(self, n: int) -> "ExpScratch":
        """The scratch of the first ``n`` rows (views, same memory)."""
        view = ExpScratch.__new__(ExpScratch)
        for name in self.__slots__:
            setattr(view, name, getattr(self, name)[:n])
        return view


def exp_into(y: torch.Tensor, out: torch.Tensor, sc: ExpScratch) -> torch.Tensor:
    """``out = E(y)`` (section 3), elementwise; ``out`` may be ``y``. Returns ``out``."""
    kf, q, ka, kb, under = sc.kf, sc.q, sc.ka, sc.kb, sc.mask
    torch.lt(y, EXP_LO, out=under)  # 1. (NaN: false)
    torch.clamp(y, EXP_LO, EXP_HI, out=out)  # 2. yc (NaN stays NaN)
    torch.mul(out, LOG2E, out=kf)  # 3. kf = ((yc * LOG2E) + SHIFTER) - SHIFTER
    kf.add_(SHIFTER)
    kf.sub_(SHIFTER)
    torch.mul(kf, LN2_HI, out=q)  # 4. r = (yc - kf * LN2_HI) - kf * LN2_LO
    out.sub_(q)
    torch.mul(kf, LN2_LO, out=q)
    out.sub_(q)
    c6, c5, c4, c3, c2 = EXP_POLY  # 5. Horner
    torch.mul(out, c6, out=q)
    for c in (c5, c4, c3, c2, 1.0):
        q.add_(c)
        q.mul_(out)
    q.add_(1.0)  # p
    ka.copy_(kf)  # 6. k (exact); a = k >> 1 in kb, b = k - a in ka
    torch.bitwise_right_shift(ka, 1, out=kb)
    ka.sub_(kb)
    kb.add_(127).bitwise_left_shift_(23)
    ka.add_(127).bitwise_left_shift_(23)
    torch.mul(q, kb.view(torch.float32), out=out)  # 7. (p * sa) * sb
    out.mul_(ka.view(torch.float32))
    out.masked_fill_(under, 0.0)  # 8.
    return out


def exp(y: torch.Tensor) -> torch.Tensor:
    """``E(y)`` of a binary32 tensor (allocating)."""
    _require_f32(y, "exp")
    out = torch.empty_like(y)
    return exp_into(y, out, ExpScratch(tuple(y.shape), y.device))


def log(x: torch.Tensor) -> torch.Tensor:
    """``L(x)`` of a binary32 tensor (section 5)."""
    _require_f32(x, "log")
    sub = (x > 0.0) & (x < 2.0**-126)
    xs = torch.where(sub, x * 2.0**23, x)  # exact for a positive subnormal
    u = xs.view(torch.int32)
    e = torch.bitwise_right_shift(u, 23) - 127 - torch.where(sub, 23, 0).to(torch.int32)
    m = torch.bitwise_or(torch.bitwise_and(u, 0x007FFFFF), 0x3F800000).view(torch.float32)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)
    e = e + big.to(torch.int32)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    l4, l3, l2, l1 = LOG_POLY
    r = z * l4
    for c in (l3, l2, l1):
        r = (r + c) * z
    hf = (f * f) * 0.5
    ef = e.to(torch.float32)
    inner = (s * (hf + r)) + (ef * LN2_LO)
    result = (ef * LN2_HI) - ((hf - inner) - f)
    result = torch.where(x == 0.0, torch.full_like(result, NEG_INF), result)
    result = torch.where(x == math.inf, torch.full_like(result, math.inf), result)
    return torch.where((x < 0.0) | (x != x), torch.full_like(result, CANONICAL_NAN), result)


def canonical_nan_(x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Write every NaN of ``x`` as ``0x7FC00000`` in place (``mask``: optional bool scratch)."""
    if mask is None:
        mask = torch.empty(x.shape, dtype=torch.bool, device=x.device)
    torch.ne(x, x, out=mask)
    return x.masked_fill_(mask, CANONICAL_NAN)


def round_into(src: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """Section 8: write the NaN-canonical binary32 ``src`` into ``out`` in its dtype, rounded once.

    bf16 is rounded by integer arithmetic on the bits (``scratch``: optional int32 buffer of
    ``src``'s shape); binary16 by the IEEE conversion; binary32 is copied.
    """
    if out.dtype == torch.float32:
        out.copy_(src)
    elif out.dtype == torch.bfloat16:
        u = src.view(torch.int32)
        r = scratch if scratch is not None else torch.empty(src.shape, dtype=torch.int32, device=src.device)
        torch.bitwise_right_shift(u, 16, out=r)
        r.bitwise_and_(1)
        r.add_(0x7FFF)
        r.add_(u)
        r.bitwise_right_shift_(16)
        out.view(torch.int16).copy_(r)  # the low 16 bits (two's complement wrap)
    elif out.dtype == torch.float16:
        out.copy_(src)  # IEEE convertFormat, RNE, with subnormals (F16C / __float2half_rn)
    else:
        raise TypeError(f"cannot round to {out.dtype}: the logits dtype must be bf16, fp16 or fp32")


def rounded(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`round_into` into a new tensor of ``dtype``."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    round_into(src.contiguous(), out)
    return out


class _ExpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = exp(y)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (out,) = ctx.saved_tensors
        return grad * out


def exp_differentiable(y: torch.Tensor) -> torch.Tensor:
    """``E(y)`` with the derivative ``grad * E(y)`` (section 9: the GRPO ratio and k3 terms)."""
    _require_f32(y, "exp_differentiable")
    return _ExpFunction.apply(y)


def _require_f32(x: torch.Tensor, name: str) -> None:
    if x.dtype != torch.float32:
        raise TypeError(f"{name} takes binary32 tensors, got {x.dtype}; upcast exactly first")


__all__ = [
    "SPEC_VERSION",
    "ArithmeticEnvironmentError",
    "ExpScratch",
    "canonical_nan_",
    "exp",
    "exp_differentiable",
    "exp_into",
    "flushes_subnormals",
    "log",
    "require_gradual_underflow",
    "round_into",
    "rounded",
]
