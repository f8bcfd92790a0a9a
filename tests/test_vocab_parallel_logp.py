"""Backend ``pytorch-vocab-parallel-logp-ws2``: oracles, padding, masks, invariances, meshes.

Determinism claims compare bytes (``tensor_bytes`` / ``fingerprint``); only the
comparisons with the oracles use tolerances. Multi-process runs use real processes and
real gloo collectives through :func:`_multiproc.run_workers`; each
spawn batches many checks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

from rl_engine.distributed.mesh import init_mesh
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.oracle import fp32_oracle, fp64_oracle
from rl_engine.tensorio import fingerprint, tensor_bytes

from _multiproc import run_workers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OUTPUTS = ("logp", "lse", "entropy", "grad")
BIG_VOCAB = 151936  # Qwen-sized: long rows are where thread splitting shows up
BIG_TILES = 64


@dataclass(frozen=True)
class Batch:
    """Global inputs of one call: logits [tokens, padded] in their dtype, plus upstream grads."""

    dtype: str
    real: int
    padded: int
    tiles: int
    num_sequences: int
    seq_len: int
    logits: torch.Tensor
    logits_fp32: torch.Tensor  # before rounding to ``dtype``
    targets: torch.Tensor
    active: torch.Tensor
    w_logp: torch.Tensor
    w_lse: torch.Tensor

    def contract(self, **overrides: Any) -> LogprobContract:
        fields = dict(
            real_vocab_size=self.real, padded_vocab_size=self.padded,
            num_vocab_tiles=self.tiles, num_sequences=self.num_sequences,
            seq_len=self.seq_len, logits_dtype=self.dtype,
        )
        return LogprobContract(**{**fields, **overrides})


def make_batch(
    dtype: str, real: int, padded: int, tiles: int, seed: int,
    num_sequences: int = 2, seq_len: int = 16, scale: float = 2.0,
) -> Batch:
    """Random logits with every fourth row inactive and holding a garbage target."""
    g = torch.Generator().manual_seed(seed)
    tokens = num_sequences * seq_len
    logits32 = torch.randn(tokens, padded, generator=g) * scale
    targets = torch.randint(0, real, (tokens,), generator=g)
    active = torch.ones(tokens, dtype=torch.bool)
    active[::4] = False
    garbage = torch.tensor([-100, -1, real, padded, 10**12, padded - 1], dtype=torch.int64)
    inactive = (~active).nonzero().squeeze(1)
    targets[inactive] = garbage[torch.arange(inactive.numel()) % garbage.numel()]
    w_logp = torch.randn(tokens, generator=g)
    w_lse = torch.randn(tokens, generator=g) * 0.5
    return Batch(dtype, real, padded, tiles, num_sequences, seq_len,
                 logits32.to(DTYPES[dtype]), logits32, targets, active, w_logp, w_lse)


def run_local(
    contract: LogprobContract, batch: Batch, *, logits: torch.Tensor | None = None,
    group: Any = None, chunk_rows: int | None = None, lse_grad: bool = True,
    op: VocabParallelLogprob | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's rows and columns of the global batch through the backend, with backward."""
    full = batch.logits if logits is None else logits
    rows = torch.tensor(contract.token_indices, dtype=torch.int64)
    x = full[rows, contract.vocab_start:contract.vocab_end].contiguous().requires_grad_(True)
    out = (op or VocabParallelLogprob())(
        x, batch.targets[rows], batch.active[rows], contract,
        group=group, compute_entropy=True, chunk_rows=chunk_rows,
    )
    assert out.entropy is not None
    w_lse = batch.w_lse[rows] if lse_grad else torch.zeros(rows.numel())
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse), x, (batch.w_logp[rows], w_lse))
    return {"logp": out.selected_logp.detach(), "lse": out.lse.detach(),
            "entropy": out.entropy, "grad": grad}


def prints(result: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: fingerprint(result[name]) for name in OUTPUTS}


def rows_of(result: dict[str, torch.Tensor], index: int) -> dict[str, bytes]:
    return {name: tensor_bytes(result[name][index]) for name in OUTPUTS}


# ----- single rank against both oracles ------------------------------------------------------

