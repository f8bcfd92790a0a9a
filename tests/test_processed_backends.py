"""Processed logprobs (docs/arithmetic.md section 13) through the fused C and Triton backends'
ops: the NumPy spec's and the eager backend's bytes.

Bytes are compared as bytes (``tobytes``): logp, LSE, entropy, ``target_kept`` and the gradient
(an LSE and an entropy gradient, the logp gradient where the target is kept) of
``cpu-vocab-parallel-logp-ws2`` for every parameter set of tests/test_processed.py (top-k,
top-p, min-p, their combinations, per-row parameters; ties planted at the thresholds, dropped
targets) in bf16, fp16 and fp32, with a temperature, non-finite inactive rows, every instruction
set; at TP 2, 4, 8 x CP 1, 2 (contiguous, zigzag) on gloo ranks in one launch, where the cut is
found by the search on the key with the tiles all-gathered. ``triton-vocab-parallel-logp-ws2``
under Triton's interpreter on a small vocabulary (each program runs in Python): the spec's bytes
for three parameter sets and three dtypes, and at TP 2 on gloo. The campaign's cut (the eager
search) and the kernels' give one kept set: the keys found are compared too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from test_processed import PARAMS, REAL, TILES, as_bytes, batch, params_for, spec

from rl_engine.logprob.api import selected_logprob
from rl_engine.logprob.backends.fused_cpu.fused_cpu import FusedCpuLogprob, kernel_unavailable
from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.processed import kept_cut, sampling_from
from rl_engine.tables import FUSED_CPU_BACKEND
from rl_engine.tensorio import tensor_bytes

from _multiproc import run_workers

pytestmark = [
    pytest.mark.skipif(kernel_unavailable() is not None, reason="the fused C kernel is not built"),
    pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning"),
]
KEYS = ("logp", "lse", "entropy", "kept", "grad")


def run_op(op: Any, b: dict[str, Any], params: dict[str, Any], contract: LogprobContract,
           rows: torch.Tensor | None = None, cols: tuple[int, int] | None = None, group: Any = None,
           entropy_grad: bool = True) -> dict[str, torch.Tensor]:
    """One processed call of ``op`` on (a shard of) the batch, and its gradient."""
    idx = rows if rows is not None else torch.arange(b["logits"].shape[0])
    lo, hi = cols if cols is not None else (0, b["logits"].shape[1])
    x = b["logits"][idx, lo:hi].contiguous().requires_grad_(True)
    flat = {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
    sampling = sampling_from(flat.get("top_k", 0), flat.get("top_p", 1.0), flat.get("min_p", 0.0),
                             (idx.numel(),), x.device)
    out = op(x, b["targets"][idx], b["active"][idx], contract, group=group, compute_entropy=True,
             sampling=sampling)
    loss = (torch.where(out.target_kept, out.selected_logp, 0.0) * b["w_logp"][idx]).sum() \
        + (out.lse * b["w_lse"][idx]).sum()
    if entropy_grad:
        loss = loss + (out.entropy * b["w_ent"][idx]).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return dict(logp=out.selected_logp.detach(), lse=out.lse.detach(), entropy=out.entropy.detach(),
                kept=out.target_kept, grad=grad)


def _contract(dtype: str, rows: int, real: int = REAL, padded: int = 1024, tiles: int = TILES,
              temperature: float = 1.0, **kw: Any) -> LogprobContract:
    return LogprobContract(real, padded, tiles, 1, rows, logits_dtype=dtype, temperature=temperature, **kw)


def _mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [k for k in KEYS if as_bytes(k, got[k]) != as_bytes(k, want[k])]


# ----- the fused C backend ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_fused_c_equals_the_numpy_spec(dtype: str, name: str) -> None:
    b = batch(dtype)
    params = params_for(name, 24)
    got = run_op(FusedCpuLogprob(), b, params, _contract(dtype, 24))
    assert _mismatches(got, spec(b, params, dtype)) == [], (dtype, name)


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_fused_c_with_a_temperature_every_isa_and_non_finite_inactive_rows(isa: str) -> None:
    try:
        op = FusedCpuLogprob(isa=isa)
    except Exception as exc:  # noqa: BLE001 - an instruction set this CPU lacks
        pytest.skip(str(exc))
    b = batch("bf16", seed=11)
    b["logits"][0, 10] = float("nan")
    b["logits"][6, 20] = float("inf")
    b["active"][0] = b["active"][6] = False
    params = dict(top_k=30, top_p=0.85, min_p=0.01)
    got = run_op(op, b, params, _contract("bf16", 24, temperature=0.7))
    assert _mismatches(got, spec(b, params, "bf16", temperature=0.7)) == []


def test_selected_logprob_serves_processed_calls_on_the_fused_c_backend() -> None:
    b = batch("fp32", seed=5)
    out = selected_logprob(b["logits"], b["targets"], b["active"], backend=FUSED_CPU_BACKEND,
                           num_vocab_tiles=TILES, real_vocab_size=REAL, compute_entropy=True, top_p=0.9, top_k=50)
    want = spec(b, dict(top_p=0.9, top_k=50), "fp32")
    assert out.provenance["actual_backend"] == FUSED_CPU_BACKEND
    assert tensor_bytes(out.selected_logp) == as_bytes("logp", want["logp"])
    assert out.target_kept.numpy().tobytes() == want["kept"].tobytes()


def test_the_kernels_cut_keeps_the_eager_searchs_set() -> None:
    """The C kernels' cut (a sort at TP = 1) and the eager search's drop the same columns."""
    b = batch("bf16", seed=7)
    params = params_for("per_row", 24)
    contract = _contract("bf16", 24)
    sampling = sampling_from(params["top_k"], params["top_p"], params["min_p"], (24,), torch.device("cpu"))
    mine = FusedCpuLogprob().engine().kept_cut(b["logits"], contract, sampling, None, 64)
    theirs = kept_cut(b["logits"], contract, sampling, None)
    x = b["logits"].float()
    cols = torch.arange(x.shape[1])
    assert mine.dropped(x, cols).numpy().tobytes() == theirs.dropped(x, cols).numpy().tobytes()


# ----- TP x CP with the fused C backend: one launch, many checks ------------------------------------
# TP 4 at CP 2 (every topology runs on all eight ranks: one less is a fifth less of the launch)
TOPOLOGIES = [(2, 1, "contiguous"), (8, 1, "contiguous"), (2, 2, "zigzag"), (4, 2, "contiguous")]
MESH_CASES = {"bf16-all": ("bf16", "all"), "bf16-per_row": ("bf16", "per_row"), "fp32-top_k3": ("fp32", "top_k3"),
              "fp16-top_p0.9": ("fp16", "top_p0.9")}
SEQS, SEQ_LEN = 2, 12


def _mesh_worker(rank: int, cases: dict[str, Any]) -> dict[Any, Any]:
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=120))
    groups: dict[int, list[Any]] = {8: [dist.group.WORLD]}
    for tp in (2, 4):
        groups[tp] = [dist.new_group(list(range(s, s + tp))) for s in range(0, 8, tp)]
    out: dict[Any, Any] = {}
    for name, (dtype, b, params) in cases.items():
        for tp, cp, layout in TOPOLOGIES:
            cp_rank, tp_rank = divmod(rank % (tp * cp), tp)
            c = LogprobContract(REAL, 1024, TILES, SEQS, SEQ_LEN, tp_world_size=tp, tp_rank=tp_rank,
                                cp_world_size=cp, cp_rank=cp_rank, cp_layout=layout, logits_dtype=dtype)
            rows = torch.tensor(c.token_indices, dtype=torch.int64)
            r = run_op(FusedCpuLogprob(threads=1), b, params, c, rows, (c.vocab_start, c.vocab_end),
                       groups[tp][rank // tp])
            out[(name, tp, cp, layout)] = {"tokens": c.token_indices, "cols": (c.vocab_start, c.vocab_end), **r}
    return out


def _assemble(results: list[dict[Any, Any]], key: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tokens = SEQS * SEQ_LEN
    out: dict[str, torch.Tensor] = {n: torch.full((tokens,), float("nan")) for n in ("logp", "lse", "entropy")}
    out["kept"] = torch.zeros(tokens, dtype=torch.bool)
    out["grad"] = torch.zeros(tokens, 1024, dtype=dtype)
    for res in results:
        r = res[key]
        idx = torch.tensor(r["tokens"], dtype=torch.int64)
        for n in ("logp", "lse", "entropy", "kept"):
            out[n][idx] = r[n]
        out["grad"][idx, r["cols"][0]:r["cols"][1]] = r["grad"]
    for res in results:  # every TP rank of a token wrote the same bytes
        r = res[key]
        idx = torch.tensor(r["tokens"], dtype=torch.int64)
        for n in ("logp", "lse", "entropy", "kept"):
            assert tensor_bytes(out[n][idx]) == tensor_bytes(r[n]), (key, n)
    return out


@pytest.fixture(scope="module")
def mesh_runs() -> tuple[dict[str, Any], list[dict[Any, Any]]]:
    cases = {}
    for i, (name, (dtype, pname)) in enumerate(MESH_CASES.items()):
        cases[name] = (dtype, batch(dtype, rows=SEQS * SEQ_LEN, seed=80 + i), params_for(pname, SEQS * SEQ_LEN))
    return cases, run_workers(_mesh_worker, 8, cases, timeout_s=420)


@pytest.mark.slow  # eight gloo ranks, about 30 s on 2 cores
@pytest.mark.ranks
@pytest.mark.parametrize("case", list(MESH_CASES))
def test_fused_c_at_tp_and_cp_gives_the_spec_bytes(mesh_runs: Any, case: str) -> None:
    cases, results = mesh_runs
    dtype, b, params = cases[case]
    want = spec(b, params, dtype)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    bad = []
    for tp, cp, layout in TOPOLOGIES:
        got = _assemble(results, (case, tp, cp, layout), dt)
        bad += [f"TP={tp} CP={cp} {layout}: {k}" for k in _mismatches(got, want)]
    assert bad == []


# ----- Triton, under the interpreter ---------------------------------------------------------------
# tile width 128, the last tile partly padding; the interpreter runs a program a row and tile, so one rank
# holds two tiles, and each of TP 3's ranks one
SMALL = dict(real=200, padded=256, tiles=2)
SMALL_TP3 = dict(real=300, padded=384, tiles=3)
TRITON_PARAMS = {"all": dict(top_k=40, top_p=0.8, min_p=0.02), "per_row": "per_row"}


def _small_batch(dtype: str, rows: int = 8, seed: int = 3, shape: dict[str, int] = SMALL) -> dict[str, Any]:
    """Logits on a grid of quarter units (ties at every threshold; NaN, +inf and all -inf inactive
    rows): tests/test_processed_kernels.py's data on the small vocabulary."""
    from test_processed_kernels import _data

    b = batch(dtype, rows=rows, seed=seed)
    b["logits"], b["targets"], b["active"] = _data(dtype, rows, seed, shape["real"], shape["padded"])
    b["active"][4] = False  # its real -inf columns: validation refuses an active row holding them
    return b


