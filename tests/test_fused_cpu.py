"""Backend ``cpu-vocab-parallel-logp-ws2``: the compiled kernel gives the eager backend's bytes.

Every comparison is of bytes (SHA-256 or raw bytes), never ``allclose``:

* logp, LSE, entropy and gradient of ``FusedCpuLogprob`` equal those of
  ``VocabParallelLogprob`` for bf16/fp16/fp32, padded vocabularies, odd tile widths
  (1, 3, 143, 2374) and row counts, 1 and 2 kernel threads, with and without an LSE
  gradient (rows with ``coef == 0``), and inputs holding the special values the
  specification defines (``-inf`` columns, subnormal binary16 values, signed zeros, an all
  ``-inf`` inactive row, NaN and ``+inf`` in inactive rows, large logits);
* per TP shard (TP = 1, 2, 4, 8 with a padding-only rank), the kernel's tile partials and
  local gradient equal the eager chunk loop's (the exchange and merge are shared code);
* the baseline (SSE2) and AVX2 variants of the kernel give the same bytes;
* the element functions (``E``, binary16 and bf16 rounding, binary16 upcast) agree with the
  eager reference and with torch's IEEE conversions;
* the backend fails closed (a missing or broken module makes dispatch raise with the reason)
  and refuses a thread that flushes subnormals;
* the campaign runner gives the same fingerprints with either backend
  (``tests/test_fused_campaign.py``).
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rl_engine.logprob import fused_cpu, portable
from rl_engine.logprob.contract import LogprobContract, LogprobContractError
from rl_engine.logprob.fused_cpu import FUSED_CPU_ID, FusedCpuEngine, FusedCpuLogprob
from rl_engine.logprob.registry import BackendUnavailableError, dispatch
from rl_engine.logprob.vocab_parallel import (
    EAGER_ENGINE,
    VocabParallelLogprob,
)
from rl_engine.tensorio import fingerprint, tensor_bytes

from _byte_cases import (  # noqa: F401
    DTYPES,
    OUTPUTS,
    _contract,
    _inputs,
    _partial_bytes,
    _run,
    assert_every_shard_matches,
    refusal_messages,
)

# (real, padded, tiles, rows): tile widths 128, 143 (odd, padding inside a tile), 1, 3,
# 2374 (the default case), and row counts 1, 5, 7, 17
SHAPES = [
    (1000, 1024, 8, 7),
    (997, 1001, 7, 5),
    (13, 16, 16, 17),
    (20, 24, 8, 1),
    (151936, 151936, 64, 5),
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_fused_gives_the_eager_bytes(dtype: str, shape: tuple[int, int, int, int], threads: int) -> None:
    real, padded, tiles, rows = shape
    x, targets, active = _inputs(dtype, real, padded, rows, seed=rows + tiles)
    contract = _contract(dtype, real, padded, tiles, rows)
    for lse_grad in (True, False):
        eager = _run(VocabParallelLogprob(), x, targets, active, contract, lse_grad)
        fused = _run(FusedCpuLogprob(threads=threads), x, targets, active, contract, lse_grad)
        for name in OUTPUTS:
            assert fused[name] == eager[name], (name, lse_grad)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_thread_count_of_the_caller_is_used_and_changes_nothing(dtype: str) -> None:
    x, targets, active = _inputs(dtype, 997, 1001, 33, seed=5)
    contract = _contract(dtype, 997, 1001, 7, 33)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(_run(FusedCpuLogprob(), x, targets, active, contract, True))
    finally:
        torch.set_num_threads(before)
    assert results[0] == results[1] == results[2]


def test_entropy_off_and_validate_off_give_the_eager_bytes() -> None:
    x, targets, active = _inputs("bf16", 1000, 1024, 9, seed=3)
    contract = _contract("bf16", 1000, 1024, 8, 9)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True, entropy=False)
    fused = _run(FusedCpuLogprob(), x, targets, active, contract, True, entropy=False)
    assert fused == eager and "entropy" not in fused
    e = VocabParallelLogprob()(x, targets, active, contract, validate=False)
    f = FusedCpuLogprob()(x, targets, active, contract, validate=False)
    assert tensor_bytes(e.lse) == tensor_bytes(f.lse)


def test_a_row_strided_view_is_read_in_place_with_the_same_bytes() -> None:
    wide, targets, active = _inputs("bf16", 1000, 1100, 6, seed=8, specials=False)
    view = wide[:, :1024]  # row stride 1100 > 1024 columns
    contract = _contract("bf16", 1000, 1024, 8, 6)
    m1, s1, t1, f1 = fused_cpu.fused_partials(view, contract, True, True)
    m2, s2, t2, f2 = fused_cpu.fused_partials(view.contiguous(), contract, True, True)
    assert all(tensor_bytes(a) == tensor_bytes(b) for a, b in ((m1, m2), (s1, s2), (t1, t2), (f1, f2)))


def test_negative_control_a_library_exp_in_the_eager_loop_breaks_the_equality(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import rl_engine.logprob.tiles as tiles

    x, targets, active = _inputs("fp32", 997, 1001, 5, seed=4, specials=False)
    contract = _contract("fp32", 997, 1001, 7, 5)
    fused = _run(FusedCpuLogprob(), x, targets, active, contract, True)
    monkeypatch.setattr(tiles, "exp_into", lambda y, out, sc: torch.exp(y, out=out))
    library = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    assert fused["grad"] != library["grad"]  # fp32: the gradient is not rounded


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_exp_arguments_near_the_spec_boundaries_in_both_kernels(isa: str) -> None:
    """Rows whose ``x - max`` and ``x - lse`` sweep [-88, 0] densely, with every binary32
    around -87 (LO) and around the smallest normal results: the vector ``E`` of the forward
    (its clamp-free, single-scale form) and of the backward give the eager bytes."""
    if isa not in _isas():
        pytest.skip(f"this CPU lacks {isa}")
    around = np.float32(-87.0)
    near = [around]
    for _ in range(300):
        near.append(np.nextafter(near[-1], np.float32(0)))
    low = [around]
    for _ in range(300):
        low.append(np.nextafter(low[-1], np.float32(-np.inf)))
    values = np.concatenate([np.array(near + low, dtype=np.float32),
                             np.linspace(-88.0, 0.0, 4096, dtype=np.float32),
                             np.array([-0.0, 0.0, -1e-30, -126 * np.log(2)], dtype=np.float32)])
    rows, width = 4, values.size + (-values.size) % 16
    x = torch.full((rows, width), -1000.0)
    for r in range(rows):
        x[r, : values.size] = torch.from_numpy(values) + float(r) * 0.25
        x[r, values.size:] = -100.0
    tiles = width // 16
    contract = _contract("fp32", width, width, tiles, rows)
    targets = torch.zeros(rows, dtype=torch.int64)
    active = torch.ones(rows, dtype=torch.bool)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    fused = _run(FusedCpuLogprob(isa=isa), x, targets, active, contract, True)
    assert fused == eager
    m1, s1, t1, _ = EAGER_ENGINE.local_partials(x, contract, 3, True, False)
    m2, s2, t2, _ = FusedCpuEngine(isa=isa).local_partials(x, contract, 3, True, False)
    assert [_partial_bytes(v) for v in (m1, s1, t1)] == [_partial_bytes(v) for v in (m2, s2, t2)]


# ----- per TP shard: partials and local gradient --------------------------------------------


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_tp_shard_computes_the_eager_partials_and_gradient(dtype: str, tp: int) -> None:
    # real 900 of 1024 columns in 16 tiles: at TP=8 rank 7 holds padding only
    assert_every_shard_matches(FusedCpuEngine(threads=2), dtype, 900, 1024, 16, 9, tp,
                               tuple(itertools.product((True, False), (True, False))))


# ----- instruction-set variants ---------------------------------------------------------------


def _isas() -> list[str]:
    kernel = fused_cpu.load_kernel()
    return ["baseline"] + [name for name in ("avx2", "avx512")
                           if kernel.selected_isa(fused_cpu.ISA_NAMES[name]) == fused_cpu.ISA_NAMES[name]]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_baseline_avx2_and_avx512_kernels_give_the_same_bytes(dtype: str) -> None:
    isas = _isas()
    if len(isas) == 1:
        pytest.skip("this CPU has neither AVX2 nor AVX-512: only the baseline kernel runs here")
    x, targets, active = _inputs(dtype, 997, 1001, 11, seed=11)
    contract = _contract(dtype, 997, 1001, 7, 11)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    for isa in isas + ["auto"]:
        assert _run(FusedCpuLogprob(isa=isa), x, targets, active, contract, True) == eager, isa


def test_an_instruction_set_the_cpu_lacks_is_refused() -> None:
    kernel = fused_cpu.load_kernel()
    missing = [n for n in ("avx2", "avx512") if kernel.selected_isa(fused_cpu.ISA_NAMES[n]) < 0]
    if not missing:
        pytest.skip("this CPU has every variant")
    with pytest.raises(LogprobContractError, match="is not supported by this CPU"):
        FusedCpuLogprob(isa=missing[0])  # when built, never after a call's agreement step
    x, targets, active = _inputs("bf16", 1000, 1024, 3, seed=1, specials=False)
    with pytest.raises(fused_cpu.FusedKernelError, match="instruction set this CPU lacks"):
        fused_cpu.fused_partials(x, _contract("bf16", 1000, 1024, 8, 3), False, False,
                                 isa=missing[0])  # the kernel's own check, below it


# ----- element functions -----------------------------------------------------------------------


def _call(name: str, src: np.ndarray, out_dtype: Any) -> np.ndarray:
    lib = fused_cpu.load_kernel().lib
    src = np.ascontiguousarray(src)
    out = np.empty(src.shape, dtype=out_dtype)
    getattr(lib, name)(src.ctypes.data, out.ctypes.data, src.size)
    return out


def _probe_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 1,
                      0x00800000, 0x33000000, 0x33000001, 0x337FFFFF, 0x38800000, 0x387FFFFF,
                      0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000, 0x3F800000],
                     dtype=np.uint32)
    # every binary16 value and the halfway points between neighbours, as binary32
    halves = np.arange(0, 1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = halves[np.isfinite(halves)]
    mids = ((finite[:-1].astype(np.float64) + finite[1:].astype(np.float64)) / 2).astype(np.float32)
    return np.concatenate([bits.view(np.float32), edges.view(np.float32), finite, mids,
                           np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])


def test_exp_is_the_eager_exp_bit_for_bit() -> None:
    y = _probe_floats()
    y = np.concatenate([y, np.linspace(-100, 100, 200001, dtype=np.float32)])
    ours = _call("rle_exp_array", y, np.float32)
    ref = portable.exp(torch.from_numpy(y.copy())).numpy()
    same = ours.view(np.uint32) == ref.view(np.uint32)
    nan = np.isnan(ours) & np.isnan(ref)
    assert bool(np.all(same | nan))


def test_binary16_rounding_is_ieee_round_to_nearest_even() -> None:
    x = _probe_floats()
    ours = _call("rle_round_f16_array", x, np.uint16)
    canonical = np.where(np.isnan(x), np.float32(np.nan), x)  # NaN first made 0x7FC00000
    ref = torch.from_numpy(canonical.copy()).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)
    assert set(ours[np.isnan(x)].tolist()) == {0x7E00}
    # and NumPy's conversion agrees (a second IEEE implementation)
    with np.errstate(over="ignore"):
        numpy_ref = canonical.astype(np.float16).view(np.uint16)
    assert np.array_equal(ours[~np.isnan(x)], numpy_ref[~np.isnan(x)])


def test_bf16_rounding_is_the_spec_formula() -> None:
    x = _probe_floats()
    ours = _call("rle_round_bf16_array", x, np.uint16)
    canonical = torch.from_numpy(np.where(np.isnan(x), np.float32(np.nan), x))
    ref = portable.rounded(canonical, torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)


def test_binary16_upcast_is_exact_for_every_binary16() -> None:
    h = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16)
    ours = _call("rle_upcast_f16_array", h, np.float32)
    ref = h.view(np.float16).astype(np.float32)
    finite = ~np.isnan(ref)
    assert np.array_equal(ours.view(np.uint32)[finite], ref.view(np.uint32)[finite])
    assert bool(np.all(np.isnan(ours[~finite])))


# ----- fail closed ---------------------------------------------------------------------------------


@pytest.fixture
def fresh_kernel_cache() -> Any:
    fused_cpu._cached.cache_clear()
    yield
    fused_cpu._cached.cache_clear()


def test_registered_with_its_capabilities_and_chosen_by_auto_on_cpu() -> None:
    contract = _contract("fp16", 997, 1001, 7, 5)
    chosen = dispatch(FUSED_CPU_ID, contract, "cpu")
    assert isinstance(chosen.op, FusedCpuLogprob) and chosen.fallback is False
    assert chosen.provenance()["actual_backend"] == FUSED_CPU_ID
    assert dispatch("auto", contract, "cpu").actual_backend == FUSED_CPU_ID  # the fastest on cpu
    with pytest.raises(BackendUnavailableError, match=r"device cuda not in \['cpu'\]"):
        dispatch(FUSED_CPU_ID, contract, "cuda")


def test_a_missing_module_makes_dispatch_raise_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, fresh_kernel_cache: None
) -> None:
    monkeypatch.setattr(fused_cpu, "MODULE", "rl_engine.logprob._no_such_kernel")
    contract = _contract("bf16", 1000, 1024, 8, 5)
    with pytest.raises(BackendUnavailableError) as info:
        dispatch(FUSED_CPU_ID, contract, "cpu")
    message = str(info.value)
    assert "unavailable" in message and "is not built" in message and "build_ext --inplace" in message
    assert "nothing falls back" in message
    with pytest.raises(fused_cpu.FusedKernelError, match="is not built"):
        FusedCpuLogprob()
    # the eager backend is untouched by the fused one's absence
    assert dispatch("pytorch-vocab-parallel-logp-ws2", contract, "cpu").fallback is False


def test_a_broken_shared_object_makes_dispatch_raise_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, fresh_kernel_cache: None, tmp_path: Path
) -> None:
    broken = tmp_path / "rl_engine_broken" / "_fused_cpu.so"
    broken.parent.mkdir()
    broken.write_bytes(b"not an ELF file")

    class Spec:
        origin = str(broken)

    monkeypatch.setattr(fused_cpu.importlib.util, "find_spec", lambda name: Spec())
    with pytest.raises(BackendUnavailableError, match="does not load"):
        dispatch(FUSED_CPU_ID, _contract("bf16", 1000, 1024, 8, 5), "cpu")


def test_a_stale_kernel_abi_is_refused(
    monkeypatch: pytest.MonkeyPatch, fresh_kernel_cache: None, tmp_path: Path
) -> None:
    real = fused_cpu.importlib.util.find_spec(fused_cpu.MODULE)
    assert real is not None and real.origin is not None
    copy = tmp_path / "copy.so"
    shutil.copy(real.origin, copy)
    monkeypatch.setattr(fused_cpu, "ABI_VERSION", 999)
    with pytest.raises(fused_cpu.FusedKernelError, match="kernel ABI 1, this code needs 999"):
        fused_cpu.load_kernel()


def test_a_thread_that_flushes_subnormals_is_refused() -> None:
    x, targets, active = _inputs("bf16", 1000, 1024, 4, seed=1, specials=False)
    contract = _contract("bf16", 1000, 1024, 8, 4)
    torch.set_flush_denormal(True)
    try:
        with pytest.raises(LogprobContractError, match="flushes subnormal"):
            FusedCpuLogprob()(x, targets, active, contract)
        # the kernel's own check, below the Python one, on its calling and worker threads
        for threads in (1, 2):
            with pytest.raises(LogprobContractError, match="kernel thread flushes subnormal"):
                fused_cpu.fused_partials(x, contract, False, False, threads=threads)
    finally:
        torch.set_flush_denormal(False)


def test_cpu_only_tensors_and_bad_options_are_refused() -> None:
    with pytest.raises(LogprobContractError, match="isa='sse9' is not one of"):
        FusedCpuLogprob(isa="sse9")
    x, targets, active = _inputs("bf16", 1000, 1024, 4, seed=1, specials=False)
    contract = _contract("bf16", 1000, 1024, 8, 4)
    with pytest.raises(LogprobContractError, match="threads=0 must be >= 1"):
        FusedCpuLogprob(threads=0)(x, targets, active, contract)
    meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
    with pytest.raises(LogprobContractError, match="logits has no real storage"):
        FusedCpuLogprob()(meta, targets.to("meta"), active.to("meta"), contract)


def test_non_finite_active_row_raises_the_eager_message() -> None:
    messages = refusal_messages([VocabParallelLogprob(), FusedCpuLogprob()], float("nan"))
    assert messages[0] == messages[1] and "row 4" in messages[0]


def test_fingerprint_of_the_default_case_equals_the_eager_one() -> None:
    from rl_engine.campaign.replay import replay_candidate

    case = {"dtype": "bf16", "real_vocab": 151936, "padded_vocab": 152064, "num_vocab_tiles": 64,
            "batch": 2, "seq": 16, "prompt_tokens": 8, "seed": 123, "logit_scale": 1.0}
    eager = replay_candidate({**case, "backend": "pytorch-vocab-parallel-logp-ws2"})
    fused = replay_candidate({**case, "backend": FUSED_CPU_ID})
    assert fused.fingerprints() == eager.fingerprints()
    assert fingerprint(fused.grad) == fingerprint(eager.grad)
    # verify --recompute replays a fused-backend case with the eager reference
    by_reference = replay_candidate({**case, "backend": FUSED_CPU_ID},
                                    backend="pytorch-vocab-parallel-logp-ws2")
    assert by_reference.fingerprints() == fused.fingerprints()
