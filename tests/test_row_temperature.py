"""A temperature per row: ``temperature`` as a tensor of the shape of ``targets``.

Each row's logits are divided by that row's ``T32`` (docs/arithmetic.md section 6 step 0) and its
gradient too (section 7 step 2). Claims, each compared as bytes: every implementation (NumPy, eager,
fused C, Triton under its interpreter) gives the same bytes, entropy gradient included, with rows
at 1, at ordinary and at extreme temperatures in one call; a row's bytes are the scalar call's at
that row's ``T32`` (so a tensor of ones gives the bytes without a temperature, and a tensor of one
value the scalar's); the result is ``selected_logprob(X.float() / T32[:, None])`` and the gradient
autograd's through that division; the Triton kernels load each row's division arguments (computed on
the device, equal to the scalar ones) and use them (a perturbed ``r`` changes the bytes); chunking,
the fused head, ``torch.compile``, verl's drop-ins and the vLLM integration (one call) carry it; TP
1/2/4 x CP 1/2 on gloo ranks give the one-rank bytes, each CP rank passing its own rows'
temperatures, with DTensor logits and ``gather_tokens``; and a bad tensor is refused by name
(shape, dtype, device, gradient, non-finite, range), on every TP rank before any collective.
"""

from __future__ import annotations

import importlib.util
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from _doc_blocks import run_trainer_block

from rl_engine.arith import spec_numpy
from rl_engine.arith.temperature import rn32
from rl_engine.logprob.api import selected_logprob
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.backends.fused_cpu.fused_cpu import FusedCpuLogprob
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.hidden import selected_logprob_from_hidden
from rl_engine.tables import TRITON_MODE_ENV
from rl_engine.tensorio import tensor_bytes

from _byte_cases import _contract, _inputs
from _multiproc import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow|divide by zero) encountered:RuntimeWarning")

HAS_TRITON = importlib.util.find_spec("triton") is not None
NUMPY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OUTPUTS = ("logp", "lse", "entropy", "grad")
EAGER = "pytorch-vocab-parallel-logp-ws2"
FUSED = "cpu-vocab-parallel-logp-ws2"
TRITON = "triton-vocab-parallel-logp-ws2"
BACKENDS = [EAGER, FUSED] + ([TRITON] if HAS_TRITON else [])
# rows at 1 among ordinary temperatures and the extremes of the range (2**-64: every quotient overflows
# or leaves the division's domain; 2**64: every quotient is tiny)
MIXED = [0.7, 1.0, 1.3, 2.0 ** -64, 0.25, 2.0 ** 64, 1.0, 3.0]


def _ops() -> dict[str, VocabParallelLogprob]:
    found: dict[str, VocabParallelLogprob] = {"eager": VocabParallelLogprob(), "fused": FusedCpuLogprob()}
    if HAS_TRITON:
        from rl_engine.logprob.backends.triton.triton_backend import TritonLogprob

        found["triton"] = TritonLogprob(mode="interpreter")
    return found


