"""Backend ``triton-vocab-parallel-logp-ws2``: its Triton kernels give the eager backend's bytes.

The kernels run under Triton's interpreter (``mode="interpreter"``: the same kernel source,
executed on CPU tensors through NumPy, one IEEE-754 operation at a time), selected explicitly;
every comparison is of bytes, never ``allclose``:

* logp, LSE, entropy and gradient equal ``VocabParallelLogprob``'s for bf16/fp16/fp32, padded
  vocabularies, tile widths 1, 3, 128, 143 and 2374 (one full row of vocabulary 151936), 1 to
  17 rows, with and without an LSE gradient, and the special values the specification defines
  (``-inf`` columns, signed zeros, subnormals, an all ``-inf`` row, NaN and ``+inf``);
* per TP shard (TP = 1, 3, 5 and 8: uneven shards, a padding-only rank at TP=8) the kernels' tile
  partials, validity flags and local gradient equal the eager chunk loop's;
* the kernels' element functions (``E``, its forward form, ``L``, the binary16 upcast and rounding)
  agree with the eager reference on a million probe values and every binary16;
* negative controls: a library ``tl.exp`` in place of ``E``, or 64 lanes in place of the
  specification's 128, change the bytes;
* the interpreter mode refuses an interpreter whose ``tl.fma`` rounds twice (Triton 3.6's);
* the backend fails closed (no Triton, no CUDA, a kernel that does not compile, a bad mode)
  and ``auto`` never picks its interpreter.

The ahead-of-time compilation to PTX and AMD ISA is checked in ``tests/test_triton_ptx.py``,
a campaign under the interpreter in ``tests/test_triton_campaign.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # the test extra installs it: CI never skips (tests/test_triton_ptx.py)
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from rl_engine.arith import portable  # noqa: E402
from rl_engine.logprob.backends.eager.vocab_parallel import EAGER_ENGINE, VocabParallelLogprob  # noqa: E402
from rl_engine.logprob.backends.triton import triton_backend  # noqa: E402
from rl_engine.logprob.backends.triton.triton_backend import (  # noqa: E402
    TritonEngine,
    TritonKernelError,
    TritonLogprob,
    load_kernels,
)
from rl_engine.logprob.contract import LogprobContractError  # noqa: E402
from rl_engine.logprob.registry import BackendUnavailableError, dispatch  # noqa: E402
from rl_engine.tables import AUTO, FUSED_CPU_BACKEND, TRITON_BACKEND  # noqa: E402

from _byte_cases import (  # noqa: E402
    OUTPUTS,
    _contract,
    _inputs,
    _partial_bytes,
    _run,
    assert_every_shard_matches,
    refusal_messages,
)

INTERP = "interpreter"
# NumPy warns about the IEEE special values the kernels compute on purpose (inf - inf, NaN casts)
pytestmark = pytest.mark.filterwarnings(
    "ignore:(invalid value|overflow) encountered:RuntimeWarning"
)

# (real, padded, tiles, rows): tile widths 128, 143 (padding inside a tile), 1, 3 (17 rows: the merge
# kernel's 16-row programs and a partial one),
# 3 (one row); the width 2374 is the full row of test_one_full_row_of_vocabulary_151936
SHAPES = [
    (1000, 1024, 8, 7),
    (997, 1001, 7, 5),
    (13, 16, 16, 3),
    (20, 24, 8, 17),
    (20, 24, 8, 1),
]


def _triton() -> TritonLogprob:
    return TritonLogprob(mode=INTERP)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_triton_gives_the_eager_bytes(dtype: str, shape: tuple[int, int, int, int]) -> None:
    real, padded, tiles, rows = shape
    x, targets, active = _inputs(dtype, real, padded, rows, seed=rows + tiles)
    contract = _contract(dtype, real, padded, tiles, rows)
    # with an LSE gradient (rows with coef == 0 among them) on every shape; without one on
    # the first (inactive rows then take the coef == 0 override everywhere)
    for lse_grad in (True, False) if shape == SHAPES[0] else (True,):
        eager = _run(VocabParallelLogprob(), x, targets, active, contract, lse_grad)
        ours = _run(_triton(), x, targets, active, contract, lse_grad)
        for name in OUTPUTS:
            assert ours[name] == eager[name], (name, lse_grad)


@pytest.mark.slow  # about 30 s under the interpreter (64 programs of 19 unrolled chunks each)
def test_one_full_row_of_vocabulary_151936() -> None:
    """One row of the default case's shape: 64 tiles of 2,374 columns (19 chunks of 128 lanes)."""
    x, targets, active = _inputs("bf16", 151936, 151936, 1, seed=3, specials=False)
    x[0, 5000:5100] = float("-inf")
    contract = _contract("bf16", 151936, 151936, 64, 1)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    assert _run(_triton(), x, targets, active, contract, True) == eager


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_subnormal_and_non_finite_inputs(dtype: str) -> None:
    """Subnormal logits of the dtype, signed zeros, NaN, +-inf, an all -inf row (inactive rows:
    the op refuses non-finite active rows), and a row of large logits."""
    x, targets, active = _inputs(dtype, 997, 1001, 6, seed=9, specials=True)
    tiny = {"bf16": 1e-39, "fp16": 3e-8, "fp32": 1e-42}[dtype]  # subnormal in each dtype
    x[3, :200] = tiny
    x[3, 200:400] = -tiny
    x[4, 7] = float("nan")
    x[4, 8] = float("-inf")
    active[4] = False
    contract = _contract(dtype, 997, 1001, 7, 6)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    assert _run(_triton(), x, targets, active, contract, True) == eager


