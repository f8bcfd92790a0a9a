"""Processed logprobs (top-k, top-p, min-p; docs/arithmetic.md section 13) on the eager backend.

Bytes are compared as bytes (``tensor_bytes``): the eager backend against the NumPy spec (whose
kept set comes from a sort and a bisection on the prefix length, the eager one from a search on
the key with gathered tile sums), the outputs at TP 1/2/4/8 x CP 1/2 against TP 1. Only the
float64 oracle of the same definition is compared with a tolerance (1e-6 on the logprob).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _doc_blocks import run_trainer_block

from rl_engine.arith import spec_numpy as S
from rl_engine.logprob.api import selected_logprob
from rl_engine.logprob.backends.description import descriptions
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.oracle import processed_fp64_oracle
from rl_engine.logprob.processed import Sampling, sampling_from
from rl_engine.logprob.registry import BackendUnavailableError, default_registry
from rl_engine.tables import EAGER_BACKEND
from rl_engine.tensorio import tensor_bytes

from _multiproc import run_workers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NP_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
REAL, PADDED, TILES = 1000, 1024, 16


def tie_logits(rows: int, padded: int, real: int, seed: int, dtype: str, scale: float = 2.0) -> torch.Tensor:
    """Random logits with ties planted where the thresholds fall: every row's top values are
    repeated at columns spread over the vocabulary (so over the TP shards), and a block of equal
    values sits in the middle of the distribution, where top-p's cutoff lands."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, padded, generator=g) * scale
    spread = torch.tensor([7, 130, 260, 520, 700, 900])  # six columns in different tiles and shards
    for r in range(rows):
        top = float(x[r, :real].max())
        x[r, spread[: 2 + r % 4]] = top + 0.5  # 2..5 copies of the row max
        x[r, spread[4:]] = top + 0.25  # two copies just below it
        mid = torch.arange(40 + r, real, 61)
        x[r, mid] = float(x[r, 3])  # a repeated value at a mid-distribution level
    return x.to(DTYPES[dtype])


def np_logits(x: torch.Tensor, dtype: str) -> np.ndarray:
    if dtype == "bf16":
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def batch(dtype: str, rows: int = 24, seed: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed + 1)
    logits = tie_logits(rows, PADDED, REAL, seed, dtype)
    targets = torch.randint(0, REAL, (rows,), generator=g)
    targets[1::3] = 7  # the tied row max: kept by min-p, but by top-k only where ties allow
    targets[2::5] = 130
    active = torch.ones(rows, dtype=torch.bool)
    active[::6] = False
    w_logp = torch.randn(rows, generator=g)
    w_lse = torch.randn(rows, generator=g) * 0.5
    w_ent = torch.randn(rows, generator=g) * 0.25
    return dict(logits=logits, targets=targets, active=active, w_logp=w_logp, w_lse=w_lse, w_ent=w_ent)


PARAMS: dict[str, dict[str, Any]] = {
    "top_k1": dict(top_k=1),
    "top_k3": dict(top_k=3),  # the k-th falls in the tied row max on some rows
    "top_k50": dict(top_k=50),
    "top_p0.9": dict(top_p=0.9),
    "top_p0.3": dict(top_p=0.3),
    "min_p0.1": dict(min_p=0.1),
    "min_p1": dict(min_p=1.0),  # the ties of the max
    "all": dict(top_k=40, top_p=0.8, min_p=0.02),
    "k_p": dict(top_k=200, top_p=0.95),
    "per_row": "per_row",
}


