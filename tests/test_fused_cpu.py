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
* the tile partials ``s`` and ``t`` are the lane sums ``G`` and ``G*`` of the NumPy
  implementation (``rl_engine/arith/spec_numpy.py``) for tile widths below, at and around 128
  and up to one tile of 151936 columns, with padding and special values, in every variant;
* the baseline (SSE2, software fma), AVX2 and AVX-512 variants of the kernel give the same
  bytes (AVX-512 where the CPU has it);
* each variant's fusedMultiplyAdd is the correctly rounded one (``spec_numpy.fma32``:
  the double-rounding counterexample, subnormal and overflowing results, random operands),
  and a written ``a * b + c`` still rounds twice (no contraction);
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

from rl_engine.arith import portable, spec_numpy
from rl_engine.logprob.backends.eager.vocab_parallel import (
    EAGER_ENGINE,
    VocabParallelLogprob,
)
from rl_engine.logprob.backends.fused_cpu import fused_cpu
from rl_engine.logprob.backends.fused_cpu.fused_cpu import FUSED_CPU_ID, FusedCpuEngine, FusedCpuLogprob
from rl_engine.logprob.contract import LogprobContractError
from rl_engine.logprob.registry import BackendUnavailableError, dispatch
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
    (151936, 151936, 1, 3),  # one tile of 151936 columns (1187 chunks of 128 lanes)
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
    import rl_engine.arith.tiles as tiles

    x, targets, active = _inputs("fp32", 997, 1001, 5, seed=4, specials=False)
    contract = _contract("fp32", 997, 1001, 7, 5)
    fused = _run(FusedCpuLogprob(), x, targets, active, contract, True)
    monkeypatch.setattr(tiles, "exp_into", lambda y, out, sc: torch.exp(y, out=out))
    library = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    assert fused["grad"] != library["grad"]  # fp32: the gradient is not rounded


def _sweep(start: float, towards: float, count: int) -> list[np.float32]:
    out = [np.float32(start)]
    for _ in range(count):
        out.append(np.nextafter(out[-1], np.float32(towards)))
    return out


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_exp_arguments_near_the_spec_boundaries_in_every_kernel(isa: str) -> None:
    """Rows whose ``x - max`` and ``x - lse`` sweep [-89, 0] densely, with every binary32
    around LO = -88, around -87.68 (where ``k`` reaches -127 and ``E`` becomes +0), around
    -87.34 (``k = -126``: subnormal results below) and around 0: the forward form of ``E`` and
    the lane sums of the forward, and the general form of the backward, give the eager bytes."""
    if isa not in _isas():
        pytest.skip(f"this CPU lacks {isa}")
    points: list[np.float32] = []
    for centre in (-88.0, -87.68317, -87.33654, -87.0):
        points += _sweep(centre, 0.0, 150) + _sweep(centre, -np.inf, 150)
    points += _sweep(-0.0, -np.inf, 300)
    values = np.concatenate([np.array(points, dtype=np.float32),
                             np.linspace(-89.0, 0.0, 4096, dtype=np.float32),
                             np.array([-0.0, 0.0, -1e-30, -1e-45, -126 * np.log(2)],
                                      dtype=np.float32)])
    # tiles of 16 columns: column 0 of each holds the tile's max (0 + r / 4), the other 15 the
    # sweep, so that the forward's y = x - max sweeps it too
    per_tile = 15
    values = np.concatenate([values, np.full((-values.size) % per_tile, -100.0, np.float32)])
    tiles = values.size // per_tile
    rows, width = 4, tiles * 16
    x = torch.empty((rows, tiles, 16))
    for r in range(rows):
        x[r, :, 0] = float(r) * 0.25
        x[r, :, 1:] = torch.from_numpy(values.reshape(tiles, per_tile)) + float(r) * 0.25
    x = x.reshape(rows, width).contiguous()
    contract = _contract("fp32", width, width, tiles, rows)
    targets = torch.zeros(rows, dtype=torch.int64)
    active = torch.ones(rows, dtype=torch.bool)
    x[1, 7] = float("-inf")  # a real -inf column (adds nothing), on an inactive row
    active[1] = False
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    fused = _run(FusedCpuLogprob(isa=isa), x, targets, active, contract, True)
    assert fused == eager
    m1, s1, t1, _ = EAGER_ENGINE.local_partials(x, contract, 3, True, False)
    m2, s2, t2, _ = FusedCpuEngine(isa=isa).local_partials(x, contract, 3, True, False)
    assert [_partial_bytes(v) for v in (m1, s1, t1)] == [_partial_bytes(v) for v in (m2, s2, t2)]


