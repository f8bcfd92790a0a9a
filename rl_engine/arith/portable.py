"""The candidate's portable arithmetic (``docs/arithmetic.md``, version ``rl-engine-arith/2``).

Every operation here is an IEEE-754 basic operation (binary32 add, subtract, multiply,
divide rounded to nearest even; fusedMultiplyAdd; comparisons; max/min; exact conversions;
bit casts and 32-bit integer arithmetic), applied as one PyTorch elementwise kernel each, in
the order the document gives. No library ``exp``/``log`` and no library-grouped reduction:
the bytes are those any conforming device computes from the same input bytes.

PyTorch has no fused multiply-add operation, so :func:`fma_into` computes each one exactly
(``docs/arithmetic.md`` section 1): the binary64 sum of the exact binary64 product and the
addend, rounded once to binary32, except where that sum lies exactly on a binary32 midpoint
or in binary32's subnormal range: there, and only there, the binary64 sum is first rounded to
odd (TwoSum), which makes the one rounding to binary32 the correct one.

:func:`exp_into` is the in-place chunk form of ``E`` (the caller's :class:`ExpScratch` holds
its temporaries); :func:`exp` and :func:`log` are the allocating forms used on per-row
tensors and by the GRPO loss.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# one definition, in the torch-free NumPy spec: the archive and verify verbs name the version without torch
from rl_engine.arith.spec_numpy import SPEC_VERSION


def _f(hex_literal: str) -> float:
    """A binary32 constant from its hex-float spelling; refuses one that is not binary32."""
    value = float.fromhex(hex_literal)
    if torch.tensor(value, dtype=torch.float32).item() != value:
        raise ValueError(f"{hex_literal} is not exactly representable in binary32")
    return value


# Section 3: E(y)
EXP_LO = _f("-0x1.6p+6")  # -88: below about -87.68, k = -127 and E returns +0
EXP_HI = _f("0x1.64p+6")  # 89: k <= 128, and k = 128 gives +inf
LOG2E = _f("0x1.715476p+0")
BIAS = _f("0x1.8000fep+23")  # 0x1.8p+23 + 127: t = BIAS + k, and bits(t) << 23 is 2**k
LN2_HI = _f("0x1.62e430p-1")  # ln 2 rounded to binary32
LN2_LO = _f("-0x1.05c610p-29")  # ln 2 - LN2_HI rounded to binary32
EXP_POLY = (  # C6 .. C2 (Horner with fusedMultiplyAdd, innermost first), then 1, 1
    _f("0x1.6a244cp-10"),
    _f("0x1.1239d4p-7"),
    _f("0x1.5558f2p-5"),
    _f("0x1.555492p-3"),
    _f("0x1.fffffcp-2"),
)
# Section 5: L(x) (unchanged from rl-engine-arith/1, with its own ln 2 split)
SQRT2 = _f("0x1.6a09e6p+0")
LOG_LN2_HI = _f("0x1.62e4p-1")
LOG_LN2_LO = _f("0x1.7f7d1cp-20")
LOG_POLY = (  # L4 .. L1 (Horner, innermost first)
    _f("0x1.e4bc8ep-3"),
    _f("0x1.242b1ap-2"),
    _f("0x1.999abcp-2"),
    _f("0x1.555554p-1"),
)
CANONICAL_NAN = float("nan")  # binary32 0x7FC00000
NEG_INF = float("-inf")
# A binary64 sum whose rounding to binary32 may round twice: its 29 bits below binary32's
# last place are exactly one half (a binary32 midpoint), or it lies below 2**-125 (binary32's
# subnormal range, where binary32's last place is higher still).
_MIDPOINT_MASK = 0x1FFFFFFF
_MIDPOINT = 0x10000000
_MAGNITUDE_MASK = 0x7FFFFFFFFFFFFFFF
_TINY_MAGNITUDE = (1023 - 125) << 52  # the bits of 2**-125


class ArithmeticEnvironmentError(RuntimeError):
    """The thread flushes subnormals (FTZ/DAZ): the specification's bytes cannot be computed."""


def flushes_subnormals() -> bool:
    """Whether this thread's CPU arithmetic flushes subnormals.

    A NumPy multiply on this thread: the same FTZ/DAZ state torch's CPU kernels run under, and no
    torch tensor (nothing the op's aten count or a dispatch mode sees, no per-call allocation)."""
    tiny = np.array([2.0**-140], dtype=np.float32)
    return bool((tiny * np.float32(1.0))[0] == 0.0)


