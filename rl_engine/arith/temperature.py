"""The sampling temperature as the arithmetic uses it (docs/arithmetic.md, section 6 step 0).

The caller's ``T`` (a Python float, binary64) is rounded once to binary32, ``T32 = RN32(T)``, and
every logit is divided by it after the exact upcast: ``x' = RN32(f32(X) / T32)``, the correctly
rounded binary32 quotient (an IEEE-754 basic operation). The gradient is divided by ``T32`` the
same way before its one rounding, as autograd's chain rule of that division computes it. ``T32 = 1``
makes the step the identity, and it is skipped: the bytes are the ones without a temperature.

A division, not a multiply by a reciprocal, because that is what the sampler does: vLLM's V1
sampler divides its float32 logits by a float32 temperature tensor (``logits.div_(temp)``, a true
division on every device), so the logprob computed here at ``T`` is the one of the distribution
it samples from. ``x * RN32(1/T32)`` differs from ``x / T32`` in the last bit for about one
logit in ten at ``T = 0.7``. (PyTorch's ``logits / T`` with a Python float ``T`` divides on the
CPU but, on CUDA, multiplies by the float32 reciprocal: a trainer that scales its logits that way
on a GPU computes ``x * RN32(1/T32)``, not this.)

:func:`inverse_temperature` (``r = RN32(1 / T32)``) is not a step of the specification: the
Triton kernels use it inside Markstein's correction, which gives ``RN32(x / T32)`` exactly from
``x * r`` and two fused multiply-adds (docs/arithmetic.md, "Dividing by T32 on a GPU").

A temperature per row (a tensor of one ``T`` per row, each row's ``T32`` this module's rounding of
it) is :mod:`rl_engine.logprob.row_temperature`'s; the range below is the same.

Torch-free (the workflow's config check reads it). ``RN32`` of a binary64 value is
``struct.pack("f")`` (round to nearest even); ``RN32(RN64(1 / T32))`` is the correctly rounded
binary32 quotient, since binary64 has more than ``2 * 24 + 2`` bits (double rounding is harmless
for the basic operations then).
"""

from __future__ import annotations

import math
import struct

from rl_engine.validators import shown

# T32 must lie in [2**-64, 2**64]: T32 and 1/T32 are then normal binary32 numbers.
MIN_TEMPERATURE = 2.0 ** -64
MAX_TEMPERATURE = 2.0 ** 64


class TemperatureError(ValueError):
    """A temperature the arithmetic does not accept."""


def rn32(value: float) -> float:
    """``value`` rounded to the nearest binary32 (ties to even), returned as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def temperature32(temperature: object, field: str = "temperature") -> float:
    """``T32 = RN32(T)``, the divisor of section 6 step 0; 1.0 means no temperature.

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
    return t32


def inverse_temperature(temperature: object, field: str = "temperature") -> float:
    """``r = RN32(1 / T32)``, exactly representable in binary32, for Markstein's division on a GPU
    (not a step of the specification); 1.0 for ``T32 = 1``. Refuses what :func:`temperature32` does."""
    return rn32(1.0 / temperature32(temperature, field))


__all__ = ["MAX_TEMPERATURE", "MIN_TEMPERATURE", "TemperatureError", "inverse_temperature", "rn32",
           "temperature32"]
