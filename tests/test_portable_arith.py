"""Portable bits: the candidate's bytes are those of ``docs/arithmetic.md`` on any machine.

* subprocesses run the default campaign case (and an fp16 and an fp32 variant) under
  ``ATEN_CPU_CAPABILITY=default`` and ``avx2``, and this process under its own ``avx512`` (where the
  CPU has it; else a subprocess under each capability): logp, LSE,
  entropy and gradient bytes are identical; the same harness with an ISA-dependent step (the
  old ``torch.randn`` input recipe) finds them different, and ``torch.exp``/``torch.log`` in
  place of the spec's ``E``/``L`` give other bytes (negative controls);
* the NumPy implementation (:mod:`rl_engine.arith.spec_numpy`, written from the document, no
  shared code) gives the same bytes as the torch candidate: several TP degrees, CP=2 zigzag,
  padding, bf16, fp16 and fp32; one changed polynomial coefficient, 64 lanes instead of 128,
  or a multiply then an add in place of each fma break that (negative controls);
* the aten operations the forward and backward dispatch are basic operations only;
* a thread that flushes subnormals is refused, and bypassing the refusal changes bytes;
* the inputs recipe is portable (the same bytes as the NumPy implementation's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from rl_engine.arith import portable, spec_numpy
from rl_engine.campaign.inputs import make_inputs
from rl_engine.campaign.replay import replay_candidate
from rl_engine.distributed.mesh import init_mesh
from rl_engine.logprob.backends.eager.vocab_parallel import VocabParallelLogprob
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.oracle import fp64_oracle
from rl_engine.tensorio import tensor_bytes

from _multiproc import run_workers

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CASE = {
    "dtype": "bf16", "backend": "pytorch-vocab-parallel-logp-ws2", "real_vocab": 151936,
    "padded_vocab": 152064, "num_vocab_tiles": 64, "batch": 2, "seq": 16, "prompt_tokens": 8,
    "seed": 123, "logit_scale": 1.0,
}
# fp16 with large logits: gradient values in binary16's subnormal range, NaN-free
SMALL_FP16_CASE = {**DEFAULT_CASE, "dtype": "fp16", "real_vocab": 1000, "padded_vocab": 1024,
                   "num_vocab_tiles": 8, "logit_scale": 6.0}
# fp32 logits: the gradient is not rounded, so a one-ULP exp difference anywhere shows; scale
# 4 puts many x - LSE below -16, where torch.exp's scalar and AVX2 kernels disagree
FP32_CASE = {**DEFAULT_CASE, "dtype": "fp32", "logit_scale": 4.0}

_ISA_SCRIPT = r"""
import json, sys
import torch
import rl_engine.arith.tiles as tiles
import rl_engine.campaign.inputs as recipe   # replay reads the recipe through this module
import rl_engine.campaign.replay as replay

def library_exp_into(y, out, sc):
    return torch.exp(y, out=out)

def randn_inputs(case):
    g = torch.Generator().manual_seed(int(case["seed"]))
    n = int(case["batch"]) * int(case["seq"])
    logits = torch.randn(n, int(case["padded_vocab"]), generator=g) * float(case["logit_scale"])
    targets = torch.randint(0, int(case["real_vocab"]), (n,), generator=g)
    active = (torch.arange(n) % int(case["seq"])) >= int(case["prompt_tokens"])
    return logits, targets, active

SWAPS = {  # module, attribute, replacement: each applied for its own cases, then undone
    "torch-exp": [(tiles, "exp_into", library_exp_into), (tiles, "exp", torch.exp), (tiles, "log", torch.log)],
    "randn-inputs": [(recipe, "make_inputs", randn_inputs)],
}
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for swap, cases in json.loads(sys.argv[1]):
    saved = [(m, a, getattr(m, a)) for m, a, _ in SWAPS.get(swap, [])]
    for m, a, new in SWAPS.get(swap, []):
        setattr(m, a, new)
    for name, case in cases.items():
        out[f"{swap}:{name}" if swap else name] = replay.replay_candidate(case).fingerprints()
    for m, a, old in saved:
        setattr(m, a, old)
