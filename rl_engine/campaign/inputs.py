"""The campaign's inputs, regenerable by anyone, on any machine, from the case's integers.

Recipe (:func:`make_inputs`, ``docs/arithmetic.md`` section 10): every logit comes from a
64-bit integer hash (splitmix64) of the seed and the element index, made bell-shaped by
summing the hash's four 16-bit pieces (an Irwin-Hall variable), converted exactly to FP32 and
scaled by two rounded multiplications::

    z = splitmix64(seed * 0x9E3779B97F4A7C15 + i * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019)
    logit[i] = (f32(z0 + z1 + z2 + z3 - 131070) * 0x1.bb67aep-16) * f32(logit_scale)
    target[row] = splitmix64(... i = 2**62 + row ...) mod real_vocab
    logits[:, real_vocab:] = PADDING_LOGIT          # padding columns, never counted
    active = (arange(batch * seq) % seq) >= prompt_tokens    # rl_engine.campaign.mask.recipe_active

No library random generator is involved: ``torch.randn`` gives other bytes under its AVX2
kernel than under its scalar one, which would make the evidence unreplayable elsewhere.
Row ``s * seq + p`` is position ``p`` of sequence ``s``; the first ``prompt_tokens``
positions of every sequence are inactive (a prompt contributes no logprob). Padding
columns hold the large value :data:`PADDING_LOGIT`, so a kernel that let padding count
would be far outside any tolerance. The candidate sees ``logits.to(dtype)``.

``inputs_sha256`` in a report is :func:`inputs_sha256` of these three tensors (FP32
logits, int64 targets, bool mask; SHA-256 of their little-endian bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from rl_engine.campaign.case import case_problems
from rl_engine.campaign.mask import recipe_active
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
        # the case's own rules on these fields (rl_engine.campaign.case), nothing of its own
        problems = case_problems({name: getattr(self, name) for name in SPEC_FIELDS})
        if problems:
            raise InputSpecError("; ".join(message for _, message in problems))

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


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_INDEX_MUL = np.uint64(0xD1B54A32D192ED03)
_OFFSET = np.uint64(0x632BE59BD9B4E019)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TARGET_BASE = 2**62
_UNIT = np.float32(float.fromhex("0x1.bb67aep-16"))  # binary32 nearest 1 / sqrt((2**32 - 1) / 3)
_ROW_BLOCK_ELEMENTS = 1 << 22  # bounds the uint64 temporaries (32 MiB each)


def _splitmix64(seed: int, index: np.ndarray) -> np.ndarray:
    """splitmix64 of ``seed`` and the uint64 element indices (wrapping 64-bit arithmetic)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) * _GOLDEN + index * _INDEX_MUL + _OFFSET
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _bell(z: np.ndarray) -> np.ndarray:
    """``f32(z0 + z1 + z2 + z3 - 131070) * UNIT`` of each hash (exact integer sum, one rounding)."""
    mask = np.uint64(0xFFFF)
    total = (z & mask) + ((z >> np.uint64(16)) & mask) + ((z >> np.uint64(32)) & mask) + (z >> np.uint64(48))
    centred = total.astype(np.int64) - 131070  # |centred| < 2**18: exact in binary32
    return centred.astype(np.float32) * _UNIT


def make_inputs(case: Mapping[str, Any] | Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits_fp32 [batch*seq, padded], targets int64 [batch*seq], active bool [batch*seq])``.

    Pure and portable: the same case gives the same bytes on every call, rank, machine and
    instruction set. See the module docstring for the exact recipe.
    """
    spec = InputSpec.from_case(case)
    return make_input_part(spec, np.arange(spec.num_tokens), 0, spec.padded_vocab)


def make_input_part(case: Mapping[str, Any] | Any, rows: Sequence[int] | np.ndarray, vocab_start: int, vocab_end: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``rows`` (global token indices, in that order) and columns ``[vocab_start, vocab_end)`` of
    :func:`make_inputs`, made alone: every element is a hash of its own index, so a rank makes only
    its tokens and columns and gets the bytes of the same slice of the whole (no rank regenerates
    the whole case for its part). ``(logits_fp32 [rows, columns], targets [rows], active [rows])``."""
    spec = InputSpec.from_case(case)
    n, vocab = spec.num_tokens, spec.padded_vocab
    index_rows = np.asarray(rows, dtype=np.int64)
    if not 0 <= vocab_start <= vocab_end <= vocab or (index_rows.size and not (
            0 <= int(index_rows.min()) and int(index_rows.max()) < n)):
        raise InputSpecError(f"rows in [0, {n}) and 0 <= vocab_start={vocab_start} <= vocab_end={vocab_end} <= "
                             f"padded_vocab={vocab} are needed to take a part of these inputs")
    width = vocab_end - vocab_start
    scale = np.float32(spec.logit_scale)
    logits = np.empty((index_rows.size, width), dtype=np.float32)
    block = max(1, _ROW_BLOCK_ELEMENTS // max(1, width))
    columns = np.arange(vocab_start, vocab_end, dtype=np.uint64)
    for start in range(0, index_rows.size, block):
        stop = min(index_rows.size, start + block)
        index = index_rows[start:stop, None].astype(np.uint64) * np.uint64(vocab) + columns
        logits[start:stop] = _bell(_splitmix64(spec.seed, index)) * scale
    logits[:, max(0, min(width, spec.real_vocab - vocab_start)):] = np.float32(PADDING_LOGIT)
    target_hash = _splitmix64(spec.seed, index_rows.astype(np.uint64) + np.uint64(_TARGET_BASE))
    targets = (target_hash % np.uint64(spec.real_vocab)).astype(np.int64)
    active = torch.from_numpy(recipe_active(index_rows, spec.seq, spec.prompt_tokens))
    return torch.from_numpy(logits), torch.from_numpy(targets), active


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


__all__ = ["PADDING_LOGIT", "InputSpec", "InputSpecError", "inputs_sha256", "make_input_part", "make_inputs"]
