"""Inputs and byte comparisons shared by the tests that hold a backend to the eager one's bytes
(``tests/test_fused_cpu.py``, ``tests/test_triton_backend.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rl_engine.logprob.backends.eager.vocab_parallel import (
    EAGER_ENGINE,
    LocalEngine,
    VocabParallelLogprob,
    backward_terms,
)
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.tensorio import tensor_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTPUTS = ("logp", "lse", "entropy", "grad")


def _inputs(dtype: str, real: int, padded: int, rows: int, seed: int, scale: float = 3.0,
            specials: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, padded, generator=g) * scale
    x[:, real:] = 100.0  # padding never counts
    targets = torch.randint(0, real, (rows,), generator=g)
    active = torch.ones(rows, dtype=torch.bool)
    active[::3] = False
    if specials and rows >= 3:
        x[1, : min(real, 5)] = float("-inf")  # real -inf columns (an inactive row: validation)
        x[1, 5 % real] = 0.0
        active[1] = False
        x[2, : real // 2] = -0.0
        x[2, real // 2 :: 7] = 6e-8 if dtype == "fp16" else 1e-30  # subnormal in fp16
        x[0, :] = float("-inf")  # an inactive row of -inf only
        if real > 3:
            x[0, 2] = float("nan")
            x[0, 3] = float("inf")
        x[rows - 1, : real] *= 25.0  # large logits: E underflows to +0 for most columns
        x[rows - 1] = x[rows - 1].clamp(-60000, 60000)
    return x.to(DTYPES[dtype]), targets, active


def _contract(dtype: str, real: int, padded: int, tiles: int, rows: int, **kw: Any) -> LogprobContract:
    return LogprobContract(real_vocab_size=real, padded_vocab_size=padded, num_vocab_tiles=tiles,
                           num_sequences=1, seq_len=rows, logits_dtype=dtype, **kw)


def _run(op: VocabParallelLogprob, x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
         contract: LogprobContract, lse_grad: bool, entropy: bool = True) -> dict[str, bytes]:
    xx = x.clone().requires_grad_(True)
    out = op(xx, targets, active, contract, compute_entropy=entropy)
    g = torch.Generator().manual_seed(99)
    w_logp = torch.randn(x.shape[0], generator=g)
    w_lse = torch.randn(x.shape[0], generator=g) if lse_grad else torch.zeros(x.shape[0])
    if lse_grad:
        w_lse[::4] = 0.0  # some rows with coef == 0 among the active ones
        w_lse[active] = torch.where(w_lse[active] == 0.0, w_logp[active], w_lse[active])
    # inactive rows get an LSE gradient too (coef != 0): their non-finite values reach E
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse), xx, (w_logp, w_lse))
    found = {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
             "grad": tensor_bytes(grad)}
    if entropy:
        assert out.entropy is not None
        found["entropy"] = tensor_bytes(out.entropy)
    return found



def _partial_bytes(t: torch.Tensor) -> bytes:
    """Bytes of a tile partial with every NaN written canonically.

    A NaN partial's payload is not part of the specification (it depends on which NaN an
    operation propagates, e.g. ``inf - inf`` against an input NaN): every output made from
    the partials is written with the canonical NaN, and those outputs are compared raw.
    """
    if t.dtype.is_floating_point:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return tensor_bytes(t)


def assert_every_shard_matches(engine: LocalEngine, dtype: str, real: int, padded: int, tiles: int,
                               rows: int, tp: int, flags: tuple[tuple[bool, bool], ...],
                               bounds: tuple[tuple[int, int], ...] | None = None) -> None:
    """Every TP rank's tile partials (per ``(entropy, validate)`` of ``flags``) and local
    gradient from ``engine`` are the eager chunk loop's bytes."""
    x, targets, active = _inputs(dtype, real, padded, rows, seed=tp)
    lse = torch.randn(rows) + 5.0
    g_logp, g_lse = torch.randn(rows), torch.randn(rows)
    g_lse[1::4] = 0.0
    extra = {"vocab_shard_bounds": bounds} if bounds is not None else {}
    for rank in range(tp):
        c = _contract(dtype, real, padded, tiles, rows, tp_world_size=tp, tp_rank=rank, **extra)
        local = x[:, c.vocab_start:c.vocab_end].contiguous()
        for entropy, validate in flags:
            eager = EAGER_ENGINE.local_partials(local, c, 3, entropy, validate)
            ours = engine.local_partials(local, c, 3, entropy, validate)
            for a, b in zip(eager, ours):
                assert (a is None) == (b is None)
                if a is not None:
                    assert _partial_bytes(a) == _partial_bytes(b), (rank, entropy, validate)
        terms = backward_terms(local, targets, active, lse, g_logp, g_lse, c)
        eager_grad = EAGER_ENGINE.local_backward(local, lse, terms, 4)
        assert tensor_bytes(engine.local_backward(local, lse, terms, 4)) == tensor_bytes(eager_grad), rank


def refusal_messages(ops: list[Any], bad_value: float) -> list[str]:
    """What each op raises for an active row holding ``bad_value`` in a real column."""
    x, targets, active = _inputs("bf16", 1000, 1024, 6, seed=2, specials=False)
    x[4, 17] = bad_value
    contract = _contract("bf16", 1000, 1024, 8, 6)
    messages = []
    for op in ops:
        with pytest.raises(LogprobContractError) as info:
            op(x, targets, active, contract)
        messages.append(str(info.value))
    return messages


def tp4_and_tp2cp2_contracts(rank: int, real: int, padded: int, tiles: int, temperature: float) -> Any:
    """Rank ``rank`` of a 4-rank gloo world (``init_mesh(tp=4)`` done by the caller): ``(tp, cp, group,
    contract)`` for TP=4 and for TP=2 x CP=2 zigzag, two sequences of four bf16 tokens."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    for tp, cp, group in ((4, 1, dist.group.WORLD), (2, 2, pairs[rank // 2])):
        cp_rank, tp_rank = divmod(rank, tp)
        yield tp, cp, group, LogprobContract(
            real_vocab_size=real, padded_vocab_size=padded, num_vocab_tiles=tiles, num_sequences=2, seq_len=4,
            tp_world_size=tp, tp_rank=tp_rank, cp_world_size=cp, cp_rank=cp_rank,
            cp_layout="zigzag" if cp > 1 else "contiguous", logits_dtype="bf16", temperature=temperature)