# (logp/lse atol, entropy atol) of the kernel against oracles that see the same rounded input
SAME_INPUT_ATOL = {"fp32": (2e-5, 1e-4), "bf16": (2e-5, 1e-4), "fp16": (2e-5, 1e-4)}
# against the FP32 oracle on the logits before rounding (the guide's comparison; 0.05 for bf16)
UNROUNDED_ATOL = {"fp32": 2e-5, "bf16": 0.05, "fp16": 0.01}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_single_rank_matches_both_oracles(dtype: str) -> None:
    b = make_batch(dtype, real=1000, padded=1024, tiles=16, seed=11, num_sequences=4)
    res = run_local(b.contract(), b)
    for oracle in (fp32_oracle, fp64_oracle):
        ref = oracle(b.logits, b.targets, b.active, b.real)
        atol, entropy_atol = SAME_INPUT_ATOL[dtype]
        for name, got, want, tol in (("logp", res["logp"], ref.selected_logp, atol),
                                     ("lse", res["lse"], ref.lse, atol),
                                     ("entropy", res["entropy"], ref.entropy, entropy_atol)):
            torch.testing.assert_close(got.double(), want.double(), atol=tol, rtol=0,
                                       msg=lambda m, oracle=oracle, name=name: f"{oracle.__name__} {name}: {m}")
    unrounded = fp32_oracle(b.logits_fp32, b.targets, b.active, b.real)
    active = b.active
    torch.testing.assert_close(res["logp"][active], unrounded.selected_logp[active],
                               atol=UNROUNDED_ATOL[dtype], rtol=0)
    torch.testing.assert_close(res["lse"], unrounded.lse, atol=UNROUNDED_ATOL[dtype], rtol=0)
    # the oracle over the padded columns would be far off: the check above can fail
    counted_padding = torch.logsumexp(b.logits.float(), dim=-1)
    assert (counted_padding - res["lse"]).abs().max() > 10 * SAME_INPUT_ATOL[dtype][0]


# gradient tolerance: the candidate's gradient is rounded to the logits dtype
GRAD_TOL = {"fp32": (1e-6, 1e-5), "bf16": (1e-6, 2**-8), "fp16": (1e-6, 2**-10)}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_backward_matches_autograd_of_the_fp32_oracle(dtype: str) -> None:
    b = make_batch(dtype, real=1000, padded=1024, tiles=16, seed=12, num_sequences=4)
    res = run_local(b.contract(), b)
    assert res["grad"].dtype == DTYPES[dtype]
    x = b.logits.float().requires_grad_(True)
    ref = fp32_oracle(x, b.targets, b.active, b.real)
    (want,) = torch.autograd.grad((ref.selected_logp, ref.lse), x, (b.w_logp, b.w_lse))
    atol, rtol = GRAD_TOL[dtype]
    torch.testing.assert_close(res["grad"].float(), want, atol=atol, rtol=rtol)
    assert tensor_bytes(res["grad"][:, b.real:]) == bytes(res["grad"][:, b.real:].numel()
                                                          * res["grad"].element_size())


# ----- padding, inactive rows ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("fill", [0.0, 1e4, -1e4, float("nan"), float("inf"), float("-inf")])
def test_padding_columns_never_change_any_output_byte(dtype: str, fill: float) -> None:
    b = make_batch(dtype, real=1000, padded=1024, tiles=16, seed=13)
    base = prints(run_local(b.contract(), b))
    other = b.logits.clone()
    other[:, b.real:] = fill
    assert prints(run_local(b.contract(), b, logits=other)) == base
    noisy = b.logits.clone()
    noisy[:, b.real:] = torch.randn(noisy.shape[0], b.padded - b.real).to(noisy.dtype) * 50
    assert prints(run_local(b.contract(), b, logits=noisy)) == base
    # negative control: a real column does change the bytes
    real_change = b.logits.clone()
    real_change[:, b.real - 1] += 1
    assert prints(run_local(b.contract(), b, logits=real_change))["lse"] != base["lse"]


def test_inactive_rows_give_exact_positive_zero_and_ignore_their_targets() -> None:
    b = make_batch("bf16", real=1000, padded=1024, tiles=16, seed=14)
    res = run_local(b.contract(), b, lse_grad=False)
    inactive = (~b.active).nonzero().squeeze(1)
    assert inactive.numel() == 8
    for i in inactive.tolist():
        assert tensor_bytes(res["logp"][i]) == b"\x00\x00\x00\x00"  # +0.0, not -0.0
        assert tensor_bytes(res["grad"][i]) == bytes(b.padded * 2)  # logp-only loss: no gradient
    # any other garbage target on inactive rows: identical bytes, no error
    other_targets = b.targets.clone()
    other_targets[inactive] = torch.tensor([7, -5, 2**40, b.real + 3] * 2)
    b2 = Batch(**{**b.__dict__, "targets": other_targets})
    assert prints(run_local(b.contract(), b2, lse_grad=False)) == prints(res)