def _small_spec(b: dict[str, Any], params: dict[str, Any], dtype: str, temperature: float = 1.0,
                shape: dict[str, int] = SMALL) -> dict[str, Any]:
    from test_processed import NP_DTYPE, np_logits

    from rl_engine.arith import spec_numpy as S

    p = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in params.items()}
    logits = np_logits(b["logits"], dtype)
    t, a = b["targets"].numpy(), b["active"].numpy()
    logp, lse, ent, kept, keep = S.forward_processed(logits, NP_DTYPE[dtype], t, a, shape["real"], shape["tiles"],
                                                     True, temperature=temperature, **p)
    grad = S.backward_processed(logits, NP_DTYPE[dtype], t, a, lse, b["w_logp"].numpy().astype(np.float32),
                                b["w_lse"].numpy().astype(np.float32), shape["real"], shape["tiles"], keep,
                                temperature=temperature, grad_entropy=b["w_ent"].numpy().astype(np.float32),
                                entropy=ent)
    return dict(logp=logp, lse=lse, entropy=ent, kept=kept, grad=grad.view(np.int16) if dtype == "bf16" else grad)


def _triton_op() -> Any:
    pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton.triton_backend import TritonLogprob

    return TritonLogprob(mode="interpreter")


@pytest.mark.slow  # the interpreter runs each program in Python
@pytest.mark.parametrize("dtype,name,temperature", [("bf16", "all", 1.0), ("fp32", "per_row", 0.7)])
def test_triton_interpreter_equals_the_numpy_spec(dtype: str, name: str, temperature: float) -> None:
    """The op's own path (sampling parameters, autograd) on the Triton kernels: every parameter at once
    and per-row ones. fp16 at 1.3 with top-p alone (rows 1 and 3 of the data's parameters) is the
    kernels' test in tests/test_processed_triton.py (forward, backward and the search against the
    reference's bytes, on this data and shape); the op adds nothing per dtype."""
    b = _small_batch(dtype)
    p = TRITON_PARAMS[name]
    params = params_for("per_row", 8) if p == "per_row" else dict(p)
    contract = _contract(dtype, 8, SMALL["real"], SMALL["padded"], SMALL["tiles"], temperature)
    got = run_op(_triton_op(), b, params, contract)
    assert _mismatches(got, _small_spec(b, params, dtype, temperature)) == []