def require_gradual_underflow(device: torch.device | str = "cpu") -> None:
    """Raise unless this thread computes with IEEE subnormals (CPU only; CUDA has no FTZ mode here)."""
    if torch.device(device).type == "cpu" and flushes_subnormals():
        raise ArithmeticEnvironmentError(
            "this thread flushes subnormal numbers to zero (torch.set_flush_denormal(True) or "
            f"FTZ/DAZ set by other code); {SPEC_VERSION} needs IEEE gradual underflow: call "
            "torch.set_flush_denormal(False) before the logprob op"
        )


Operand = torch.Tensor | float


class FmaScratch:
    """Temporaries of :func:`fma_into` for tensors of one shape (reused call after call)."""

    __slots__ = ("sum64", "wide", "bits", "flag", "tiny")

    def __init__(self, shape: tuple[int, ...], device: torch.device | str) -> None:
        self.sum64 = torch.empty(shape, dtype=torch.float64, device=device)
        self.wide = torch.empty(shape, dtype=torch.float64, device=device)
        self.bits = torch.empty(shape, dtype=torch.int64, device=device)
        self.flag = torch.empty(shape, dtype=torch.bool, device=device)
        self.tiny = torch.empty(shape, dtype=torch.bool, device=device)

    def rows(self, n: int) -> "FmaScratch":
        """The scratch of the first ``n`` rows (views, same memory)."""
        view = FmaScratch.__new__(FmaScratch)
        for name in self.__slots__:
            setattr(view, name, getattr(self, name)[:n])
        return view

    def narrow(self, n: int) -> "FmaScratch":
        """The scratch of the first ``n`` elements of the last dimension (views, same memory)."""
        view = FmaScratch.__new__(FmaScratch)
        for name in self.__slots__:
            setattr(view, name, getattr(self, name)[..., :n])
        return view