# ----- lane sums against the NumPy implementation ----------------------------------------------


def _numpy_partials(x: np.ndarray, real: int, tiles: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Section 6 steps 1-4 by ``rl_engine/arith/spec_numpy.py`` (binary32 ``x``, padding read as -inf)."""
    x = x.copy()
    x[:, real:] = -np.inf
    rows, vp = x.shape
    xt = x.reshape(rows, tiles, vp // tiles)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.add(np.maximum.reduce(xt, axis=2), np.float32(0.0))
        sh = np.where(m == -np.inf, np.float32(0.0), m).astype(np.float32)
        y = np.subtract(xt, sh[:, :, None])
        e = spec_numpy.exp32(y)
        s = spec_numpy.lane_sum(e)
        t = spec_numpy.lane_fma_sum(e, np.maximum(y, spec_numpy.E2_LO))
    return m, s, t


# (real, padded, tiles): tile widths 1, 3, 100, 127, 128, 129, 143, 255, 256, 383, 2374 and one
# tile of 151936, with padding inside the last tile where real < padded
LANE_SHAPES = [(30, 32, 32), (40, 48, 16), (290, 300, 3), (254, 254, 2), (1000, 1024, 8),
               (250, 258, 2), (997, 1001, 7), (500, 510, 2), (512, 512, 2), (383, 383, 1),
               (9000, 9496, 4), (151936, 151936, 1)]


@pytest.mark.parametrize("shape", LANE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tile_partials_are_the_numpy_lane_sums(shape: tuple[int, int, int]) -> None:
    real, padded, tiles = shape
    rows = 4
    x, _, _ = _inputs("fp32", real, padded, rows, seed=real, scale=4.0)
    x[1, : min(real, 5)] = float("-inf")  # real -inf columns add nothing under /2
    ref = _numpy_partials(x.numpy(), real, tiles)
    want = [_partial_bytes(torch.from_numpy(np.ascontiguousarray(v))) for v in ref]
    contract = _contract("fp32", real, padded, tiles, rows)
    for isa in _isas():
        m, s, t, _ = FusedCpuEngine(isa=isa).local_partials(x, contract, 3, True, False)
        assert [_partial_bytes(v) for v in (m, s, t)] == want, isa


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


@pytest.mark.parametrize("shape", [(997, 1001, 7), (9000, 9496, 4), (13, 16, 16)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_baseline_avx2_and_avx512_kernels_give_the_same_bytes(dtype: str, shape: tuple[int, int, int]) -> None:
    isas = _isas()
    if len(isas) == 1:
        pytest.skip("this CPU has neither AVX2 nor AVX-512: only the baseline kernel runs here")
    real, padded, tiles = shape
    x, targets, active = _inputs(dtype, real, padded, 11, seed=11)
    contract = _contract(dtype, real, padded, tiles, 11)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    for isa in isas + ["auto"]:
        assert _run(FusedCpuLogprob(isa=isa), x, targets, active, contract, True) == eager, isa


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_kernel_variant_divides_by_the_temperature_with_the_eager_bytes(dtype: str) -> None:
    """With a temperature every variant (baseline, AVX2, AVX-512: the division's vector and scalar
    paths) gives the eager backend's bytes, forward and gradient."""
    real, padded, tiles = 997, 1001, 7
    x, targets, active = _inputs(dtype, real, padded, 11, seed=12)
    contract = _contract(dtype, real, padded, tiles, 11, temperature=0.7)
    eager = _run(VocabParallelLogprob(), x, targets, active, contract, True)
    for isa in _isas() + ["auto"]:
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


def _elementwise(op: int, isa: str, a: np.ndarray, b: np.ndarray | None = None,
                 c: np.ndarray | None = None) -> np.ndarray:
    """The kernel's hook ``rle_elementwise_array`` in variant ``isa``: op 0 ``fma(a, b, c)``,
    op 1 ``a * b + c`` as written, op 2 ``E(a)`` (the general form)."""
    lib = fused_cpu.load_kernel().lib
    args = [np.ascontiguousarray(v, dtype=np.float32) if v is not None else None for v in (a, b, c)]
    out = np.empty(args[0].shape, dtype=np.float32)
    status = lib.rle_elementwise_array(op, *[v.ctypes.data if v is not None else None for v in args],
                                       out.ctypes.data, out.size, fused_cpu.ISA_NAMES[isa])
    assert status == 0, status
    return out


def _same_bits(ours: np.ndarray, ref: np.ndarray) -> bool:
    same = ours.view(np.uint32) == ref.view(np.uint32)
    nan = np.isnan(ours) & np.isnan(ref)  # a NaN's payload is not specified
    return bool(np.all(same | nan))


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_exp_is_the_eager_exp_bit_for_bit(isa: str) -> None:
    if isa not in _isas():
        pytest.skip(f"this CPU lacks {isa}")
    y = _probe_floats()
    y = np.concatenate([y, np.linspace(-100, 100, 200001, dtype=np.float32),
                        np.array([float.fromhex(v) for v in (  # k = 128 (+inf) from 0x1.61814ep+6 on
                            "0x1.61814cp+6", "0x1.61814ep+6", "0x1.6p+6", "0x1.62e42ep+6",
                            "0x1.64p+6", "0x1.64002p+6", "0x1p+7")], dtype=np.float32)])
    ours = _elementwise(2, isa, y)
    assert _same_bits(ours, portable.exp(torch.from_numpy(y.copy())).numpy())
    assert _same_bits(ours, spec_numpy.exp32(y))  # and the NumPy implementation's


def _fma_probes() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    n = 1 << 18

    def f32(bits: np.ndarray) -> np.ndarray:
        return bits.astype(np.uint32).view(np.float32)

    def rand_bits(lo: int, hi: int, size: int) -> np.ndarray:
        return f32(rng.integers(lo, hi, size=size, dtype=np.uint64))

    a, b, c = [], [], []
    # any bit patterns (NaN, infinities, subnormals, zeros of both signs included)
    for arr in (a, b, c):
        arr.append(rand_bits(0, 2**32, n))
    # moderate exponents, product and addend of comparable size: cancellation, midpoints
    for arr in (a, b):
        arr.append(rng.uniform(-4, 4, n).astype(np.float32))
    c.append((a[-1].astype(np.float64) * b[-1].astype(np.float64)
              * -rng.choice([1.0, 1.0 + 2.0**-20, 1.0 - 2.0**-24], n)).astype(np.float32))
    # subnormal and underflowing results
    a.append(rand_bits(0x1E000000, 0x21000000, n) * rng.choice(np.array([1, -1], np.float32), n))
    b.append(rand_bits(0x1E000000, 0x21000000, n))
    c.append(rand_bits(0, 0x01000000, n) * rng.choice(np.array([1, -1], np.float32), n))
    # overflowing results
    a.append(rand_bits(0x5F000000, 0x60000000, n))
    b.append(rand_bits(0x5F000000, 0x60000000, n))
    c.append(-rand_bits(0x7E000000, 0x7F800000, n))
    # E's own operands: t = fma(yc, LOG2E, BIAS) and Horner steps
    yc = rng.uniform(-88, 0, n).astype(np.float32)
    a.append(yc)
    b.append(np.full(n, spec_numpy.LOG2E))
    c.append(np.full(n, spec_numpy.BIAS))
    # the double-rounding counterexample of docs/arithmetic.md section 1, and signed zeros
    hx = [float.fromhex(v) for v in ("0x1.000002p-12", "0x1.fffffcp-13", "0x1.000002p+0")]
    a.append(np.array([hx[0], 0.0, -0.0, 0.0, -0.0, 1.0], np.float32))
    b.append(np.array([hx[1], -88.0, 5.0, -1.0, 0.0, -1.0], np.float32))
    c.append(np.array([hx[2], 0.0, -0.0, 0.0, 0.0, 1.0], np.float32))
    return np.concatenate(a), np.concatenate(b), np.concatenate(c)


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_each_variant_fma_is_the_correctly_rounded_one(isa: str) -> None:
    """``fma`` of the variant (baseline: the software one by rounding to odd; AVX2, AVX-512:
    vfmadd) equals ``spec_numpy.fma32`` bit for bit, NaN payloads aside."""
    if isa not in _isas():
        pytest.skip(f"this CPU lacks {isa}")
    a, b, c = _fma_probes()
    ours = _elementwise(0, isa, a, b, c)
    assert _same_bits(ours, spec_numpy.fma32(a, b, c))
    # the counterexample: fma is 0x1.000002p+0, the binary64 sum rounded twice 0x1.000004p+0
    hx = [float.fromhex(v) for v in ("0x1.000002p-12", "0x1.fffffcp-13", "0x1.000002p+0")]
    one = _elementwise(0, isa, *[np.array([v], np.float32) for v in hx])
    twice = np.float32(np.float64(hx[0]) * np.float64(hx[1]) + np.float64(hx[2]))
    assert float(one[0]) == float.fromhex("0x1.000002p+0") != float(twice)
    # the three results of the special cases: +0 * LO + +0 == +0, -0 * 5 + -0 == -0
    assert ours[-6:].view(np.uint32)[1:5].tolist() == [0x00000000, 0x80000000, 0x00000000, 0x00000000]
    assert ours[-1] == 0.0  # 1 * -1 + 1
    # results in binary32's subnormal range and overflows occurred
    finite = np.isfinite(ours)
    assert np.any((ours != 0) & (np.abs(ours) < np.float32(2.0**-126)))
    assert np.any(np.isinf(ours) & np.isfinite(a) & np.isfinite(b) & np.isfinite(c)) and finite.any()


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_each_variant_divides_by_the_temperature_as_ieee_division(isa: str) -> None:
    """Section 6 step 0 in C (``x / T32``, the hook's op 3, vectors and the scalar tail): the
    correctly rounded quotient, NumPy's, on random bit patterns (NaN, infinities and subnormals
    among them) and every bf16 value, at several temperatures; the multiply by ``RN32(1/T32)``
    differs (negative control)."""
    if isa not in _isas():
        pytest.skip(f"this CPU lacks {isa}")
    rng = np.random.default_rng(41)
    x = np.concatenate([rng.integers(0, 1 << 32, 200003, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)])
    for t in (0.7, 0.3, 1.1, 2.7, 1e-10, 2.0 ** 64):
        t32 = np.float32(t)
        with np.errstate(all="ignore"):
            want, mul = np.divide(x, t32), np.multiply(x, np.divide(np.float32(1), t32))
        ours = _elementwise(3, isa, x, np.full_like(x, t32))
        assert _same_bits(ours, want), t
        assert t == 2.0 ** 64 or not _same_bits(ours, mul), t  # 1/2**64 is exact: there they agree


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_a_written_multiply_add_rounds_twice_in_every_variant(isa: str) -> None:
    """No contraction: ``a * b + c`` written in the kernel's source is a multiply then an add,
    also in the variants compiled for the FMA instruction (-ffp-contract=off)."""
    if isa not in _isas():
        pytest.skip(f"this CPU lacks {isa}")
    u = np.float32(1.0 + 2.0**-12)  # u * u = 1 + 2**-11 + 2**-24: the product rounds (a tie)
    a = np.array([u, u], np.float32)
    c = np.array([-(1.0 + 2.0**-11), 0.0], np.float32)
    written = _elementwise(1, isa, a, a, c)
    fused = _elementwise(0, isa, a, a, c)
    assert written[0] == 0.0 and fused[0] == np.float32(2.0**-24)
    assert written[1] == fused[1] == np.float32(1.0 + 2.0**-11)  # a * b rounded either way


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
    # /2 with a temperature per row (/1: 1, /2 before the temperature: 2, multiplying by r: 3, dividing by T32: 4)
    assert fused_cpu.ABI_VERSION == 5
    monkeypatch.setattr(fused_cpu, "ABI_VERSION", 999)
    with pytest.raises(fused_cpu.FusedKernelError, match="kernel ABI 5, this code needs 999"):
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