def _weights(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    w_logp, w_lse, w_ent = (torch.randn(rows, generator=g) for _ in range(3))
    w_lse[::4] = 0.0
    w_ent[1::3] = 0.0  # rows with coef == 0 and no entropy term: the override
    w_logp[1::3] = 0.0
    return w_logp, w_lse, w_ent


def _numpy(x: torch.Tensor, dtype: str, targets: torch.Tensor, active: torch.Tensor, real: int, tiles: int,
           temps: np.ndarray) -> dict[str, bytes]:
    arr = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else x.numpy()
    logp, lse, ent = spec_numpy.forward(arr, NUMPY_DTYPES[dtype], targets.numpy(), active.numpy(), real, tiles,
                                        True, temperature=temps)
    w_logp, w_lse, w_ent = _weights(x.shape[0])
    grad = spec_numpy.backward(arr, NUMPY_DTYPES[dtype], targets.numpy(), active.numpy(), lse, w_logp.numpy(),
                               w_lse.numpy(), real, tiles, temperature=temps, grad_entropy=w_ent.numpy(),
                               entropy=ent)
    return {"logp": logp.tobytes(), "lse": lse.tobytes(), "entropy": ent.tobytes(), "grad": grad.tobytes()}


def _op_run(op: VocabParallelLogprob, x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
            contract: Any, temps: torch.Tensor | None, chunk_rows: int | None = None) -> dict[str, bytes]:
    leaf = x.clone().requires_grad_(True)
    extra = {} if temps is None else {"temperature": temps}
    out = op(leaf, targets, active, contract, compute_entropy=True, chunk_rows=chunk_rows, **extra)
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse, out.entropy), leaf, _weights(x.shape[0]))
    return {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
            "entropy": tensor_bytes(out.entropy), "grad": tensor_bytes(grad)}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_implementation_gives_the_numpy_bytes_with_a_temperature_per_row(dtype: str) -> None:
    real, padded, tiles, rows = 997, 1001, 7, len(MIXED)
    x, targets, active = _inputs(dtype, real, padded, rows, seed=5)
    temps = torch.tensor(MIXED, dtype=torch.float32)
    want = _numpy(x, dtype, targets, active, real, tiles, temps.numpy())
    contract = _contract(dtype, real, padded, tiles, rows)
    for name, op in _ops().items():
        for chunk_rows in (None, 3):
            got = _op_run(op, x, targets, active, contract, temps, chunk_rows)
            assert {k: got[k] == want[k] for k in OUTPUTS} == dict.fromkeys(OUTPUTS, True), (name, dtype, chunk_rows)
    # negative control: another temperature on one row gives other bytes
    other = temps.clone()
    other[4] = 0.5
    assert _numpy(x, dtype, targets, active, real, tiles, other.numpy())["logp"] != want["logp"]