def _triton_worker(rank: int, b: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    import os

    os.environ["RL_ENGINE_TRITON_MODE"] = "interpreter"
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=300))
    c = _contract("bf16", 8, SMALL_TP3["real"], SMALL_TP3["padded"], SMALL_TP3["tiles"], tp_world_size=3,
                  tp_rank=rank)
    r = run_op(_triton_op(), b, params, c, None, (c.vocab_start, c.vocab_end), dist.group.WORLD)
    return {"cols": (c.vocab_start, c.vocab_end), **r}


@pytest.mark.slow
@pytest.mark.ranks
def test_triton_interpreter_at_tp3_gives_the_spec_bytes() -> None:
    b = _small_batch("bf16", seed=5, shape=SMALL_TP3)
    params = dict(top_k=20, top_p=0.7, min_p=0.01)
    results = run_workers(_triton_worker, 3, b, params, timeout_s=500)
    want = _small_spec(b, params, "bf16", shape=SMALL_TP3)
    grad = torch.zeros(8, SMALL_TP3["padded"], dtype=torch.bfloat16)
    for r in results:
        grad[:, r["cols"][0]:r["cols"][1]] = r["grad"]
        assert _mismatches({**r, "grad": want["grad"]}, want) == []
    assert as_bytes("grad", grad) == as_bytes("grad", want["grad"])