print(json.dumps(out))
"""
ISA_CASES = {"default": DEFAULT_CASE, "fp16": SMALL_FP16_CASE, "fp32": FP32_CASE}
# the negative controls, run after the portable cases in the same interpreter (one torch import
# fewer each), on the fp32 case (the default case's vocabulary, 0.4 s a replay against 1.7 s): the
# old input recipe under the scalar and the AVX2 kernels (its bytes differ between them), and the
# library exp and log under the scalar one
CONTROLS = {"randn-inputs": ("fp32",), "torch-exp": ("fp32",)}
CONTROLLED = {"default", "avx2"}  # the capabilities some control runs under


def _run_isa(capability: str) -> dict[str, Any]:
    """The cases (keys ``default``, ``fp16``, ``fp32``) and the negative controls that apply under
    ``capability`` (keys ``<swap>:<case>``), in one interpreter."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    jobs = [("", ISA_CASES)] + [(swap, {n: ISA_CASES[n] for n in names}) for swap, names in CONTROLS.items()
                                    if capability == "default" or (swap, capability) == ("randn-inputs", "avx2")]
    done = subprocess.run([sys.executable, "-c", _ISA_SCRIPT, json.dumps(jobs)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_replay() -> Any:
    """The default case's candidate replay in this process, made once: three tests read it."""
    return replay_candidate(DEFAULT_CASE)


def _run_here(default: Any) -> dict[str, Any]:
    """The cases under this process's own capability (what torch picked here): no control runs under it."""
    return {"capability": torch.backends.cpu.get_cpu_capability(), "default": default.fingerprints(),
            **{name: replay_candidate(case).fingerprints() for name, case in ISA_CASES.items() if name != "default"}}


def _capabilities() -> list[str]:
    found = ["default", "avx2"]
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512f" in cpu and "avx512bw" in cpu and "avx512vl" in cpu and "avx512dq" in cpu:
        found.append("avx512")
    return found


@pytest.fixture(scope="module")
def isa_runs(default_replay: Any) -> dict[str, dict[str, Any]]:
    """One subprocess per capability: the portable cases and, after them, the negative controls;
    this process's own capability, when no control runs under it (AVX512 where the CPU has it), is
    run here (one torch import fewer)."""
    native = torch.backends.cpu.get_cpu_capability()
    if native == "DEFAULT":
        pytest.skip("this CPU offers no vector kernel to compare with the scalar one")
    here = native.lower() if native.lower() in set(_capabilities()) - CONTROLLED else None
    return {cap: _run_here(default_replay) if cap == here else _run_isa(cap) for cap in _capabilities()}


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_fingerprints_are_identical_under_every_cpu_capability(isa_runs: dict[str, dict[str, Any]]) -> None:
    seen = {cap: run["capability"] for cap, run in isa_runs.items()}
    assert seen["default"] == "DEFAULT" and seen["avx2"] == "AVX2", seen  # the kernels really differed
    if "avx512" in seen:
        assert seen["avx512"] == "AVX512", seen
    for case in ("default", "fp16", "fp32"):
        prints = {cap: run[case] for cap, run in isa_runs.items()}
        assert len({json.dumps(p, sort_keys=True) for p in prints.values()}) == 1, prints


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_the_cross_isa_harness_sees_an_isa_dependent_step(isa_runs: dict[str, dict[str, Any]]) -> None:
    """Negative control: with the old input recipe (``torch.randn``, whose AVX2 kernel gives
    other bytes than its scalar one) the same harness finds different fingerprints."""
    scalar, vector = isa_runs["default"]["randn-inputs:fp32"], isa_runs["avx2"]["randn-inputs:fp32"]
    assert scalar != vector
    # the recipe really was swapped: its bytes are not the portable recipe's
    assert scalar != isa_runs["default"]["fp32"]


@pytest.mark.slow  # a subprocess or torchrun end to end: in the full suite, not the quick loop
def test_the_library_exp_is_not_the_spec(isa_runs: dict[str, dict[str, Any]]) -> None:
    """Negative control: ``torch.exp``/``torch.log`` in place of ``E``/``L`` change the bytes.

    Measured on this machine (torch 2.13.0+cpu): torch's own exp and log agree between its
    scalar, AVX2 and AVX512 kernels on every input tried, so a swap does not break the cross-ISA
    equality here; it breaks the equality with the specification (and so with the NumPy
    implementation, and with any device whose exp differs: NumPy's float32 exp, a GPU's expf).
    """
    run = isa_runs["default"]
    assert run["torch-exp:fp32"]["candidate_grad_sha256"] != run["fp32"]["candidate_grad_sha256"]
    assert set(run) >= {"default", "fp16", "fp32", "randn-inputs:fp32", "torch-exp:fp32"}  # every job ran


def test_the_numpy_comparison_fails_with_the_library_exp(monkeypatch: pytest.MonkeyPatch) -> None:
    import rl_engine.arith.tiles as tiles

    monkeypatch.setattr(tiles, "exp_into", lambda y, out, sc: torch.exp(y, out=out))
    b = _batch("fp32-exact")
    mine = _torch_bytes([_torch_run(b, _contract(b))], b)
    want = _numpy_bytes(b)
    assert [n for n in want if mine[n] != want[n]] != []


def test_replay_equals_the_numpy_implementation_on_the_default_case(default_replay: Any) -> None:
    """The default campaign's TP=1 replay, recomputed by the NumPy implementation."""
    replay = default_replay
    logits, targets, active = make_inputs(DEFAULT_CASE)
    x_bits = logits.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    logp, lse, entropy = spec_numpy.forward(x_bits, "bfloat16", targets.numpy(), active.numpy(),
                                            151936, 64, True)
    grad = spec_numpy.backward(x_bits, "bfloat16", targets.numpy(), active.numpy(), lse,
                               np.ones(32, dtype=np.float32), None, 151936, 64)
    assert logp.tobytes() == tensor_bytes(replay.tensors["logp"])
    assert lse.tobytes() == tensor_bytes(replay.tensors["lse"])
    assert entropy.tobytes() == tensor_bytes(replay.tensors["entropy"])
    assert grad.tobytes() == tensor_bytes(replay.grad)


# ---- torch candidate vs NumPy implementation ------------------------------------------------
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NUMPY_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# dtype, real, padded, tiles, scale
CASES = {
    "bf16-padded": ("bf16", 1000, 1024, 8, 3.0),
    "fp16-padded": ("fp16", 2000, 2048, 16, 5.0),
    "fp32-exact": ("fp32", 768, 768, 4, 2.0),
    "bf16-odd-tiles": ("bf16", 1500, 1536, 12, 8.0),
}


def _batch(name: str) -> dict[str, Any]:
    dtype, real, padded, tiles, scale = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    rows = 2 * 8
    x32 = torch.randn(rows, padded, generator=g) * scale
    x32[3, 5] = -1e-39  # subnormal input: gradual underflow is part of the spec
    targets = torch.randint(0, real, (rows,), generator=g)
    active = torch.ones(rows, dtype=torch.bool)
    active[::5] = False
    x32[5, :] = float("-inf")  # an inactive, all -inf row: LSE -inf, entropy NaN
    active[5] = False
    w_logp = torch.randn(rows, generator=g)
    w_lse = torch.randn(rows, generator=g) * 0.5
    return {"dtype": dtype, "real": real, "padded": padded, "tiles": tiles, "rows": rows,
            "x": x32.to(DTYPES[dtype]), "targets": targets, "active": active,
            "w_logp": w_logp, "w_lse": w_lse}


def _torch_run(b: dict[str, Any], contract: LogprobContract, group: Any = None) -> dict[str, torch.Tensor]:
    rows = torch.tensor(contract.token_indices, dtype=torch.int64)
    x = b["x"][rows, contract.vocab_start:contract.vocab_end].contiguous().requires_grad_(True)
    out = VocabParallelLogprob()(x, b["targets"][rows], b["active"][rows], contract, group=group,
                                 compute_entropy=True)
    (grad,) = torch.autograd.grad((out.selected_logp, out.lse), x, (b["w_logp"][rows], b["w_lse"][rows]))
    assert out.entropy is not None
    return {"logp": out.selected_logp.detach(), "lse": out.lse.detach(), "entropy": out.entropy,
            "grad": grad, "rows": rows, "cols": torch.tensor([contract.vocab_start, contract.vocab_end])}


def _contract(b: dict[str, Any], **kw: Any) -> LogprobContract:
    return LogprobContract(real_vocab_size=b["real"], padded_vocab_size=b["padded"],
                           num_vocab_tiles=b["tiles"], num_sequences=2, seq_len=8,
                           logits_dtype=b["dtype"], **kw)


def _numpy_bytes(b: dict[str, Any], module: Any = spec_numpy) -> dict[str, bytes]:
    dtype = b["dtype"]
    x = b["x"]
    arr = x.view(torch.int16).numpy().view(np.uint16) if dtype == "bf16" else x.numpy()
    logp, lse, entropy = module.forward(arr, NUMPY_DTYPES[dtype], b["targets"].numpy(), b["active"].numpy(),
                                        b["real"], b["tiles"], True)
    grad = module.backward(arr, NUMPY_DTYPES[dtype], b["targets"].numpy(), b["active"].numpy(), lse,
                           b["w_logp"].numpy(), b["w_lse"].numpy(), b["real"], b["tiles"])
    return {"logp": logp.tobytes(), "lse": lse.tobytes(), "entropy": entropy.tobytes(), "grad": grad.tobytes()}


def _torch_bytes(parts: list[dict[str, torch.Tensor]], b: dict[str, Any]) -> dict[str, bytes]:
    """Reassemble rank outputs by token index and column; TP peers must agree byte for byte."""
    out = {n: torch.full((b["rows"],), 7.0) for n in ("logp", "lse", "entropy")}
    grad = torch.zeros(b["rows"], b["padded"], dtype=b["x"].dtype)
    for part in parts:
        rows = part["rows"]
        start, end = part["cols"].tolist()
        for n in out:
            out[n][rows] = part[n]
        grad[rows, start:end] = part["grad"]
    return {**{n: tensor_bytes(t) for n, t in out.items()}, "grad": tensor_bytes(grad)}


@pytest.mark.parametrize("name", list(CASES))
def test_numpy_implementation_gives_the_candidates_bytes_at_tp1(name: str) -> None:
    b = _batch(name)
    mine = _torch_bytes([_torch_run(b, _contract(b))], b)
    assert mine == _numpy_bytes(b)


TOPOLOGIES = ((2, 1, "contiguous"), (4, 1, "contiguous"), (2, 2, "zigzag"), (1, 2, "zigzag"))


def _topology_worker(rank: int, batches: dict[str, dict[str, Any]]) -> dict[Any, Any]:
    init_mesh(tp=4, cp=1, timeout_s=60)
    groups = {4: dist.group.WORLD, 2: [dist.new_group([0, 1]), dist.new_group([2, 3])], 1: None}
    out: dict[Any, Any] = {}
    for name, b in batches.items():
        for tp, cp, layout in TOPOLOGIES:
            cp_rank, tp_rank = divmod(rank % (tp * cp), tp)  # ranks beyond tp*cp replicate
            group = groups[tp] if tp != 2 else groups[2][rank // 2]
            contract = _contract(b, tp_world_size=tp, tp_rank=tp_rank, cp_world_size=cp, cp_rank=cp_rank,
                                 cp_layout=layout)
            out[(name, tp, cp, layout)] = _torch_run(b, contract, group)
    return out


def test_numpy_implementation_gives_the_bytes_of_every_topology() -> None:
    batches = {name: _batch(name) for name in ("bf16-padded", "fp16-padded")}
    results = run_workers(_topology_worker, 4, batches, timeout_s=240)
    mismatches = []
    for name, b in batches.items():
        want = _numpy_bytes(b)
        for tp, cp, layout in TOPOLOGIES:
            parts = [res[(name, tp, cp, layout)] for res in results[: tp * cp]]
            got = _torch_bytes(parts, b)
            mismatches += [f"{name} TP={tp} CP={cp} {layout}: {n}" for n in want if got[n] != want[n]]
    assert mismatches == []


def test_one_changed_coefficient_breaks_the_numpy_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _batch("bf16-padded")
    mine = _torch_bytes([_torch_run(b, _contract(b))], b)
    # C3 as its Taylor value 1/6 instead of the document's minimax value: a plausible slip
    monkeypatch.setattr(spec_numpy, "C3", np.float32(float.fromhex("0x1.555556p-3")))
    other = _numpy_bytes(b)
    assert [n for n in mine if mine[n] != other[n]] != []


def test_another_lane_count_or_no_fma_breaks_the_numpy_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls of the two changes /2 made: 64 lanes instead of 128, or each fma a
    multiply then an add, give other bytes than the torch candidate's."""
    b = _batch("fp32-exact")  # tiles of 192 columns: 64 lanes group them otherwise
    mine = _torch_bytes([_torch_run(b, _contract(b))], b)
    assert mine == _numpy_bytes(b)
    monkeypatch.setattr(spec_numpy, "LANES", 64)
    lanes64 = _numpy_bytes(b)
    assert mine["lse"] != lanes64["lse"] and mine["entropy"] != lanes64["entropy"]
    monkeypatch.undo()
    monkeypatch.setattr(spec_numpy, "fma32", lambda a, c, d: np.add(np.multiply(np.asarray(a, np.float32),
                                                                                  np.asarray(c, np.float32)),
                                                                      np.asarray(d, np.float32)))
    unfused = _numpy_bytes(b)
    assert [n for n in mine if mine[n] != unfused[n]] != []


def test_exp_and_log_equal_the_numpy_implementation_bit_for_bit() -> None:
    bits = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    t = torch.from_numpy(values.copy())
    e = portable.exp(t).numpy()
    want = spec_numpy.canon_nan(spec_numpy.exp32(values))
    mine = e.copy()
    mine[np.isnan(mine)] = np.float32("nan")
    assert mine.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    positive = np.abs(values[np.isfinite(values)])
    lg = portable.log(torch.from_numpy(positive.copy())).numpy()
    assert lg.tobytes() == spec_numpy.log32(positive).tobytes()


def test_inputs_recipe_equals_the_numpy_implementations() -> None:
    logits, targets, active = make_inputs(DEFAULT_CASE)
    n_logits, n_targets, n_active = spec_numpy.make_inputs(2, 16, 8, 151936, 152064, 123, 1.0)
    assert tensor_bytes(logits) == n_logits.tobytes()
    assert tensor_bytes(targets) == n_targets.tobytes()
    assert tensor_bytes(active) == n_active.tobytes()


# ---- no library transcendental or reduction on the candidate's path -------------------------
ALLOWED_OPS = {
    # elementwise basic operations (one IEEE operation per element) and comparisons
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "abs",
    "lt", "le", "gt", "ge", "eq", "ne", "logical_and", "logical_or", "logical_not",
    "bitwise_and", "bitwise_and_", "bitwise_or", "bitwise_not", "bitwise_left_shift_",
    "bitwise_right_shift", "bitwise_right_shift_", "bitwise_left_shift", "__and__", "__or__", "__invert__",
    "maximum", "minimum", "clamp", "clamp_", "amax", "amin", "aminmax", "max", "min", "isfinite", "isnan",
    "where", "masked_fill_", "nan_to_num", "fill_", "zero_", "scatter_add_", "index_fill_",
    # data movement, conversion, shape
    "copy_", "_to_copy", "to", "clone", "view", "_unsafe_view", "reshape", "slice", "select",
    "unsqueeze", "squeeze", "expand", "permute", "t", "transpose", "contiguous", "alias", "detach",
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones_like", "full", "full_like",
    "new_empty", "new_zeros", "new_full", "new_empty_strided", "lift_fresh", "scalar_tensor",
    "index", "index_put_", "gather", "cat", "stack", "split", "unbind", "as_strided", "arange",
    "nonzero", "any", "all", "searchsorted", "_local_scalar_dense", "item", "lift_fresh_copy", "set_",
    "index_select", "_index_put_impl_", "sort", "ones", "is_nonzero", "equal", "count_nonzero",
    "sum_int",  # never seen; listed so that an integer count would be flagged by name below
    "rsub", "logical_or_", "logical_and_",  # the exact fma's binary64 steps (portable.fma_into)
}
FORBIDDEN_OPS = {"exp", "exp_", "exp2", "log", "log_", "log1p", "expm1", "pow", "logsumexp", "softmax",
                 "_softmax", "log_softmax", "_log_softmax", "sum", "mean", "matmul", "mm", "bmm",
                 "cumsum", "prod", "addcmul", "addcmul_", "addcdiv", "lerp", "sigmoid", "tanh", "sqrt",
                 "rsqrt", "norm", "linalg_vector_norm", "dot", "addmm", "_softmax_backward_data"}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _record_candidate(with_entropy: bool = True) -> set[str]:
    b = _batch("bf16-padded")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # chunks inline on this thread, where the mode records them
    try:
        contract = _contract(b)
        x = b["x"].clone().requires_grad_(True)
        with _Recorder() as rec:
            out = VocabParallelLogprob()(x, b["targets"], b["active"], contract, compute_entropy=with_entropy)
            torch.autograd.grad((out.selected_logp, out.lse), x, (b["w_logp"], b["w_lse"]))
    finally:
        torch.set_num_threads(threads)
    return rec.ops


def test_forward_and_backward_dispatch_only_basic_operations() -> None:
    ops = _record_candidate()
    assert ops & FORBIDDEN_OPS == set(), sorted(ops & FORBIDDEN_OPS)
    assert ops - ALLOWED_OPS == set(), f"unreviewed aten ops on the candidate's path: {sorted(ops - ALLOWED_OPS)}"
    assert {"mul_", "add_", "bitwise_left_shift"} <= ops  # the recorder saw the chunk loop


def test_the_recorder_catches_a_library_exp(monkeypatch: pytest.MonkeyPatch) -> None:
    import rl_engine.arith.tiles as tiles

    monkeypatch.setattr(tiles, "exp_into", lambda y, out, sc: torch.exp(y, out=out))
    assert "exp" in _record_candidate() & FORBIDDEN_OPS


def test_grpo_terms_use_the_portable_exp() -> None:
    from rl_engine.grpo.contract import GRPOContract
    from rl_engine.grpo.objective import token_terms

    with _Recorder() as rec:
        logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, -4.0]], requires_grad=True)
        old = torch.tensor([[-1.1, -1.9, -0.5], [-0.3, -0.25, -3.0]])
        ref = torch.tensor([[-1.2, -2.2, -0.4], [-0.1, -0.3, -2.0]])
        active = torch.tensor([[True, True, False], [True, True, True]])
        contract = _grpo_contract(GRPOContract)
        terms = token_terms(logp, old, ref, active, torch.tensor([0.5, -0.5]), contract)
        terms.total.backward(torch.ones_like(terms.total))
    assert rec.ops & FORBIDDEN_OPS == set(), sorted(rec.ops & FORBIDDEN_OPS)
    delta = (logp - old).detach()
    assert tensor_bytes(terms.ratio[1]) == tensor_bytes(portable.exp(delta[1].contiguous()))


