"""The temperature in the arithmetic (docs/arithmetic.md section 6 step 0, section 7 step 2).

``T`` is rounded once to binary32 (``T32``), every logit becomes ``RN32(f32(X) / T32)`` (the IEEE
division, as vLLM's sampler divides) and the gradient is divided by ``T32`` before its one
rounding, as autograd's chain rule of that division computes it. Every implementation (NumPy,
eager, fused C, Triton under its interpreter) gives the same bytes at a temperature other than 1,
at every TP degree; ``T = 1`` gives exactly the bytes without a temperature; the result is, byte for
byte, ``selected_logprob(X.float() / T32)`` at no temperature, and the gradient autograd's through
that division (so the division is what is applied, and not the multiply by ``RN32(1/T32)``); the
Triton kernels' guarded fast path gives the same bytes on the inputs that take each of its
branches; and a temperature is refused where it cannot be represented.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch
from _doc_blocks import run_trainer_block

from rl_engine.arith import spec_numpy
from rl_engine.arith.temperature import TemperatureError, inverse_temperature, rn32, temperature32
from rl_engine.distributed.mesh import init_mesh
from rl_engine.logprob.api import selected_logprob
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.backends.fused_cpu.fused_cpu import FusedCpuLogprob, kernel_unavailable
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.tables import TRITON_MODE_ENV
from rl_engine.tensorio import tensor_bytes

from _byte_cases import _contract, _inputs, _run, tp4_and_tp2cp2_contracts
from _multiproc import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

NUMPY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
OUTPUTS = ("logp", "lse", "entropy", "grad")


def test_the_divisor_is_the_temperature_rounded_once_to_binary32() -> None:
    assert temperature32(1.0) == 1.0 and temperature32(1) == 1.0
    assert temperature32(0.7) == float(np.float32(0.7)) == rn32(0.7) != 0.7
    assert temperature32(1 + 1e-9) == 1.0  # rounds to 1: no temperature
    # r, the Triton kernels' reciprocal for Markstein's division (not a step of the specification)
    assert inverse_temperature(0.5) == 2.0 and inverse_temperature(2.0) == 0.5
    assert inverse_temperature(0.7) == float(np.float32(1.0) / np.float32(0.7)) == rn32(1.0 / rn32(0.7))
    assert inverse_temperature(1.1) != rn32(1.0 / 1.1)  # T is rounded to binary32 first, then divided
    contract = _contract("bf16", 10, 16, 4, 2, temperature=0.7)
    assert contract.temperature32 == rn32(0.7) and contract.tempered
    assert not _contract("bf16", 10, 16, 4, 2, temperature=1 + 1e-9).tempered
    below_one = float(np.nextafter(np.float32(1), np.float32(0)))  # the binary32 next to 1 is a temperature
    assert _contract("bf16", 10, 16, 4, 2, temperature=below_one).tempered and inverse_temperature(below_one) != 1.0
    for bad in (0.0, -0.7, float("nan"), float("inf"), 1e-30, 1e30, True, "0.7", None):
        with pytest.raises(TemperatureError, match="temperature"):
            temperature32(bad)
        with pytest.raises(TemperatureError, match="temperature"):
            inverse_temperature(bad)
    with pytest.raises(LogprobContractError, match="temperature=0"):
        _contract("bf16", 10, 16, 4, 2, temperature=0)


def _numpy(x: torch.Tensor, dtype: str, targets: torch.Tensor, active: torch.Tensor, real: int, tiles: int,
           temperature: float, w_logp: torch.Tensor, w_lse: torch.Tensor) -> dict[str, bytes]:
    arr = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else x.numpy()
    logp, lse, ent = spec_numpy.forward(arr, NUMPY_DTYPES[dtype], targets.numpy(), active.numpy(), real, tiles,
                                        True, temperature=temperature)
    grad = spec_numpy.backward(arr, NUMPY_DTYPES[dtype], targets.numpy(), active.numpy(), lse, w_logp.numpy(),
                               w_lse.numpy(), real, tiles, temperature=temperature)
    return {"logp": logp.tobytes(), "lse": lse.tobytes(), "entropy": ent.tobytes(), "grad": grad.tobytes()}


def _weights(active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The upstream gradients ``_byte_cases._run`` uses with ``lse_grad=True``."""
    g = torch.Generator().manual_seed(99)
    w_logp = torch.randn(active.shape[0], generator=g)
    w_lse = torch.randn(active.shape[0], generator=g)
    w_lse[::4] = 0.0
    w_lse[active] = torch.where(w_lse[active] == 0.0, w_logp[active], w_lse[active])
    return w_logp, w_lse


