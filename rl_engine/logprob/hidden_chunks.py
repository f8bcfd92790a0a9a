"""The fused head's work: the active rows' logits made chunk by chunk, the op on them, the gradients.

Shared by the eager call (:mod:`rl_engine.logprob.hidden`) and the registered op that
``torch.compile`` keeps whole (:func:`rl_engine.logprob.hidden.compiled_from_hidden`), so both compute the same
bytes by the same code.

* Only active rows are computed: their indices (one host read of the mask) pick the rows of
  ``hidden`` that are multiplied; the chunks are ``chunk_tokens`` active rows each, and inactive
  rows get ``+0`` logprob, LSE and entropy, and a ``+0`` gradient row, without a logit being made.
  With the fixed-order product a row's logits are the same bits whichever rows share its chunk, so
  the outputs of the active rows are those of computing every row.
* The logits are :func:`rl_engine.logprob.head_matmul.head_logits` in the compute dtype (the
  inputs' dtype, or autocast's); the op's gradient to them is rounded once to that dtype, as the
  op's own backward does; ``hidden``'s gradient rows are the library's ``grad_logits @ weight`` per
  chunk, ``weight``'s the chunks' ``grad_logits.T @ hidden`` added in binary32 (rounded once at the
  end to the weight's dtype) or, with ``grad_weight_fp32=False``, in the compute dtype (one rounding
  per chunk).
* With ``keep_logits`` (the plan's) the forward writes each chunk's logits into one
  ``[active rows, vocabulary columns]`` tensor of the compute dtype, which the backward reads in
  place of making them again: one product per chunk fewer, for the memory of the whole logits
  (``active rows x columns x itemsize`` bytes: 4 per logit in fp32, 2 in bf16 and fp16). They are
  the bytes the backward would have made (the same product of the same rows), so every gradient is
  byte-equal to the recomputing backward's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_engine.logprob.backends.eager.vocab_parallel import vocab_parallel_backward
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.head_matmul import MatmulChoice, head_logits
from rl_engine.logprob.processed import Sampling

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class HeadPlan:
    """Everything a call decides once: the contract of its tokens, the op, the chunking, the product,
    the compute dtype, the weight gradient's accumulation, and the TP group (``None`` without TP)."""

    contract: LogprobContract
    op: Any
    chunk_tokens: int
    compute_entropy: bool
    validate: bool
    matmul: MatmulChoice
    compute_dtype: torch.dtype
    grad_weight_fp32: bool
    group: Any
    reduce_hidden: bool
    row_t32: torch.Tensor | None = None  # a temperature per token: binary32 [tokens], each token's T32
    sampling: Sampling | None = None  # per token (flat); docs/arithmetic.md section 13
    keep_logits: bool = False  # the forward keeps the active rows' logits for the backward

    def __post_init__(self) -> None:
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise LogprobContractError(f"chunk_tokens={self.chunk_tokens!r} must be a positive integer")
        if self.compute_dtype not in FLOAT_DTYPES:
            raise LogprobContractError(f"compute dtype {self.compute_dtype} must be one of {FLOAT_DTYPES}")
        if not isinstance(self.keep_logits, bool):
            raise LogprobContractError(f"keep_logits={self.keep_logits!r} must be True or False")

    def chunk_contract(self, rows: int) -> LogprobContract:
        """The contract of one chunk of ``rows`` active rows (one sequence)."""
        c = self.contract
        return LogprobContract(
            real_vocab_size=c.real_vocab_size, padded_vocab_size=c.padded_vocab_size,
            num_vocab_tiles=c.num_vocab_tiles, num_sequences=1, seq_len=rows,
            tp_world_size=c.tp_world_size, tp_rank=c.tp_rank, vocab_shard_bounds=c.vocab_shard_bounds,
            logits_dtype=c.logits_dtype, ignore_index=c.ignore_index, temperature=c.temperature)


def active_rows(active: torch.Tensor) -> torch.Tensor:
    """The indices of the active rows (int64, ascending): one host read of the mask."""
    return active.nonzero().reshape(-1)


def _chunk_sampling(plan: HeadPlan, index: torch.Tensor) -> Sampling | None:
    s = plan.sampling
    if s is None:
        return None
    return Sampling(s.top_k.index_select(0, index), s.top_p.index_select(0, index), s.min_p.index_select(0, index))