def _grpo_contract(cls: Any) -> Any:
    return cls.build(num_sequences=2, seq_len=3, group_size=2,
                     logprob={"real_vocab_size": 8, "padded_vocab_size": 8, "num_vocab_tiles": 1},
                     beta=0.1, kl_estimator="k3", advantage_mode="group_mean", reduction="token_mean")


# ---- subnormals: refused, and why ---------------------------------------------------------
def _tiny_gradient_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LogprobContract, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=g)
    targets = torch.tensor([1, 2, 3, 4])
    active = torch.ones(4, dtype=torch.bool)
    contract = LogprobContract(real_vocab_size=256, padded_vocab_size=256, num_vocab_tiles=4,
                               num_sequences=1, seq_len=4, logits_dtype="fp32")
    upstream = torch.full((4,), 1e-35)  # coef * p reaches binary32's subnormal range
    return x, targets, active, contract, upstream


def _grad_bytes(x: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, contract: LogprobContract,
                upstream: torch.Tensor) -> bytes:
    xx = x.clone().requires_grad_(True)
    out = VocabParallelLogprob()(xx, targets, active, contract)
    (grad,) = torch.autograd.grad(out.selected_logp, xx, upstream)
    return tensor_bytes(grad)


def test_a_thread_that_flushes_subnormals_is_refused_and_would_change_the_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush subnormals (no FTZ/DAZ)")
    case = _tiny_gradient_case()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the flush mode is per thread: keep the chunks on this one
    try:
        honest = _grad_bytes(*case)
        torch.set_flush_denormal(True)
        with pytest.raises(LogprobContractError, match="set_flush_denormal"):
            _grad_bytes(*case)
        import rl_engine.logprob.backends.eager.vocab_parallel as vp

        monkeypatch.setattr(vp, "require_gradual_underflow", lambda device="cpu": None)
        flushed = _grad_bytes(*case)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
    assert honest != flushed  # outside the promise, and the bytes show it
    assert not portable.flushes_subnormals()


