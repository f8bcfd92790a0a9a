"""Dividing by ``T32`` with fused multiply-adds: what the Triton kernels compute, and why it is exact.

Section 6 step 0 of ``docs/arithmetic.md`` divides every logit by ``T32`` (``RN32(x / T32)``,
an IEEE division) and section 7 divides the gradient by it. A correctly rounded ``div.rn.f32``
costs about a dozen instructions per element on an NVIDIA GPU (a reciprocal approximation, its
refinement, a range check and a branch around a call to a slow path); the Triton kernels compute the same
quotient with Markstein's correction instead, from ``r = RN32(1 / T32)`` computed once on the
host::

    q = RN(x * r)                      # within 1.5 ulp of x / T32
    e = fma(q, T32, -x)                # the residual q * T32 - x, exact where it matters
    q = fma(-e, r, q)                  # q + (x - q * T32) * r, rounded once

once for bf16 and binary16 logits (:data:`STEPS`), twice for binary32 values (logits or gradient).
Written this way (``fma(q, T32, -x)``, not ``fma(-q, T32, x)``) ``x = -0`` gives ``-0``.

The sequence equals ``RN32(x / T32)`` on :func:`domain` (``x = +-0``, or ``|x| >= lo`` and
``|x| < hi`` where the quotient, the residual and every intermediate are normal binary32 numbers):
there every value is ``2**(a - b)`` times the same sequence on the significands ``A = x / 2**a``
and ``B = T32 / 2**b`` in ``[1, 2)``, so checking every pair of significands checks every ``x``
and ``T32``. Outside the domain (infinities, overflow, quotients or residuals below ``2**-126``)
it is not exact (an infinity gives NaN; a subnormal quotient can be one unit off), and the
kernels use the IEEE division there (``docs/arithmetic.md``, "Dividing by T32 on a GPU").

A bf16 or binary16 logit has 8 or 11 significant bits, so its product with a reciprocal cut to
``24 - 8`` (``24 - 11``) significant bits is exact, and two operations give the quotient at most
temperatures (:func:`split_reciprocal`, the forward kernel's fast path with one temperature per call)::

    q = fma(x, r_lo, x * r_hi)         # RN(x * (r_hi + r_lo)): one rounding of x times 1 / T32 to ~2**-40

``r_hi + r_lo`` is ``1 / T32`` to about ``2**-40`` (binary16: ``2**-37``), and ``x / T32`` is never
that close to a rounding boundary relative to itself for most ``T32``: which ones it holds for is
checked, per temperature, on every significand of the precision (128 or 1024 values, exactly), so
the host takes it only where that check passes and Markstein's step elsewhere (``r_lo >= 0``, so
``x = -0`` gives ``-0``).

Checks (NumPy, exact: ``spec_numpy.fma32`` is a correctly rounded fusedMultiplyAdd):
:func:`significand_mismatches` (every ``A`` of a precision against given ``B``), used by
``tests/test_division.py`` on samples and by ``scripts/markstein_proof.py`` exhaustively.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from rl_engine.arith.spec_numpy import fma32

F32 = np.float32

# Markstein steps per logits dtype: one is exact for bf16 and binary16 (8 and 11 significant bits,
# every T32: scripts/markstein_proof.py), two for binary32 (24 bits: one is not).
STEPS: dict[str, int] = {"bfloat16": 1, "float16": 1, "float32": 2}
# Significand bits after the leading one, per dtype (the A of the significand check).
FRACTION_BITS: dict[str, int] = {"bfloat16": 7, "float16": 10, "float32": 23}
# |x| >= 2**LOW_EXPONENT keeps the residual's exact value a multiple of 2**-149: with x = A * 2**a,
# q * T32 - x is a multiple of 2**(a - 47) (a product of two 24-bit significands).
LOW_EXPONENT = -102


def reciprocal(t32: float) -> float:
    """``r = RN32(1 / T32)``, one binary32 division."""
    return float(np.divide(F32(1.0), F32(t32)))


def step(x: np.ndarray, q: np.ndarray, t32: float, r: float) -> np.ndarray:
    """One Markstein correction of ``q ~ x / T32``: ``fma(-fma(q, T32, -x), r, q)``."""
    x, q = np.asarray(x, F32), np.asarray(q, F32)
    e = fma32(q, np.full_like(q, t32), np.negative(x))
    return fma32(np.negative(e), np.full_like(q, r), q)


def markstein(x: np.ndarray, t32: float, steps: int) -> np.ndarray:
    """The kernels' quotient: ``q = RN(x * r)`` and ``steps`` corrections."""
    x = np.asarray(x, F32)
    r = reciprocal(t32)
    with np.errstate(over="ignore", invalid="ignore"):
        q = np.multiply(x, F32(r))
        for _ in range(steps):
            q = step(x, q, t32, r)
    return q


