"""Processed logprobs (docs/arithmetic.md section 13) in the Triton kernels, under Triton's
interpreter, and the search on the key for every engine.

Every comparison is of bytes, never ``allclose``:

* the search on the key (no sort) with the Triton kernels, and with the compiled C kernels,
  finds the keys of the C kernels' TP = 1 path (candidates for min-p and top-k), whose kept sets
  are the NumPy reference's (tests/_processed_ref.py), for top-k, top-p, min-p and combinations,
  per-row parameters, bf16/fp16/fp32, a temperature, ties at every threshold;
* the search over TP shards (2, 4, 8: each shard's tiles, brought together in rank order)
  finds the same keys as over the full row;
* the Triton masked forward (logp, LSE, entropy, ``target_kept``) and backward (with an LSE
  and an entropy gradient) are the reference's bytes, dropped targets included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
import _processed_ref as ref  # noqa: E402
from test_processed_kernels import PADDED as C_PADDED  # noqa: E402
from test_processed_kernels import REAL as C_REAL  # noqa: E402
from test_processed_kernels import TILES as C_TILES  # noqa: E402
from test_processed_kernels import (  # noqa: E402
    _contract,
    _data,
    _grads,
    _params,
    _row_max,
    call,
)

from rl_engine.arith import portable  # noqa: E402
from rl_engine.arith.tiles import merge_tiles  # noqa: E402
from rl_engine.logprob.backends.eager.vocab_parallel import backward_terms  # noqa: E402
from rl_engine.logprob.backends.fused_cpu.fused_kept import FusedKeptScan, kept_keys_tp1  # noqa: E402
from rl_engine.logprob.backends.triton.triton_backend import TritonEngine  # noqa: E402
from rl_engine.logprob.backends.triton.triton_kept import (  # noqa: E402
    TritonKeptScan,
    triton_kept_backward,
    triton_kept_partials,
)
from rl_engine.logprob.contract import LogprobContract  # noqa: E402
from rl_engine.logprob.kept_search import kept_keys, order_of, order_of16, value_of  # noqa: E402
from rl_engine.logprob.processed import KeptCut  # noqa: E402

INTERP = "interpreter"
# small rows for the interpreter (each program runs in Python, one program a row and tile: the cost is
# the rows times the tiles): tile width 128, the last tile partly padding
REAL, PADDED, TILES = 200, 256, 2
SHAPE = (REAL, PADDED, TILES)
ROWS = 8
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")
# the Triton-interpreter cases are marked slow (CI runs them); the C cases run by default


def _key_bytes(keys: KeptCut) -> bytes:
    return keys.value.numpy().tobytes() + keys.index.numpy().tobytes()


def test_the_order_of_binary32_and_16_bit_values_round_trips_and_is_descending() -> None:
    v = torch.tensor([float("inf"), 3.0, 1e-45, 0.0, -0.0, -1e-45, -2.5, float("-inf")])
    u = order_of(v)
    assert bool((u[1:] >= u[:-1]).all()) and u[3] == u[4]
    assert value_of(u).numpy().tobytes() == torch.where(v == 0, 0.0, v).numpy().tobytes()
    h = torch.tensor([float("inf"), 3.0, 1e-7, 0.0, -0.0, -1e-7, -2.5, float("-inf")], dtype=torch.bfloat16)
    u16 = order_of16(h.view(torch.int16).to(torch.int64))
    assert bool((u16[1:] > u16[:-1]).all())  # -0 just after +0 (equal values: the same prefix)


def _keys_of_either_engine(dtype: str, temperature: float, x: torch.Tensor, k: torch.Tensor, p: torch.Tensor,
                           m: torch.Tensor) -> KeptCut:
    """The search on the key with the C and the Triton kernels' scans: both find the keys of the C
    kernels' TP = 1 path (bytes compared). Returns the Triton engine's keys. The search is the one
    the engines make (:func:`rl_engine.logprob.kept_search.engine_cut`): 16-bit logits bisect their own
    order; the binary32 bisection of 16-bit logits is held to the same keys with the C scans
    (:func:`test_the_search_over_shards_finds_the_full_rows_keys`)."""
    contract = _contract(dtype, x.shape[0], temperature, shape=SHAPE)
    big = _row_max(x, contract)
    want = kept_keys_tp1(call(), x, contract, k, p, m, big)
    how = dict(dtype=contract.torch_dtype, t32=contract.temperature32)
    by_c = kept_keys(FusedKeptScan(call(), x, contract), big, k, p, m, REAL, **how)
    by_triton = kept_keys(TritonKeptScan(TritonEngine(INTERP).kept_call(), x, contract), big, k, p, m, REAL, **how)
    assert _key_bytes(by_c) == _key_bytes(want)
    assert _key_bytes(by_triton) == _key_bytes(want)
    return by_triton


@pytest.mark.slow  # the interpreter runs each program in Python: about 6 s a case on 2 cores
@pytest.mark.parametrize("dtype,temperature", [("fp32", 1.0)])
def test_search_on_the_key_finds_the_sorted_keys_with_either_engine(dtype: str, temperature: float) -> None:
    """The search's one path the forward and backward test below does not take: it searches 16-bit
    logits (their own order) at T = 1 (bf16) and at a temperature (fp16 at 1.3), binary32 at a
    temperature (fp32 at 0.7), with both engines; here binary32 at T = 1. A bf16 search at a
    temperature would be the fp16 one's path on the other 16-bit order, which the bf16 case at T = 1
    already searches."""
    x, _, _ = _data(dtype, rows=ROWS, real=REAL, padded=PADDED)
    _keys_of_either_engine(dtype, temperature, x, *_params(x.shape[0]))


class _Shards:
    """The scans of TP shards, their tiles put side by side in rank order (what the all-gather
    brings every rank)."""

    def __init__(self, x: torch.Tensor, tp: int, dtype: str = "bf16", temperature: float = 1.0) -> None:
        self.scans = []
        for rank in range(tp):
            c = LogprobContract(real_vocab_size=C_REAL, padded_vocab_size=C_PADDED, num_vocab_tiles=C_TILES,
                                num_sequences=1, seq_len=x.shape[0], logits_dtype=dtype,
                                tp_world_size=tp, tp_rank=rank, temperature=temperature)
            self.scans.append(FusedKeptScan(call(), x[:, c.vocab_start:c.vocab_end], c))

    def prefix(self, keys, row_max):  # type: ignore[no-untyped-def]
        parts = [s.prefix(keys, row_max) for s in self.scans]
        return torch.cat([a for a, _ in parts], dim=1), torch.cat([b for _, b in parts], dim=1)

    def min_p(self, row_max, lmp):  # type: ignore[no-untyped-def]
        parts = [s.min_p(row_max, lmp) for s in self.scans]
        return torch.cat([a for a, _ in parts], dim=1), torch.cat([b for _, b in parts], dim=1)


@pytest.mark.parametrize("tp,dtype,temperature", [(2, "bf16", 1.0), (3, "fp16", 0.7), (6, "fp32", 1.3),
                                                  (1, "bf16", 0.7)])
def test_the_search_over_shards_finds_the_full_rows_keys(tp: int, dtype: str, temperature: float) -> None:
    """With the C kernels' scans (fast): the search on the key over the shards' tiles, 16-bit logits
    bisected on their own order, gives the full row's keys (kept_keys_tp1, whose kept sets
    tests/test_processed_kernels.py holds to the NumPy reference's sort)."""
    x, _, _ = _data(dtype, rows=12)
    k, p, m = _params(x.shape[0], seed=tp)
    contract = _contract(dtype, x.shape[0], temperature)
    big = _row_max(x, contract)
    want = kept_keys_tp1(call(), x, contract, k, p, m, big)
    got = kept_keys(_Shards(x, tp, dtype, temperature), big, k, p, m, C_REAL, dtype=contract.torch_dtype,
                    t32=contract.temperature32)
    assert _key_bytes(got) == _key_bytes(want)
    # the binary32 bisection of the value (32 steps) finds the same keys for 16-bit logits too
    assert _key_bytes(kept_keys(_Shards(x, tp, dtype, temperature), big, k, p, m, C_REAL)) == _key_bytes(want)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,temperature", [("bf16", 1.0), ("fp16", 1.3), ("fp32", 0.7)])
