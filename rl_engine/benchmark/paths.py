"""The benchmarked paths (candidate, naive, floor) and their seeded inputs.

- ``candidate``: backend ``pytorch-vocab-parallel-logp-ws2`` as a user calls it (default
  chunk size, ``validate=True`` unless ``--no-validate``), gradient through ``selected_logp``;
- ``fused``: backend ``cpu-vocab-parallel-logp-ws2`` (the compiled one-pass kernel, the same
  bytes as ``candidate``) called the same way;
- ``naive``: ``torch.log_softmax(logits.float(), -1).gather(...)`` with autograd, masked by
  the active rows;
- ``floor``: one pass over the logits in row chunks, upcast and row max (the least any
  exact method must do); its backward adds one more read of the logits and one write of a
  gradient in the logits dtype. The floor runs its chunks through the same chunk runner
  as the candidate, so neither is handicapped by the other's threading.

``forward`` runs under ``torch.no_grad()`` (how a GRPO step computes old and reference
logprobs); ``forward_backward`` builds the graph, runs backward and returns the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from rl_engine.benchmark.config import PATHS, BenchConfig, BenchError
from rl_engine.logprob.chunk_threads import for_each_chunk
from rl_engine.logprob.contract import LOGITS_DTYPES
from rl_engine.logprob.vocab_parallel import VocabParallelLogprob


def default_paths() -> tuple[str, ...]:
    """Every path this machine can run: the fused backend only where its kernel loads."""
    from rl_engine.logprob.fused_cpu import kernel_unavailable

    return tuple(p for p in PATHS if p != "fused" or kernel_unavailable() is None)

LOGIT_SCALE = 2.0
Step = Callable[[], Any]


@dataclass
class Inputs:
    logits: torch.Tensor
    targets: torch.Tensor
    active: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.element_size() * t.numel() for t in (self.logits, self.targets, self.active))


def make_inputs(tokens: int, vocab: int, dtype: str, seed: int, block_rows: int = 256) -> Inputs:
    """Seeded logits ``[tokens, vocab]`` built block by block (no full-size FP32 transient).

    Every row is active and its target a real vocabulary id.
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.empty(tokens, vocab, dtype=LOGITS_DTYPES[dtype])
    for start in range(0, tokens, block_rows):
        stop = min(tokens, start + block_rows)
        logits[start:stop] = torch.randn(stop - start, vocab, generator=gen).mul_(LOGIT_SCALE)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    active = torch.ones(tokens, dtype=torch.bool)
    return Inputs(logits, targets, active)


def _naive_logp(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.where(active, logp, torch.zeros_like(logp))


def floor_forward(logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """Upcast and row max, chunk by chunk: one read of the logits."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)

    def work(buf: torch.Tensor, start: int, stop: int) -> None:
        chunk = buf[: stop - start]
        chunk.copy_(logits[start:stop])
        torch.amax(chunk, dim=1, out=out[start:stop])

    for_each_chunk(
        rows, chunk_rows,
        lambda: torch.empty(min(chunk_rows, rows), vocab, dtype=torch.float32, device=logits.device),
        work,
    )
    return out


def floor_backward(logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """One more read of the logits (upcast) and one write of a gradient in their dtype."""
    rows, vocab = logits.shape
    grad = torch.empty_like(logits)

    def work(buf: torch.Tensor, start: int, stop: int) -> None:
        chunk = buf[: stop - start]
        chunk.copy_(logits[start:stop])
        grad[start:stop].copy_(chunk)

    for_each_chunk(
        rows, chunk_rows,
        lambda: torch.empty(min(chunk_rows, rows), vocab, dtype=torch.float32, device=logits.device),
        work,
    )
    return grad


def build_step(path: str, phase: str, inputs: Inputs, config: BenchConfig) -> tuple[Step, Step]:
    """``(step, reset)``: ``step()`` runs the path once and returns what it produced (kept
    alive until the clock stops); ``reset()`` drops the gradient it left behind."""
    contract = config.contract(inputs.logits.shape[0])
    chunk_rows = config.resolved_chunk_rows()
    logits, targets, active = inputs.logits, inputs.targets, inputs.active
    leaf = logits.detach().requires_grad_(phase == "forward_backward")

    def reset() -> None:
        leaf.grad = None

    if path in ("candidate", "fused"):
        if path == "fused":
            from rl_engine.logprob.fused_cpu import FusedCpuLogprob

            op: VocabParallelLogprob = FusedCpuLogprob()
        else:
            op = VocabParallelLogprob()
        if phase == "forward":
            def step() -> Any:
                with torch.no_grad():
                    return op(logits, targets, active, contract, validate=config.validate)
        else:
            def step() -> Any:
                out = op(leaf, targets, active, contract, validate=config.validate)
                out.selected_logp.sum().backward()
                return leaf.grad
    elif path == "naive":
        if phase == "forward":
            def step() -> Any:
                with torch.no_grad():
                    return _naive_logp(logits, targets, active)
        else:
            def step() -> Any:
                _naive_logp(leaf, targets, active).sum().backward()
                return leaf.grad
    elif path == "floor":
        if phase == "forward":
            def step() -> Any:
                return floor_forward(logits, chunk_rows)
        else:
            def step() -> Any:
                return floor_forward(logits, chunk_rows), floor_backward(logits, chunk_rows)
    else:  # pragma: no cover - BenchConfig validates paths
        raise BenchError(f"path={path!r} is unknown; use one of {list(PATHS)}")
    return step, reset