def domain(t32: float) -> tuple[float, float]:
    """``(lo, hi)``: the sequence is exact for ``x = +-0`` and ``lo <= |x| < hi`` (``hi`` may be
    ``inf``). With ``T32 = B * 2**b``: ``|x| >= 2**-102`` (the residual is a multiple of
    ``2**-149``), ``|x| >= 2**(b - 125)`` (the quotient and its estimates are normal) and
    ``|x| < 2**(127 + b)`` (no estimate overflows)."""
    _, b = math.frexp(float(t32))  # t32 = m * 2**b, m in [0.5, 1)
    b -= 1
    lo = max(2.0 ** LOW_EXPONENT, 2.0 ** (b - 125))
    hi = 2.0 ** (127 + b) if 127 + b < 128 else math.inf
    return lo, hi


def tiny_bound(t32: float) -> float:
    """A power of two above ``|x / T32|`` and ``|markstein(x)|`` for every ``x`` below the domain
    (``|x| < lo``): ``2 * max(lo * r, 2**-126)``, rounded up to a power of two."""
    lo, _ = domain(t32)
    return 2.0 ** math.ceil(math.log2(2.0 * max(lo * reciprocal(t32), 2.0 ** -126)))


# A value below the domain cannot change RN(v - s) when |s| >= 2**SHIFT_MARGIN * tiny_bound: it is
# below a quarter of the last place of s (2**-25 of it), so v - s rounds to -s whichever the value.
SHIFT_MARGIN = 30


def kernel_bounds(t32: float) -> tuple[float, float, float]:
    """``(hi, lo, shift_min)``, binary32 values, for the kernels' choice between Markstein's
    sequence and the IEEE division: a tile or block holding a value of magnitude ``>= hi`` (``inf``
    when every finite one is in range) or a non-zero gradient below ``lo`` divides with the IEEE
    division, and so does one whose shift (a tile's maximum, a row's ``lse`` or ``Mb``) has a
    magnitude below ``shift_min`` (a logit below the domain could change ``x - shift`` then)."""
    lo, hi = domain(t32)
    return hi, lo, 2.0 ** SHIFT_MARGIN * tiny_bound(t32)


# Significant bits of r_hi per dtype: with the logit's 8 (bf16) or 11 (binary16) bits, 24 in all, so
# x * r_hi is exact wherever it is a normal binary32 number.
SPLIT_BITS: dict[str, int] = {"bfloat16": 16, "float16": 13}


def split_parts(t32: float, dtype: str) -> tuple[float, float]:
    """``(r_hi, r_lo)``: ``1 / T32`` rounded down to :data:`SPLIT_BITS` significant bits, and the rest
    (``>= 0``) rounded to binary32 (exact rational arithmetic, then one rounding to binary64 and one
    to binary32: a deterministic choice, checked by :func:`split_mismatches`). ``r_lo >= 0`` keeps
    the sign of zero: ``fma(-0, r_lo, -0 * r_hi)`` is ``-0 + -0``."""
    if dtype not in SPLIT_BITS:
        raise ValueError(f"dtype={dtype!r}: the split quotient needs a logit of at most 11 significant bits; "
                         f"pass one of {sorted(SPLIT_BITS)}")
    from fractions import Fraction

    inverse = Fraction(1) / Fraction(float(F32(t32)))
    unit = (1 << (24 - SPLIT_BITS[dtype])) - 1
    bits = int(np.array([reciprocal(t32)], F32).view(np.uint32)[0]) & ~unit
    if Fraction(_float32(bits)) > inverse:  # RN32(1 / T32) rounded up: one unit of the kept bits less
        bits -= unit + 1
    r_hi = _float32(bits)
    return r_hi, float(F32(float(inverse - Fraction(r_hi))))


def _float32(bits: int) -> float:
    return float(np.array([bits], np.uint32).view(F32)[0])