def test_triton_forward_and_backward_are_the_reference_bytes(dtype: str, temperature: float) -> None:
    x, targets, active = _data(dtype, rows=ROWS, real=REAL, padded=PADDED)
    rows = x.shape[0]
    k, p, m = _params(rows)
    contract = _contract(dtype, rows, temperature, shape=SHAPE)
    keys = _keys_of_either_engine(dtype, temperature, x, k, p, m)  # the C and Triton searches agree
    xt = ref.tempered(x, contract.temperature32)
    mask = ref.kept_mask(xt, REAL, TILES, k.numpy(), p.numpy(), m.numpy())
    want = ref.forward(xt, mask, targets.numpy(), active.numpy(), REAL, TILES)
    mm, s, t, _, _ = triton_kept_partials(TritonEngine(INTERP).kept_call(), x, contract, True, True, keys)
    lse, ent = merge_tiles(mm, s, t, portable.exp, portable.log)
    xtg = torch.from_numpy(xt).gather(1, targets.unsqueeze(1)).squeeze(1)
    kept = ~((xtg < keys.value) | ((xtg == keys.value) & (targets > keys.index)))
    logp = torch.where(active, xtg - lse, torch.zeros_like(lse))
    logp = torch.where(active & ~kept, torch.full_like(lse, float("-inf")), logp)
    got = [portable.canonical_nan_(o) for o in (logp, lse, ent)] + [kept | ~active]
    for name, a, b in zip(("logp", "lse", "entropy", "target_kept"), got, want):
        assert a.numpy().tobytes() == b.tobytes(), name
    gp, gl, ge = _grads(rows)
    terms = backward_terms(x, targets, active, lse, gp, gl, contract, ge, ent, keep=keys,
                           target_kept=kept | ~active)
    grad = triton_kept_backward(TritonEngine(INTERP).kept_call(), x, lse, terms)
    want_g = ref.backward(xt, mask, targets.numpy(), active.numpy(), lse.numpy(), gp.numpy(), gl.numpy(),
                          REAL, TILES, contract.temperature32, dtype, ge.numpy(), ent.numpy())
    view = (torch.int32, np.int32) if dtype == "fp32" else (torch.int16, np.int16)
    assert grad.view(view[0]).numpy().tobytes() == want_g.view(view[1]).tobytes()