# ----- a temperature per row (a rollout batch mixes requests) ------------------------------------------
def _per_row_call(backend: str, b: dict[str, Any], temperature: torch.Tensor, params: dict[str, Any]) -> dict:
    x = b["logits"].clone().requires_grad_(True)
    out = selected_logprob(x, b["targets"], b["active"], backend=backend, num_vocab_tiles=TILES,
                           real_vocab_size=REAL, compute_entropy=True, temperature=temperature, **params)
    loss = (torch.where(out.target_kept, out.selected_logp, 0.0) * b["w_logp"]).sum() + (out.lse * b["w_lse"]).sum() \
        + (out.entropy * b["w_ent"]).sum()
    (grad,) = torch.autograd.grad(loss, x)
    return dict(logp=out.selected_logp.detach(), lse=out.lse.detach(), entropy=out.entropy.detach(),
                kept=out.target_kept, grad=grad)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_fused_c_with_a_temperature_per_row_gives_the_eager_bytes(dtype: str) -> None:
    from rl_engine.tables import EAGER_BACKEND

    b = batch(dtype, seed=13)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5] * 6)
    params = params_for("per_row", 24)
    got = _per_row_call(FUSED_CPU_BACKEND, b, temperature, params)
    want = _per_row_call(EAGER_BACKEND, b, temperature, params)
    assert _mismatches(got, want) == []
    one = _per_row_call(FUSED_CPU_BACKEND, b, torch.full((24,), 0.7), params)  # control: the temperatures act
    assert as_bytes("lse", one["lse"]) != as_bytes("lse", got["lse"])


def test_triton_refuses_a_temperature_per_row_with_sampling_parameters_by_name() -> None:
    from rl_engine.logprob.contract import LogprobContractError

    op = _triton_op()
    b = _small_batch("bf16")
    c = _contract("bf16", 8, SMALL["real"], SMALL["padded"], SMALL["tiles"])
    engine = op.engine()
    sampling = sampling_from(0, 0.9, 0.0, (8,), torch.device("cpu"))
    with pytest.raises(LogprobContractError, match="temperature per row"):
        engine.kept_cut(b["logits"], c, sampling, None, 8, torch.full((8,), 0.7))


def test_fused_c_on_a_grid_past_the_vocabulary_gives_the_eager_bytes() -> None:
    """Tiles of ceil(V / T) columns (1003 columns, 8 tiles: the last one ends past the vocabulary)."""
    from rl_engine.tables import EAGER_BACKEND

    g = torch.Generator().manual_seed(17)
    b = batch("bf16", seed=17)
    b["logits"] = (torch.randint(-20, 8, (24, 1003), generator=g).float() / 4).to(torch.bfloat16)
    b["targets"] = b["targets"] % 1003
    params = params_for("per_row", 24)

    def call(backend: str) -> dict[str, Any]:
        x = b["logits"].clone().requires_grad_(True)
        out = selected_logprob(x, b["targets"], b["active"], backend=backend, num_vocab_tiles=8,
                               compute_entropy=True, **params)
        loss = (torch.where(out.target_kept, out.selected_logp, 0.0) * b["w_logp"]).sum() + out.lse.sum()
        (grad,) = torch.autograd.grad(loss, x)
        return dict(logp=out.selected_logp.detach(), lse=out.lse.detach(), entropy=out.entropy.detach(),
                    kept=out.target_kept, grad=grad)

    assert _mismatches(call(FUSED_CPU_BACKEND), call(EAGER_BACKEND)) == []