def split_quotient(x: np.ndarray, r_hi: float, r_lo: float) -> np.ndarray:
    """The split quotient ``fma(x, r_lo, x * r_hi)`` in binary32 (``x * r_hi`` rounded as the
    kernels' multiplication rounds it; exact where :func:`split_reciprocal` promises it)."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        return fma32(x, np.full_like(x, r_lo), np.multiply(x, F32(r_hi)))


def split_mismatches(t32: float, dtype: str) -> np.ndarray:
    """The significands ``A`` in ``[1, 2)`` of ``dtype`` (every one: 128 or 1024) where the split
    quotient of ``A`` differs from ``RN32(A / T32)`` (compared as bits)."""
    a = significands(FRACTION_BITS[dtype])
    r_hi, r_lo = split_parts(t32, dtype)
    return a[split_quotient(a, r_hi, r_lo).view(np.uint32) != np.divide(a, F32(t32)).view(np.uint32)]


def split_reciprocal(t32: float, dtype: str) -> tuple[float, float] | None:
    """``(r_hi, r_lo)`` when the split quotient ``fma(x, r_lo, x * r_hi)`` is ``RN32(x / T32)`` for
    every ``x`` of ``dtype`` (bf16 or binary16) in :func:`domain`, else ``None`` (Markstein's step
    then: about one temperature in fifty for binary16, one in 10,000 sampled from ``[0.05, 5]`` for bf16).

    Why it holds where the check passes: on the domain ``x = A * 2**a`` with ``A`` a significand of
    the dtype, ``x * r_hi`` is exact (24 significant bits, a normal number: the quotient is normal
    there and ``r_hi <= r``), the FMA rounds ``x * (r_hi + r_lo)`` once, and that and ``x / T32`` are
    ``2**a`` times the values for ``A`` (scaling by a power of two commutes with rounding to a normal
    result); so checking every ``A`` against the IEEE quotient checks every ``x``. Below the domain
    the split quotient stays under :func:`tiny_bound`, as Markstein's does (the guard's reasoning
    holds unchanged); ``x = -0`` gives ``-0``."""
    if dtype not in SPLIT_BITS or t32 == 1.0:
        return None
    return _split_checked(float(F32(t32)), dtype)


@functools.lru_cache(maxsize=None)
def _split_checked(t32: float, dtype: str) -> tuple[float, float] | None:
    """:func:`split_reciprocal` once per temperature and dtype a process meets (128 or 1024 exact FMAs)."""
    return split_parts(t32, dtype) if split_mismatches(t32, dtype).size == 0 else None


def in_domain(x: np.ndarray, t32: float) -> np.ndarray:
    """Where :func:`markstein` is proved to be ``RN32(x / T32)`` (a bool array)."""
    lo, hi = domain(t32)
    a = np.abs(np.asarray(x, F32)).astype(np.float64)
    return (a == 0) | ((a >= lo) & (a < hi))


def kernel_quotient(x: np.ndarray, t32: float, steps: int) -> np.ndarray:
    """What a kernel writes: the sequence on the domain, the IEEE division elsewhere."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(in_domain(x, t32), markstein(x, t32, steps), np.divide(x, F32(t32)))


def significands(fraction_bits: int) -> np.ndarray:
    """Every significand in ``[1, 2)`` with ``fraction_bits`` bits after the leading one (float32)."""
    n = np.arange(1 << fraction_bits, dtype=np.uint32)
    return ((n << np.uint32(23 - fraction_bits)) | np.uint32(0x3F800000)).view(F32)


def significand_mismatches(a: np.ndarray, b: np.ndarray, steps: int) -> np.ndarray:
    """Indices ``i`` where the sequence on significands ``a[i] / b[i]`` (both in ``[1, 2)``, arrays
    of one shape) differs from the IEEE quotient (compared as bits)."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    r = np.divide(F32(1.0), b)
    q = np.multiply(a, r)
    for _ in range(steps):
        e = fma32(q, b, np.negative(a))
        q = fma32(np.negative(e), r, q)
    want = np.divide(a, b)
    return np.nonzero(q.view(np.uint32) != want.view(np.uint32))[0]


__all__ = ["FRACTION_BITS", "LOW_EXPONENT", "SHIFT_MARGIN", "SPLIT_BITS", "STEPS", "domain", "in_domain",
           "kernel_bounds", "kernel_quotient", "markstein", "reciprocal", "significand_mismatches", "significands",
           "split_mismatches", "split_parts", "split_quotient", "split_reciprocal", "step", "tiny_bound"]
