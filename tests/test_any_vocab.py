"""A vocabulary the tiles do not divide (docs/arithmetic.md section 6, "Any vocabulary").

Tiles of ``w = ceil(Vp / T)`` columns; the grid's columns past the vocabulary are padding nobody
stores. Claims, each compared as bytes: every backend (eager, fused C on every instruction set,
the NumPy specification ``rl_engine/arith/spec_numpy.py``; Triton's interpreter in ``test_triton_backend``-style shapes here) gives
the same outputs at GPT-2's 50257; they are the bytes of the logits padded by hand to ``T w``
columns; another tile width gives other bytes (negative control); the TP shards hold whole tiles,
the last rank's narrower; ``auto`` keeps every dividing count and falls back only where none
divides; the fused head takes a ``[50257, H]`` weight. Across TP and CP ranks:
``tests/test_vocab_parallel_logp.py``'s mesh cases at 50257.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from rl_engine.arith import spec_numpy
from rl_engine.distributed.bounds import (
    BoundsError,
    auto_vocab_tiles,
    check_vocab_shards,
    even_vocab_shards,
    grid_tile_width,
    tile_width,
)
from rl_engine.logprob import selected_logprob, selected_logprob_from_hidden
from rl_engine.logprob.api import resolve_vocab_tiles
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.backends.fused_cpu.fused_cpu import (
    FusedCpuEngine,
    FusedCpuLogprob,
    kernel_unavailable,
    load_kernel,
)
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.head_matmul import fixed_logits
from rl_engine.tables import FUSED_CPU_BACKEND
from rl_engine.tensorio import tensor_bytes

from _byte_cases import OUTPUTS, _contract, _inputs, _run, assert_every_shard_matches

GPT2 = 50257  # 29 x 1733: no multiple of 8 divides it
NUMPY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

needs_fused = pytest.mark.skipif(kernel_unavailable() is not None, reason=str(kernel_unavailable()))


def _isas() -> list[str]:
    kernel = load_kernel()
    return [isa for isa in ("baseline", "avx2", "avx512") if kernel.lib.rle_selected_isa(
        {"baseline": 1, "avx2": 2, "avx512": 3}[isa]) >= 0]


# ----- the rule -----------------------------------------------------------------------------------


def test_the_tile_width_is_the_ceiling_and_equals_the_quotient_where_the_count_divides() -> None:
    assert grid_tile_width(GPT2, 16) == 3142 and grid_tile_width(GPT2, 64) == 786
    for vocab, tiles in ((151936, 64), (1024, 16), (50304, 16)):
        assert grid_tile_width(vocab, tiles) == tile_width(vocab, tiles) == vocab // tiles
    c = LogprobContract(real_vocab_size=GPT2, padded_vocab_size=GPT2, num_vocab_tiles=16, num_sequences=1,
                        seq_len=4)
    assert (c.tile_width, c.local_tiles, c.local_grid_width, c.local_vocab_size) == (3142, (0, 16), 50272, GPT2)
    with pytest.raises(BoundsError, match="num_vocab_tiles=16 does not divide padded_vocab=50257"):
        tile_width(GPT2, 16)  # the campaign's rule stays the dividing one


def test_a_count_that_leaves_a_tile_without_a_column_is_refused_naming_the_fix() -> None:
    with pytest.raises(BoundsError, match=re.escape(
            "num_vocab_tiles=8 leaves its last tile with no column of padded_vocab=10 (tiles of ceil(10 / 8) = 2 "
            "columns); use fewer tiles (at most 3 always works)")):
        grid_tile_width(10, 8)
    with pytest.raises(LogprobContractError, match="no column of padded_vocab_size=10"):
        LogprobContract(real_vocab_size=10, padded_vocab_size=10, num_vocab_tiles=8, num_sequences=1, seq_len=1)
    assert grid_tile_width(10, 4) == 3  # tiles of 3, 3, 3, 1 columns
    with pytest.raises(ValueError, match="leaves a tile with no column"):
        spec_numpy.forward(np.zeros((1, 10), np.float32), "float32", [0], [True], 10, 8, False)


def test_tp_shards_hold_whole_tiles_and_the_last_rank_the_rest() -> None:
    for tp in (1, 2, 4, 8):
        bounds = even_vocab_shards(GPT2, 64, tp)
        check_vocab_shards(bounds, GPT2, 64)
        assert [s for s, _ in bounds] == [r * 64 // tp * 786 for r in range(tp)] and bounds[-1][1] == GPT2
    assert even_vocab_shards(GPT2, 16, 8)[6:] == ((37704, 43988), (43988, GPT2))  # 6284 columns, then 6269
    assert even_vocab_shards(151936, 64, 8) == tuple((r * 18992, (r + 1) * 18992) for r in range(8))
    with pytest.raises(BoundsError, match=re.escape("vocab_shard_bounds[0]=(0, 6283) is not aligned to the tile "
                                                    "width 786")):
        check_vocab_shards(((0, 6283), (6283, GPT2)), GPT2, 64)  # torch.chunk's split
    c = LogprobContract(real_vocab_size=GPT2, padded_vocab_size=GPT2, num_vocab_tiles=16, num_sequences=1,
                        seq_len=4, tp_world_size=8, tp_rank=7)
    assert (c.local_tiles, c.local_vocab_size, c.local_grid_width) == ((14, 16), 6269, 6284)


def test_auto_keeps_every_dividing_count_and_falls_back_only_where_none_divides() -> None:
    assert auto_vocab_tiles(GPT2, 8) == 16 and auto_vocab_tiles(GPT2, 2) == 14
    assert auto_vocab_tiles(GPT2, 4) == 16 and auto_vocab_tiles(151936, 8) == 64  # the default case's count
    assert auto_vocab_tiles(1001, 8) == 8  # tiles of 126 columns, the last 119
    with pytest.raises(BoundsError, match="padded_vocab_size=50272, the smallest that has one"):
        auto_vocab_tiles(GPT2, 8, divisible=True)  # the campaign's rule (workflow config)
    with pytest.raises(BoundsError, match="every count leaves a tile or a TP rank without a column"):
        auto_vocab_tiles(20, 8)  # 8 tiles of 3 columns leave the last without one
    assert resolve_vocab_tiles("auto", GPT2)["resolved"] == 16


# ----- the bytes on every backend -----------------------------------------------------------------


def _backend_bytes(op: object, x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
                   contract: LogprobContract) -> dict[str, bytes]:
    return _run(op, x, targets, active, contract, lse_grad=True)  # type: ignore[arg-type]


def _numpy_forward(x: torch.Tensor, dtype: str, targets: torch.Tensor, active: torch.Tensor, real: int,
                   tiles: int) -> dict[str, bytes]:
    bits = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else x.numpy()
    logp, lse, ent = spec_numpy.forward(bits, NUMPY_DTYPES[dtype], targets.numpy(), active.numpy(), real, tiles,
                                        True)
    return {"logp": logp.tobytes(), "lse": lse.tobytes(), "entropy": ent.tobytes()}


@needs_fused
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_backend_gives_the_numpy_bytes_at_50257_and_those_of_padding_by_hand(dtype: str) -> None:
    rows, tiles = 5, 16
    x, targets, active = _inputs(dtype, GPT2, GPT2, rows, seed=7)
    contract = _contract(dtype, GPT2, GPT2, tiles, rows)
    eager = _backend_bytes(VocabParallelLogprob(), x, targets, active, contract)
    assert {name: eager[name] for name in ("logp", "lse", "entropy")} == _numpy_forward(
        x, dtype, targets, active, GPT2, tiles)
    for isa in _isas():
        for threads in (1, 2):
            fused = _backend_bytes(FusedCpuLogprob(threads=threads, isa=isa), x, targets, active, contract)
            assert fused == eager, (isa, threads)
    # padded by hand to 16 x 3142 = 50272 columns (any values there), the real vocabulary unchanged
    padded = torch.cat([x, torch.full((rows, 15), 7.0).to(x.dtype)], dim=1)
    by_hand = _run(VocabParallelLogprob(), padded, targets, active, _contract(dtype, GPT2, 50272, tiles, rows),
                   lse_grad=True)
    assert {n: by_hand[n] for n in ("logp", "lse", "entropy")} == {n: eager[n] for n in ("logp", "lse", "entropy")}
    grad_width = len(eager["grad"]) // rows
    assert [by_hand["grad"][r * (grad_width + 15 * x.element_size()):][:grad_width] for r in range(rows)] == [
        eager["grad"][r * grad_width:][:grad_width] for r in range(rows)]
    # negative control: 16 tiles of 50304 (GPT-2 as trainers pad it) are 3144 columns wide: other bytes
    x, targets, active = _inputs(dtype, GPT2, GPT2, 16, seed=8, specials=False)
    ours = _run(VocabParallelLogprob(), x, targets, active, _contract(dtype, GPT2, GPT2, tiles, 16), lse_grad=True)
    wider = torch.cat([x, torch.zeros(16, 47).to(x.dtype)], dim=1)
    other = _run(VocabParallelLogprob(), wider, targets, active, _contract(dtype, GPT2, 50304, tiles, 16),
                 lse_grad=True)
    assert other["entropy"] != ours["entropy"]


@needs_fused
def test_selected_logprob_just_works_at_50257_on_the_auto_and_explicit_backends() -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 4, GPT2, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, GPT2, (2, 4), generator=g)
    outs = [selected_logprob(logits, ids, compute_entropy=True, backend=b)
            for b in ("auto", "pytorch-vocab-parallel-logp-ws2", FUSED_CPU_BACKEND)]
    assert outs[0].provenance is not None and outs[0].provenance["num_vocab_tiles"]["resolved"] == 16
    for name in ("selected_logp", "lse", "entropy"):
        assert len({tensor_bytes(getattr(o, name)) for o in outs}) == 1, name


@needs_fused
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_shard_of_an_odd_vocabulary_computes_the_eager_partials_and_gradient(tp: int) -> None:
    # 1003 columns (1000 real) in 16 tiles of 63: the grid runs 5 columns past the vocabulary
    assert_every_shard_matches(FusedCpuEngine(threads=2), ("bf16", "fp16", "fp32")[tp % 3], 1000, 1003, 16, 7,
                               tp, ((True, True), (False, False)))


@pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")  # IEEE specials on purpose
def test_triton_s_interpreter_gives_the_eager_bytes_on_an_odd_vocabulary() -> None:
    pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton.triton_backend import TritonEngine, TritonLogprob

    x, targets, active = _inputs("bf16", 1000, 1003, 5, seed=4)
    contract = _contract("bf16", 1000, 1003, 16, 5)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    assert _run(TritonLogprob(mode="interpreter"), x, targets, active, contract, True) == eager
    assert set(eager) == set(OUTPUTS)
    assert_every_shard_matches(TritonEngine("interpreter"), "fp32", 1000, 1003, 16, 4, 8, ((True, True),))


# ----- the fused head ------------------------------------------------------------------------------


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_head_takes_a_50257_row_weight_with_the_op_s_bytes_on_its_logits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 16, generator=g).to(dtype)
    weight = (torch.randn(GPT2, 16, generator=g) * 0.5).to(dtype)
    ids = torch.randint(0, GPT2, (6,), generator=g)
    got = selected_logprob_from_hidden(hidden, weight, ids, compute_entropy=True, chunk_tokens=4)
    ref = selected_logprob(fixed_logits(hidden, weight), ids, compute_entropy=True)
    assert got.provenance is not None and got.provenance["num_vocab_tiles"]["resolved"] == 16
    for name in ("selected_logp", "lse", "entropy"):
        assert tensor_bytes(getattr(got, name)) == tensor_bytes(getattr(ref, name)), name