def _odd_rounded(a: Operand, b: Operand, c: Operand, like: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` in binary64 rounded to odd (TwoSum), for the few elements that need it."""
    def wide(v: Operand) -> Operand:
        return v.to(torch.float64) if isinstance(v, torch.Tensor) else v

    a64, b64, c64 = wide(a), wide(b), wide(c)
    p = torch.mul(a64, b64) if isinstance(a64, torch.Tensor) else a64 * b64  # exact
    if not isinstance(p, torch.Tensor):
        p = torch.full(like.shape, p, dtype=torch.float64, device=like.device)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)  # TwoSum: s + err == p + c exactly
    u = s.view(torch.int64)
    fix = torch.isfinite(s) & torch.isfinite(err) & (err != 0) & ((u & 1) == 0)
    away = (err > 0) == (s > 0)  # the exact value lies further from zero than s
    return torch.where(fix, torch.where(away, u + 1, u - 1), u).view(torch.float64)


def fma_into(a: torch.Tensor, b: Operand, c: Operand, out: torch.Tensor, sc: FmaScratch,
             tiny_exact: bool = False) -> torch.Tensor:
    """``out = fma(a, b, c)``: IEEE-754 fusedMultiplyAdd in binary32, exactly (section 1).

    ``a`` is a binary32 tensor of ``out``'s shape; ``b`` and ``c`` are binary32 tensors of that
    shape, or Python floats holding binary32 values. ``out`` may alias ``a``, ``b`` or ``c``.
    The product is exact in binary64, and rounding the binary64 sum once to binary32 is correct
    unless that sum sits exactly on a binary32 midpoint, or is a nonzero value below
    ``2**-125`` (binary32's subnormal range) that binary64 rounded; those elements (rare: a
    midpoint needs 28 particular bits) get the sum rounded to odd first.

    ``tiny_exact=True`` skips the subnormal-range test: for callers whose results below
    ``2**-125`` are always exact binary64 sums (``E`` of section 3 and the entropy's ``G*``:
    see :func:`exp_into`); the byte tests against the NumPy implementation, whose ``fma32``
    always tests, hold them to it.
    """
    s, w = sc.sum64, sc.wide
    s.copy_(a)
    if isinstance(b, torch.Tensor):
        w.copy_(b)
        s.mul_(w)  # exact: 24 x 24 bits
    else:
        s.mul_(b)
    if isinstance(c, torch.Tensor):
        w.copy_(c)
        s.add_(w)
    else:
        s.add_(c)
    bits = s.view(torch.int64)
    torch.bitwise_and(bits, _MIDPOINT_MASK, out=sc.bits)
    torch.eq(sc.bits, _MIDPOINT, out=sc.flag)
    if not tiny_exact:
        torch.bitwise_and(bits, _MAGNITUDE_MASK, out=sc.bits)
        torch.lt(sc.bits, _TINY_MAGNITUDE, out=sc.tiny)
        sc.flag.logical_or_(sc.tiny.logical_and_(sc.bits != 0))
    if bool(sc.flag.any()):
        idx = sc.flag.nonzero(as_tuple=True)

        def pick(v: Operand) -> Operand:
            return v[idx] if isinstance(v, torch.Tensor) else v

        s[idx] = _odd_rounded(pick(a), pick(b), pick(c), s[idx])
    return out.copy_(s)


def fma(a: torch.Tensor, b: Operand, c: Operand) -> torch.Tensor:
    """``fma(a, b, c)`` of binary32 operands (allocating; ``a`` gives the shape)."""
    _require_f32(a, "fma")
    for v, name in ((b, "b"), (c, "c")):
        if isinstance(v, torch.Tensor):
            _require_f32(v, f"fma {name}")
    out = torch.empty_like(a)
    return fma_into(a, b, c, out, FmaScratch(tuple(a.shape), a.device))


class ExpScratch:
    """Temporaries of :func:`exp_into` for tensors of one shape (reused chunk after chunk)."""

    __slots__ = ("yc", "t", "kf", "q", "ka", "mask", "yc64", "r64", "s64", "bits", "odd", "fma")

    def __init__(self, shape: tuple[int, ...], device: torch.device | str) -> None:
        self.yc = torch.empty(shape, dtype=torch.float32, device=device)
        self.t = torch.empty_like(self.yc)
        self.kf = torch.empty_like(self.yc)
        self.q = torch.empty_like(self.yc)
        self.ka = torch.empty(shape, dtype=torch.int32, device=device)
        self.mask = torch.empty(shape, dtype=torch.bool, device=device)
        self.yc64 = torch.empty(shape, dtype=torch.float64, device=device)
        self.r64 = torch.empty_like(self.yc64)
        self.s64 = torch.empty_like(self.yc64)
        self.bits = torch.empty(shape, dtype=torch.int64, device=device)
        self.odd = torch.empty(shape, dtype=torch.bool, device=device)
        self.fma = FmaScratch(shape, device)

    def rows(self, n: int) -> "ExpScratch":
        """The scratch of the first ``n`` rows (views, same memory)."""
        view = ExpScratch.__new__(ExpScratch)
        for name in self.__slots__:
            setattr(view, name, getattr(self, name).rows(n) if name == "fma" else getattr(self, name)[:n])
        return view

    def flat(self, start: int, stop: int) -> "ExpScratch":
        """The scratch of elements ``[start, stop)`` of the flattened shape (views, same memory)."""
        view = ExpScratch.__new__(ExpScratch)
        for name in self.__slots__:
            if name != "fma":
                setattr(view, name, getattr(self, name).view(-1)[start:stop])
        view.fma = self.fma
        return view


# Elements of E evaluated at once: its binary64 temporaries then stay in a core's cache (a
# chunk of three rows of vocabulary 151936 in binary64 is 3.6 MB a buffer); the bytes never
# depend on it (every operation is elementwise).
EXP_BLOCK = 65536


def _rounded_to(s64: torch.Tensor, out: torch.Tensor, sc: ExpScratch) -> torch.Tensor:
    """``out = s64`` rounded to binary32, noting in ``sc.odd`` the sums that sit on a binary32
    midpoint (the only ones a binary64 rounding can have misled: :func:`fma_into`)."""
    torch.bitwise_and(s64.view(torch.int64), _MIDPOINT_MASK, out=sc.bits)
    torch.eq(sc.bits, _MIDPOINT, out=sc.mask)
    sc.odd.logical_or_(sc.mask)
    return out.copy_(s64)


def _exp_exact(y: torch.Tensor) -> torch.Tensor:
    """``E(y)`` with every fused multiply-add rounded to odd first: for the few elements where
    :func:`exp_into`'s binary64 sums met a binary32 midpoint (allocating, any shape)."""
    def fma_(a: Operand, b: Operand, c: Operand) -> torch.Tensor:
        return _odd_rounded(a, b, c, y).to(torch.float32)

    yc = torch.clamp(y, EXP_LO, EXP_HI)
    t = fma_(yc, LOG2E, BIAS)
    kf = t - BIAS
    r = fma_(kf, -LN2_LO, fma_(kf, -LN2_HI, yc))
    c6, c5, c4, c3, c2 = EXP_POLY
    q = fma_(r, c6, c5)
    for c in (c4, c3, c2, 1.0, 1.0):
        q = fma_(q, r, c)
    return q * torch.bitwise_left_shift(t.view(torch.int32), 23).view(torch.float32)


def exp_into(y: torch.Tensor, out: torch.Tensor, sc: ExpScratch) -> torch.Tensor:
    """``out = E(y)`` (section 3, the general form), elementwise; ``out`` may be ``y``.

    Leaves ``yc = min(max(y, LO), HI)`` (step 1) in ``sc.yc``: for ``y <= 0`` it is the
    ``max(y, LO)`` the entropy term of section 6 step 4 multiplies by.

    Each fused multiply-add is computed as :func:`fma_into` says, in binary64 (the products of
    binary32 values are exact there): the binary64 sum rounded once to binary32 is the fma,
    except where that sum sits exactly on a binary32 midpoint. Those elements are noted while
    the steps run, and recomputed at the end with every fma rounded to odd first
    (:func:`_exp_exact`). No fma of ``E`` has a result below ``2**-125`` in magnitude unless its
    binary64 sum is exact (``t`` lies in ``[2**23, 2**24)``; ``r`` is exact for ``k = 0`` and
    otherwise a nonzero multiple of ``2**-52``; ``q`` and ``p`` lie in ``[C5, 1.5]``), so the
    subnormal-range test of :func:`fma_into` is not needed here.
    """
    n = y.numel()
    if n > EXP_BLOCK and y.is_contiguous() and out.is_contiguous() and sc.yc.is_contiguous() and y.shape == sc.yc.shape:
        yf, of = y.view(-1), out.view(-1)
        for start in range(0, n, EXP_BLOCK):
            stop = min(n, start + EXP_BLOCK)
            _exp_block(yf[start:stop], of[start:stop], sc.flat(start, stop))
    else:
        _exp_block(y, out, sc)
    if bool(sc.odd.any()):  # a binary64 sum on a binary32 midpoint: recompute those exactly
        idx = sc.odd.nonzero(as_tuple=True)
        out[idx] = _exp_exact(sc.yc[idx])  # E(yc) = E(y): step 1 is idempotent
    return out


def _exp_block(y: torch.Tensor, out: torch.Tensor, sc: ExpScratch) -> torch.Tensor:
    """:func:`exp_into` on one block (same shape for ``y``, ``out`` and the scratch), but for the
    elements it notes in ``sc.odd``."""
    yc, t, kf, q = sc.yc, sc.t, sc.kf, sc.q
    yc64, r64, s64 = sc.yc64, sc.r64, sc.s64
    sc.odd.zero_()
    torch.clamp(y, EXP_LO, EXP_HI, out=yc)  # 1. NaN stays NaN
    yc64.copy_(yc)
    torch.mul(yc64, LOG2E, out=s64)  # 2. t = fma(yc, LOG2E, BIAS) = BIAS + k
    s64.add_(BIAS)
    _rounded_to(s64, t, sc)
    torch.sub(t, BIAS, out=kf)  # 3. exact
    r64.copy_(kf)  # 4. r = fma(kf, -LN2_HI, yc): exact (section 3), so exact in binary64 too
    torch.mul(r64, -LN2_HI, out=s64)
    s64.add_(yc64)
    r64.mul_(-LN2_LO)  # r = fma(kf, -LN2_LO, r)
    r64.add_(s64)
    _rounded_to(r64, out, sc)
    r64.copy_(out)  # r, exactly
    c6, c5, c4, c3, c2 = EXP_POLY  # 5. Horner with fusedMultiplyAdd
    torch.mul(r64, c6, out=s64)
    s64.add_(c5)
    _rounded_to(s64, q, sc)
    for c in (c4, c3, c2, 1.0, 1.0):
        s64.copy_(q)
        s64.mul_(r64)
        s64.add_(c)
        _rounded_to(s64, q, sc)  # the last one is p
    # 6. sc = float(bits(t) << 23): 2**k, +0 at k = -127, +inf at k = 128
    ka = sc.ka
    torch.bitwise_left_shift(t.view(torch.int32), 23, out=ka)
    torch.mul(q, ka.view(torch.float32), out=out)  # 7. p * sc
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
    inner = (s * (hf + r)) + (ef * LOG_LN2_LO)
    result = (ef * LOG_LN2_HI) - ((hf - inner) - f)
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
    "fma",
    "fma_into",
    "FmaScratch",
    "log",
    "require_gradual_underflow",
    "round_into",
    "rounded",
]