def test_inactive_rows_may_hold_non_finite_logits() -> None:
    b = make_batch("bf16", real=1000, padded=1024, tiles=16, seed=15)
    base = run_local(b.contract(), b, lse_grad=False)
    bad = b.logits.clone()
    inactive = (~b.active).nonzero().squeeze(1)
    bad[inactive[0], 3] = float("nan")
    bad[inactive[1], 4] = float("inf")
    bad[inactive[2]] = float("-inf")
    res = run_local(b.contract(), b, logits=bad, lse_grad=False)
    for i in inactive.tolist():
        assert tensor_bytes(res["logp"][i]) == b"\x00\x00\x00\x00"
        assert tensor_bytes(res["grad"][i]) == bytes(b.padded * 2)
    keep = b.active.nonzero().squeeze(1)
    for name in OUTPUTS:
        assert tensor_bytes(res[name][keep]) == tensor_bytes(base[name][keep])


# ----- batch, thread and chunk invariance at a realistic vocabulary -------------------------


@pytest.fixture(scope="module")
def big() -> Batch:
    return make_batch("bf16", real=BIG_VOCAB, padded=BIG_VOCAB, tiles=BIG_TILES, seed=21,
                      num_sequences=1, seq_len=16)


def _sub_batch(b: Batch, rows: list[int], logits: torch.Tensor | None = None) -> Batch:
    idx = torch.tensor(rows, dtype=torch.int64)
    src = b.logits if logits is None else logits
    return Batch(b.dtype, b.real, b.padded, b.tiles, 1, len(rows), src[idx],
                 b.logits_fp32[idx], b.targets[idx], b.active[idx], b.w_logp[idx], b.w_lse[idx])


def test_batch_invariance_a_row_does_not_depend_on_the_other_rows(big: Batch) -> None:
    full = run_local(big.contract(), big)
    for i in (1, 6, 15):
        alone = _sub_batch(big, [i])
        assert rows_of(run_local(alone.contract(), alone), 0) == rows_of(full, i)
    # same row among different rows, at another position, in a batch of another size
    g = torch.Generator().manual_seed(99)
    strangers = (torch.randn(5, big.padded, generator=g) * 4).to(big.logits.dtype)
    mixed_logits = torch.cat([strangers[:2], big.logits[6:7], strangers[2:]])

    def pick(t: torch.Tensor) -> torch.Tensor:  # the other rows' side inputs: rows 9..13
        return torch.cat([t[9:11], t[6:7], t[11:14]])

    mixed = Batch(big.dtype, big.real, big.padded, big.tiles, 1, 6, mixed_logits,
                  mixed_logits.float(), pick(big.targets), pick(big.active), pick(big.w_logp),
                  pick(big.w_lse))
    assert rows_of(run_local(mixed.contract(), mixed), 2) == rows_of(full, 6)


def _with_threads(n: int, fn: Callable[[], Any]) -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("tiles", [BIG_TILES, 1])  # one tile: a whole 151936-wide row
@pytest.mark.parametrize("rows", [1, 16])
def test_thread_count_invariance(big: Batch, rows: int, tiles: int) -> None:
    b = _sub_batch(big, list(range(rows)))
    c = b.contract(num_vocab_tiles=tiles)
    one = _with_threads(1, lambda: prints(run_local(c, b)))
    two = _with_threads(2, lambda: prints(run_local(c, b)))
    assert one == two


def test_plain_torch_sum_over_a_long_row_depends_on_the_thread_count(big: Batch) -> None:
    """Negative control: the hazard the fixed fold avoids is real on this torch."""
    row = big.logits_fp32[:1] * 1.5
    one = _with_threads(1, lambda: fingerprint(row.sum(dim=-1)))
    two = _with_threads(2, lambda: fingerprint(row.sum(dim=-1)))
    assert one != two


