"""Processed logprobs (docs/arithmetic.md section 13) in the fused C kernels: the NumPy
reference's bytes.

Every comparison is of bytes (``tobytes``), never ``allclose``:

* the kept set each row's key describes is the reference's (a sort and a bisection on the
  prefix length) for top-k, top-p, min-p and their combinations, per-row parameters, bf16, fp16
  and fp32, a temperature, ties at every threshold (logits on a coarse grid), NaN and all
  ``-inf`` rows (no filtering);
* logp, LSE, entropy, ``target_kept`` and the gradient (with and without an LSE gradient, an
  entropy gradient) of the masked kernels are the reference's, targets outside the kept set
  included (``-inf``, never NaN; ``+0`` gradient on dropped columns);
* per TP shard (2, 4, 8) the masked partials, the top-p tile sums with the row max as the shift,
  and top-k's rank-local candidates merged by key give the full row's bytes and key;
* every instruction-set variant gives the same bytes; negative control: a key one column off
  changes the bytes.
"""

from __future__ import annotations

import _processed_ref as ref
import numpy as np
import pytest
import torch

from rl_engine.arith import portable
from rl_engine.arith.tiles import merge_tiles
from rl_engine.logprob.backends.eager.vocab_parallel import backward_terms
from rl_engine.logprob.backends.fused_cpu.fused_cpu import FusedCpuEngine, fused_partials
from rl_engine.logprob.backends.fused_cpu.fused_kept import (
    KernelCall,
    fused_candidates,
    fused_kept_backward,
    fused_kept_partials,
    kept_keys_tp1,
    min_p_log,
)
from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.processed import KEEP_ALL, KeptCut

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REAL, PADDED, TILES = 700, 768, 6  # tile width 128; the last tile half padding