def _engines() -> dict[str, VocabParallelLogprob]:
    found = {"eager": VocabParallelLogprob()}
    if kernel_unavailable() is None:
        found["fused"] = FusedCpuLogprob()
    try:
        from rl_engine.logprob.backends.triton.triton_backend import TritonLogprob

        found["triton"] = TritonLogprob(mode="interpreter")
    except ImportError:
        pass
    return found


@pytest.mark.parametrize("temperature", [0.7, 1.3, 0.25])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_implementation_gives_the_numpy_bytes_at_a_temperature(dtype: str, temperature: float) -> None:
    real, padded, tiles, rows = 997, 1001, 7, 6
    x, targets, active = _inputs(dtype, real, padded, rows, seed=5)
    contract = _contract(dtype, real, padded, tiles, rows, temperature=temperature)
    want = _numpy(x, dtype, targets, active, real, tiles, temperature, *_weights(active))
    engines = _engines()
    assert {"eager", "fused"} <= set(engines)  # the CPU's two are always here (the kernel is built)
    assert ("triton" in engines) == (importlib.util.find_spec("triton") is not None)
    for name, op in engines.items():
        got = _run(op, x, targets, active, contract, lse_grad=True)
        assert {k: got[k] == want[k] for k in OUTPUTS} == dict.fromkeys(OUTPUTS, True), (name, dtype, temperature)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_temperature_one_is_exactly_the_bytes_without_one_and_another_is_not(dtype: str) -> None:
    real, padded, tiles, rows = 1000, 1024, 8, 7
    x, targets, active = _inputs(dtype, real, padded, rows, seed=11)
    plain = _run(VocabParallelLogprob(), x, targets, active, _contract(dtype, real, padded, tiles, rows), True)
    one = _run(VocabParallelLogprob(), x, targets, active,
               _contract(dtype, real, padded, tiles, rows, temperature=1.0), True)
    warm = _run(VocabParallelLogprob(), x, targets, active,
                _contract(dtype, real, padded, tiles, rows, temperature=0.7), True)
    assert one == plain
    assert all(warm[k] != plain[k] for k in OUTPUTS)  # negative control: the step is applied


ENGINE_NAMES = ("eager", "fused", "triton")


def _call(engine: str, x: torch.Tensor, targets: torch.Tensor, temperature: float) -> tuple[dict[str, bytes], torch.Tensor]:
    """``selected_logprob`` of ``x`` (one rank) on ``engine``: its outputs' bytes and the gradient of
    ``logp . w + lse . v`` (fixed weights) to ``x``."""
    if engine == "triton":
        pytest.importorskip("triton")
    backend = {"eager": "pytorch-vocab-parallel-logp-ws2", "fused": "cpu-vocab-parallel-logp-ws2",
               "triton": "triton-vocab-parallel-logp-ws2"}[engine]
    leaf = x.detach().clone().requires_grad_(True)
    out = selected_logprob(leaf, targets, num_vocab_tiles=4, temperature=temperature, compute_entropy=True,
                           backend=backend)
    g = torch.Generator().manual_seed(4)
    w, v = torch.randn(targets.shape, generator=g), torch.randn(targets.shape, generator=g)
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse), leaf, (w, v))
    return {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
            "entropy": tensor_bytes(out.entropy)}, grad


