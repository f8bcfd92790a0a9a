"""The entropy's gradient (docs/arithmetic.md section 7 step 1): ``(g_ent * p) * (Mb - x)`` where
``g_ent != 0`` and ``p != 0``, ``Mb = LSE - H``.

``entropy.sum().backward()`` raised "does not require grad": TRL's ``entropy_coef`` and verl's
``entropy_coeff`` need it. The gradient of ``a * logp + b * entropy (+ c * lse)`` comes in one
backward pass; every implementation (NumPy, eager, fused C, Triton under its interpreter) gives
the same bytes, at every TP and CP degree, with a temperature too; it is the derivative (against
float64 autograd); and a loss without the entropy keeps the bytes it had.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
import torch

from rl_engine.arith import spec_numpy
from rl_engine.distributed.mesh import init_mesh
from rl_engine.logprob.api import selected_logprob
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.backends.fused_cpu.fused_cpu import FusedCpuLogprob, kernel_unavailable
from rl_engine.logprob.contract import LogprobContract
from rl_engine.logprob.hidden import selected_logprob_from_hidden
from rl_engine.tensorio import tensor_bytes

from _byte_cases import _contract, _inputs, tp4_and_tp2cp2_contracts
from _multiproc import run_workers

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

NUMPY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _weights(active: torch.Tensor) -> dict[str, torch.Tensor]:
    """Upstream gradients with rows of every kind: coef == 0 with and without an entropy term,
    g_ent == 0 with coef != 0, and rows with all three."""
    g = torch.Generator().manual_seed(7)
    rows = active.shape[0]
    w = {"logp": torch.randn(rows, generator=g), "lse": torch.randn(rows, generator=g),
         "entropy": torch.randn(rows, generator=g)}
    w["lse"][::3] = 0.0
    w["lse"][active] = torch.where(w["lse"][active] == 0.0, w["logp"][active], w["lse"][active])  # coef == 0
    w["entropy"][1::4] = 0.0  # no entropy term on these rows
    return w


def _run(op: Any, x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, contract: LogprobContract,
         w: dict[str, torch.Tensor]) -> dict[str, bytes]:
    xx = x.clone().requires_grad_(True)
    out = op(xx, targets, active, contract, compute_entropy=True)
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse, out.entropy), xx, (w["logp"], w["lse"], w["entropy"]))
    return {"logp": tensor_bytes(out.selected_logp), "lse": tensor_bytes(out.lse),
            "entropy": tensor_bytes(out.entropy), "grad": tensor_bytes(grad)}


def _numpy(x: torch.Tensor, dtype: str, targets: torch.Tensor, active: torch.Tensor, real: int, tiles: int,
           w: dict[str, torch.Tensor], temperature: float) -> dict[str, bytes]:
    arr = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else x.numpy()
    t, a = targets.numpy(), active.numpy()
    logp, lse, ent = spec_numpy.forward(arr, NUMPY_DTYPES[dtype], t, a, real, tiles, True, temperature=temperature)
    grad = spec_numpy.backward(arr, NUMPY_DTYPES[dtype], t, a, lse, w["logp"].numpy(), w["lse"].numpy(), real, tiles,
                               temperature=temperature, grad_entropy=w["entropy"].numpy(), entropy=ent)
    return {"logp": logp.tobytes(), "lse": lse.tobytes(), "entropy": ent.tobytes(), "grad": grad.tobytes()}


def _engines() -> dict[str, Any]:
    found: dict[str, Any] = {"eager": VocabParallelLogprob()}
    if kernel_unavailable() is None:
        found["fused"] = FusedCpuLogprob()
    if importlib.util.find_spec("triton") is not None:
        from rl_engine.logprob.backends.triton.triton_backend import TritonLogprob

        found["triton"] = TritonLogprob(mode="interpreter")
    return found


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_implementation_gives_the_numpy_bytes(dtype: str, temperature: float) -> None:
    real, padded, tiles, rows = 997, 1001, 7, 9
    x, targets, active = _inputs(dtype, real, padded, rows, seed=13)  # -inf, NaN, subnormal rows among them
    w = _weights(active)
    contract = _contract(dtype, real, padded, tiles, rows, temperature=temperature)
    want = _numpy(x, dtype, targets, active, real, tiles, w, temperature)
    engines = _engines()
    assert "fused" in engines
    for name, op in engines.items():
        got = _run(op, x, targets, active, contract, w)
        assert {k: got[k] == want[k] for k in want} == dict.fromkeys(want, True), (name, dtype, temperature)


def test_it_is_the_derivative_of_the_entropy() -> None:
    """Against float64 autograd of ``-(p log p).sum()``: within a few binary32 ulps of the largest term."""
    g = torch.Generator().manual_seed(1)
    for temperature in (1.0, 0.7):
        x = (torch.randn(6, 512, generator=g) * 3).requires_grad_(True)
        ids = torch.randint(0, 512, (6,), generator=g)
        out = selected_logprob(x, ids, num_vocab_tiles=8, compute_entropy=True, temperature=temperature)
        (0.5 * out.selected_logp.sum() - 0.3 * out.entropy.sum()).backward()
        y = x.detach().double().requires_grad_(True)
        ls = torch.log_softmax(y / temperature, -1)
        entropy = -(ls.exp() * ls).sum(-1)
        (0.5 * ls.gather(1, ids[:, None]).sum() - 0.3 * entropy.sum()).backward()
        scale = float(y.grad.abs().max())
        assert float((x.grad.double() - y.grad).abs().max()) <= 4e-6 * scale, temperature


def test_a_loss_without_the_entropy_keeps_its_bytes() -> None:
    """The entropy unused, or used with a zero coefficient (a zero gradient on every row): the
    logits' gradient is the bytes of the call without an entropy; a nonzero coefficient changes it."""
    real, padded, tiles, rows = 1000, 1024, 8, 7
    x, targets, active = _inputs("bf16", real, padded, rows, seed=3)
    contract = _contract("bf16", real, padded, tiles, rows)

    def grad(coefficient: float | None, entropy: bool) -> bytes:
        xx = x.clone().requires_grad_(True)
        out = VocabParallelLogprob()(xx, targets, active, contract, compute_entropy=entropy)
        loss = out.selected_logp.sum() + out.lse.sum()
        if coefficient is not None:
            loss = loss + coefficient * torch.nan_to_num(out.entropy).sum()
        loss.backward()
        return tensor_bytes(xx.grad)

    plain = grad(None, False)
    assert grad(None, True) == plain and grad(0.0, True) == plain
    assert grad(0.01, True) != plain


