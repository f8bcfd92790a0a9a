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

Checks (NumPy, exact: ``spec_numpy.fma32`` is a correctly rounded fusedMultiplyAdd):
:func:`significand_mismatches` (every ``A`` of a precision against given ``B``), used by
``tests/test_division.py`` on samples and by ``scripts/markstein_proof.py`` exhaustively.
"""

from __future__ import annotations

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


__all__ = ["FRACTION_BITS", "LOW_EXPONENT", "SHIFT_MARGIN", "STEPS", "domain", "in_domain", "kernel_bounds",
           "kernel_quotient", "markstein", "reciprocal", "significand_mismatches", "significands", "step", "tiny_bound"]
