"""A temperature per row: a rollout batch mixes requests sampled at different temperatures.

vLLM's sampler divides each request's float32 logits by that request's float32 temperature (a
tensor with one value per row), so the logprob of what it sampled is the one at that row's ``T``.
Here a row's ``T32`` is what docs/arithmetic.md section 6 step 0 makes of a number: every logit of
the row is divided by it after the exact upcast, and the row's gradient (section 7 step 2) too.
Rows never mix, so each row's bytes are those of the scalar call at its ``T32``, and a row at
``T32 = 1`` has the bytes without a temperature (a division by 1 is exact).

What is accepted (:func:`row_temperature32`): a tensor of the shape of ``targets`` (the logits'
shape without the vocabulary), on the logits' device, not requiring a gradient, of a floating-point
dtype. bf16, binary16 and binary32 values convert to binary32 exactly; a float64 value is rounded
once, ``T32 = RN32(T)``, as a Python number is. Every ``T32`` must be finite and lie in
``[2**-64, 2**64]`` (then ``T32`` and ``1 / T32`` are normal binary32 numbers); the first that does
not is named with its index and value. With validation the check reads the ``[rows]`` tensor once on the host,
before any collective of the call.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_engine.arith.temperature import MAX_TEMPERATURE, MIN_TEMPERATURE
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.hidden_dtensor import is_dtensor

FIX = "pass temperatures > 0 such as 0.7 (1.0 for a row sampled without temperature)"


def is_row_temperature(temperature: Any) -> bool:
    """Whether ``temperature`` is a tensor (per row) rather than a number (the whole call)."""
    return isinstance(temperature, torch.Tensor)


def row_temperature32(temperature: Any, lead: tuple[int, ...], device: torch.device,
                      field: str = "temperature", check_values: bool = True) -> torch.Tensor:
    """The rows' ``T32`` as a contiguous binary32 tensor of shape ``lead`` on ``device``.

    Refuses (:class:`LogprobContractError`, naming ``field``, the value and the fix) another shape,
    a non-floating dtype, another device, a tensor requiring a gradient, and a ``T32`` that is not
    finite or lies outside ``[2**-64, 2**64]``. The last check reads the values on the host (one
    sync); ``check_values=False`` (the op's ``validate=False``, which skips the targets' range check
    too) leaves it out, so that a call without validation stays free of host round trips."""
    if is_dtensor(temperature):
        from torch.distributed.tensor import Replicate

        if not all(isinstance(p, Replicate) for p in temperature.placements):
            raise LogprobContractError(
                f"{field} is a DTensor with placements {list(temperature.placements)}; a per-row temperature "
                f"must be whole on every rank: pass a plain tensor or {field}.redistribute(placements=[Replicate()])")
        temperature = temperature.to_local()
    if not isinstance(temperature, torch.Tensor):
        raise LogprobContractError(f"{field} must be a number or a tensor, got {type(temperature).__name__}; "
                                   "pass a float such as 0.7 or one temperature per row")
    if tuple(temperature.shape) != tuple(lead):
        raise LogprobContractError(
            f"{field}.shape={tuple(temperature.shape)} must equal logits.shape[:-1]={tuple(lead)} (one temperature "
            f"per row, the shape of targets); pass a number for one temperature over the whole call")
    if not temperature.dtype.is_floating_point:
        raise LogprobContractError(
            f"{field}.dtype={temperature.dtype} is not a floating-point type; pass bf16, fp16 or fp32 temperatures "
            f"(exact in binary32) or float64 ones (rounded once to binary32), e.g. {field}.float()")
    if temperature.device != device:
        raise LogprobContractError(
            f"{field}.device={temperature.device} differs from logits.device={device}; move the temperatures to "
            "the logits' device")
    if temperature.requires_grad:
        raise LogprobContractError(
            f"{field}.requires_grad=True: the op gives no gradient to the temperature; pass {field}.detach()")
    t32 = temperature.detach().to(torch.float32).contiguous()  # exact from <= 32 bits; RN32 from float64
    if not check_values:
        return t32
    bad = ~((t32 >= MIN_TEMPERATURE) & (t32 <= MAX_TEMPERATURE))  # NaN compares false: bad
    if t32.numel() and bool(bad.any()):
        index = tuple(int(i) for i in bad.nonzero()[0])
        value = float(temperature.detach()[index])
        rounded = float(t32[index])
        note = "" if rounded == value or value != value else f" (binary32 {rounded!r})"
        raise LogprobContractError(
            f"{field}{list(index)}={value!r}{note} must be finite with its binary32 value in [2**-64, 2**64] "
            f"(T32 and 1/T32 normal); {FIX}")
    return t32


__all__ = ["is_row_temperature", "row_temperature32"]
