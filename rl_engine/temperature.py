"""The sampling temperature as the arithmetic uses it (docs/arithmetic.md, section 6 step 0).

The caller's ``T`` (a Python float, binary64) is rounded once to binary32, ``T32 = RN32(T)``, and
its reciprocal is one binary32 division, ``r = RN32(1 / T32)``; every logit is then multiplied by
``r`` after the exact upcast, ``x' = RN32(f32(X) * r)``, and the gradient by ``r`` before its one
rounding. ``T = 1`` gives ``r = 1``: the step is the identity and is skipped, so the bytes are the
ones without a temperature.

A multiply by ``r``, not a division by ``T32``: one instruction per element on a GPU against about
ten for a correctly rounded division, so the arith/2 kernels keep their instruction budget at any
temperature. ``x * r`` and ``x / T32`` differ in the last bit for some ``x`` when ``1/T32`` is not
a power of two; both are deterministic, and this one is specified.

Torch-free (the workflow's config check reads it). ``RN32`` of a binary64 value is
``struct.pack("f")`` (round to nearest even); ``RN32(RN64(1 / T32))`` is the correctly rounded
binary32 quotient, since binary64 has more than ``2 * 24 + 2`` bits (double rounding is harmless
for the basic operations then).
"""

from __future__ import annotations

import math
import struct

from rl_engine.validators import shown

# T32 must lie in [2**-64, 2**64]: T32 and r are then normal binary32 numbers, and r is finite.
MIN_TEMPERATURE = 2.0 ** -64
MAX_TEMPERATURE = 2.0 ** 64


class TemperatureError(ValueError):
    """A temperature the arithmetic does not accept."""


def rn32(value: float) -> float:
    """``value`` rounded to the nearest binary32 (ties to even), returned as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def inverse_temperature(temperature: object, field: str = "temperature") -> float:
    """``r = RN32(1 / RN32(T))``, exactly representable in binary32; 1.0 for ``T = 1``.

    Refuses (naming ``field``) a bool, a non-number, NaN, an infinity, and a ``T`` whose binary32
    rounding lies outside ``[2**-64, 2**64]``."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TemperatureError(f"{field} must be a number, got {temperature!r}; pass a float such as 0.7")
    try:
        value = float(temperature)
    except OverflowError:  # an integer beyond binary64 (10**400): far outside the range below
        raise TemperatureError(f"{field}={shown(temperature)} is outside [2**-64, 2**64] (an integer beyond "
                               "binary64's range); pass a temperature > 0 such as 0.7") from None
    if not math.isfinite(value):
        raise TemperatureError(f"{field}={temperature!r} must be finite; pass a temperature > 0 such as 0.7")
    try:
        t32 = rn32(value)
    except OverflowError:
        t32 = math.inf
    if not MIN_TEMPERATURE <= t32 <= MAX_TEMPERATURE:
        raise TemperatureError(f"{field}={temperature!r} is outside [2**-64, 2**64] in binary32 "
                               "(the arithmetic needs T > 0 whose binary32 value and reciprocal are normal); "
                               "pass 1.0 for the logits as they are")
    return rn32(1.0 / t32)


__all__ = ["MAX_TEMPERATURE", "MIN_TEMPERATURE", "TemperatureError", "inverse_temperature", "rn32"]
