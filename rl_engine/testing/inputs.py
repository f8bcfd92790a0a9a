"""The campaign's inputs, regenerable by anyone from the case's integers.

Recipe (:func:`make_inputs`), exactly, on the CPU and independent of the topology::

    g = torch.Generator(device="cpu"); g.manual_seed(seed)
    logits = torch.randn(batch * seq, padded_vocab, generator=g, dtype=torch.float32) * logit_scale
    targets = torch.randint(0, real_vocab, (batch * seq,), generator=g, dtype=torch.int64)
    logits[:, real_vocab:] = PADDING_LOGIT          # padding columns, never counted
    active = (arange(batch * seq) % seq) >= prompt_tokens

Row ``s * seq + p`` is position ``p`` of sequence ``s``; the first ``prompt_tokens``
positions of every sequence are inactive (a prompt contributes no logprob). Padding
columns hold the large value :data:`PADDING_LOGIT`, so a kernel that let padding count
would be far outside any tolerance. The candidate sees ``logits.to(dtype)``.

``inputs_sha256`` in a report is :func:`inputs_sha256` of these three tensors (FP32
logits, int64 targets, bool mask; SHA-256 of their little-endian bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from rl_engine.tensorio import fingerprint

PADDING_LOGIT = 100.0
SPEC_FIELDS: tuple[str, ...] = (
    "batch",
    "seq",
    "prompt_tokens",
    "real_vocab",
    "padded_vocab",
    "seed",
    "logit_scale",
)


class InputSpecError(ValueError):
    """Input parameters from which no inputs can be made; names the field, value and fix."""


@dataclass(frozen=True)
class InputSpec:
    """The parameters of :func:`make_inputs` (a subset of a campaign case)."""

    batch: int
    seq: int
    prompt_tokens: int
    real_vocab: int
    padded_vocab: int
    seed: int
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        for name, minimum in (
            ("batch", 1),
            ("seq", 1),
            ("prompt_tokens", 0),
            ("real_vocab", 1),
            ("padded_vocab", 1),
            ("seed", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise InputSpecError(f"{name}={value!r} must be an integer >= {minimum}")
        if self.real_vocab > self.padded_vocab:
            raise InputSpecError(
                f"real_vocab={self.real_vocab} exceeds padded_vocab={self.padded_vocab}; "
                "the padded vocabulary must be >= the real one"
            )
        if self.prompt_tokens > self.seq:
            raise InputSpecError(
                f"prompt_tokens={self.prompt_tokens} exceeds seq={self.seq}; a prompt is a "
                "prefix of the sequence"
            )
        scale = self.logit_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise InputSpecError(f"logit_scale={scale!r} must be a finite number > 0")
        if scale != scale or scale == float("inf"):
            raise InputSpecError(f"logit_scale={scale!r} must be a finite number > 0")

    @classmethod
    def from_case(cls, case: Mapping[str, Any] | Any) -> "InputSpec":
        """From a report/plan ``case`` mapping or any object with the same attributes."""
        if isinstance(case, InputSpec):
            return case
        get = case.get if isinstance(case, Mapping) else lambda k, d=None: getattr(case, k, d)
        missing = [k for k in SPEC_FIELDS if k != "logit_scale" and get(k, None) is None]
        if missing:
            raise InputSpecError(f"case lacks {missing}; it needs every field of {list(SPEC_FIELDS)}")
        values = {k: get(k, None) for k in SPEC_FIELDS}
        if values["logit_scale"] is None:
            values["logit_scale"] = 1.0
        return cls(**values)

    @property
    def num_tokens(self) -> int:
        return self.batch * self.seq


def make_inputs(case: Mapping[str, Any] | Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits_fp32 [batch*seq, padded], targets int64 [batch*seq], active bool [batch*seq])``.

    Pure: the same case gives the same bytes on every call, rank and machine with the same
    torch CPU generator. See the module docstring for the exact recipe.
    """
    spec = InputSpec.from_case(case)
    g = torch.Generator(device="cpu")
    g.manual_seed(spec.seed)
    n = spec.num_tokens
    logits = torch.randn(n, spec.padded_vocab, generator=g, dtype=torch.float32) * float(
        spec.logit_scale
    )
    targets = torch.randint(0, spec.real_vocab, (n,), generator=g, dtype=torch.int64)
    logits[:, spec.real_vocab :] = PADDING_LOGIT
    positions = torch.arange(n, dtype=torch.int64) % spec.seq
    active = positions >= spec.prompt_tokens
    return logits, targets, active


def inputs_sha256(
    logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor
) -> dict[str, str]:
    """The report's ``inputs_sha256``: fingerprints of the FP32 logits, targets and mask."""
    if logits.dtype != torch.float32 or targets.dtype != torch.int64 or active.dtype != torch.bool:
        raise InputSpecError(
            "inputs_sha256 needs FP32 logits, int64 targets and a bool mask, got "
            f"{logits.dtype}, {targets.dtype}, {active.dtype}"
        )
    return {"logits": fingerprint(logits), "targets": fingerprint(targets), "mask": fingerprint(active)}


__all__ = ["PADDING_LOGIT", "InputSpec", "InputSpecError", "inputs_sha256", "make_inputs"]