def test_chunk_size_invariance(big: Batch) -> None:
    """One row a chunk, chunks that leave a remainder (3, 7 of 16 rows), and one chunk of every row.

    On one thread: the thread count is its own claim (test_thread_count_invariance), and two
    threads on a whole 16 x 151936 chunk spin at the pool's barriers when the machine is loaded
    (12 s of wall for 0.2 s of work, against 1.3 s on one thread)."""
    c = big.contract()
    base = _with_threads(1, lambda: prints(run_local(c, big)))
    for chunk_rows in (1, 3, 7, 4096):
        assert _with_threads(1, lambda n=chunk_rows: prints(run_local(c, big, chunk_rows=n))) == base, chunk_rows


def test_another_tile_count_changes_the_bytes(big: Batch) -> None:
    """Negative control: the tile count is numerical identity (hence in the contract).

    At 151936 columns the regrouping stays below the LSE's last bit here but shows in the
    entropy; on a short row it shows in the LSE itself.
    """
    a = run_local(big.contract(), big)
    b = run_local(big.contract(num_vocab_tiles=BIG_TILES * 2), big)
    assert fingerprint(a["entropy"]) != fingerprint(b["entropy"])
    torch.testing.assert_close(a["entropy"], b["entropy"], atol=1e-4, rtol=0)  # same maths
    short = make_batch("fp32", real=1000, padded=1024, tiles=16, seed=21)
    c = run_local(short.contract(), short)
    d = run_local(short.contract(num_vocab_tiles=8), short)
    assert fingerprint(c["lse"]) != fingerprint(d["lse"])
    torch.testing.assert_close(c["lse"], d["lse"], atol=1e-5, rtol=0)


# ----- bad input ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small() -> Batch:
    return make_batch("bf16", real=1000, padded=1024, tiles=16, seed=31, num_sequences=1, seq_len=8)


def _call(b: Batch, logits: torch.Tensor | None = None, targets: torch.Tensor | None = None,
          active: torch.Tensor | None = None, **kw: Any) -> Any:
    return VocabParallelLogprob()(
        b.logits if logits is None else logits, b.targets if targets is None else targets,
        b.active if active is None else active, b.contract(), **kw)


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda b: dict(logits=b.logits.float()), "logits.dtype=torch.float32"),
        (lambda b: dict(logits=b.logits[:, :512]), "logits.shape=(8, 512)"),
        (lambda b: dict(logits=b.logits[:4]), "logits.shape=(4, 1024)"),
        (lambda b: dict(logits=b.logits.reshape(-1)), "logits.shape=(8192,)"),
        (lambda b: dict(targets=b.targets.int()), "targets must be int64"),
        (lambda b: dict(targets=b.targets[:4]), "shape=(4,)"),
        (lambda b: dict(active=b.active.to(torch.uint8)), "active mask must be bool"),
        (lambda b: dict(active=b.active[:, None]), "shape=(8, 1)"),
        (lambda b: dict(chunk_rows=0), "chunk_rows=0"),
    ],
)
def test_wrong_dtype_or_shape_raises(small: Batch, change: Callable[[Batch], dict[str, Any]],
                                     needle: str) -> None:
    with pytest.raises(LogprobContractError, match=re.escape(needle)):
        _call(small, **change(small))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_logit_in_an_active_real_column_raises(small: Batch, value: float) -> None:
    row = int(small.active.nonzero()[0, 0])
    bad = small.logits.clone()
    bad[row, 999] = value
    with pytest.raises(LogprobContractError, match=rf"logits row {row} .*non-finite"):
        _call(small, logits=bad)
    padding_only = small.logits.clone()
    padding_only[row, 1000] = value
    _call(small, logits=padding_only)  # padding: no error


@pytest.mark.parametrize("target", [1000, 1023, -1, 2**40, -100])
def test_active_target_outside_the_real_vocabulary_raises(small: Batch, target: int) -> None:
    row = int(small.active.nonzero()[0, 0])
    targets = small.targets.clone()
    targets[row] = target
    with pytest.raises(LogprobContractError, match=re.escape(f"targets[{row}]={target}")) as info:
        _call(small, targets=targets)
    assert ("ignore_index=-100" in str(info.value)) == (target == -100)


def test_misaligned_shard_and_a_tile_without_a_column_raise() -> None:
    with pytest.raises(LogprobContractError, match="not aligned to the tile width 64"):
        LogprobContract(1000, 1024, 16, 1, 8, tp_world_size=2,
                        vocab_shard_bounds=((0, 480), (480, 1024)))
    with pytest.raises(LogprobContractError, match="num_vocab_tiles=33 leaves its last tile with no column"):
        LogprobContract(1000, 1024, 33, 1, 8)  # 33 tiles of 32: the last one past the vocabulary
    assert LogprobContract(1000, 1024, 24, 1, 8).tile_width == 43  # 24 tiles of ceil(1024 / 24)