@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_a_temperature_is_the_division_of_the_upcast_logits_gradient_included(
        dtype: str, engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``selected_logprob(x, temperature=T)`` gives the bytes of ``selected_logprob(x.float() / T32)``
    (logp, LSE, entropy), and its gradient to ``x`` is autograd's through ``x.float() / T32`` (the
    ``DivBackward`` of a binary32 division on the CPU, then ``.float()``'s backward, the rounding to
    ``x``'s dtype). Negative control: the logits multiplied by ``RN32(1/T32)`` give other bytes."""
    monkeypatch.setenv(TRITON_MODE_ENV, "interpreter")  # the Triton backend on CPU tensors
    g = torch.Generator().manual_seed(13)
    x = (torch.randn(6, 256, generator=g) * 3).to({"bf16": torch.bfloat16, "fp16": torch.float16,
                                                  "fp32": torch.float32}[dtype])
    targets = torch.randint(0, 256, (6,), generator=g)
    for temperature in (0.7, 1.3, 0.3):
        t32 = torch.tensor(temperature32(temperature), dtype=torch.float32)
        ours, grad = _call(engine, x, targets, temperature)
        leaf = x.detach().clone().requires_grad_(True)
        divided = leaf.float() / t32  # autograd's division (DivBackward0) and .float() (ToCopyBackward0)
        theirs, _ = _call(engine, divided.detach(), targets, 1.0)
        assert ours == theirs, (engine, dtype, temperature)
        out = selected_logprob(divided, targets, num_vocab_tiles=4, compute_entropy=True,
                               backend="pytorch-vocab-parallel-logp-ws2")
        gg = torch.Generator().manual_seed(4)
        w, v = torch.randn(targets.shape, generator=gg), torch.randn(targets.shape, generator=gg)
        (autograd,) = torch.autograd.grad((out.selected_logp, out.lse), leaf, (w, v))
        assert grad.dtype == autograd.dtype == x.dtype
        assert tensor_bytes(grad) == tensor_bytes(autograd), (engine, dtype, temperature)
        # negative control: the multiply by RN32(1/T32) (this arithmetic before, and PyTorch's CUDA x / T)
        scaled, _ = _call(engine, (x.float() * inverse_temperature(temperature)).detach(), targets, 1.0)
        assert scaled != ours, (engine, dtype, temperature)


EDGE_REAL = 300  # :func:`_edge_inputs`' real columns, unless a test asks for others


def _edge_inputs(dtype: str, real: int = EDGE_REAL, padded: int = 320, overflow: slice = slice(50, 60)
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows that take each branch of the Triton kernels' choice between Markstein's sequence and
    the IEEE division (docs/arithmetic.md, "Dividing by T32 on a GPU"), and the upstream gradients:
    0: real -inf logits among ordinary ones; 1: logits below the division's domain and a tiny
    maximum (the tile's shift is below the guard's bound); 2, 4, 6: ordinary rows (the fast path);
    3: logits whose quotient overflows to -inf at T = 0.25; 5: an ordinary row whose gradient is
    scaled to tiny values (below the domain: subnormal quotients); 7: a row whose gradient is scaled
    up to overflow at T = 0.25. Rows 0, 1, 3 are inactive (validation refuses non-finite logits
    there only). ``overflow``: row 3's columns."""
    rows = 8
    g = torch.Generator().manual_seed(17)
    x = torch.randn(rows, padded, generator=g) * 3
    x[:, real:] = 100.0
    x[0, 10:40] = float("-inf")
    tiny = torch.from_numpy(((np.arange(real, dtype=np.uint32) * 9973 % 0x01000000) | 0x00400000).view(np.float32))
    x[1, :real] = torch.where(torch.arange(real) % 2 == 0, tiny, -tiny)  # |x| < 2**-125: below the domain
    x[3, overflow] = -3.0e38  # / 0.25: -inf
    x = x.to(DTYPES_TORCH[dtype])
    targets = torch.randint(0, real, (rows,), generator=g)
    active = torch.ones(rows, dtype=torch.bool)
    active[[0, 1, 3]] = False
    w_logp, w_lse = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
    w_lse[5], w_logp[5] = 3e-37, 1e-38  # coef * p below the domain, quotients subnormal
    w_lse[7], w_logp[7] = 3e38, -3e38  # coef * p / 0.25 overflows
    return x, targets, active, w_logp, w_lse


DTYPES_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _edge_run(op: VocabParallelLogprob, x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor,
              w_logp: torch.Tensor, w_lse: torch.Tensor, contract: Any) -> dict[str, bytes]:
    leaf = x.clone().requires_grad_(True)
    out = op(leaf, targets, active, contract, compute_entropy=True)
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse), leaf, (w_logp, w_lse))
    return {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
            "entropy": tensor_bytes(out.entropy), "grad": tensor_bytes(grad)}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_triton_kernels_guard_takes_the_ieee_division_where_markstein_is_not_exact(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every implementation gives NumPy's bytes on rows built to take each branch of the Triton
    kernels' guard (:func:`_edge_inputs`). Controls on the Triton kernels (interpreter): with the
    guard forced on everywhere (the IEEE division for every tile and block) the bytes are the same;
    with it off (Markstein's sequence everywhere) they differ, in the forward and in the gradient;
    and with the reciprocal perturbed (``r * (1 + 2**-5)``: the sequence's steps no longer reach the
    quotient) they differ too, so the ordinary rows do run the sequence."""
    pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton import triton_backend

    temperature, tiles = 0.25, 4
    x, targets, active, w_logp, w_lse = _edge_inputs(dtype)
    contract = _contract(dtype, 300, 320, tiles, 8, temperature=temperature)
    want = _numpy(x, dtype, targets, active, EDGE_REAL, tiles, temperature, w_logp, w_lse)
    for name, op in _engines().items():
        assert _edge_run(op, x, targets, active, w_logp, w_lse, contract) == want, name
    triton = _engines()["triton"]
    real_args = triton_backend.division_args
    t32, r = temperature32(temperature), inverse_temperature(temperature)
    monkeypatch.setattr(triton_backend, "division_args", lambda t: (t32, r, 0.0, 2**40, float("inf")))
    assert _edge_run(triton, x, targets, active, w_logp, w_lse, contract) == want  # IEEE everywhere
    # the forward's split quotient is exact at T = 0.25 (a power of two) even outside the domain: the
    # controls below are of Markstein's sequence, so the forward divides with it here
    monkeypatch.setattr(triton_backend, "split_args", lambda *args, **kwargs: None)
    monkeypatch.setattr(triton_backend, "division_args", lambda t: (t32, r, float("inf"), 0, 0.0))
    off = _edge_run(triton, x, targets, active, w_logp, w_lse, contract)
    assert off["lse"] != want["lse"] and off["grad"] != want["grad"], {k: off[k] == want[k] for k in off}
    nudged = float(np.float32(r) * np.float32(1 + 2.0 ** -5))
    monkeypatch.setattr(triton_backend, "division_args", lambda t: (*real_args(t)[:1], nudged, *real_args(t)[2:]))
    assert _edge_run(triton, x, targets, active, w_logp, w_lse, contract)["lse"] != want["lse"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_triton_backward_guard_of_a_whole_block_is_the_block_s_whole_test(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole backward block (2,048 columns: each thread's own columns reduced first, then one flag
    a thread) takes the IEEE division exactly where the block's maximum and minimum say: NumPy's bytes
    on :func:`_edge_inputs`' rows 2,300 columns wide (a whole block and the last one), row 3's overflow
    in one column of a thread's second 16-byte load (1,531). Control: with the guard off (Markstein's
    sequence everywhere) the bf16 and fp32 gradients differ, so these rows do need the block's branch."""
    pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton import triton_backend

    temperature, tiles, real, padded = 0.25, 4, 2300, 2304
    assert triton_backend.BACKWARD_BLOCK == 2048 and triton_backend.BACKWARD_WARPS * 32 == \
        triton_backend.load_kernels("compiled").THREADS.value
    x, targets, active, w_logp, w_lse = _edge_inputs(dtype, real, padded, slice(1531, 1532))
    contract = _contract(dtype, real, padded, tiles, 8, temperature=temperature)
    want = _numpy(x, dtype, targets, active, real, tiles, temperature, w_logp, w_lse)
    triton = _engines()["triton"]
    assert _edge_run(triton, x, targets, active, w_logp, w_lse, contract) == want
    t32, r = temperature32(temperature), inverse_temperature(temperature)
    monkeypatch.setattr(triton_backend, "split_args", lambda *args, **kwargs: None)
    monkeypatch.setattr(triton_backend, "division_args", lambda t: (t32, r, float("inf"), 0, 0.0))
    off = _edge_run(triton, x, targets, active, w_logp, w_lse, contract)["grad"]
    # binary16's one rounding hides the control: Markstein's wrong quotients there are binary32
    # subnormals (rounded to 0) or overflows (infinity) either way
    assert (off != want["grad"]) == (dtype != "fp16")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_triton_kernels_split_quotient_gives_numpys_bytes_and_is_what_runs(
        dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At ``T = 0.7`` the forward and the backward divide the logits with the split quotient
    ``fma(x, r_lo, x * r_hi)`` (``split_args``: the temperature passes the check on every
    significand) and every branch of the guard (:func:`_edge_inputs`'s rows) gives NumPy's bytes,
    gradient included. Controls: the launches say ``SPLIT``; with ``r_lo`` nudged by ``2**-4`` of
    itself the LSE's and the gradient's bytes change (the ordinary rows run the split quotient); with
    the split refused (``None``: Markstein's step) the bytes are the same."""
    pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton import triton_backend

    temperature, tiles = 0.7, 4
    x, targets, active, w_logp, w_lse = _edge_inputs(dtype)
    contract = _contract(dtype, 300, 320, tiles, 8, temperature=temperature)
    want = _numpy(x, dtype, targets, active, EDGE_REAL, tiles, temperature, w_logp, w_lse)
    triton = _engines()["triton"]
    torch_dtype = DTYPES_TORCH[dtype]
    t32 = temperature32(temperature)
    real_split = triton_backend.split_args

    def launched() -> list[bool]:
        buffers = (torch.empty(8, tiles),) * 4
        terms = triton_backend.empty_terms(8, x.device, 300, t32, False)
        return [triton_backend.forward_launch(x, contract, *buffers, True, True, torch_dtype).meta["SPLIT"]] + [
            launch.meta["SPLIT"] for launch in triton_backend.backward_launches(x, torch.empty(8), terms, x, torch_dtype)
            if launch.kernel == "backward_kernel"]

    assert real_split(t32, torch_dtype) is not None
    assert launched() == [True, True]  # the forward's partials, the backward's one (last) block of 320 columns
    assert _edge_run(triton, x, targets, active, w_logp, w_lse, contract) == want
    monkeypatch.setattr(triton_backend, "split_args", lambda *args, **kwargs: (
        real_split(*args, **kwargs)[0], real_split(*args, **kwargs)[1] * (1 + 2.0 ** -4)))
    nudged = _edge_run(triton, x, targets, active, w_logp, w_lse, contract)
    assert nudged["lse"] != want["lse"] and nudged["grad"] != want["grad"]
    monkeypatch.setattr(triton_backend, "split_args", lambda *args, **kwargs: None)
    assert launched() == [False, False]
    assert _edge_run(triton, x, targets, active, w_logp, w_lse, contract) == want


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("temperature", [0.25, 0.7])
def test_a_tile_without_a_finite_logit_under_the_split_quotient(temperature: float, dtype: str) -> None:
    """bf16 and binary16 with the split quotient divide each tile's maximum by it too; a tile without
    a real column (the last of 4 tiles of 80 when the real vocabulary is 230: maximum ``-inf``,
    minimum ``+inf``, not exotic) keeps ``-inf`` (at ``T = 0.25``, ``r_lo = 0`` and ``-inf * r_lo`` is
    NaN), and so does a tile of real ``-inf`` logits (row 0's second: exotic): NumPy's bytes, gradient
    included, on :func:`_edge_inputs`' rows (``r_lo`` as said: ``0`` at 0.25, non-zero at 0.7)."""
    pytest.importorskip("triton")
    from rl_engine.logprob.backends.triton import triton_backend

    tiles, real = 4, 230
    x, targets, active, w_logp, w_lse = _edge_inputs(dtype)
    x[0, 80:160] = float("-inf")
    targets = targets % real
    contract = _contract(dtype, real, 320, tiles, 8, temperature=temperature)
    r_lo = triton_backend.split_args(temperature32(temperature), DTYPES_TORCH[dtype])[1]
    assert (r_lo == 0.0) == (temperature == 0.25)
    want = _numpy(x, dtype, targets, active, real, tiles, temperature, w_logp, w_lse)
    assert _edge_run(_engines()["triton"], x, targets, active, w_logp, w_lse, contract) == want


def _tp_worker(rank: int, case: dict) -> dict:
    """Rank ``rank`` of TP=4 (and of TP=2 x CP=2, zigzag): its outputs and gradient at ``T = 0.7``."""
    init_mesh(tp=4, cp=1, timeout_s=60)
    x, targets, active = case["x"], case["targets"], case["active"]
    out = {}
    for tp, cp, group, contract in tp4_and_tp2cp2_contracts(rank, case["real"], case["padded"], case["tiles"], 0.7):
        rows = torch.tensor(contract.token_indices, dtype=torch.int64)
        local = x[rows, contract.vocab_start:contract.vocab_end].contiguous().requires_grad_(True)
        res = VocabParallelLogprob()(local, targets[rows], active[rows], contract, group=group, compute_entropy=True)
        (grad,) = torch.autograd.grad((res.selected_logp, res.lse), local,
                                      (case["w_logp"][rows], case["w_lse"][rows]))
        out[(tp, cp)] = {"rows": rows, "cols": (contract.vocab_start, contract.vocab_end),
                         "logp": res.selected_logp.detach(), "lse": res.lse.detach(), "entropy": res.entropy,
                         "grad": grad}
    return out


def test_a_temperature_gives_the_same_bytes_at_every_tp_and_cp_degree() -> None:
    real, padded, tiles = 1000, 1024, 8
    x, targets, active = _inputs("bf16", real, padded, 8, seed=21)
    w_logp, w_lse = _weights(active)
    case = {"x": x, "targets": targets, "active": active, "real": real, "padded": padded, "tiles": tiles,
            "w_logp": w_logp, "w_lse": w_lse}
    want = _numpy(x, "bf16", targets, active, real, tiles, 0.7, w_logp, w_lse)
    results = run_workers(_tp_worker, 4, case, timeout_s=240)
    for topology in ((4, 1), (2, 2)):
        got = {n: torch.full((8,), 7.0) for n in ("logp", "lse", "entropy")}
        grad = torch.zeros(8, padded, dtype=torch.bfloat16)
        for res in results:
            part = res[topology]
            for n in got:
                got[n][part["rows"]] = part[n]
            start, end = part["cols"]
            grad[part["rows"], start:end] = part["grad"]
        mine = {**{n: tensor_bytes(t) for n, t in got.items()}, "grad": tensor_bytes(grad)}
        assert {k: mine[k] == want[k] for k in OUTPUTS} == dict.fromkeys(OUTPUTS, True), topology


def test_the_documented_block_of_docs_trainer_md_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    run_trainer_block("<!-- run by tests/test_temperature.py -->")
    assert "torch.Size([4]) torch.Size([4]) torch.bfloat16" in capsys.readouterr().out