def per_row(rows: int) -> dict[str, torch.Tensor]:
    """A batch of requests with mixed settings, every parameter off on some rows."""
    k = torch.tensor([0, 5, 0, 1, 3, 64, 0, 0, 2, 1000, 0, 7] * (rows // 12 + 1))[:rows]
    p = torch.tensor([1.0, 1.0, 0.9, 0.5, 1.0, 0.95, 0.7, 1.0, 0.3, 0.99, 0.2, 1.0] * (rows // 12 + 1))[:rows]
    m = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.5, 0.0, 0.01, 1.0, 0.0, 0.001, 0.0, 0.0] * (rows // 12 + 1))[:rows]
    return dict(top_k=k, top_p=p.double(), min_p=m.double())


def params_for(name: str, rows: int) -> dict[str, Any]:
    p = PARAMS[name]
    return per_row(rows) if p == "per_row" else dict(p)


def eager(b: dict[str, Any], params: dict[str, Any], temperature: float = 1.0, tiles: int = TILES,
          entropy_grad: bool = True) -> dict[str, torch.Tensor]:
    x = b["logits"].clone().requires_grad_(True)
    out = selected_logprob(x, b["targets"], b["active"], backend=EAGER_BACKEND, num_vocab_tiles=tiles,
                           real_vocab_size=REAL, compute_entropy=True, temperature=temperature, **params)
    assert out.entropy is not None and out.target_kept is not None
    loss = (torch.where(out.target_kept, out.selected_logp, 0.0) * b["w_logp"]).sum() + (out.lse * b["w_lse"]).sum()
    if entropy_grad:
        loss = loss + (out.entropy * b["w_ent"]).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return dict(logp=out.selected_logp.detach(), lse=out.lse.detach(), entropy=out.entropy.detach(),
                kept=out.target_kept, grad=grad)


def spec(b: dict[str, Any], params: dict[str, Any], dtype: str, temperature: float = 1.0,
         tiles: int = TILES, entropy_grad: bool = True) -> dict[str, Any]:
    rows = b["targets"].shape[0]
    p = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
    logits = np_logits(b["logits"], dtype)
    targets, active = b["targets"].numpy(), b["active"].numpy()
    logp, lse, ent, kept, keep = S.forward_processed(logits, NP_DTYPE[dtype], targets, active, REAL, tiles, True,
                                                     temperature=temperature, **p)
    # the gradient of logp where kept (a dropped target's logp is the constant -inf)
    g_logp = b["w_logp"].numpy().astype(np.float32)
    g_ent = b["w_ent"].numpy().astype(np.float32) if entropy_grad else None
    grad = S.backward_processed(logits, NP_DTYPE[dtype], targets, active, lse, g_logp,
                                b["w_lse"].numpy().astype(np.float32), REAL, tiles, keep,
                                temperature=temperature, grad_entropy=g_ent, entropy=ent)
    if dtype == "bf16":
        grad = grad.view(np.int16)
    assert kept.shape == (rows,)
    return dict(logp=logp, lse=lse, entropy=ent, kept=kept, grad=grad, keep=keep)


def as_bytes(name: str, value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        if name == "grad" and value.dtype == torch.bfloat16:
            value = value.view(torch.int16)
        return value.contiguous().numpy().tobytes()
    return np.ascontiguousarray(value).tobytes()


# ----- the NumPy spec and the eager backend, byte for byte ---------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_eager_backend_equals_the_numpy_spec_byte_for_byte(dtype: str, name: str) -> None:
    b = batch(dtype)
    params = params_for(name, 24)
    got, want = eager(b, params), spec(b, params, dtype)
    for key in ("logp", "lse", "entropy", "kept", "grad"):
        assert as_bytes(key, got[key]) == as_bytes(key, want[key]), (dtype, name, key)
    assert not bool(got["kept"].all()) or name in ("top_k50", "k_p", "min_p0.1", "top_p0.9"), "no dropped target"


def test_temperature_and_processing_compose_as_the_spec_says() -> None:
    b = batch("bf16", seed=11)
    params = dict(top_k=30, top_p=0.85, min_p=0.01)
    got, want = eager(b, params, temperature=0.7), spec(b, params, "bf16", temperature=0.7)
    for key in ("logp", "lse", "entropy", "kept", "grad"):
        assert as_bytes(key, got[key]) == as_bytes(key, want[key]), key
    raw = eager(b, params)
    assert as_bytes("lse", raw["lse"]) != as_bytes("lse", got["lse"])  # the temperature acts


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_temperature_per_row_and_per_row_parameters_compose_as_the_spec_says(dtype: str) -> None:
    """A rollout batch mixes requests: each row its own temperature and sampling parameters. The
    kept set is found on each row's tempered logits (section 13 after section 6 step 0 at that
    row's T32): the eager bytes equal the NumPy spec's with the same per-row temperatures, and a
    row's bytes equal the call with its temperature as a number."""
    b = batch(dtype, seed=13)
    rows = b["targets"].shape[0]
    temps = torch.tensor([0.7, 1.0, 1.3, 0.25, 2.0, 0.9] * (rows // 6))[:rows]
    params = per_row(rows)
    got = eager(b, params, temperature=temps)
    want = spec(b, params, dtype, temperature=temps.numpy().astype(np.float64))
    for key in ("logp", "lse", "entropy", "kept", "grad"):
        assert as_bytes(key, got[key]) == as_bytes(key, want[key]), key
    for row in (2, 3, 4):  # the rows at 1.3, 0.25 and 2.0 (each with a parameter on), alone at a number
        alone = {k: v[row:row + 1] for k, v in b.items()}
        one = eager(alone, {k: v[row:row + 1] for k, v in params.items()}, temperature=float(temps[row]))
        for key in ("logp", "lse", "entropy", "kept"):
            assert as_bytes(key, one[key]) == as_bytes(key, got[key][row:row + 1]), (row, key)
    flat = eager(b, params, temperature=1.0)
    assert as_bytes("lse", flat["lse"]) != as_bytes("lse", got["lse"])  # the temperatures act


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_any_vocabulary_gives_the_numpy_spec_bytes(dtype: str) -> None:
    """1003 columns in 16 tiles of 63 (section 6): the grid's columns past the vocabulary are +0
    terms of top-p's sums, as padding is; eager and the NumPy spec agree byte for byte."""
    b = batch(dtype, seed=17)
    b["logits"] = b["logits"][:, :1003].contiguous()
    for params in (dict(top_k=40, top_p=0.8, min_p=0.02), dict(top_p=0.95), per_row(24)):
        got, want = eager(b, params), spec(b, params, dtype)
        for key in ("logp", "lse", "entropy", "kept", "grad"):
            assert as_bytes(key, got[key]) == as_bytes(key, want[key]), (params, key)


def test_another_tile_count_changes_the_bytes_of_top_p() -> None:
    """Negative control: top-p's sums are grouped by the tiles, so the tile count is part of the bytes."""
    b = batch("fp32", seed=5)
    a, c = eager(b, dict(top_p=0.9), tiles=16), eager(b, dict(top_p=0.9), tiles=8)
    assert as_bytes("lse", a["lse"]) != as_bytes("lse", c["lse"])
    assert as_bytes("lse", c["lse"]) == as_bytes("lse", spec(b, dict(top_p=0.9), "fp32", tiles=8)["lse"])


# ----- the kept set on planted ties ----------------------------------------------------------------
def test_ties_at_the_kth_value_keep_the_lower_token_ids() -> None:
    x = torch.full((3, 1024), -5.0)
    x[:, [700, 7, 520, 130]] = 3.0  # four ties of the max, spread over tiles and shards
    x[:, 900] = 2.0
    targets = torch.tensor([130, 700, 900])  # k=3 keeps {7, 130, 520}: 700 is the fourth tie
    out = selected_logprob(x, targets, backend=EAGER_BACKEND, num_vocab_tiles=16, top_k=torch.tensor([2, 3, 5]))
    assert out.target_kept.tolist() == [True, False, True]
    # row 0 keeps {7, 130}: logp = log(1/2); row 2 keeps the four ties and 900
    assert out.selected_logp[0].item() == pytest.approx(-np.log(2.0), abs=1e-6)
    assert out.selected_logp[1].item() == float("-inf")


def test_top_p_cutoff_inside_a_tie_block_keeps_the_lower_ids() -> None:
    x = torch.full((1, 1024), -30.0)
    ids = [900, 5, 300, 640]  # four equal probabilities: 0.25 each (the rest is below 1e-13)
    x[0, ids] = 0.0
    for p, n in ((0.5, 2), (0.51, 3), (0.25, 1), (0.76, 4)):
        keep = S.kept_set(x.numpy(), 1024, 16, top_p=p)[0]
        assert sorted(np.nonzero(keep)[0].tolist()) == sorted(ids)[:n], p
        for t in sorted(ids):
            out = selected_logprob(x, torch.tensor([t]), backend=EAGER_BACKEND, num_vocab_tiles=16, top_p=p)
            assert bool(out.target_kept[0]) == (t in sorted(ids)[:n])


def test_min_p_one_keeps_the_ties_of_the_max() -> None:
    x = torch.randn(2, 512)
    x[:, [3, 400]] = 9.0
    keep = S.kept_set(x.numpy(), 512, 4, min_p=1.0)
    assert [np.nonzero(k)[0].tolist() for k in keep] == [[3, 400], [3, 400]]


def test_a_dropped_target_has_minus_inf_and_a_zero_logp_gradient() -> None:
    b = batch("bf16", rows=6, seed=9)
    b["targets"][:] = 999  # a low logit: dropped by top_k=5 on every row
    b["active"][:] = True
    x = b["logits"].clone().requires_grad_(True)
    out = selected_logprob(x, b["targets"], b["active"], backend=EAGER_BACKEND, num_vocab_tiles=TILES,
                           real_vocab_size=REAL, top_k=5)
    assert not bool(out.target_kept.any())
    assert torch.isneginf(out.selected_logp).all() and not torch.isnan(out.selected_logp).any()
    (g,) = torch.autograd.grad(out.selected_logp.sum(), x)  # gl = 0, coef = 0: +0 everywhere
    assert tensor_bytes(g) == tensor_bytes(torch.zeros_like(g))
    (g2,) = torch.autograd.grad(
        selected_logprob(x, b["targets"], b["active"], backend=EAGER_BACKEND, num_vocab_tiles=TILES,
                         real_vocab_size=REAL, top_k=5).lse.sum(), x)
    assert int((g2 != 0).sum()) == 6 * 5  # the softmax of the kept set: five columns a row


def test_non_finite_rows_keep_every_real_column_and_only_inactive_rows_may_hold_them() -> None:
    b = batch("fp32", rows=6, seed=2)
    b["logits"][0, 10] = float("nan")
    b["logits"][3, 20] = float("inf")
    b["active"][0] = b["active"][3] = False
    params = dict(top_k=3, top_p=0.5)
    got, want = eager(b, params, entropy_grad=False), spec(b, params, "fp32", entropy_grad=False)
    for key in ("logp", "lse", "entropy", "kept", "grad"):
        assert as_bytes(key, got[key]) == as_bytes(key, want[key]), key
    assert want["keep"][0, :REAL].all() and want["keep"][3, :REAL].all()
    b["active"][0] = True
    with pytest.raises(LogprobContractError, match="non-finite"):
        eager(b, params)


# ----- all off: the raw bytes ----------------------------------------------------------------
def test_every_parameter_off_gives_the_raw_bytes_and_no_target_kept() -> None:
    b = batch("bf16", seed=4)
    x = b["logits"]
    raw = selected_logprob(x, b["targets"], b["active"], backend=EAGER_BACKEND, num_vocab_tiles=TILES,
                           compute_entropy=True)
    rows = x.shape[0]
    for off in (dict(top_k=0, top_p=1.0, min_p=0.0),
                dict(top_k=torch.zeros(rows, dtype=torch.int64), top_p=torch.ones(rows), min_p=torch.zeros(rows))):
        out = selected_logprob(x, b["targets"], b["active"], backend=EAGER_BACKEND, num_vocab_tiles=TILES,
                               compute_entropy=True, **off)
        assert out.target_kept is None
        for name in ("selected_logp", "lse", "entropy"):
            assert tensor_bytes(getattr(out, name)) == tensor_bytes(getattr(raw, name))
    assert sampling_from(0, 1.0, 0.0, (rows,), torch.device("cpu")) is None


def test_per_row_parameters_equal_each_row_alone() -> None:
    b = batch("bf16", seed=8)
    params = per_row(24)
    whole = eager(b, params, entropy_grad=False)
    for r in (1, 3, 5, 9):
        one = {k: v[r:r + 1] for k, v in b.items()}
        alone = eager(one, {k: v[r:r + 1] for k, v in params.items()}, entropy_grad=False)
        for key in ("logp", "lse", "kept", "grad"):
            assert as_bytes(key, alone[key]) == as_bytes(key, whole[key][r:r + 1]), (r, key)


# ----- the float64 oracle of the same definition ---------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_within_1e_6_of_the_float64_oracle(dtype: str) -> None:
    b = batch(dtype, rows=48, seed=21)
    params = per_row(48)
    got = eager(b, params, entropy_grad=False)
    ref, keep = processed_fp64_oracle(b["logits"].float(), b["targets"], b["active"], REAL,
                                      params["top_k"], params["top_p"].float(), params["min_p"].float())
    assert np.array_equal(keep.numpy(), spec(b, params, dtype)["keep"][:, :REAL])  # the same kept sets
    lp = got["logp"].double()
    assert torch.equal(torch.isneginf(lp), torch.isneginf(ref.selected_logp))
    fin = torch.isfinite(lp)
    assert float((lp[fin] - ref.selected_logp[fin]).abs().max()) <= 1e-6
    assert float((got["lse"].double() - ref.lse).abs().max()) <= 1e-5
    assert float((got["entropy"].double() - ref.entropy).abs().max()) <= 1e-4


# ----- refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=-1), "pass 0 to turn top-k off"),
    (dict(top_k=-3), "top_k"),
    (dict(top_k=2.0), "top_k=2.0 must be an integer"),
    (dict(top_p=0.0), r"top_p\[0\]=0.0 .*outside \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(top_k=torch.zeros(3, dtype=torch.int64)), r"top_k.shape=\(3,\) must equal"),
    (dict(top_k=torch.ones(4)), "top_k.dtype=torch.float32 must be an integer type"),
])
def test_bad_parameters_are_refused_naming_the_field(kwargs: dict[str, Any], match: str) -> None:
    x = torch.randn(4, 256)
    with pytest.raises(LogprobContractError, match=match):
        selected_logprob(x, torch.zeros(4, dtype=torch.int64), backend=EAGER_BACKEND, **kwargs)


def test_a_backend_without_processed_logprobs_refuses_by_name() -> None:
    """An engine without ``supports_processed`` (every registered one has it now: a stand-in here)
    is refused by name before any collective, and the registry's capability is honoured."""
    from rl_engine.logprob.backends.eager.vocab_parallel import LocalEngine
    from rl_engine.logprob.registry import dispatch

    class _RawOnly(LocalEngine):
        supports_processed = False

    class _RawOnlyOp(VocabParallelLogprob):
        backend_id = "raw-only-test-backend"

        def engine(self) -> LocalEngine:
            return _RawOnly()

    x = torch.randn(4, 256)
    t = torch.zeros(4, dtype=torch.int64)
    contract = LogprobContract(256, 256, 4, 1, 4, logits_dtype="fp32")
    sampling = Sampling(torch.zeros(4, dtype=torch.int64), torch.full((4,), 0.5), torch.zeros(4))
    with pytest.raises(LogprobContractError, match="backend 'raw-only-test-backend' does not compute"):
        _RawOnlyOp()(x, t, torch.ones(4, dtype=torch.bool), contract, sampling=sampling)
    from dataclasses import replace

    spec_ = default_registry()[EAGER_BACKEND]
    incapable = replace(spec_, capabilities=replace(spec_.capabilities, processed_logprobs=False))
    with pytest.raises(BackendUnavailableError, match="processed logprobs"):
        dispatch(EAGER_BACKEND, contract, "cpu", {EAGER_BACKEND: incapable}, processed=True)


def test_every_engine_flag_matches_the_registry_table() -> None:
    described = {d.backend_id: d.processed_logprobs for d in descriptions()}
    assert described[EAGER_BACKEND]
    for backend_id, spec_ in default_registry().items():
        assert spec_.capabilities.processed_logprobs == described[backend_id]
    assert VocabParallelLogprob().engine().supports_processed


# ----- TP x CP on gloo: one launch, many checks ------------------------------------------------------
# TP 1 and CP 1 each beside the other's sharding (1x1 is the reference itself, :func:`eager`); TP 4 at
# CP 2 in both layouts (every topology runs on all eight ranks: one less is an eighth less of the launch)
TOPOLOGIES = [(2, 1, "contiguous"), (8, 1, "contiguous"), (1, 2, "contiguous"), (2, 2, "zigzag"),
              (4, 2, "contiguous"), (4, 2, "zigzag")]
MESH_CASES = {  # dtype, parameter set name
    "bf16-all": ("bf16", "all"),
    "bf16-per_row": ("bf16", "per_row"),
    "fp16-top_p0.9": ("fp16", "top_p0.9"),
    "fp32-top_k3": ("fp32", "top_k3"),
    "fp32-min_p0.1": ("fp32", "min_p0.1"),
    # any vocabulary (section 6: tiles of ceil(Vp / T) = 63 columns, the grid's last 5 past the
    # vocabulary; the last TP 8 rank holds 121 columns): top-p's sums over the grid's tiles
    "fp32-all-1003": ("fp32", "all", 1003),
}
SEQS, SEQ_LEN = 2, 12  # 24 rows


def _run_rank(b: dict[str, Any], params: dict[str, Any], dtype: str, tp: int, tp_rank: int, cp: int,
              cp_rank: int, layout: str, group: Any) -> dict[str, Any]:
    c = LogprobContract(REAL, b["logits"].shape[1], TILES, SEQS, SEQ_LEN, tp_world_size=tp, tp_rank=tp_rank, cp_world_size=cp,
                        cp_rank=cp_rank, cp_layout=layout, logits_dtype=dtype)
    rows = torch.tensor(c.token_indices, dtype=torch.int64)
    x = b["logits"][rows, c.vocab_start:c.vocab_end].contiguous().requires_grad_(True)
    flat = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
    sampling = sampling_from(flat.get("top_k", 0), flat.get("top_p", 1.0), flat.get("min_p", 0.0),
                             (rows.numel(),), x.device)
    out = VocabParallelLogprob()(x, b["targets"][rows], b["active"][rows], c, group=group, compute_entropy=True,
                                 sampling=sampling)
    loss = (torch.where(out.target_kept, out.selected_logp, 0.0) * b["w_logp"][rows]).sum() \
        + (out.lse * b["w_lse"][rows]).sum() + (out.entropy * b["w_ent"][rows]).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return {"tokens": c.token_indices, "cols": (c.vocab_start, c.vocab_end), "logp": out.selected_logp.detach(),
            "lse": out.lse.detach(), "entropy": out.entropy.detach(), "kept": out.target_kept, "grad": grad}


def _mesh_worker(rank: int, cases: dict[str, Any]) -> dict[Any, Any]:
    from rl_engine.distributed.mesh import init_mesh
    from rl_engine.logprob import selected_logprob_tp

    mesh = init_mesh(tp=4, cp=2, timeout_s=90)
    groups: dict[int, list[Any]] = {1: [None] * 8, 8: [dist.group.WORLD]}
    for tp in (2, 4):
        groups[tp] = [dist.new_group(list(range(s, s + tp))) for s in range(0, 8, tp)]
    out: dict[Any, Any] = {}
    # the public TP entry on the mesh: the op's bytes with the same (numbers for every row) parameters
    dtype, b, _ = next(iter(cases.values()))
    c = LogprobContract.from_mesh(mesh, real_vocab_size=REAL, padded_vocab_size=PADDED, num_vocab_tiles=TILES,
                                  num_sequences=SEQS, seq_len=SEQ_LEN, logits_dtype=dtype)
    rows = torch.tensor(c.token_indices, dtype=torch.int64)
    x = b["logits"][rows, c.vocab_start:c.vocab_end].contiguous()
    public = selected_logprob_tp(x, b["targets"][rows], b["active"][rows], c, mesh, backend=EAGER_BACKEND,
                                 top_k=40, top_p=0.8, min_p=0.02)
    out["public"] = {"tokens": c.token_indices, "logp": public.selected_logp, "kept": public.target_kept}
    for name, (dtype, b, params) in cases.items():
        for tp, cp, layout in TOPOLOGIES:
            cp_rank, tp_rank = divmod(rank % (tp * cp), tp)
            out[(name, tp, cp, layout)] = _run_rank(b, params, dtype, tp, tp_rank, cp, cp_rank, layout,
                                                    groups[tp][rank // tp])
    return out


def _assemble(results: list[dict[Any, Any]], key: Any, padded: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tokens = SEQS * SEQ_LEN
    out: dict[str, torch.Tensor] = {n: torch.full((tokens,), float("nan")) for n in ("logp", "lse", "entropy")}
    out["kept"] = torch.zeros(tokens, dtype=torch.bool)
    grad = torch.zeros(tokens, padded, dtype=dtype)
    for res in results:
        r = res[key]
        idx = torch.tensor(r["tokens"], dtype=torch.int64)
        for n in ("logp", "lse", "entropy", "kept"):
            out[n][idx] = r[n]
        grad[idx, r["cols"][0]:r["cols"][1]] = r["grad"]
    out["grad"] = grad
    # every rank holding a token agrees on its bytes
    for n in ("logp", "lse", "entropy", "kept"):
        for res in results:
            r = res[key]
            idx = torch.tensor(r["tokens"], dtype=torch.int64)
            assert tensor_bytes(r[n]) == tensor_bytes(out[n][idx]), (key, n)
    return out


@pytest.fixture(scope="module")
def mesh_runs() -> tuple[dict[str, Any], list[dict[Any, Any]]]:
    cases = {}
    for i, (name, (dtype, pname, *padded)) in enumerate(MESH_CASES.items()):
        b = batch(dtype, rows=SEQS * SEQ_LEN, seed=60 + i)
        if padded:
            b["logits"] = b["logits"][:, :padded[0]].contiguous()
        cases[name] = (dtype, b, params_for(pname, SEQS * SEQ_LEN))
    return cases, run_workers(_mesh_worker, 8, cases, timeout_s=300)


def test_selected_logprob_tp_takes_the_parameters_and_gives_the_one_rank_bytes(mesh_runs: Any) -> None:
    cases, results = mesh_runs
    _dtype, b, _ = next(iter(cases.values()))
    want = eager(b, dict(top_k=40, top_p=0.8, min_p=0.02))
    for res in results:
        idx = torch.tensor(res["public"]["tokens"], dtype=torch.int64)
        assert tensor_bytes(res["public"]["logp"]) == tensor_bytes(want["logp"][idx])
        assert tensor_bytes(res["public"]["kept"]) == tensor_bytes(want["kept"][idx])


@pytest.mark.parametrize("case", list(MESH_CASES))
def test_tp_and_cp_give_the_tp1_bytes(mesh_runs: Any, case: str) -> None:
    cases, results = mesh_runs
    dtype, b, params = cases[case]
    reference = eager(b, params)
    mismatches = []
    for tp, cp, layout in TOPOLOGIES:
        got = _assemble(results, (case, tp, cp, layout), b["logits"].shape[1], DTYPES[dtype])
        mismatches += [f"TP={tp} CP={cp} {layout}: {n}" for n in ("logp", "lse", "entropy", "kept", "grad")
                       if as_bytes(n, got[n]) != as_bytes(n, reference[n])]
    assert mismatches == []


def test_the_documented_block_of_docs_trainer_md_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    run_trainer_block("<!-- run by tests/test_processed.py -->")
    assert "torch.Size([2, 6]) torch.Size([2, 6]) True" in capsys.readouterr().out


# ----- the fused head: selected_logprob_from_hidden ------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_head_gives_the_op_s_processed_bytes_on_its_fixed_order_logits(dtype: torch.dtype) -> None:
    from rl_engine.logprob import selected_logprob_from_hidden
    from rl_engine.logprob.head_matmul import fixed_logits

    hid, chunk = 64, 16
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(3, 50, hid, generator=gen).to(dtype)
    weight = (torch.randn(PADDED, hid, generator=gen) * 0.3).to(dtype)
    ids = torch.randint(0, REAL, (3, 50), generator=gen)
    ids[:, :3] = -100
    top_k = torch.randint(0, 40, (3, 50), generator=gen)
    params = dict(top_k=top_k, top_p=0.8, min_p=torch.full((3, 50), 0.01))

    def loss(out: Any) -> torch.Tensor:  # the plain sum: a dropped target's -inf carries gl = 0
        return out.selected_logp.sum() + 0.1 * out.lse.sum() - 0.05 * out.entropy.sum()

    flat, flat_ids = hidden.reshape(-1, hid), ids.reshape(-1)
    rows = (flat_ids != -100).nonzero().reshape(-1)
    logits = fixed_logits(flat[rows], weight).requires_grad_(True)
    ref = selected_logprob(logits, flat_ids[rows], real_vocab_size=REAL, compute_entropy=True,
                           top_k=top_k.reshape(-1)[rows], top_p=0.8, min_p=params["min_p"].reshape(-1)[rows])
    loss(ref).backward()
    grad_hidden = torch.zeros_like(flat)
    for i in range(0, rows.numel(), chunk):
        grad_hidden[rows[i:i + chunk]] = logits.grad[i:i + chunk] @ weight
    h = hidden.clone().requires_grad_(True)
    out = selected_logprob_from_hidden(h, weight, ids, real_vocab_size=REAL, compute_entropy=True,
                                       chunk_tokens=chunk, **params)
    loss(out).backward()
    assert not bool(out.target_kept.reshape(-1)[rows].all())  # some targets dropped
    assert bool(out.target_kept.reshape(-1)[(flat_ids == -100).nonzero().reshape(-1)].all())
    for name in ("selected_logp", "lse", "entropy", "target_kept"):
        assert tensor_bytes(getattr(out, name).reshape(-1)[rows]) == tensor_bytes(getattr(ref, name)), name
    assert tensor_bytes(h.grad) == tensor_bytes(grad_hidden.reshape(hidden.shape))


def test_under_torch_compile_fullgraph_the_call_is_refused() -> None:
    """The registered op has no sampling parameters yet: inside a traced region the call refuses by
    name, so ``fullgraph=True`` fails (without ``fullgraph`` dynamo breaks the graph there and the call
    runs eagerly)."""
    x = torch.randn(4, 256)
    t = torch.zeros(4, dtype=torch.int64)

    def f(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return selected_logprob(x, t, top_p=0.9, backend=EAGER_BACKEND).selected_logp

    torch._dynamo.reset()
    with pytest.raises(Exception, match="Observed exception"):
        torch.compile(f, backend="eager", fullgraph=True)(x, t)


def test_the_bench_times_processed_against_raw_in_one_run(tmp_path: Any) -> None:
    """``bench --paths candidate processed``: both timed in one run, the ratio computed from its rows."""
    from rl_engine import jsonio, schemas
    from rl_engine.benchmark import cli as bench_cli

    out = tmp_path / "bench.json"
    flags = ["--tokens", "8", "--vocab", "512", "--tiles", "4", "--repeats", "1", "--warmup", "0", "--threads", "1",
             "--no-memory", "--paths", "candidate", "processed"]
    assert bench_cli.main([*flags, "--output", str(out)]) == 0
    doc = jsonio.load(out)
    assert schemas.errors(doc, "bench") == []
    rows = {(r["path"], r["phase"]): r["median_s"] for r in doc["rows"]}
    for phase in ("forward", "forward_backward"):
        ratio = doc["path_ratios"]["processed"]["8"][phase]["time_vs_candidate"]
        assert ratio == rows[("processed", phase)] / rows[("candidate", phase)]