def _data(dtype: str, rows: int = 24, seed: int = 3, real: int = REAL,
          padded: int = PADDED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits on a grid of quarter units: many equal values at every threshold."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-24, 9, (rows, padded), generator=g).float() / 4
    x[:, real:] = 100.0
    x[3, :real] = 2.0  # every column tied with the max
    x[4, :real:2] = float("-inf")  # real -inf columns
    x[5, 10:20] = x[5, :real].max()  # ties of the max
    targets = torch.randint(0, real, (rows,), generator=g)
    active = torch.ones(rows, dtype=torch.bool)
    x[0, 7] = float("nan")  # inactive rows with non-finite values: kept whole
    x[1, :] = float("-inf")
    x[2, 9] = float("inf")
    active[:3] = False
    active[6] = False
    return x.to(DTYPES[dtype]), targets, active


def _params(rows: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (top_k, p32, mp32): each alone, in pairs, all three, and off."""
    g = torch.Generator().manual_seed(seed)
    ks = torch.tensor([0, 1, 2, 5, 37, 699, 700, 5000])
    ps = torch.tensor([1.0, 0.9, 0.5, 0.05, 0.999])
    ms = torch.tensor([0.0, 0.05, 0.3, 1.0, 1e-6])
    pick = lambda n: torch.randint(0, n, (rows,), generator=g)  # noqa: E731
    k, p, m = ks[pick(len(ks))], ps[pick(len(ps))], ms[pick(len(ms))]
    # row 3 (every column tied): top-p alone, Z of a prefix of n columns is n, tau = n / 2 exactly
    k[:6] = torch.tensor([3, 0, 0, 0, 3, 2])
    p[:6] = torch.tensor([1.0, 0.7, 1.0, 0.5, 0.7, 0.9])
    m[:6] = torch.tensor([0.0, 0.0, 0.1, 0.0, 0.1, 0.0])
    return k, p.float(), m.float()


def _contract(dtype: str, rows: int, temperature: float = 1.0, tp: int = 1, rank: int = 0,
              shape: tuple[int, int, int] = (REAL, PADDED, TILES)) -> LogprobContract:
    kw = {} if tp == 1 else {"tp_world_size": tp, "tp_rank": rank}
    real, padded, tiles = shape
    return LogprobContract(real_vocab_size=real, padded_vocab_size=padded, num_vocab_tiles=tiles,
                           num_sequences=1, seq_len=rows, logits_dtype=dtype, temperature=temperature, **kw)


def call(isa: str = "auto") -> KernelCall:
    """The compiled library as the fused engine hands it to the processed kernels."""
    return FusedCpuEngine(isa=isa).kernel_call()


def _row_max(x: torch.Tensor, contract: LogprobContract) -> torch.Tensor:
    m, _, _, _ = fused_partials(x, contract, False, False)
    return m.amax(dim=1)


def _mask(x: torch.Tensor, contract: LogprobContract, keys: KeptCut) -> np.ndarray:
    xt = torch.from_numpy(ref.tempered(x, contract.temperature32))
    cols = torch.arange(x.shape[1]).unsqueeze(0)
    v, c = keys.value.unsqueeze(1), keys.index.unsqueeze(1)
    dropped = (xt < v) | ((xt == v) & (cols > c))
    dropped[:, contract.real_vocab_size:] = True
    return (~dropped).numpy()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_kept_set_is_the_reference_one(dtype: str, temperature: float) -> None:
    x, _, _ = _data(dtype)
    k, p, m = _params(x.shape[0])
    contract = _contract(dtype, x.shape[0], temperature)
    keys = kept_keys_tp1(call(), x, contract, k, p, m, _row_max(x, contract))
    xt = ref.tempered(x, contract.temperature32)
    want = ref.kept_mask(xt, REAL, TILES, k.numpy(), p.numpy(), m.numpy())
    got = _mask(x, contract, keys)
    assert got.tobytes() == want.tobytes()
    assert want[3:].sum(axis=1).min() >= 1 and (want.sum(axis=1) < REAL).sum() > 10  # it filters
    assert want[3].sum() == 350  # Z(prefix) == tau at the shortest prefix: kept (>=)


def _forward(x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, contract: LogprobContract,
             keys: KeptCut, isa: str = "auto") -> tuple[torch.Tensor, ...]:
    m, s, t, _ = fused_kept_partials(call(isa), x, contract, True, False, keys)
    lse, ent = merge_tiles(m, s, t, portable.exp, portable.log)
    xt = torch.from_numpy(ref.tempered(x, contract.temperature32))
    xtg = xt.gather(1, targets.unsqueeze(1)).squeeze(1)
    cols = targets
    kept = ~((xtg < keys.value) | ((xtg == keys.value) & (cols > keys.index)))
    logp = torch.where(active, xtg - lse, torch.zeros_like(lse))
    logp = torch.where(active & ~kept, torch.full_like(lse, float("-inf")), logp)
    for out in (logp, lse, ent):
        portable.canonical_nan_(out)
    return logp, lse, ent, kept | ~active


def _grads(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    gp, gl, ge = (torch.randn(rows, generator=g) for _ in range(3))
    gl[::4] = 0.0
    ge[::3] = 0.0
    return gp, gl, ge


@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_forward_and_backward_are_the_reference_bytes(dtype: str, temperature: float) -> None:
    x, targets, active = _data(dtype)
    rows = x.shape[0]
    k, p, m = _params(rows)
    contract = _contract(dtype, rows, temperature)
    keys = kept_keys_tp1(call(), x, contract, k, p, m, _row_max(x, contract))
    xt = ref.tempered(x, contract.temperature32)
    mask = ref.kept_mask(xt, REAL, TILES, k.numpy(), p.numpy(), m.numpy())
    want = ref.forward(xt, mask, targets.numpy(), active.numpy(), REAL, TILES)
    got = _forward(x, targets, active, contract, keys)
    names = ("logp", "lse", "entropy", "target_kept")
    for name, a, b in zip(names, got, want):
        assert a.numpy().tobytes() == b.tobytes(), name
    assert (~got[3]).sum() > 0  # targets outside the kept set are in the data
    assert not torch.isnan(got[0][active]).any()
    gp, gl, ge = _grads(rows)
    for grad_entropy in (None, ge):
        kept = got[3]
        terms = backward_terms(x, targets, active, got[1], gp, gl, contract,
                               grad_entropy, got[2] if grad_entropy is not None else None, keep=keys,
                               target_kept=kept)
        grad = fused_kept_backward(call(), x, got[1], terms)
        want_g = ref.backward(xt, mask, targets.numpy(), active.numpy(), got[1].numpy(), gp.numpy(),
                              gl.numpy(), REAL, TILES, contract.temperature32, dtype,
                              None if grad_entropy is None else ge.numpy(),
                              None if grad_entropy is None else got[2].numpy())
        assert grad.view(torch.int16 if dtype != "fp32" else torch.int32).numpy().tobytes() == \
            want_g.view(np.int16 if dtype != "fp32" else np.int32).tobytes()


def test_every_variant_gives_the_same_bytes_and_a_key_one_off_changes_them() -> None:
    x, targets, active = _data("bf16")
    rows = x.shape[0]
    k, p, m = _params(rows)
    contract = _contract("bf16", rows)
    found = set()
    for isa in ("baseline", "avx2", "avx512"):
        try:
            keys = kept_keys_tp1(call(isa), x, contract, k, p, m, _row_max(x, contract))
            out = _forward(x, targets, active, contract, keys, isa=isa)
        except Exception as exc:  # an instruction set this CPU lacks
            assert "isa" in str(exc) or "instruction set" in str(exc), exc
            continue
        found.add(b"".join(t.numpy().tobytes() for t in out) + keys.index.numpy().tobytes())
    assert len(found) == 1
    moved = KeptCut(keys.value, torch.where(keys.index == KEEP_ALL, keys.index, keys.index - 1))
    other = _forward(x, targets, active, contract, moved)
    assert b"".join(t.numpy().tobytes() for t in other[:3]) != b"".join(t.numpy().tobytes() for t in out[:3])


def _merge_candidates(parts: list, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k's merge of the shards' candidates: all (value, global id) sorted by key, the k-th."""
    value = torch.cat([c.value for c in parts], dim=1)
    column = torch.cat([c.column for c in parts], dim=1)
    out_v, out_c = [], []
    for r in range(value.shape[0]):
        pairs = sorted((-float(v), int(c)) for v, c in zip(value[r], column[r]) if c >= 0)
        kk = int(k[r])
        out_v.append(-pairs[kk - 1][0] if 0 < kk <= len(pairs) else float("nan"))
        out_c.append(pairs[kk - 1][1] if 0 < kk <= len(pairs) else -1)
    return torch.tensor(out_v, dtype=torch.float32), torch.tensor(out_c)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_shards_compose_to_the_full_row(tp: int) -> None:
    padded, tiles = 1024, 8
    g = torch.Generator().manual_seed(tp)
    x = (torch.randint(-20, 5, (12, padded), generator=g).float() / 4).to(torch.bfloat16)
    rows = x.shape[0]
    k, p, m = _params(rows)
    k = k.clamp(max=50)

    def con(rank: int, size: int) -> LogprobContract:
        kw = {} if size == 1 else {"tp_world_size": size, "tp_rank": rank}
        return LogprobContract(real_vocab_size=1000, padded_vocab_size=padded, num_vocab_tiles=tiles,
                               num_sequences=1, seq_len=rows, logits_dtype="bf16", **kw)

    full = con(0, 1)
    big = _row_max(x, full)
    keys = kept_keys_tp1(call(), x, full, k, p, m, big)
    m_full, s_full, t_full, _ = fused_kept_partials(call(), x, full, True, False, keys)
    _, z_full, _, _ = fused_kept_partials(call(), x, full, False, False, keys, shift=big)
    cands, ms, ss, ts, zs = [], [], [], [], []
    lmp = min_p_log(m)
    for rank in range(tp):
        c = con(rank, tp)
        shard = x[:, c.vocab_start:c.vocab_end]
        cands.append(fused_candidates(call(), shard, c, big, lmp, k))
        a, b, t, _ = fused_kept_partials(call(), shard, c, True, False, keys)
        ms.append(a)
        ss.append(b)
        ts.append(t)
        zs.append(fused_kept_partials(call(), shard, c, False, False, keys, shift=big)[1])
    for name, whole, pieces in (("m", m_full, ms), ("s", s_full, ss), ("t", t_full, ts), ("z", z_full, zs)):
        assert torch.cat(pieces, dim=1).numpy().tobytes() == whole.numpy().tobytes(), name
    one = fused_candidates(call(), x, full, big, lmp, k)
    kv, kc = _merge_candidates(cands, k)
    want_v, want_c = _merge_candidates([one], k)
    assert kv.numpy().tobytes() == want_v.numpy().tobytes() and kc.numpy().tobytes() == want_c.numpy().tobytes()
    assert torch.stack([c.count for c in cands]).sum(0).numpy().tobytes() == one.count.numpy().tobytes()
    assert torch.stack([c.least for c in cands]).amin(0).numpy().tobytes() == one.least.numpy().tobytes()