def test_an_all_minus_inf_inactive_row_has_lse_minus_inf_like_the_oracle() -> None:
    x = torch.randn(3, 64)
    x[1, :] = float("-inf")
    targets = torch.tensor([1, 2, 3])
    active = torch.tensor([True, False, True])
    contract = LogprobContract(real_vocab_size=64, padded_vocab_size=64, num_vocab_tiles=4,
                               num_sequences=1, seq_len=3, logits_dtype="fp32")
    out = VocabParallelLogprob()(x, targets, active, contract, compute_entropy=True)
    oracle = fp64_oracle(x, targets, active, 64)
    assert float(out.lse[1]) == float("-inf") == float(oracle.lse[1])
    assert out.selected_logp[1].view(torch.int32).item() == 0  # +0.0 on an inactive row
    assert out.entropy is not None and out.entropy[1:2].view(torch.int32).item() == 0x7FC00000


def test_outputs_carry_the_canonical_nan_only() -> None:
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")
    x[2, 9] = -float("nan")
    targets = torch.tensor([1, 2, 3])
    active = torch.tensor([True, False, False])
    contract = LogprobContract(real_vocab_size=64, padded_vocab_size=64, num_vocab_tiles=4,
                               num_sequences=1, seq_len=3, logits_dtype="fp32")
    out = VocabParallelLogprob()(x, targets, active, contract, compute_entropy=True)
    assert out.entropy is not None
    for t in (out.lse, out.entropy):
        assert [v & 0xFFFFFFFF for v in t[1:].view(torch.int32).tolist()] == [0x7FC00000, 0x7FC00000]