def test_a_tp_contract_without_a_group_raises_before_any_collective(small: Batch) -> None:
    c = small.contract(tp_world_size=2)
    x = small.logits[:, :512].contiguous()
    with pytest.raises(LogprobContractError, match="tp_world_size=2 needs a TP process group"):
        VocabParallelLogprob()(x, small.targets, small.active, c)


# ----- real multi-process gloo runs -----------------------------------------------------------

TOPOLOGIES: list[tuple[int, int, str]] = [
    (2, 1, "contiguous"), (4, 1, "contiguous"), (8, 1, "contiguous"),
    (1, 2, "contiguous"), (1, 2, "zigzag"),
    (2, 2, "contiguous"), (2, 2, "zigzag"),
    (4, 2, "contiguous"), (4, 2, "zigzag"),
]
MESH_CASES: dict[str, tuple[str, int, int, int]] = {  # dtype, real, padded, tiles
    "fp32": ("fp32", 1024, 1024, 16),
    "fp32-padded-1-tile-per-rank-at-tp8": ("fp32", 1000, 1024, 8),
    "bf16": ("bf16", 1024, 1024, 16),
    "bf16-padded": ("bf16", 1000, 1024, 16),
    "bf16-padded-rank7-all-padding": ("bf16", 850, 1024, 16),
    "fp16-padded": ("fp16", 1000, 1024, 16),
    # tiles that do not divide the vocabulary (docs/arithmetic.md section 6): GPT-2's 50257 in 64
    # tiles of 786 (the last rank's shard narrower), and 1003 columns (1000 real) in 16 tiles of 63
    "bf16-gpt2-50257": ("bf16", 50257, 50257, 64),
    "fp32-1003-grid-padding": ("fp32", 1000, 1003, 16),
}
WORLD = 8


