"""The temperature in the arithmetic (docs/arithmetic.md section 6 step 0, section 7 step 2).

``T`` is rounded once to binary32, ``r = RN32(1 / T32)``, every logit becomes ``RN32(f32(X) * r)``
and the gradient is multiplied by ``r`` before its one rounding. Every implementation (NumPy,
eager, fused C, Triton under its interpreter) gives the same bytes at a temperature other than 1,
at every TP degree; ``T = 1`` gives exactly the bytes without a temperature; the result is the
logprob of the logits scaled by ``r`` (so the scaling is really applied), and it is refused where
it cannot be represented.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from rl_engine import spec_numpy
from rl_engine.distributed.mesh import init_mesh
from rl_engine.logprob.api import selected_logprob
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.fused_cpu import FusedCpuLogprob, kernel_unavailable
from rl_engine.logprob.vocab_parallel import VocabParallelLogprob
from rl_engine.temperature import TemperatureError, inverse_temperature, rn32
from rl_engine.tensorio import tensor_bytes

from _byte_cases import _contract, _inputs, _run, tp4_and_tp2cp2_contracts
from _multiproc import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

NUMPY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
OUTPUTS = ("logp", "lse", "entropy", "grad")


def test_the_reciprocal_is_one_binary32_division_of_the_rounded_temperature() -> None:
    assert inverse_temperature(1.0) == 1.0 and inverse_temperature(1) == 1.0
    assert inverse_temperature(0.5) == 2.0 and inverse_temperature(2.0) == 0.5
    t32 = np.float32(0.7)
    assert inverse_temperature(0.7) == float(np.float32(1.0) / t32) == rn32(1.0 / rn32(0.7))
    assert inverse_temperature(1.1) != rn32(1.0 / 1.1)  # T is rounded to binary32 first, then divided
    for bad in (0.0, -0.7, float("nan"), float("inf"), 1e-30, 1e30, True, "0.7", None):
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
        from rl_engine.logprob.triton_backend import TritonLogprob

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


def test_the_result_is_the_logprob_of_the_scaled_logits() -> None:
    """At ``T = 0.5`` (``r = 2``, exact in every dtype) the bytes equal the call without a
    temperature on logits doubled beforehand (fp32: the doubling is exact), gradient included
    after the chain rule's factor 2 (also exact)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g) * 2
    targets = torch.randint(0, 64, (4,), generator=g)
    warm_x = x.clone().requires_grad_(True)
    warm = selected_logprob(warm_x, targets, num_vocab_tiles=4, temperature=0.5, compute_entropy=True)
    warm.selected_logp.sum().backward()
    doubled = (x * 2).requires_grad_(True)
    plain = selected_logprob(doubled, targets, num_vocab_tiles=4, compute_entropy=True)
    plain.selected_logp.sum().backward()
    for a, b in ((warm.selected_logp, plain.selected_logp), (warm.lse, plain.lse), (warm.entropy, plain.entropy)):
        assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes()
    assert warm_x.grad.numpy().tobytes() == (doubled.grad * 2).numpy().tobytes()
    assert warm.provenance is not None


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
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "trainer.md").read_text(encoding="utf-8")
    mark = "<!-- run by tests/test_temperature.py -->"
    assert text.count(mark) == 1
    block = re.search(re.escape(mark) + r"\n```python\n(.*?)^```", text, re.S | re.M)
    assert block is not None
    exec(compile(block.group(1), "docs/trainer.md", "exec"), {"__name__": "__main__"})
    assert "torch.Size([4]) torch.Size([4]) torch.bfloat16" in capsys.readouterr().out