def test_default_case_fingerprints_are_the_documented_ones(default_replay: Any) -> None:
    """The default case's fingerprints under rl-engine-arith/2 (any machine, any ISA), and
    under /1 by the NumPy replay of that version: the values /1 archives recorded."""
    from rl_engine.campaign.replay import replay_numpy

    assert default_replay.fingerprints() == DOCUMENTED_FINGERPRINTS
    assert replay_numpy(DEFAULT_CASE, spec_numpy.SPEC_V1).fingerprints() == DOCUMENTED_FINGERPRINTS_ARITH1


DOCUMENTED_FINGERPRINTS = {
    "candidate_logp_sha256": "4fe3feb31f692d60293f7682a5e495d19b7e34fa904b2c729eeedea8ba1a94de",
    "candidate_lse_sha256": "41afa7c9ea3e25eba44a46da1dd1ba0f87c1ad9effb528a04ebeddb17f7236ce",
    "candidate_entropy_sha256": "122391f42009cab0afae5754c8b84fa53adfe9d18fa23a5337bada4b5a120a2e",
    # the bf16 gradient rounds away every difference /2 makes on this case
    "candidate_grad_sha256": "5cff72223ee981e305dc1cf6a9b049804763f3301a1afa531ef8e809e7b42572",
}
DOCUMENTED_FINGERPRINTS_ARITH1 = {
    "candidate_logp_sha256": "b5a48d5b77de155ad7d7afacb8e8e5e7267400937d1de2b23846bc1768f08738",
    "candidate_lse_sha256": "57463b471807f6803937a8316cf94d826a5af07696b7bb1729752019e35b96d5",
    "candidate_entropy_sha256": "4ea188aa5bd6275f4df5a2c948959c4dfe785ec2c6194fcf3f4bb2976dbea37a",
    "candidate_grad_sha256": "5cff72223ee981e305dc1cf6a9b049804763f3301a1afa531ef8e809e7b42572",
}
