"""The benchmark's seeded inputs: the one input maker of both modes and of gpu-smoke's timing.

Not the campaign's recipe (:func:`rl_engine.campaign.inputs.make_inputs`): that one is portable
(splitmix64 in NumPy, the same bytes on every machine, which the evidence needs) but builds the
whole FP32 matrix at once (5 GB at 8192 x 151936, twice the BF16 input) and takes about 1.8 s
per 256 rows of 151936 on the 2-vCPU VM against 0.36 s here, in every memory-probe subprocess
and every TP rank. A timing needs no portable bits (it checks no fingerprint), only the
same logits for every path, mode and TP degree of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rl_engine.benchmark.config import BenchError
from rl_engine.logprob.contract import LOGITS_DTYPES

LOGIT_SCALE = 2.0
BLOCK_ROWS = 256


@dataclass
class Inputs:
    logits: torch.Tensor
    targets: torch.Tensor
    active: torch.Tensor
    hidden: torch.Tensor | None = None  # [tokens, hidden_size], for the head paths
    weight: torch.Tensor | None = None  # [vocab, hidden_size]: the lm_head's

    def to(self, device: str) -> "Inputs":
        """The same inputs on ``device`` (drawn on the cpu, so every device times the same logits)."""
        if device == "cpu":
            return self
        return Inputs(self.logits.to(device), self.targets.to(device), self.active.to(device),
                      None if self.hidden is None else self.hidden.to(device),
                      None if self.weight is None else self.weight.to(device))

    @property
    def nbytes(self) -> int:
        held = [t for t in (self.logits, self.targets, self.active, self.hidden, self.weight) if t is not None]
        return sum(t.element_size() * t.numel() for t in held)


def make_inputs(tokens: int, vocab: int, dtype: str, seed: int,
                columns: tuple[int, int] | None = None, hidden_size: int | None = None) -> Inputs:
    """Seeded logits ``[tokens, vocab]`` (``randn * 2``), built ``BLOCK_ROWS`` rows at a time
    (no full-size FP32 transient), in ``dtype``.

    ``columns=(start, stop)`` keeps only those vocabulary columns: a TP rank's shard of the same
    matrix that TP=1 sees (each block is drawn whole, then cut). Every row is active; targets
    are global vocabulary ids, the same whatever ``columns``. ``hidden_size`` adds a hidden state
    ``[tokens, hidden_size]`` and an lm_head weight ``[vocab, hidden_size]`` for the head paths.
    """
    start, stop = columns if columns is not None else (0, vocab)
    if not 0 <= start < stop <= vocab:
        raise BenchError(f"columns=({start}, {stop}) must satisfy 0 <= start < stop <= vocab={vocab}")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, stop - start, dtype=LOGITS_DTYPES[dtype])
    for row in range(0, tokens, BLOCK_ROWS):
        end = min(tokens, row + BLOCK_ROWS)
        block = torch.randn(end - row, vocab, generator=gen).mul_(LOGIT_SCALE)
        logits[row:end] = block[:, start:stop]
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    active = torch.ones(tokens, dtype=torch.bool)
    if hidden_size is None:
        return Inputs(logits, targets, active)
    # a hidden state and an lm_head weight whose product has the logits' scale (randn * 2)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(LOGITS_DTYPES[dtype])
    weight = torch.empty(vocab, hidden_size, dtype=LOGITS_DTYPES[dtype])
    for row in range(0, vocab, 8192):
        end = min(vocab, row + 8192)
        weight[row:end] = torch.randn(end - row, hidden_size, generator=gen).mul_(LOGIT_SCALE / hidden_size ** 0.5)
    return Inputs(logits, targets, active, hidden, weight)