def _mesh_worker(rank: int, batches: dict[str, Batch]) -> dict[Any, Any]:
    """Every topology of TOPOLOGIES on one 8-process world; replicas fill unused ranks."""
    mesh = init_mesh(tp=4, cp=2, timeout_s=60)
    groups: dict[int, list[Any]] = {1: [None] * WORLD, 8: [dist.group.WORLD]}
    for tp in (2, 4):  # every rank creates every group, in the same order
        groups[tp] = [dist.new_group(list(range(s, s + tp))) for s in range(0, WORLD, tp)]
    out: dict[Any, Any] = {
        "coords": mesh.coords,
        "tp_group": dist.get_process_group_ranks(mesh.tp_group),
        "cp_group": dist.get_process_group_ranks(mesh.cp_group),
    }
    for name, b in batches.items():
        for tp, cp, layout in TOPOLOGIES:
            cp_rank, tp_rank = divmod(rank % (tp * cp), tp)
            group = mesh.tp_group if (tp, cp) == (4, 2) else groups[tp][rank // tp]
            c = b.contract(tp_world_size=tp, tp_rank=tp_rank, cp_world_size=cp,
                           cp_rank=cp_rank, cp_layout=layout)
            res = run_local(c, b, group=group)
            out[(name, tp, cp, layout)] = {
                "tokens": c.token_indices, "cols": (c.vocab_start, c.vocab_end), **res
            }
    return out


@pytest.fixture(scope="module")
def mesh_runs() -> tuple[dict[str, Batch], list[dict[Any, Any]]]:
    batches = {
        name: make_batch(dtype, real, padded, tiles, seed=40 + i)
        for i, (name, (dtype, real, padded, tiles)) in enumerate(MESH_CASES.items())
    }
    return batches, run_workers(_mesh_worker, WORLD, batches, timeout_s=240)


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_mesh_groups_are_tp_fastest(mesh_runs: Any) -> None:
    _, results = mesh_runs
    for rank, res in enumerate(results):
        cp_rank, tp_rank = divmod(rank, 4)
        assert res["coords"] == (0, cp_rank, tp_rank)
        assert res["tp_group"] == [4 * cp_rank + i for i in range(4)]
        assert res["cp_group"] == [tp_rank, 4 + tp_rank]


def _assemble(results: list[dict[Any, Any]], key: Any, b: Batch) -> dict[str, torch.Tensor]:
    """Reassemble the global tensors by token index and vocabulary column.

    Ranks holding the same tokens (the TP ranks of a CP rank, and replicas) must agree
    byte for byte; every token and every (token, column) must be covered exactly once.
    """
    tokens = b.num_sequences * b.seq_len
    by_tokens: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    by_block: dict[tuple[tuple[int, ...], tuple[int, int]], list[bytes]] = {}
    for res in results:
        r = res[key]
        by_tokens.setdefault(r["tokens"], []).append(r)
        by_block.setdefault((r["tokens"], r["cols"]), []).append(tensor_bytes(r["grad"]))
    out = {name: torch.full((tokens,), float("nan")) for name in ("logp", "lse", "entropy")}
    seen = torch.zeros(tokens, dtype=torch.int64)
    for token_set, held in by_tokens.items():
        idx = torch.tensor(token_set, dtype=torch.int64)
        for name in out:
            assert len({tensor_bytes(r[name]) for r in held}) == 1, f"{key} {name} differs in a TP group"
            out[name][idx] = held[0][name]
        seen[idx] += 1
    assert seen.tolist() == [1] * tokens, f"{key}: tokens not covered exactly once"
    grad = torch.full((tokens, b.padded), float("nan"), dtype=b.logits.dtype)
    covered = torch.zeros(tokens, b.padded, dtype=torch.int64)
    for (token_set, (start, end)), blobs in by_block.items():
        assert len(set(blobs)) == 1, f"{key}: replicas disagree on a gradient block"
        idx = torch.tensor(token_set, dtype=torch.int64)
        held = next(r[key] for r in results if (r[key]["tokens"], r[key]["cols"]) == (token_set, (start, end)))
        grad[idx, start:end] = held["grad"]
        covered[idx, start:end] += 1
    assert bool((covered == 1).all()), f"{key}: gradient not covered exactly once"
    out["grad"] = grad
    return out


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
@pytest.mark.parametrize("case", list(MESH_CASES))
def test_tp_and_cp_outputs_are_byte_identical_to_tp1(mesh_runs: Any, case: str) -> None:
    batches, results = mesh_runs
    b = batches[case]
    reference = prints(run_local(b.contract(), b))
    mismatches = []
    for tp, cp, layout in TOPOLOGIES:
        got = prints(_assemble(results, (case, tp, cp, layout), b))
        mismatches += [f"TP={tp} CP={cp} {layout}: {n}" for n in OUTPUTS if got[n] != reference[n]]
    assert mismatches == []


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_padding_only_rank_at_tp8_contributes_nothing_but_still_runs(mesh_runs: Any) -> None:
    batches, results = mesh_runs
    key = ("bf16-padded-rank7-all-padding", 8, 1, "contiguous")
    assert results[7][key]["cols"] == (896, 1024) and batches[key[0]].real == 850
    assert tensor_bytes(results[7][key]["grad"]) == bytes(32 * 128 * 2)


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
               "broadcast", "barrier", "reduce_scatter", "all_to_all", "gather", "scatter")


def _count_collectives() -> list[int]:
    counter = [0]
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counter[0] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counter