def _tp_worker(rank: int, case: dict[str, Any]) -> dict[Any, Any]:
    init_mesh(tp=4, cp=1, timeout_s=60)
    out: dict[Any, Any] = {}
    for tp, cp, group, contract in tp4_and_tp2cp2_contracts(rank, case["real"], case["padded"], case["tiles"], case["temperature"]):
        rows = torch.tensor(contract.token_indices, dtype=torch.int64)
        local = case["x"][rows, contract.vocab_start:contract.vocab_end].contiguous().requires_grad_(True)
        res = VocabParallelLogprob()(local, case["targets"][rows], case["active"][rows], contract, group=group,
                                     compute_entropy=True)
        (grad,) = torch.autograd.grad((res.selected_logp, res.lse, res.entropy), local,
                                      tuple(case["w"][k][rows] for k in ("logp", "lse", "entropy")))
        out[(tp, cp)] = {"rows": rows, "cols": (contract.vocab_start, contract.vocab_end), "grad": grad}
    return out


def test_the_entropy_gradient_is_the_same_bytes_at_every_tp_and_cp_degree() -> None:
    real, padded, tiles = 1000, 1024, 8
    x, targets, active = _inputs("bf16", real, padded, 8, seed=17)
    w = _weights(active)
    want = _numpy(x, "bf16", targets, active, real, tiles, w, 0.7)["grad"]
    case = {"x": x, "targets": targets, "active": active, "w": w, "real": real, "padded": padded, "tiles": tiles,
            "temperature": 0.7}
    results = run_workers(_tp_worker, 4, case, timeout_s=240)
    for topology in ((4, 1), (2, 2)):
        grad = torch.zeros(8, padded, dtype=torch.bfloat16)
        for res in results:
            part = res[topology]
            start, end = part["cols"]
            grad[part["rows"], start:end] = part["grad"]
        assert tensor_bytes(grad) == want, topology


def test_the_fused_head_and_a_compiled_step_carry_the_entropy_gradient() -> None:
    """``selected_logprob_from_hidden`` (the library's product in one chunk, the weight's gradient in its
    dtype: the materialised path's bits) and a ``torch.compile(fullgraph=True)`` step give the eager
    call's gradient of logp + entropy."""
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(12, 32, generator=g).to(torch.bfloat16)
    weight = (torch.randn(256, 32, generator=g) * 0.3).to(torch.bfloat16)
    ids = torch.randint(0, 250, (12,), generator=g)

    def loss(out: Any) -> torch.Tensor:
        return -out.selected_logp.sum() - 0.01 * out.entropy.sum()

    h, wt = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss(selected_logprob(h @ wt.T, ids, real_vocab_size=250, compute_entropy=True)).backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss(selected_logprob_from_hidden(h2, w2, ids, real_vocab_size=250, compute_entropy=True, chunk_tokens=64,
                                      matmul="library", grad_weight_fp32=False)).backward()
    assert tensor_bytes(h2.grad) == tensor_bytes(h.grad) and tensor_bytes(w2.grad) == tensor_bytes(wt.grad)

    torch._dynamo.reset()
    logits = (hidden @ weight.T).detach()

    def step(x: torch.Tensor) -> torch.Tensor:
        return loss(selected_logprob(x, ids, real_vocab_size=250, compute_entropy=True))

    eager_x = logits.clone().requires_grad_(True)
    step(eager_x).backward()
    compiled_x = logits.clone().requires_grad_(True)
    torch.compile(step, fullgraph=True, backend="aot_eager")(compiled_x).backward()
    assert tensor_bytes(compiled_x.grad) == tensor_bytes(eager_x.grad)
    assert bool((eager_x.grad != 0).any())