def _api(x: torch.Tensor, targets: torch.Tensor, temperature: Any, backend: str,
         chunk_rows: int | None = None, part: slice = slice(None)) -> dict[str, bytes]:
    """The outputs' and the gradient's bytes; the upstream gradients are ``_weights(6)[part]``."""
    leaf = x.clone().requires_grad_(True)
    out = selected_logprob(leaf, targets, num_vocab_tiles=4, compute_entropy=True, temperature=temperature,
                           backend=backend, chunk_rows=chunk_rows)
    w = tuple(v[part] for v in _weights(6))
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse, out.entropy), leaf,
                                  tuple(t.reshape(targets.shape) for t in w))
    return {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
            "entropy": tensor_bytes(out.entropy), "grad": tensor_bytes(grad)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_s_bytes_are_the_scalar_call_s_at_its_temperature(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor of ones gives the bytes without a temperature; a tensor of one value the scalar
    call's; a mixed tensor gives each row the scalar call's bytes at that row's ``T32`` (rows never
    mix), also as float64 (rounded once, like a number) and in ``[batch, seq]`` shape."""
    monkeypatch.setenv(TRITON_MODE_ENV, "interpreter")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 256, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, 256, (6,), generator=g)
    assert _api(x, targets, torch.ones(6), backend) == _api(x, targets, 1.0, backend)
    assert _api(x, targets, torch.full((6,), rn32(0.7)), backend) == _api(x, targets, 0.7, backend)
    assert _api(x, targets, torch.full((6,), 0.7), backend) != _api(x, targets, 1.0, backend)  # the control
    temps64 = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.3, 2.5], dtype=torch.float64)
    mixed = _api(x, targets, temps64, backend, chunk_rows=4)
    assert mixed == _api(x, targets, temps64.float(), backend)  # float64 is RN32, as a number is
    assert mixed == _api(x.reshape(2, 3, 256), targets.reshape(2, 3), temps64.reshape(2, 3), backend)
    rows = [_api(x[i:i + 1], targets[i:i + 1], float(temps64[i]), backend, part=slice(i, i + 1)) for i in range(6)]
    for k in OUTPUTS:
        size = len(mixed[k]) // 6
        assert [mixed[k][i * size:(i + 1) * size] for i in range(6)] == [r[k] for r in rows], k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_temperature_per_row_is_the_division_of_the_upcast_logits_gradient_included(
        dtype: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bytes of ``selected_logprob(x.float() / T32[:, None])`` and autograd's gradient through that
    division (``DivBackward`` per row, then ``.float()``'s rounding to ``x``'s dtype)."""
    monkeypatch.setenv(TRITON_MODE_ENV, "interpreter")
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(6, 256, generator=g) * 3).to(TORCH_DTYPES[dtype])
    targets = torch.randint(0, 256, (6,), generator=g)
    t32 = torch.tensor([0.7, 1.3, 1.0, 0.3, 2.0 ** -20, 7.5])
    ours = _api(x, targets, t32, backend)
    leaf = x.detach().clone().requires_grad_(True)
    divided = leaf.float() / t32[:, None]
    out = selected_logprob(divided, targets, num_vocab_tiles=4, compute_entropy=True, backend=EAGER)
    (autograd,) = torch.autograd.grad((out.selected_logp, out.lse, out.entropy), leaf, _weights(6))
    theirs = {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
              "entropy": tensor_bytes(out.entropy), "grad": tensor_bytes(autograd)}
    assert {k: ours[k] == theirs[k] for k in OUTPUTS} == dict.fromkeys(OUTPUTS, True), (dtype, backend)
    times = selected_logprob(x, targets, num_vocab_tiles=4, backend=EAGER, temperature=1.0)  # control: no division
    assert tensor_bytes(times.selected_logp) != ours["logp"]


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")
def test_the_triton_kernels_per_row_division_arguments_are_the_scalar_ones_and_are_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_engine.logprob.backends.triton import triton_backend

    rng = random.Random(1)
    temps = [1.0, 0.7, 1.3, 2.0 ** -64, 2.0 ** 64, 0.5, 2.0, 1e-10, 1e10, 0.1, 3.0]
    temps += [rng.uniform(0.01, 10) for _ in range(200)] + [2.0 ** rng.uniform(-64, 64) for _ in range(300)]
    t32 = [rn32(t) for t in temps]
    got = triton_backend.row_division_args(torch.tensor(t32))
    for i, t in enumerate(t32):
        row = (float(got[0][i]), float(got[1][i]), float(got[2][i]), int(got[3][i]), float(got[4][i]))
        assert row == triton_backend.division_args(t), t
    # the kernels use each row's: r perturbed on row 2 alone (r * (1 + 2**-5): the sequence's steps no
    # longer reach the quotient) changes row 2's bytes and no other row's
    monkeypatch.setenv(TRITON_MODE_ENV, "interpreter")
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 256, generator=g) * 3
    targets = torch.randint(0, 256, (6,), generator=g)
    temps4 = torch.tensor([0.7, 1.3, 0.3, 2.7, 0.9, 1.1])
    want = _api(x, targets, temps4, EAGER)
    assert _api(x, targets, temps4, TRITON) == want
    real = triton_backend.row_division_args

    def nudged(row_t32: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t, r, *rest = real(row_t32)
        r = r.clone()
        r[2] = r[2] * (1 + 2.0 ** -5)
        return (t, r, *rest)

    monkeypatch.setattr(triton_backend, "row_division_args", nudged)
    lse = _api(x, targets, temps4, TRITON)["lse"]
    assert [lse[4 * i:4 * i + 4] == want["lse"][4 * i:4 * i + 4] for i in range(6)] == [True, True, False] + [True] * 3


def test_the_fused_head_and_compiled_calls_carry_a_temperature_per_token() -> None:
    """The fused head per token (chunks of active rows) gives each token the scalar call's bytes; under
    ``torch.compile(fullgraph=True)`` (aot_eager, inductor) the op and the head give the eager bytes."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 3, 16, generator=g), torch.randn(64, 16, generator=g) * 0.5
    ids = torch.randint(0, 64, (2, 3), generator=g)
    ids[1, 2] = -100
    temps = torch.tensor([[0.7, 1.0, 1.3], [2.0, 0.7, 0.25]])

    def head(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, temp: Any) -> tuple[torch.Tensor, ...]:
        out = selected_logprob_from_hidden(h, w, t, num_vocab_tiles=4, compute_entropy=True, temperature=temp,
                                           chunk_tokens=2)
        return out.selected_logp, out.entropy

    def run(fn: Any, temp: Any, h: torch.Tensor = hidden, t: torch.Tensor = ids) -> list[bytes]:
        hh, ww = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp, ent = fn(hh, ww, t, temp)
        (logp.sum() + 0.5 * ent.sum()).backward()
        return [tensor_bytes(v) for v in (logp, ent, hh.grad, ww.grad)]

    eager = run(head, temps)
    for b in range(2):
        for s in range(3):
            one = run(head, float(temps[b, s]), hidden[b:b + 1, s:s + 1], ids[b:b + 1, s:s + 1])
            i = b * 3 + s
            assert [one[0], one[1]] == [eager[0][4 * i:4 * i + 4], eager[1][4 * i:4 * i + 4]], (b, s)
            assert one[2] == eager[2][64 * i:64 * i + 64], (b, s)
    assert run(torch.compile(head, backend="aot_eager", fullgraph=True), temps) == eager

    x = (torch.randn(2, 5, 64, generator=g) * 3).to(torch.bfloat16)
    tg = torch.randint(0, 64, (2, 5), generator=g)
    t2 = torch.rand(2, 5, generator=g) + 0.3

    def op(xx: torch.Tensor, temp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = selected_logprob(xx, tg, num_vocab_tiles=4, compute_entropy=True, temperature=temp)
        return out.selected_logp, out.entropy

    def run_op(fn: Any) -> list[bytes]:
        xx = x.clone().requires_grad_(True)
        logp, ent = fn(xx, t2)
        (logp.sum() + ent.sum()).backward()
        return [tensor_bytes(v) for v in (logp, ent, xx.grad)]

    plain = run_op(op)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        assert run_op(torch.compile(op, backend=backend, fullgraph=True)) == plain, backend


def test_verl_s_drop_ins_and_the_vllm_integration_take_each_row_s_temperature(monkeypatch: pytest.MonkeyPatch) -> None:
    from rl_engine.integrations import verl
    from rl_engine.integrations import vllm as rv

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, 3, 128, generator=g) * 2).to(torch.bfloat16)
    labels = torch.randint(0, 128, (2, 3), generator=g)
    temps = torch.tensor([[0.6, 1.0, 0.9], [1.2, 0.6, 2.0]])
    logp, ent = verl.logprobs_and_entropy_from_logits(x, labels, temperature=temps)
    for b in range(2):
        for s in range(3):
            one = verl.logprobs_and_entropy_from_logits(x[b:b + 1, s:s + 1], labels[b:b + 1, s:s + 1],
                                                        temperature=float(temps[b, s]))
            assert (tensor_bytes(one[0]), tensor_bytes(one[1])) == (tensor_bytes(logp[b, s]), tensor_bytes(ent[b, s]))

    # vLLM's processed logprobs: one call with each row's temperature, the bytes of a call per row
    calls: list[Any] = []
    import rl_engine.logprob as logprob_pkg

    real = logprob_pkg.selected_logprob

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("temperature"))
        return real(*args, **kwargs)

    monkeypatch.setattr(logprob_pkg, "selected_logprob", counted)
    defaults = dict(top_k=0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                    logit_bias=None, allowed_token_ids=None, bad_words=[], min_tokens=0, structured_outputs=None)
    runner = SimpleNamespace(requests={"0-aaaaaaaa": SimpleNamespace(sampling_params=SimpleNamespace(**defaults))})
    recorder = rv._Recorder(runner, rv.Options(capture=False, logprobs="processed"))
    rows = (torch.randn(3, 128, generator=g) * 2)
    row_temps = torch.tensor([0.7, 1.0, 0.7], dtype=torch.float32)
    ids = torch.randint(0, 128, (3, 2), generator=g)
    tensors = SimpleNamespace(logprobs=torch.zeros(3, 2), logprob_token_ids=ids)
    off = (torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.zeros(3))  # top_k, top_p, min_p: off
    recorder._replace(rows, ids[:, 0], row_temps, tensors, off)
    assert len(calls) == 1 and isinstance(calls[0], torch.Tensor)
    for i in range(3):
        want = real(rows[i:i + 1].expand(2, 128), ids[i], num_vocab_tiles=recorder.options.num_vocab_tiles,
                    temperature=float(row_temps[i]))
        assert tensor_bytes(tensors.logprobs[i]) == tensor_bytes(want.selected_logp), i


def _bad(change: Any) -> str:
    x = torch.randn(2, 3, 64)
    ids = torch.randint(0, 64, (2, 3))
    with pytest.raises(LogprobContractError) as info:
        selected_logprob(x, ids, num_vocab_tiles=4, temperature=change(torch.full((2, 3), 0.7)))
    return str(info.value)


@pytest.mark.parametrize("change, needles", [
    (lambda t: t.reshape(-1), ["temperature.shape=(6,)", "logits.shape[:-1]=(2, 3)"]),
    (lambda t: t[:1], ["temperature.shape=(1, 3)"]),
    (lambda t: torch.ones(2, 3, dtype=torch.int64), ["temperature.dtype=torch.int64", "floating-point", ".float()"]),
    (lambda t: torch.ones(2, 3, dtype=torch.bool), ["temperature.dtype=torch.bool"]),
    (lambda t: t.to("meta"), ["temperature.device=meta", "logits.device=cpu"]),
    (lambda t: t.requires_grad_(True), ["requires_grad=True", "temperature.detach()"]),
    (lambda t: t.index_put_((torch.tensor([1]), torch.tensor([2])), torch.tensor(float("nan"))),
     ["temperature[1, 2]=nan", "must be finite", "[2**-64, 2**64]", "such as 0.7"]),
    (lambda t: t.index_fill_(1, torch.tensor([1]), float("inf")), ["temperature[0, 1]=inf"]),
    (lambda t: t.index_fill_(1, torch.tensor([0]), 0.0), ["temperature[0, 0]=0.0"]),
    (lambda t: t.index_fill_(1, torch.tensor([2]), -0.7), ["temperature[0, 2]=-0.699999988079071"]),
    (lambda t: t.index_fill_(0, torch.tensor([1]), 1e-30), ["temperature[1, 0]=1.0000000031710769e-30"]),
    (lambda t: t.double().index_fill_(0, torch.tensor([1]), 2.0 ** 64 * (1 + 2.0 ** -20)),
     ["temperature[1, 0]=1.84467", "e+19 must be finite", "[2**-64, 2**64]"]),
    (lambda t: t.double().index_fill_(0, torch.tensor([0]), 1e300), ["temperature[0, 0]=1e+300 (binary32 inf)"]),
])
def test_a_bad_temperature_tensor_is_refused_naming_field_value_and_fix(change: Any, needles: list[str]) -> None:
    message = _bad(change)
    for needle in needles:
        assert needle in message, (needle, message)


def test_the_range_ends_are_accepted_and_the_op_refuses_two_temperatures() -> None:
    x = torch.randn(2, 64)
    ids = torch.randint(0, 64, (2,))
    ends = torch.tensor([2.0 ** -64, 2.0 ** 64 * (1 + 2.0 ** -30)], dtype=torch.float64)  # RN32: 2**-64, 2**64
    selected_logprob(x, ids, num_vocab_tiles=4, temperature=ends)  # the ends of the range are temperatures
    contract = _contract("fp32", 64, 64, 4, 2, temperature=0.7)
    with pytest.raises(LogprobContractError, match="pass one of them"):
        VocabParallelLogprob()(x, ids, torch.ones(2, dtype=torch.bool), contract, temperature=torch.ones(2))
    with pytest.raises(LogprobContractError, match=r"temperature.shape=\(3,\) must equal"):
        VocabParallelLogprob()(x, ids, torch.ones(2, dtype=torch.bool), _contract("fp32", 64, 64, 4, 2),
                               temperature=torch.ones(3))


# ----- TP 1/2/4 x CP 1/2 on four gloo ranks: one launch ------------------------------------------------
REAL, PADDED, TILES = 1000, 1024, 8
TOPOLOGIES = ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2))


def _case() -> dict[str, Any]:
    x, targets, active = _inputs("bf16", REAL, PADDED, 8, seed=21)
    temps = torch.tensor([0.7, 1.0, 1.3, 0.25, 2.0 ** -64, 3.0, 1.0, 0.9])
    w_logp, w_lse, w_ent = _weights(8)
    g = torch.Generator().manual_seed(6)
    head = (torch.randn(2, 4, 16, generator=g), torch.randn(PADDED, 16, generator=g) * 0.5,
            torch.randint(0, REAL, (2, 4), generator=g), temps.reshape(2, 4))
    return {"x": x, "targets": targets, "active": active, "temps": temps, "w": (w_logp, w_lse, w_ent), "head": head}


def _rank_worker(rank: int, case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from rl_engine.distributed.mesh import init_mesh
    from rl_engine.logprob.api import gather_tokens
    from rl_engine.logprob.contract import LogprobContract

    init_mesh(tp=4, cp=1, timeout_s=60)
    x, targets, active, temps, w = case["x"], case["targets"], case["active"], case["temps"], case["w"]
    # groups, made in the same order on every rank: TP pairs {0,1},{2,3}; CP pairs {0,2},{1,3}; CP pairs {0,1},{2,3}
    tp_pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_cross = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    out: dict[Any, Any] = {}
    for tp, cp in TOPOLOGIES:
        replica_size = tp * cp  # ranks [k * replica, (k + 1) * replica) compute one copy of the call
        local_rank = rank % replica_size
        cp_rank, tp_rank = divmod(local_rank, tp)
        tp_group = {1: None, 2: tp_pairs[rank // 2], 4: dist.group.WORLD}[tp]
        cp_group = None if cp == 1 else (tp_pairs[rank // 2] if tp == 1 else cp_cross[rank % 2])
        contract = LogprobContract(real_vocab_size=REAL, padded_vocab_size=PADDED, num_vocab_tiles=TILES,
                                   num_sequences=2, seq_len=4, tp_world_size=tp, tp_rank=tp_rank, cp_world_size=cp,
                                   cp_rank=cp_rank, cp_layout="zigzag" if cp > 1 else "contiguous", logits_dtype="bf16")
        rows = torch.tensor(contract.token_indices, dtype=torch.int64)
        local = x[rows, contract.vocab_start:contract.vocab_end].contiguous().requires_grad_(True)
        res = VocabParallelLogprob()(local, targets[rows], active[rows], contract, group=tp_group,
                                     compute_entropy=True, temperature=temps[rows])  # this CP rank's rows' T32
        (grad,) = torch.autograd.grad((res.selected_logp, res.lse, res.entropy), local, tuple(v[rows] for v in w))
        gathered = gather_tokens(res.selected_logp.detach(), contract, cp_group)
        out[(tp, cp)] = {"rows": rows, "cols": (contract.vocab_start, contract.vocab_end),
                         "logp": res.selected_logp.detach(), "lse": res.lse.detach(), "entropy": res.entropy.detach(),
                         "grad": grad, "gathered": gathered}
    # DTensor logits sharded on the vocabulary over the four ranks, a per-row temperature
    mesh = init_device_mesh("cpu", (4,))
    quarter = PADDED // 4
    shard = x[:, rank * quarter:(rank + 1) * quarter].clone().requires_grad_(True)
    dt = selected_logprob(DTensor.from_local(shard, mesh, [Shard(1)]), targets, active, num_vocab_tiles=TILES,
                          real_vocab_size=REAL, compute_entropy=True, temperature=temps)
    (dgrad,) = torch.autograd.grad((dt.selected_logp, dt.lse, dt.entropy), shard, w)
    out["dtensor"] = {"logp": dt.selected_logp.detach(), "lse": dt.lse.detach(), "entropy": dt.entropy.detach(),
                      "grad": dgrad}
    # the fused head under TP=4 (group=): each rank's quarter of the lm_head, a temperature per token
    hidden, weight, hids, htemps = case["head"]
    rows_w = weight.shape[0] // 4
    hh = hidden.clone().requires_grad_(True)
    head = selected_logprob_from_hidden(hh, weight[rank * rows_w:(rank + 1) * rows_w], hids, num_vocab_tiles=TILES,
                                        compute_entropy=True, temperature=htemps, chunk_tokens=3,
                                        group=dist.group.WORLD)
    (head.selected_logp.sum() + 0.5 * head.entropy.sum()).backward()
    out["head"] = [tensor_bytes(v) for v in (head.selected_logp, head.entropy, hh.grad)]
    # refusals on every rank of the group before any numerical collective
    refused: dict[str, str | None] = {}
    for name, bad in (("nan", lambda t: t.index_fill(0, torch.tensor([5]), float("nan")) if rank == 3 else t),
                      ("disagree", lambda t: t.index_fill(0, torch.tensor([2]), 0.5) if rank == 1 else t)):
        try:
            selected_logprob(DTensor.from_local(shard.detach(), mesh, [Shard(1)]), targets, active,
                             num_vocab_tiles=TILES, real_vocab_size=REAL, temperature=bad(temps))
            refused[name] = None
        except LogprobContractError as exc:
            refused[name] = str(exc)
    out["refused"] = refused
    return out


def _one_rank(case: dict[str, Any]) -> dict[str, bytes]:
    leaf = case["x"].clone().requires_grad_(True)
    res = VocabParallelLogprob()(leaf, case["targets"], case["active"], _contract("bf16", REAL, PADDED, TILES, 8),
                                 compute_entropy=True, temperature=case["temps"])
    (grad,) = torch.autograd.grad((res.selected_logp, res.lse, res.entropy), leaf, case["w"])
    return {"logp": tensor_bytes(res.selected_logp), "lse": tensor_bytes(res.lse),
            "entropy": tensor_bytes(res.entropy), "grad": tensor_bytes(grad)}


@pytest.mark.slow
def test_a_temperature_per_row_gives_the_one_rank_bytes_at_every_tp_and_cp_degree() -> None:
    case = _case()
    want = _one_rank(case)
    assert want == _numpy(case["x"], "bf16", case["targets"], case["active"], REAL, TILES, case["temps"].numpy())
    results = run_workers(_rank_worker, 4, case, timeout_s=300)
    for topology in TOPOLOGIES:
        got = {n: torch.full((8,), 7.0) for n in ("logp", "lse", "entropy")}
        grad = torch.zeros(8, PADDED, dtype=torch.bfloat16)
        for res in results:
            part = res[topology]
            for n in got:
                got[n][part["rows"]] = part[n]
            start, end = part["cols"]
            grad[part["rows"], start:end] = part["grad"]
            assert tensor_bytes(part["gathered"]) == want["logp"], topology  # gather_tokens: global order
        mine = {**{n: tensor_bytes(t) for n, t in got.items()}, "grad": tensor_bytes(grad)}
        assert {k: mine[k] == want[k] for k in OUTPUTS} == dict.fromkeys(OUTPUTS, True), topology
    dgrad = torch.cat([res["dtensor"]["grad"] for res in results], dim=1)
    for res in results:
        assert [tensor_bytes(res["dtensor"][n]) for n in ("logp", "lse", "entropy")] == \
            [want["logp"], want["lse"], want["entropy"]]
        assert "temperature[5]=nan" in (res["refused"]["nan"] or ""), res["refused"]
        assert "row_temperature" in (res["refused"]["disagree"] or ""), res["refused"]
    assert tensor_bytes(dgrad) == want["grad"]
    hidden, weight, hids, htemps = case["head"]
    hh = hidden.clone().requires_grad_(True)
    head = selected_logprob_from_hidden(hh, weight, hids, num_vocab_tiles=TILES, compute_entropy=True,
                                        temperature=htemps, chunk_tokens=3)
    (head.selected_logp.sum() + 0.5 * head.entropy.sum()).backward()
    one_rank = [tensor_bytes(v) for v in (head.selected_logp, head.entropy, hh.grad)]
    assert [res["head"][:2] for res in results] == [one_rank[:2]] * 4
    hidden_grads = [res["head"][2] for res in results]
    assert hidden_grads == [hidden_grads[0]] * 4  # all-reduced: the same on every rank


def test_the_documented_block_of_docs_trainer_md_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    run_trainer_block("<!-- run by tests/test_row_temperature.py -->")
    assert "torch.Size([2, 3]) torch.bfloat16" in capsys.readouterr().out