@pytest.mark.parametrize("tp,dtype", [(3, "bf16"), (5, "fp16"), (8, "fp32")])
def test_every_tp_shard_computes_the_eager_partials_and_gradient(tp: int, dtype: str) -> None:
    # real 890 of 1024 columns in 16 tiles of 64: uneven shards (given as vocab_shard_bounds)
    # at TP=3 and 5; the last rank holds padding only at TP=8; one dtype each. Every degree
    # interprets the whole vocabulary (its ranks' shards together): the other degrees would repeat
    # these paths with other bounds, TP=1 (the whole row) is test_triton_gives_the_eager_bytes'.
    tiles = 16
    counts = [tiles // tp + (r < tiles % tp) for r in range(tp)]
    edges = [64 * sum(counts[:r]) for r in range(tp + 1)]
    assert_every_shard_matches(TritonEngine(INTERP), dtype, 890, 1024,
                               tiles, 5, tp, ((True, True), (False, False)),
                               tuple(zip(edges[:-1], edges[1:])))


def test_validation_flags_a_non_finite_real_column_with_the_eager_message() -> None:
    messages = refusal_messages([VocabParallelLogprob(), _triton()], float("inf"))
    assert messages[0] == messages[1] and "row 4" in messages[0]


# ----- element functions ---------------------------------------------------------------------


def _elementwise(fn_name: str, src: np.ndarray, out_dtype: torch.dtype) -> torch.Tensor:
    """Run one of the kernels' element functions over ``src`` in one interpreted program."""
    kernels = load_kernels(INTERP)
    globals()["_element_fn"] = getattr(kernels, fn_name)
    n = 1 << max(0, int(np.ceil(np.log2(src.size))))
    padded = np.zeros(n, dtype=src.dtype)
    padded[: src.size] = src
    inp = torch.from_numpy(padded)
    out = torch.empty(n, dtype=out_dtype)
    InterpretedFunction(_apply_kernel)[(1,)](inp, out, BLOCK=n)
    return out[: src.size]


def _apply_kernel(src_ptr, out_ptr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _element_fn(tl.load(src_ptr + offs)))  # noqa: F821


def _forward_exp(y):  # type: ignore[no-untyped-def]
    return load_kernels(INTERP).spec_exp_forward(y)[0]


def test_kernel_exp_is_the_eager_exp_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    y = np.concatenate([bits.view(np.float32), np.linspace(-100, 100, 100001, dtype=np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -87.0, -87.7, 88.37, 88.3763, 88.72, 89.0],
                                 dtype=np.float32)])
    ours = _elementwise("spec_exp", y, torch.float32).numpy()
    ref = portable.exp(torch.from_numpy(y.copy())).numpy()
    same = (ours.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(ours) & np.isnan(ref))
    assert bool(same.all())
    # the forward form (no clamp at HI) is E on every y <= 89 and NaN
    low = y[~(y > 89.0)]
    globals()["_element_fn"] = _forward_exp
    out = torch.empty(1 << int(np.ceil(np.log2(low.size))), dtype=torch.float32)
    padded = np.zeros(out.numel(), np.float32)
    padded[: low.size] = low
    InterpretedFunction(_apply_kernel)[(1,)](torch.from_numpy(padded), out, BLOCK=out.numel())
    fwd = out[: low.size].numpy()
    want = portable.exp(torch.from_numpy(low.copy())).numpy()
    assert bool(((fwd.view(np.uint32) == want.view(np.uint32)) | (np.isnan(fwd) & np.isnan(want))).all())


