"""The benchmarked paths and their steps, on the whole vocabulary (TP=1) or a TP rank's shard.

- ``candidate``: backend ``pytorch-vocab-parallel-logp-ws2`` as a user calls it (default
  chunk size, ``validate=True`` unless ``--no-validate``), gradient through ``selected_logp``;
- ``fused``: backend ``cpu-vocab-parallel-logp-ws2`` (the compiled one-pass kernel, the same
  bytes as ``candidate``) called the same way;
- ``triton``: backend ``triton-vocab-parallel-logp-ws2`` (the Triton kernels: compiled on
  cuda; on the cpu only under Triton's interpreter, ``RL_ENGINE_TRITON_MODE=interpreter``, whose
  timings say nothing of a GPU) called the same way;
- ``naive``: at TP=1 ``torch.log_softmax(logits.float(), -1).gather(...)`` with autograd,
  masked by the active rows; under TP what a user writes without this engine (Megatron-LM's
  vocab-parallel cross-entropy, :class:`NaiveVocabParallelLogp`);
- ``lm_head`` and ``fused_lm_head`` (asked for by name, with ``--hidden-size``): the logprob
  from a hidden state and an lm_head weight, the logits made whole (``hidden @ weight.T``, then
  ``selected_logprob``) or chunk by chunk (``selected_logprob_from_hidden``); forward+backward
  gives the gradients of both; ``fused_lm_head_kept``: ``selected_logprob_from_hidden`` with
  ``keep_logits=True`` (the forward's logits kept for the backward); ``naive_lm_head``: ``torch.log_softmax((hidden @ weight.T).float(),
  -1).gather(...)`` with autograd, what a trainer writes without this engine;
- ``floor``: one pass over the (local) logits in row chunks, upcast and row max (the least any
  exact method must do); its backward adds one more read of the logits and one write of a
  gradient in the logits dtype. The floor runs its chunks through the same chunk runner
  as the candidate, so neither is handicapped by the other's threading.

``forward`` runs under ``torch.no_grad()`` (how a GRPO step computes old and reference
logprobs); ``forward_backward`` builds the graph, runs backward and returns the gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from rl_engine.benchmark.config import (
    BACKEND_PATHS,
    HEAD_PATHS,
    PATHS,
    PROCESSED_PARAMS,
    PROCESSED_PATH,
    BenchConfig,
    BenchError,
)
from rl_engine.benchmark.inputs import Inputs
from rl_engine.logprob.backends.eager.chunk_threads import for_each_chunk
from rl_engine.logprob.contract import LogprobContract

Step = Callable[[], Any]


def default_paths(device: str = "cpu") -> tuple[str, ...]:
    """Every path this machine can run on ``device``: on the cpu the fused backend where its
    kernel loads (never triton: its interpreter gives bytes, not timings, and is asked for by
    name); on cuda the triton backend where it compiles (never fused: it is cpu-only)."""
    if device == "cuda":
        from rl_engine.logprob.backends.triton.triton_backend import triton_unavailable

        return tuple(p for p in PATHS if p not in ("fused", PROCESSED_PATH) and p not in HEAD_PATHS
                     and (p != "triton" or triton_unavailable() is None))
    from rl_engine.logprob.backends.fused_cpu.fused_cpu import kernel_unavailable

    return tuple(p for p in PATHS if p not in ("triton", PROCESSED_PATH) and p not in HEAD_PATHS
                 and (p != "fused" or kernel_unavailable() is None))


def _naive_logp(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.where(active, logp, torch.zeros_like(logp))


class NaiveVocabParallelLogp(torch.autograd.Function):
    """The logprob a user writes for vocab-sharded logits without this engine (the shape of
    Megatron-LM's vocab-parallel cross-entropy): an FP32 copy of the shard, all-reduce of the
    row max, of the target logit and of the sum of exponentials, the softmax kept for backward
    (``tokens x local vocab`` FP32), gradient ``(onehot - softmax) * grad`` in the logits dtype.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
                vocab_start: int, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        x = logits.to(torch.float32, copy=True)
        row_max = x.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x.sub_(row_max.unsqueeze(1))
        local = targets - vocab_start
        inside = (local >= 0) & (local < x.shape[1])
        local = local.clamp(0, x.shape[1] - 1)
        picked = torch.where(inside, x.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
        dist.all_reduce(picked, group=group)
        x.exp_()
        sum_exp = x.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        x.div_(sum_exp.unsqueeze(1))
        ctx.save_for_backward(x, local, inside, active)
        ctx.logits_dtype = logits.dtype
        return torch.where(active, picked - sum_exp.log(), 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local, inside, active = ctx.saved_tensors
        g = torch.where(active, grad, 0.0)
        out = softmax.mul_(-g.unsqueeze(1))
        rows = inside.nonzero().squeeze(1)
        out[rows, local[rows]] += g[rows]
        return out.to(ctx.logits_dtype), None, None, None, None


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


def _head_step(path: str, phase: str, inputs: Inputs, config: BenchConfig) -> tuple[Step, Step]:
    """``lm_head``: ``hidden @ weight.T`` made whole, then ``selected_logprob`` (backend auto);
    ``fused_lm_head``: ``selected_logprob_from_hidden`` (the same backend, the logits chunk by
    chunk; ``fused_lm_head_kept`` with ``keep_logits=True``). With ``forward_backward`` each gives the
    gradients of the hidden state and the weight."""
    from rl_engine.logprob import selected_logprob, selected_logprob_from_hidden

    if inputs.hidden is None or inputs.weight is None:
        raise BenchError(f"path={path!r} needs a hidden state and a weight: pass --hidden-size")
    hidden = inputs.hidden.detach().requires_grad_(phase == "forward_backward")
    weight = inputs.weight.detach().requires_grad_(phase == "forward_backward")
    targets, active = inputs.targets, inputs.active

    def run() -> Any:
        if path == "naive_lm_head":  # what a trainer writes without this engine, in autograd
            return _naive_logp(hidden @ weight.T, targets, active)
        if path == "lm_head":
            return selected_logprob(hidden @ weight.T, targets, active, num_vocab_tiles=config.tiles,
                                    validate=config.validate)
        return selected_logprob_from_hidden(hidden, weight, targets, active, num_vocab_tiles=config.tiles,
                                            validate=config.validate, keep_logits=path == "fused_lm_head_kept")

    def reset() -> None:
        hidden.grad = None
        weight.grad = None

    if phase == "forward":
        def step() -> Any:
            with torch.no_grad():
                return run()
    else:
        def step() -> Any:
            out = run()
            (out if path == "naive_lm_head" else out.selected_logp).sum().backward()
            return hidden.grad, weight.grad
    return step, reset


def _processed_step(phase: str, inputs: Inputs, config: BenchConfig, contract: LogprobContract, group: Any,
                    leaf: torch.Tensor) -> tuple[Step, Step]:
    """``processed``: the eager candidate with :data:`PROCESSED_PARAMS` on every row (section 13)."""
    from rl_engine.logprob.processed import sampling_from
    from rl_engine.logprob.registry import dispatch

    logits, targets, active = inputs.logits, inputs.targets, inputs.active
    op = dispatch(BACKEND_PATHS["candidate"], contract, logits.device.type, processed=True).op
    sampling = sampling_from(PROCESSED_PARAMS["top_k"], PROCESSED_PARAMS["top_p"], PROCESSED_PARAMS["min_p"],
                             (logits.shape[0],), logits.device)

    def reset() -> None:
        leaf.grad = None

    if phase == "forward":
        def step() -> Any:
            with torch.no_grad():
                return op(logits, targets, active, contract, group=group, validate=config.validate,
                          chunk_rows=config.chunk_rows, sampling=sampling)
    else:
        def step() -> Any:
            out = op(leaf, targets, active, contract, group=group, validate=config.validate,
                     chunk_rows=config.chunk_rows, sampling=sampling)
            torch.where(out.target_kept, out.selected_logp, 0.0).sum().backward()
            return leaf.grad
    return step, reset


def build_step(path: str, phase: str, inputs: Inputs, config: BenchConfig,
               contract: LogprobContract | None = None, group: Any = None) -> tuple[Step, Step]:
    """``(step, reset)``: ``step()`` runs the path once and returns what it produced (kept
    alive until the clock stops); ``reset()`` drops the gradient it left behind.

    ``inputs`` hold the whole vocabulary (TP=1) or, with a TP ``contract`` and its ``group``,
    that rank's shard.
    """
    contract = contract or config.contract(inputs.logits.shape[0])
    chunk_rows = config.resolved_chunk_rows(contract.local_vocab_size)
    logits, targets, active = inputs.logits, inputs.targets, inputs.active
    leaf = logits.detach().requires_grad_(phase == "forward_backward")

    def reset() -> None:
        leaf.grad = None

    if path in BACKEND_PATHS:
        from rl_engine.logprob.registry import BackendUnavailableError, dispatch

        try:
            op = dispatch(BACKEND_PATHS[path], contract, logits.device.type).op
        except BackendUnavailableError as exc:
            raise BenchError(f"path={path!r}: {exc}") from None
        if phase == "forward":
            def step() -> Any:
                with torch.no_grad():
                    return op(logits, targets, active, contract, group=group, validate=config.validate,
                              chunk_rows=config.chunk_rows)
        else:
            def step() -> Any:
                out = op(leaf, targets, active, contract, group=group, validate=config.validate,
                         chunk_rows=config.chunk_rows)
                out.selected_logp.sum().backward()
                return leaf.grad
    elif path == "naive":
        def naive(x: torch.Tensor) -> torch.Tensor:
            if contract.tp_world_size == 1:
                return _naive_logp(x, targets, active)
            return NaiveVocabParallelLogp.apply(x, targets, active, contract.vocab_start, group)

        if phase == "forward":
            def step() -> Any:
                with torch.no_grad():
                    return naive(logits)
        else:
            def step() -> Any:
                naive(leaf).sum().backward()
                return leaf.grad
    elif path in HEAD_PATHS:
        return _head_step(path, phase, inputs, config)
    elif path == PROCESSED_PATH:
        return _processed_step(phase, inputs, config, contract, group, leaf)
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