def _bad_input_worker(rank: int, b: Batch) -> dict[str, tuple[str, str, int]]:
    """Each scenario on a TP=2 world: (outcome, message, collectives this rank entered)."""
    mesh = init_mesh(tp=2, timeout_s=60)
    counter = _count_collectives()
    good = b.contract(tp_world_size=2, tp_rank=rank)
    local = b.logits[:, good.vocab_start:good.vocab_end].contiguous()
    nan_on_rank0 = local.clone()
    if rank == 0:
        nan_on_rank0[int(b.active.nonzero()[0, 0]), 5] = float("nan")
    bad_targets = b.targets.clone()
    bad_targets[int(b.active.nonzero()[0, 0])] = b.real
    other_backend = VocabParallelLogprob()
    if rank == 1:
        other_backend.backend_id = "another-backend"  # type: ignore[misc]
    scenarios: list[tuple[str, Callable[[], Any]]] = [
        ("tiles", lambda: VocabParallelLogprob()(
            local, b.targets, b.active,
            b.contract(tp_world_size=2, tp_rank=rank, num_vocab_tiles=16 if rank == 0 else 8),
            group=mesh.tp_group)),
        ("ignore_index", lambda: VocabParallelLogprob()(
            local, b.targets, b.active,
            b.contract(tp_world_size=2, tp_rank=rank, ignore_index=-100 if rank == 0 else -1),
            group=mesh.tp_group)),
        ("backend", lambda: other_backend(local, b.targets, b.active, good, group=mesh.tp_group)),
        ("group_size", lambda: VocabParallelLogprob()(
            b.logits, b.targets, b.active, b.contract(), group=mesh.tp_group)),
        ("group_rank", lambda: VocabParallelLogprob()(
            local, b.targets, b.active, b.contract(tp_world_size=2, tp_rank=1 - rank),
            group=mesh.tp_group)),
        ("bad_target", lambda: VocabParallelLogprob()(
            local, bad_targets, b.active, good, group=mesh.tp_group)),
        ("nan_on_one_rank", lambda: VocabParallelLogprob()(
            nan_on_rank0, b.targets, b.active, good, group=mesh.tp_group)),
        ("good", lambda: VocabParallelLogprob()(
            local, b.targets, b.active, good, group=mesh.tp_group)),
    ]
    out = {}
    for name, call in scenarios:
        before = counter[0]
        try:
            res = call()
            out[name] = ("ok", fingerprint(res.lse) + fingerprint(res.selected_logp),
                         counter[0] - before)
        except LogprobContractError as exc:
            out[name] = ("raised", str(exc), counter[0] - before)
    return out


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_bad_input_across_ranks_raises_on_every_rank() -> None:
    b = make_batch("bf16", real=1000, padded=1024, tiles=16, seed=51, num_sequences=1, seq_len=8)
    results = run_workers(_bad_input_worker, 2, b, timeout_s=120)
    expected = {  # scenario: (message fragment, collectives entered): the agreement step first
        "tiles": ("TP ranks disagree on contract.num_vocab_tiles", 1),
        "ignore_index": ("TP ranks disagree on contract.ignore_index", 1),
        "backend": ("TP ranks disagree on backend", 1),
        "group_size": ("TP group size 2 disagrees with tp_world_size=1", 1),
        "group_rank": ("disagrees with tp_rank=", 1),
        "bad_target": ("outside [0, real_vocab_size=1000)", 1),
        "nan_on_one_rank": ("non-finite", 2),
    }
    for rank, res in enumerate(results):
        for name, (needle, collectives) in expected.items():
            outcome, message, entered = res[name]
            assert outcome == "raised" and needle in message, (rank, name, message)
            assert entered == collectives, (rank, name, entered)
            assert message == results[0][name][1], (rank, name)  # the same error on every rank
        assert "tp_rank=0" in res["nan_on_one_rank"][1]  # names the rank that holds the value
    assert results[0]["good"][0] == "ok" and results[0]["good"] == results[1]["good"]
    reference = run_local(b.contract(), b)
    assert results[0]["good"][1] == fingerprint(reference["lse"]) + fingerprint(reference["logp"])


# ----- the multi-process harness itself -------------------------------------------------------


def _harness_worker(rank: int, mode: str) -> Any:
    import os

    if mode == "echo":
        return rank, os.environ.get("RL_ENGINE_HARNESS_MARK"), torch.get_num_threads(), torch.ones(3)
    if mode == "hang":
        if rank == 0:
            import time

            time.sleep(60)
        return rank
    init_mesh(tp=2, timeout_s=60)
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # fails (peer gone) or is killed after the grace period
    return rank


@pytest.mark.ranks  # several processes: left out of the default workflow's focused suite (docs/workflow.md)
def test_run_workers_returns_values_and_reports_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    from _multiproc import WorkerError

    monkeypatch.setenv("RL_ENGINE_HARNESS_MARK", "seen")
    values = run_workers(_harness_worker, 2, "echo", threads=2)
    assert [v[:3] for v in values] == [(0, "seen", 2), (1, "seen", 2)]
    assert tensor_bytes(values[1][3]) == tensor_bytes(torch.ones(3))
    with pytest.raises(WorkerError) as info:
        run_workers(_harness_worker, 2, "fail", failure_grace_s=2.0)
    assert set(info.value.failures) == {0, 1}
    assert "ValueError: rank 1 fails on purpose" in info.value.failures[1]
    with pytest.raises(WorkerError) as info:
        run_workers(_harness_worker, 2, "hang", timeout_s=2.0)
    assert info.value.failures == {0: "timed out after 2.0s"}