def test_kernel_log_is_the_eager_log_bit_for_bit() -> None:
    """``log_kernel`` (the merge's ``L(sum)``) gives ``portable.log``'s bits, NaN's included (canonical):
    random bit patterns of every sign and class, their magnitudes, subnormals, the binade edges."""
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, size=1 << 17, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, 2.0, 0.5, 1e-45, -1e-45, 2.0**-126, 2.0**-127,
             float.fromhex("0x1.6a09e6p+0"), float.fromhex("0x1.6a09e8p+0"), float.fromhex("0x1.fffffep+127"), 64.0]
    x = torch.from_numpy(np.concatenate([bits, np.abs(bits), np.array(edges, dtype=np.float32)]))
    ours = triton_backend.triton_log(x, INTERP)
    assert ours.view(torch.int32).numpy().tobytes() == portable.log(x).view(torch.int32).numpy().tobytes()


def _f16_rounding_inputs() -> np.ndarray:
    """binary32 values around every binary16 rounding decision: each binary16 value, each midpoint
    between neighbours and the binary32 values either side of it, the overflow threshold, the
    subnormal range, every 8209th binary32 bit pattern (523,204 of them, NaNs of every sign and
    payload included) and the special values."""
    halves = np.arange(0, 1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    finite = np.sort(halves[np.isfinite(halves)])
    mids = ((finite[:-1].astype(np.float64) + finite[1:].astype(np.float64)) / 2).astype(np.float32)
    strided = np.arange(0, 1 << 32, 8209, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([finite, mids, np.nextafter(mids, np.float32(np.inf)),
                           np.nextafter(mids, np.float32(-np.inf)), strided,
                           np.array([np.inf, -np.inf, 1e-30, -1e-30, 7e4, 65520.0, -65520.0, 65519.996,
                                     2.0**-25, 2.0**-25 * 1.0000001, -(2.0**-25)], dtype=np.float32)])


def test_kernel_binary16_rounding_is_ieee_on_a_dense_set_of_binary32_values() -> None:
    """Section 8's rounding (round_f16_bits, binary32 operations): IEEE round to nearest even with
    subnormals and overflow, every NaN the canonical 0x7E00, against NumPy's conversion."""
    x = _f16_rounding_inputs()
    ours = _elementwise("round_f16_bits", x.view(np.int32), torch.int32).numpy() & 0xFFFF
    with np.errstate(over="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    ref = np.where(np.isnan(x), np.uint16(0x7E00), ref)
    assert np.array_equal(ours.astype(np.uint16), ref), x[ours.astype(np.uint16) != ref][:8]


def _upcast_f16(raw):  # type: ignore[no-untyped-def]
    return load_kernels(INTERP).upcast(raw, 2)


def _upcast_f16_flushed(raw):  # type: ignore[no-untyped-def]
    """A wrong upcast for the negative control: infinities as the largest finite binary16."""
    x = raw.to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(tl.abs(x) == float("inf"), tl.where(x > 0, 65504.0, -65504.0), x)


def test_kernel_binary16_upcast_is_exact_on_every_bit_pattern() -> None:
    """All 65,536 binary16 bit patterns: the upcast (the widening conversion) gives NumPy's binary32
    bits for every non-NaN, subnormals, signed zeros and infinities included, and a NaN for every NaN
    (its payload is not part of any result: every output NaN is canonical)."""
    h = np.arange(0, 1 << 16, dtype=np.uint32).astype(np.uint16).view(np.int16)
    exact = h.view(np.float16).astype(np.float32)
    nan = np.isnan(exact)
    globals()["_element_fn"] = _upcast_f16
    up = torch.empty(1 << 16, dtype=torch.float32)
    InterpretedFunction(_apply_kernel)[(1,)](torch.from_numpy(h.copy()), up, BLOCK=1 << 16)
    got = up.numpy()
    assert np.array_equal(got[~nan].view(np.uint32), exact[~nan].view(np.uint32))
    assert bool(np.isnan(got[nan]).all()) and int(nan.sum()) == 2 * 1023  # 1023 significands, both signs


def test_a_binary16_tile_with_an_infinity_or_nan_gives_the_eager_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """binary16 tiles holding a NaN, ``-inf`` and ``+inf`` (inactive rows, so the logprob reads the
    row's LSE alone): the eager bytes, gradient included. Negative control: an upcast that reads an
    infinity as the largest finite binary16 gives other bytes."""
    x, targets, active = _inputs("fp16", 997, 1001, 6, seed=9, specials=True)
    x[4, 7] = float("nan")
    x[4, 300] = float("-inf")
    x[5, 500] = float("inf")
    x[3, 600] = float("-inf")
    active[4] = active[5] = False
    contract = _contract("fp16", 997, 1001, 7, 6)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, False)
    assert _run(_triton(), x, targets, active, contract, False) == eager
    kernels = load_kernels(INTERP)
    real = kernels.upcast
    monkeypatch.setattr(kernels, "upcast", lambda raw, dtype: _upcast_f16_flushed(raw) if dtype == 2 else real(raw, dtype))
    flushed = _run(_triton(), x, targets, active, contract, False)
    assert flushed["lse"] != eager["lse"]


# ----- negative controls -------------------------------------------------------------------------


def _library_exp(y):  # type: ignore[no-untyped-def]
    return tl.exp(y)


def _library_exp_forward(y):  # type: ignore[no-untyped-def]
    return tl.exp(y), tl.maximum(y, -88.0)


def test_negative_control_a_library_exp_in_the_kernels_breaks_the_equality(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, targets, active = _inputs("fp32", 997, 1001, 5, seed=4, specials=False)
    contract = _contract("fp32", 997, 1001, 7, 5)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    assert _run(_triton(), x, targets, active, contract, True) == eager
    monkeypatch.setattr(load_kernels(INTERP), "spec_exp", _library_exp)
    monkeypatch.setattr(load_kernels(INTERP), "spec_exp_forward", _library_exp_forward)
    library = _run(_triton(), x, targets, active, contract, True)
    assert library["grad"] != eager["grad"] and library["entropy"] != eager["entropy"]


def test_negative_control_another_lane_count_breaks_the_equality(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """64 lanes instead of the specification's 128 group a 143-wide tile's sums otherwise: the
    sums' bytes change, the max does not."""
    x, targets, active = _inputs("fp32", 1001, 1001, 16, seed=6, specials=False)
    contract = _contract("fp32", 1001, 1001, 7, 16)  # 112 tile sums: a few percent differ
    m, s, t, _ = EAGER_ENGINE.local_partials(x, contract, 3, True, False)
    ours = TritonEngine(INTERP).local_partials(x, contract, 3, True, False)
    assert [_partial_bytes(v) for v in ours[:3]] == [_partial_bytes(v) for v in (m, s, t)]
    kernels = load_kernels(INTERP)
    monkeypatch.setattr(kernels, "LANES", tl.constexpr(64))
    monkeypatch.setattr(kernels, "LANE_LEVELS", tl.constexpr(6))
    m2, s2, t2, _ = TritonEngine(INTERP).local_partials(x, contract, 3, True, False)
    assert _partial_bytes(m2) == _partial_bytes(m)  # the max does not depend on grouping
    assert _partial_bytes(s2) != _partial_bytes(s) and _partial_bytes(t2) != _partial_bytes(t)


def test_an_interpreter_whose_fma_rounds_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton 3.6's interpreter computes tl.fma as a*b+c with two roundings: it cannot compute
    the specification's bytes, so the interpreter mode refuses it (compiled kernels are not
    affected). Simulated here by expecting the double-rounded value of the probe."""
    triton_backend.load_kernels.cache_clear()
    monkeypatch.setattr(triton_backend, "FMA_PROBE_RESULT", float.fromhex("0x1.000004p+0"))
    try:
        with pytest.raises(TritonKernelError, match="rounds\\s+twice|rounds twice"):
            triton_backend.load_kernels(INTERP)
        assert "rounds twice" in str(triton_backend.triton_unavailable(INTERP))
    finally:
        monkeypatch.undo()
        triton_backend.load_kernels.cache_clear()


# ----- selection and failing closed ------------------------------------------------------------------


def test_explicit_interpreter_mode_is_recorded_and_auto_never_picks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    contract = _contract("bf16", 1000, 1024, 8, 5)
    with pytest.raises(BackendUnavailableError, match=r"device cpu not in \['cuda'\]"):
        dispatch(TRITON_BACKEND, contract, "cpu")  # compiled mode serves cuda only
    monkeypatch.setenv(triton_backend.MODE_ENV, INTERP)
    chosen = dispatch(TRITON_BACKEND, contract, "cpu")
    assert isinstance(chosen.op, TritonLogprob) and chosen.op.mode == INTERP
    assert chosen.provenance()["mode"] == INTERP and chosen.fallback is False
    auto = dispatch(AUTO, contract, "cpu")
    assert auto.actual_backend == FUSED_CPU_BACKEND and auto.fallback is False
    assert dict(auto.rejections)[TRITON_BACKEND].startswith("not chosen by auto on device cpu")
    monkeypatch.setenv(triton_backend.MODE_ENV, "fast")
    with pytest.raises(BackendUnavailableError, match="RL_ENGINE_TRITON_MODE='fast' is not one of"):
        dispatch(TRITON_BACKEND, contract, "cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CUDA-less machine's path")
def test_without_cuda_the_compiled_backend_fails_closed() -> None:
    contract = _contract("bf16", 1000, 1024, 8, 5)
    with pytest.raises(BackendUnavailableError) as info:
        dispatch(TRITON_BACKEND, contract, "cuda")
    assert "compiled Triton kernels need CUDA" in str(info.value) and "nothing falls back" in str(info.value)
    x, targets, active = _inputs("bf16", 1000, 1024, 5, seed=1, specials=False)
    with pytest.raises(LogprobContractError, match=r"logits.device=cpu is not served by backend"):
        TritonLogprob(mode="compiled")(x, targets, active, contract)


def test_without_triton_dispatch_raises_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_triton(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "triton" or name.startswith("triton."):
            raise ImportError("No module named 'triton' (test)")
        return real_import(name, *args, **kwargs)

    triton_backend.load_kernels.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_triton)
    monkeypatch.setenv(triton_backend.MODE_ENV, INTERP)
    try:
        with pytest.raises(BackendUnavailableError, match="Triton is not installed"):
            dispatch(TRITON_BACKEND, _contract("bf16", 1000, 1024, 8, 5), "cpu")
        with pytest.raises(TritonKernelError, match="Triton is not installed"):
            TritonLogprob()
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        triton_backend.load_kernels.cache_clear()


def test_an_old_triton_and_a_kernel_that_does_not_run_raise_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import triton

    triton_backend.load_kernels.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    try:
        assert "older than the oldest tested, 3.6" in str(triton_backend.triton_unavailable(INTERP))
    finally:
        monkeypatch.undo()
        triton_backend.load_kernels.cache_clear()
    kernels = load_kernels(INTERP)

    def broken(*args):  # type: ignore[no-untyped-def]
        raise ValueError("no such op (test)")

    monkeypatch.setattr(kernels, "spec_exp_forward", broken)
    x, targets, active = _inputs("bf16", 1000, 1024, 2, seed=1, specials=False)
    with pytest.raises(TritonKernelError, match="forward_partials_kernel failed.*no such op"):
        _triton()(x, targets, active, _contract("bf16", 1000, 1024, 8, 2))