def _chunk_hidden(hidden: torch.Tensor, rows: torch.Tensor, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    return hidden.index_select(0, rows[start:end]).to(dtype)


def forward_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                   plan: HeadPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor | None]:
    """``(logp, lse, entropy, target_kept, logits)`` of every token (``+0`` on inactive rows; entropy
    empty without ``compute_entropy``; ``target_kept`` True but where the plan's sampling drops an
    active target; ``logits`` the active rows' ``[rows, columns]`` logits in the compute dtype with
    the plan's ``keep_logits``, else ``None``). ``hidden`` is ``[tokens, H]``, ``weight`` the compute
    dtype's copy of the rank's rows, ``rows`` the active rows' indices."""
    tokens = hidden.shape[0]
    kept = torch.ones(tokens, dtype=torch.bool, device=hidden.device)
    logp = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
    lse = torch.zeros_like(logp)
    entropy = torch.zeros_like(logp) if plan.compute_entropy else logp.new_empty(0)
    count = rows.numel()
    whole = torch.empty(count, weight.shape[0], dtype=plan.compute_dtype, device=hidden.device) \
        if plan.keep_logits else None
    for start in range(0, count, plan.chunk_tokens):
        end = min(start + plan.chunk_tokens, count)
        index = rows[start:end]
        logits = head_logits(_chunk_hidden(hidden, rows, start, end, plan.compute_dtype), weight, plan.matmul,
                             None if whole is None else whole[start:end])
        ones = torch.ones(end - start, dtype=torch.bool, device=hidden.device)
        per_row = {} if plan.row_t32 is None else {"temperature": plan.row_t32.index_select(0, index)}
        sampling = _chunk_sampling(plan, index)
        out = plan.op(logits, targets.index_select(0, index), ones, plan.chunk_contract(end - start),
                      group=plan.group, compute_entropy=plan.compute_entropy, validate=plan.validate,
                      **per_row, **({"sampling": sampling} if sampling is not None else {}))
        logp[index] = out.selected_logp
        if out.target_kept is not None:
            kept[index] = out.target_kept
        lse[index] = out.lse
        if plan.compute_entropy:
            entropy[index] = out.entropy
        del logits, out
    return logp, lse, entropy, kept, whole


def backward_chunks(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                    lse: torch.Tensor, entropy: torch.Tensor | None, grad_logp: torch.Tensor | None,
                    grad_lse: torch.Tensor | None, grad_entropy: torch.Tensor | None, plan: HeadPlan,
                    want_hidden: bool, want_weight: bool,
                    weight_dtype: torch.dtype,
                    target_kept: torch.Tensor | None = None,
                    logits_kept: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``hidden`` (``+0`` rows where inactive, all-reduced over the TP group when
    the plan says so) and of the weight (in ``weight_dtype``), from the forward's LSE and entropy,
    and from the forward's logits where ``logits_kept`` holds them (``[active rows, columns]``), else
    from each chunk's logits made again.
    With the plan's sampling, each chunk's kept set is found again (the same cut: the same logits;
    under TP its collectives run on every rank in the same chunk order) and ``target_kept`` is the
    forward's."""
    count = rows.numel()
    if logits_kept is not None and (logits_kept.shape != (count, weight.shape[0])
                                    or logits_kept.dtype != plan.compute_dtype):
        raise LogprobContractError(
            f"the kept logits {tuple(logits_kept.shape)} {logits_kept.dtype} are not the forward's: "
            f"[{count} active rows, {weight.shape[0]} columns] in {plan.compute_dtype}; pass the forward's own "
            "(or none, to make them again)")
    grad_rows = torch.empty(count, hidden.shape[1], dtype=plan.compute_dtype, device=hidden.device) \
        if want_hidden else None
    accumulate = torch.float32 if plan.grad_weight_fp32 else plan.compute_dtype
    grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if want_weight else None
    with torch.no_grad():
        for start in range(0, count, plan.chunk_tokens):
            end = min(start + plan.chunk_tokens, count)
            index = rows[start:end]
            chunk = _chunk_hidden(hidden, rows, start, end, plan.compute_dtype)
            logits = head_logits(chunk, weight, plan.matmul) if logits_kept is None else logits_kept[start:end]
            part = plan.chunk_contract(end - start)
            ones = torch.ones(end - start, dtype=torch.bool, device=hidden.device)
            sampling = _chunk_sampling(plan, index)
            chunk_rows = plan.op.default_chunk_rows(part, logits.device)
            row_t32 = None if plan.row_t32 is None else plan.row_t32.index_select(0, index)
            keep = None if sampling is None else plan.op.engine().kept_cut(
                logits, part, sampling, plan.group, chunk_rows, **({} if row_t32 is None else {"row_t32": row_t32}))
            grad_logits = vocab_parallel_backward(
                logits, targets.index_select(0, index), ones, lse.index_select(0, index),
                None if grad_logp is None else grad_logp.index_select(0, index),
                None if grad_lse is None else grad_lse.index_select(0, index), part,
                chunk_rows, plan.op.engine(),
                None if grad_entropy is None else grad_entropy.index_select(0, index),
                None if grad_entropy is None or entropy is None else entropy.index_select(0, index),
                row_t32, keep, None if keep is None or target_kept is None else target_kept.index_select(0, index))
            del logits
            if grad_rows is not None:
                grad_rows[start:end] = grad_logits @ weight
            if grad_weight is not None and plan.grad_weight_fp32:
                grad_weight.addmm_(grad_logits.T.float(), chunk.float())
            elif grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, chunk)
            del grad_logits
    grad_hidden = None
    if grad_rows is not None:
        grad_hidden = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        grad_hidden[rows] = grad_rows.to(hidden.dtype)
        if plan.reduce_hidden:
            import torch.distributed as dist

            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=plan.group)  # the ranks' partial products
    return grad_hidden, None if grad_weight is None else grad_weight.to(weight_dtype)


__all__ = ["HeadPlan", "active_rows", "backward_chunks", "forward_chunks"]
