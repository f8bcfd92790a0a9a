"""Self-contained tests of rl_engine/arith/spec_numpy.py (the NumPy reading of docs/arithmetic.md).

These check the NumPy implementation against float64 oracles, exact rational arithmetic
(``fractions.Fraction``: the fused multiply-add), hand-written fold and lane orders and
hand-picked bit patterns; they do not import torch or rl_engine.logprob. ``rl-engine-arith/2``
is the default; ``rl-engine-arith/1`` (``docs/arithmetic-1.md``) stays for the replay of
archives made under it.
"""

from __future__ import annotations

import math
from decimal import Decimal, getcontext
from fractions import Fraction

import numpy as np
import pytest

from rl_engine.arith import spec_numpy as sn

F32 = np.float32
U32 = np.uint32

# Measured maxima of the strided sweeps below (see measure_ulp for the full sweep: /2's E
# 0.8822 on [-87, 0], 0.9091 on [0, 88.376]; /1's 1.1622); the bounds leave a small margin and
# are far below what a wrong constant or order gives.
EXP_MAX_ULP = 0.92
EXP1_MAX_ULP = 1.25
LOG_MAX_ULP = 0.85
FMA_COUNTEREXAMPLE = (float.fromhex("0x1.000002p-12"), float.fromhex("0x1.fffffcp-13"),
                      float.fromhex("0x1.000002p+0"))


def bits32(x) -> np.ndarray:
    return np.asarray(x, F32).view(U32)


def from_bits(b) -> np.ndarray:
    return np.asarray(b, dtype=np.uint64).astype(U32).view(F32)


def fb(x: float) -> int:
    return int(bits32(np.array([x], F32))[0])


def strided(lo: float, hi: float, stride: int) -> np.ndarray:
    """Every `stride`-th binary32 between lo and hi (same sign), by bit pattern."""
    a, b = sorted((fb(lo), fb(hi)))
    return from_bits(np.arange(a, b + 1, stride, dtype=np.uint64))


# ---------------------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------------------
def test_spec_version_and_constants():
    assert sn.SPEC_VERSION == "rl-engine-arith/2" and sn.SPECS == ("rl-engine-arith/1", "rl-engine-arith/2")
    getcontext().prec = 50
    ln2 = Decimal(2).ln()
    # /2's E: LN2_HI2 = RN32(ln 2), LN2_LO2 = RN32(ln 2 - LN2_HI2), BIAS = 1.5 * 2**23 + 127
    assert float(sn.LN2_HI2) == float(F32(float(ln2)))
    assert float(F32(float(ln2 - Decimal(float(sn.LN2_HI2))))) == float(sn.LN2_LO2)
    assert float(sn.BIAS) == 1.5 * 2 ** 23 + 127 and float(sn.E2_LO) == -88.0
    assert float(F32(float(1 / ln2))) == float(sn.LOG2E)
    assert float(F32(math.sqrt(2.0))) == float(sn.SQRT2)
    # /1's and L's LN2_HI has 15 significant bits: k * LN2_HI exact for |k| <= 256
    assert float(F32(float(ln2 - Decimal(float(sn.LN2_HI))))) == float(sn.LN2_LO)
    m, _ = math.frexp(float(sn.LN2_HI))
    assert (m * 2 ** 15) == int(m * 2 ** 15)
    k = np.arange(-256, 257).astype(F32)
    assert np.all((k * sn.LN2_HI).astype(np.float64) == k.astype(np.float64) * float(sn.LN2_HI))
    # section 10: 0x1.bb67aep-16 is the binary32 nearest to 1/sqrt((65536**2 - 1)/3)
    exact = Decimal(1) / ((Decimal(65536) ** 2 - 1) / 3).sqrt()
    assert float(F32(float(exact))) == float(sn.IH_SCALE)
    assert 131070 * float(sn.IH_SCALE) < 3.47


# ---------------------------------------------------------------------------------------
# Section 1: fusedMultiplyAdd, exactly
# ---------------------------------------------------------------------------------------
def fma_reference(a: float, b: float, c: float) -> float:
    """fma(a, b, c) of binary32 values: the exact rational a * b + c, rounded once to binary32 by
    exact comparison with its neighbours (no binary64 rounding on the way)."""
    if not all(math.isfinite(v) for v in (a, b, c)):
        return float(F32(a * b + c))  # IEEE specials: binary64 gives the same
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:
        return float(F32(a * b + c))  # the sign of an exact zero is binary64's
    guess = F32(float(exact))  # within one ulp of the answer
    cands = {float(np.nextafter(guess, F32(-np.inf))), float(guess), float(np.nextafter(guess, F32(np.inf)))}
    finite = sorted(v for v in cands if math.isfinite(v))
    best = min(finite, key=lambda v: (abs(Fraction(v) - exact), int(bits32(np.array([v], F32))[0]) & 1))
    if abs(exact) >= Fraction(2) ** 128 - Fraction(2) ** 103:  # past the midpoint above FLT_MAX
        return math.copysign(math.inf, float(exact))
    return best


def test_fma32_counterexample_and_its_negative_control():
    a, b, c = (np.array([v], F32) for v in FMA_COUNTEREXAMPLE)
    assert float(sn.fma32(a, b, c)[0]).hex() == "0x1.0000020000000p+0"
    assert fma_reference(*FMA_COUNTEREXAMPLE) == float.fromhex("0x1.000002p+0")
    # binary64 a*b + c rounded to binary32 rounds twice: another value
    naive = (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)
    assert float(naive[0]).hex() == "0x1.0000040000000p+0"


def test_fma32_is_the_correctly_rounded_fma():
    rng = np.random.default_rng(5)
    n = 4000
    a = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(F32)
    b = (rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(F32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0 ** -rng.integers(1, 40, n))).astype(F32)
    c[::3] = (rng.standard_normal(n // 3 + 1) * 2.0 ** rng.integers(-60, 60, n // 3 + 1)).astype(F32)
    # near binary32 midpoints: a * b a small odd multiple of half an ulp of c
    c[1::7] = F32(1.0)
    a[1::7] = F32(2.0 ** -24) * (rng.integers(0, 64, len(a[1::7])) * 2 + 1).astype(F32)
    b[1::7] = (1 + rng.integers(-4, 4, len(b[1::7])) * 2.0 ** -23).astype(F32)
    # subnormal and overflowing results, signed zeros, specials
    specials = [(2.0 ** -75, 2.0 ** -75, 0.0), (3e-39, 0.5, 1e-45), (-2.0 ** -140, 1.5, 2.0 ** -149),
                (3e38, 2.0, -1e38), (3.4e38, 1.0, 3.4e38), (1.0, -0.0, 0.0), (-0.0, 5.0, -0.0),
                (2.0, 3.0, -6.0), (np.inf, 0.0, 1.0), (np.inf, 1.0, -np.inf), (np.nan, 1.0, 1.0),
                (1.0, 1.0, np.inf), FMA_COUNTEREXAMPLE]
    a = np.concatenate([a, np.array([v[0] for v in specials], F32)])
    b = np.concatenate([b, np.array([v[1] for v in specials], F32)])
    c = np.concatenate([c, np.array([v[2] for v in specials], F32)])
    got = sn.fma32(a, b, c)
    want = np.array([fma_reference(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)], F32)
    same = (bits32(got) == bits32(want)) | (np.isnan(got) & np.isnan(want))
    assert bool(same.all()), [(float(a[i]).hex(), float(b[i]).hex(), float(c[i]).hex())
                              for i in np.flatnonzero(~same)[:5]]
    naive = (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)
    assert np.count_nonzero((bits32(naive) != bits32(want)) & ~np.isnan(want)) > 0  # double rounding shows


# ---------------------------------------------------------------------------------------
# Section 3: exp
# ---------------------------------------------------------------------------------------
# /2's E runs the exact NumPy fma32 (slow): every 509th binary32 (2.2 million points); /1's every 64th
@pytest.mark.parametrize("exp, bound, top, stride", [(sn.exp32, EXP_MAX_ULP, 88.376, 509),
                                                     (sn.exp32_v1, EXP1_MAX_ULP, 88.7, 64)],
                         ids=["arith2", "arith1"])
def test_exp32_sweep_ulp_and_no_subnormals(exp, bound, top, stride):
    worst = []
    for lo, hi in ((-87.0, -0.0), (0.0, top)):
        y = strided(lo, hi, stride)
        r = exp(y)
        assert r.dtype == F32
        err, _ = sn.ulp_errors(r, np.exp(y.astype(np.float64)))
        worst.append(float(err.max()))
        # every result normal (no subnormal, no zero) in [-87, top]
        assert np.all(r >= np.finfo(F32).tiny) and np.all(np.isfinite(r))
    assert max(worst) <= bound, worst


def test_exp32_special_values_and_ends():
    def e(v):
        return sn.exp32(np.array(v, F32))

    assert bits32(e([0.0, -0.0])).tolist() == [fb(1.0), fb(1.0)]
    assert bits32(e([-np.inf])).tolist() == [0]  # +0
    assert e([np.inf])[0] == np.inf
    assert np.isnan(e([np.nan])[0])
    below = strided(-87.7, -3.4e38, 4099)  # k = -127: +0, never -0
    assert np.all(bits32(sn.exp32(below)) == 0)
    # gradual underflow just above: subnormal results, correctly rounded products p * 2**-126
    sub = strided(-87.6, -87.4, 97)
    r = sn.exp32(sub)
    assert np.all(r > 0) and np.any(r < np.finfo(F32).tiny)
    err, _ = sn.ulp_errors(r, np.exp(sub.astype(np.float64)))
    assert float(err.max()) < 1.0
    # +inf from the first binary32 with k = 128 on; finite just below it
    first = F32(float.fromhex("0x1.61814ep+6"))
    assert e([first])[0] == np.inf and np.isfinite(e([np.nextafter(first, F32(0))])[0])
    assert np.all(sn.exp32(strided(88.38, 3.4e38, 1 << 16)) == np.inf)


def test_exp32_first_reduction_step_is_exact():
    """Section 3 step 4: fma(kf, -LN2_HI, yc) rounds nothing, on every 97th binary32 of [-88, 89]."""
    y = np.concatenate([strided(-88.0, -0.0, 97), strided(0.0, 89.0, 97)])
    t = sn.fma32(y, sn.LOG2E, sn.BIAS)
    kf = np.subtract(t, sn.BIAS)
    assert np.all(np.abs(kf) <= 128) and np.array_equal(kf, np.round(kf))
    r = sn.fma32(kf, -sn.LN2_HI2, y)
    exact = y.astype(np.float64) - kf.astype(np.float64) * float(sn.LN2_HI2)  # exact in binary64
    assert np.array_equal(r.astype(np.float64), exact)


def test_exp32_without_fma_gives_other_bytes(monkeypatch):
    """Negative control: each fma as a binary32 multiply then add (two roundings, /1's habit)
    changes E on a few percent of arguments. (The naive binary64 emulation errs only where a binary64 sum
    lands exactly on a binary32 midpoint: test_fma32_is_the_correctly_rounded_fma shows it.)"""
    y = strided(-87.0, -0.0, 4099)
    good = sn.exp32(y)

    def unfused(a, b, c):
        a, b, c = (np.asarray(v, F32) for v in (a, b, c))
        return np.add(np.multiply(a, b), c)

    monkeypatch.setattr(sn, "fma32", unfused)
    differ = np.count_nonzero(bits32(sn.exp32(y)) != bits32(good))
    assert differ > y.size // 100, differ  # 2.4 % of this sweep (many of its arguments are tiny: E = 1)


# ---------------------------------------------------------------------------------------
# Section 5: log
# ---------------------------------------------------------------------------------------
def test_log32_sweep_ulp():
    worst = []
    for x in (strided(1.0, 2.0 ** 20, 64),
              from_bits(np.arange(0x00800000, 0x7F800000, 4093, dtype=np.uint64)),
              from_bits(np.arange(1, 0x00800000, 4093, dtype=np.uint64))):
        r = sn.log32(x)
        assert r.dtype == F32
        err, _ = sn.ulp_errors(r, np.log(x.astype(np.float64)))
        worst.append(float(err.max()))
    assert max(worst) <= LOG_MAX_ULP, worst
    x = strided(1.0, 2.0 ** 20, 64)
    assert np.all(sn.log32(x) >= 0)


def test_log32_special_values():
    x = np.array([1.0, 0.0, -0.0, -1.0, np.inf, -np.inf, np.nan, -1e-45], F32)
    r = sn.log32(x)
    assert bits32(r[0]) == 0  # L(1) = +0
    assert r[1] == -np.inf and r[2] == -np.inf
    assert np.isnan(r[3]) and np.isnan(r[5]) and np.isnan(r[6]) and np.isnan(r[7])
    assert r[4] == np.inf
    assert sn.log32(np.array([2.0], F32))[0] == F32(math.log(2.0))


# ---------------------------------------------------------------------------------------
# Section 4: fold
# ---------------------------------------------------------------------------------------
class Sym:
    def __init__(self, s):
        self.s = s

    def __add__(self, o):
        return Sym(f"({self.s}+{o.s})")


EXPECTED_FOLD = {
    1: "a",
    2: "(a+b)",
    3: "((a+c)+b)",
    4: "((a+c)+(b+d))",
    5: "(((a+d)+c)+(b+e))",
    6: "(((a+d)+(c+f))+(b+e))",
    7: "(((a+e)+(c+g))+((b+f)+d))",
    8: "(((a+e)+(c+g))+((b+f)+(d+h)))",
    9: "((((a+f)+(d+i))+(c+h))+((b+g)+e))",
}


@pytest.mark.parametrize("n", range(1, 10))
def test_fold_grouping(n):
    v = np.empty(n, dtype=object)
    for i in range(n):
        v[i] = Sym("abcdefghi"[i])
    assert sn.fold(v).s == EXPECTED_FOLD[n]
    # numerically, bit for bit, with the same order written by hand in binary32
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((5, n)) * 10.0 ** rng.integers(-3, 4, (5, n))).astype(F32)
    env = {c: x[:, i] for i, c in enumerate("abcdefghi"[:n])}
    ref = eval(EXPECTED_FOLD[n], {}, env)  # float32 array adds, in the written order
    got = sn.fold(x, axis=1)
    assert got.dtype == F32 and np.array_equal(bits32(got), bits32(ref))
    got0 = sn.fold(x.T.copy(), axis=0)
    assert np.array_equal(bits32(got0), bits32(ref))


def test_fold_differs_from_left_to_right():
    v = np.array([1.0, 2.0 ** 24, -(2.0 ** 24)], F32)
    ltr = (v[0] + v[1]) + v[2]
    assert ltr == 0.0 and sn.fold(v) == 1.0
    assert sn.fold(np.array([3.0], F32)) == 3.0
    with pytest.raises(ValueError):
        sn.fold(np.zeros(0, F32))


def lane_sum_by_hand(v: np.ndarray, lanes: int = 128, fma_with: np.ndarray | None = None) -> np.float32:
    """G (or G*) written out in Python: lane l adds columns l, l + lanes, ... in order, then the
    halving F of the lanes."""
    acc = [F32(0.0)] * lanes
    for c in range(len(v)):
        if fma_with is None:
            acc[c % lanes] = F32(acc[c % lanes] + v[c])
        else:
            acc[c % lanes] = F32(fma_reference(float(v[c]), float(fma_with[c]), float(acc[c % lanes])))
    w = lanes
    while w > 1:
        w //= 2
        acc = [F32(acc[i] + acc[i + w]) for i in range(w)]
    return acc[0]


@pytest.mark.parametrize("width", [1, 3, 127, 128, 129, 143, 300, 2374])
def test_lane_sums_are_the_written_order(width):
    rng = np.random.default_rng(width)
    v = (rng.standard_normal((2, width)) * 10.0 ** rng.integers(-4, 5, (2, width))).astype(F32)
    u = rng.random((2, width)).astype(F32)
    got, got_fma = sn.lane_sum(v), sn.lane_fma_sum(u, v)
    for row in range(2):
        assert bits32(got[row]) == bits32(lane_sum_by_hand(v[row]))
        assert bits32(got_fma[row]) == bits32(lane_sum_by_hand(u[row], fma_with=v[row]))


def test_lane_sum_negative_controls():
    """Another lane count, or the fold F over the whole tile (/1's order), change the bytes."""
    rng = np.random.default_rng(0)
    v = (rng.standard_normal((64, 2374)) * 10.0 ** rng.integers(-4, 5, (64, 2374))).astype(F32)
    g = sn.lane_sum(v)
    assert not np.array_equal(bits32(g), bits32(np.array([lane_sum_by_hand(r, 64) for r in v[:8]] +
                                                            list(g[8:]), F32)))
    assert not np.array_equal(bits32(g), bits32(sn.fold(v, axis=1)))
    # a lane of no column stays +0 and -0 terms never make a -0 lane
    assert bits32(sn.lane_sum(np.full((1, 5), -0.0, F32)))[0] == 0


# ---------------------------------------------------------------------------------------
# Conversions and the rounding of section 8
# ---------------------------------------------------------------------------------------
def test_to_f32():
    b = np.array([0x3F80, 0xBF80, 0x0001, 0x7F80, 0xFF80, 0x7FC0, 0x8000], np.uint16)
    assert sn.to_f32(b, "bfloat16").view(U32).tolist() == [int(v) << 16 for v in b]
    h = np.array([1.0, 6e-8, -65504.0, np.inf], np.float16)
    assert np.array_equal(sn.to_f32(h, "float16"), h.astype(np.float64).astype(F32))
    with pytest.raises(TypeError):
        sn.to_f32(np.zeros(2, F32), "bfloat16")
    with pytest.raises(ValueError):
        sn.to_f32(np.zeros(2, F32), "bf16")


def bf16_reference(u: int) -> int:
    """Round-to-nearest-even binary32 -> bf16 by exact float64 comparison (not the formula)."""
    x = float(from_bits([u])[0])
    if math.isnan(x):
        return 0x7FC0
    if math.isinf(x):
        return u >> 16
    sign = u & 0x80000000
    mag = u & 0x7FFFFFFF
    lo = mag & 0xFFFF0000
    hi = lo + 0x10000
    vlo = float(from_bits([lo])[0])
    vhi = 2.0 ** 128 if hi == 0x7F800000 else float(from_bits([hi])[0])
    ax = abs(x)
    if ax - vlo < vhi - ax or (ax - vlo == vhi - ax and ((lo >> 16) & 1) == 0):
        r = lo
    else:
        r = hi
    return (sign | r) >> 16


BF16_CASES = {
    0x00000000: 0x0000, 0x80000000: 0x8000, 0x3F800000: 0x3F80,
    0x3F808000: 0x3F80,  # tie, even below
    0x3F818000: 0x3F82,  # tie, odd below -> up
    0x3F808001: 0x3F81, 0x3F807FFF: 0x3F80,
    0x00008000: 0x0000,  # subnormal tie to even (zero)
    0x00018000: 0x0002,  # subnormal tie, odd below -> up
    0x00007FFF: 0x0000, 0x00008001: 0x0001,
    0x007FFFFF: 0x0080,  # largest subnormal rounds up into the smallest normal
    0x807FFFFF: 0x8080,
    0x7F7FFFFF: 0x7F80,  # max float -> +inf
    0xFF7FFFFF: 0xFF80,
    0x7F7F7FFF: 0x7F7F, 0x7F7F8000: 0x7F80,  # tie at the top, odd below -> inf
    0x7F800000: 0x7F80, 0xFF800000: 0xFF80,
    0x7FC00000: 0x7FC0, 0xFFC00000: 0x7FC0, 0x7F800001: 0x7FC0, 0xFFFFFFFF: 0x7FC0,
}


def test_round_bf16_hand_picked_and_random():
    u = np.array(list(BF16_CASES), U32)
    got = sn.round_bf16(u.view(F32))
    assert got.dtype == np.uint16
    assert got.tolist() == list(BF16_CASES.values())
    assert [bf16_reference(int(v)) for v in u] == list(BF16_CASES.values())
    rng = np.random.default_rng(0)
    r = rng.integers(0, 2 ** 32, 3000, dtype=np.uint64).astype(U32)
    r[:500] &= U32(0x807FFFFF)  # subnormals
    r[500:1000] = (r[500:1000] & U32(0xFFFF0000)) | U32(0x8000)  # ties
    got = sn.round_bf16(r.view(F32)).tolist()
    assert got == [bf16_reference(int(v)) for v in r]


def test_round_f16_hand_picked():
    cases = [
        (2.0 ** -24, 0x0001), (2.0 ** -25, 0x0000), (3 * 2.0 ** -25, 0x0002),
        (2.0 ** -25 + 2.0 ** -40, 0x0001), (-(2.0 ** -24), 0x8001),
        (65504.0, 0x7BFF), (65519.0, 0x7BFF), (65520.0, 0x7C00), (1e30, 0x7C00),
        (-1e30, 0xFC00), (1.0 + 2.0 ** -11, 0x3C00), (1.0 + 3 * 2.0 ** -11, 0x3C02),
        (np.inf, 0x7C00),
    ]
    x = np.array([c[0] for c in cases], F32)
    assert sn.round_f16(x).view(np.uint16).tolist() == [c[1] for c in cases]
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], U32).view(F32)
    assert sn.round_f16(nans).view(np.uint16).tolist() == [0x7E00] * 4
    assert sn.canon_nan(nans).view(U32).tolist() == [0x7FC00000] * 4


# ---------------------------------------------------------------------------------------
# Section 6: forward
# ---------------------------------------------------------------------------------------
def oracle_forward(x32: np.ndarray, targets, active, real_vocab):
    x = x32[:, :real_vocab].astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(x - lse[:, None])
    ent = lse - (p * x).sum(axis=1)
    logp = np.where(active, x[np.arange(len(x)), np.minimum(targets, real_vocab - 1)] - lse, 0.0)
    return logp, lse, ent


def tiny_case(dtype, rows=6, real=37, padded=48, seed=3, scale=4.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, padded)) * scale).astype(F32)
    x[:, real:] = rng.standard_normal((rows, padded - real)).astype(F32) * 1e4
    if dtype == "bfloat16":
        logits = sn.round_bf16(x)
    elif dtype == "float16":
        logits = x.astype(np.float16)
    else:
        logits = x
    targets = rng.integers(0, real, rows)
    active = np.array([True, False, True, True, True, False][:rows])
    return logits, targets, active, real


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("tiles", [1, 2, 3, 4, 16])
def test_forward_matches_float64_oracle(dtype, tiles):
    logits, targets, active, real = tiny_case(dtype)
    logp, lse, ent = sn.forward(logits, dtype, targets, active, real, tiles, True)
    assert logp.dtype == lse.dtype == ent.dtype == F32
    x32 = sn.to_f32(logits, dtype)
    olp, olse, oent = oracle_forward(x32, targets, active, real)
    tol = 1e-6 * np.maximum(1.0, np.abs(olse))
    assert np.all(np.abs(lse - olse) <= tol)
    assert np.all(np.abs(logp - olp) <= tol)
    assert np.all(np.abs(ent - oent) <= 2 * tol)
    assert np.all(bits32(logp[~active]) == 0)  # +0 on inactive rows
    # without entropy: same logp/lse bytes
    lp2, lse2, none = sn.forward(logits, dtype, targets, active, real, tiles, False)
    assert none is None
    assert np.array_equal(bits32(lp2), bits32(logp)) and np.array_equal(bits32(lse2), bits32(lse))


def test_forward_ignores_padding_values():
    logits, targets, active, real = tiny_case("float32")
    a = sn.forward(logits, "float32", targets, active, real, 4, True)
    other = logits.copy()
    other[:, real:] = np.array([np.nan, np.inf, -np.inf, 3e38], F32)[np.arange(48 - real) % 4]
    b = sn.forward(other, "float32", targets, active, real, 4, True)
    for u, v in zip(a, b):
        assert np.array_equal(bits32(u), bits32(v))


def test_forward_signed_zero_logits_same_bytes():
    rows, vp = 2, 8
    t, act = np.zeros(rows, np.int64), np.ones(rows, bool)
    pos = sn.forward(np.zeros((rows, vp), F32), "float32", t, act, vp, 2, True)
    neg = sn.forward(np.full((rows, vp), -0.0, F32), "float32", t, act, vp, 2, True)
    for u, v in zip(pos, neg):
        assert np.array_equal(bits32(u), bits32(v))
    assert abs(pos[1][0] - math.log(8)) < 1e-6


def test_forward_edge_rows():
    vp, real = 8, 6
    x = np.zeros((4, vp), F32)
    x[0, :] = -np.inf  # all -inf real row (padding too)
    x[1, 2] = from_bits([0xFFC00001])[0]  # NaN with payload and sign
    x[2, 5] = from_bits([0x7F800001])[0]  # signalling-pattern NaN
    x[3, 1] = np.inf
    t = np.array([1, 1, 1, 0])
    act = np.ones(4, bool)
    logp, lse, ent = sn.forward(x, "float32", t, act, real, 2, True)
    assert lse[0] == -np.inf
    assert bits32(ent[0]) == 0x7FC00000
    assert bits32(logp[0]) == 0x7FC00000  # -inf - (-inf)
    for r in (1, 2):
        assert bits32(lse[r]) == 0x7FC00000 and bits32(ent[r]) == 0x7FC00000
        assert bits32(logp[r]) == 0x7FC00000
    assert bits32(ent[3]) == 0x7FC00000
    assert np.all(bits32(np.concatenate([logp, lse, ent])[np.isnan(np.concatenate([logp, lse, ent]))]) == 0x7FC00000)
    # inactive NaN row: logp is +0, LSE still canonical NaN
    lp, ls, _ = sn.forward(x, "float32", t, np.zeros(4, bool), real, 2, False)
    assert np.all(bits32(lp) == 0) and bits32(ls[1]) == 0x7FC00000


def test_a_minus_inf_logit_adds_nothing_to_the_entropy():
    """/2: a real -inf among finite logits contributes 0 (E(-inf) = +0, its term +0 * LO = -0);
    /1 made the entropy NaN (0 * -inf)."""
    x = np.linspace(-2, 2, 16, dtype=F32).reshape(2, 8)
    x[1, 3] = -np.inf
    t, act = np.array([0, 0]), np.ones(2, bool)
    _, lse, ent = sn.forward(x, "float32", t, act, 8, 2, True)
    _, lse_drop, ent_drop = sn.forward(np.delete(x, 3, axis=1), "float32", t, act, 7, 1, True)
    assert np.isfinite(ent[1]) and abs(float(ent[1]) - float(ent_drop[1])) < 1e-6
    assert abs(float(lse[1]) - float(lse_drop[1])) < 1e-6
    _, _, ent1 = sn.forward(x, "float32", t, act, 8, 2, True, spec=sn.SPEC_V1)
    assert np.isnan(ent1[1])


def test_forward_rejects_bad_arguments():
    x = np.zeros((2, 8), F32)
    t, a = np.zeros(2, np.int64), np.ones(2, bool)
    with pytest.raises(ValueError, match="leaves a tile with no column"):
        sn.forward(x, "float32", t, a, 8, 4 + 3, False)  # 7 tiles of 2 columns: the last past the 8
    with pytest.raises(ValueError, match="must divide"):
        sn.forward(x, "float32", t, a, 8, 3, False, spec=sn.SPEC_V1)  # /1 takes only a dividing count
    sn.forward(x, "float32", t, a, 8, 3, False)  # /2: tiles of 3, 3, 2 columns (section 6)
    with pytest.raises(ValueError):
        sn.forward(x, "float32", np.array([0, 8]), a, 8, 2, False)
    with pytest.raises(TypeError):
        sn.forward(x.astype(np.float16), "float32", t, a, 8, 2, False)
    # inactive rows may carry any target
    sn.forward(x, "float32", np.array([0, -100]), np.array([True, False]), 8, 2, False)


# ---------------------------------------------------------------------------------------
# Sections 7, 8: backward
# ---------------------------------------------------------------------------------------
def oracle_grad(x32, targets, active, real, g_logp, g_lse):
    x = x32[:, :real].astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))
    p = np.exp(x - lse)
    gl = np.where(active, g_logp, 0.0).astype(np.float64)
    g = (g_lse.astype(np.float64) - gl)[:, None] * p
    g[np.arange(len(x))[active], targets[active]] += gl[active]
    out = np.zeros(x32.shape)
    out[:, :real] = g
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_backward_matches_float64_oracle(dtype):
    logits, targets, active, real = tiny_case(dtype)
    rows = len(targets)
    rng = np.random.default_rng(11)
    g_logp = rng.standard_normal(rows).astype(F32)
    g_lse = rng.standard_normal(rows).astype(F32)
    _, lse, _ = sn.forward(logits, dtype, targets, active, real, 4, False)
    g = sn.backward(logits, dtype, targets, active, lse, g_logp, g_lse, real, 4)
    want_dtype = {"float32": F32, "bfloat16": np.uint16, "float16": np.float16}[dtype]
    assert g.dtype == want_dtype and g.shape == logits.shape
    g32 = sn.to_f32(g, dtype).astype(np.float64)
    ref = oracle_grad(sn.to_f32(logits, dtype), targets, active, real, g_logp, g_lse)
    rel = {"float32": 2e-6, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}[dtype]
    assert np.all(np.abs(g32 - ref) <= rel * np.abs(ref) + 1e-6 * (dtype != "float32") + 1e-7)
    assert np.all(sn.to_f32(g, dtype)[:, real:].view(U32) == 0)  # padding +0
    if dtype == "float32":  # the rounding is applied once, to the binary32 gradient
        for dt, rnd in (("bfloat16", sn.round_bf16), ("float16", sn.round_f16)):
            lg = sn.round_bf16(logits) if dt == "bfloat16" else logits.astype(np.float16)
            _, lse2, _ = sn.forward(lg, dt, targets, active, real, 4, False)
            g2 = sn.backward(lg, dt, targets, active, lse2, g_logp, g_lse, real, 4)
            g2_32 = sn.backward(sn.to_f32(lg, dt), "float32", targets, active, lse2,
                                g_logp, g_lse, real, 4)
            assert np.array_equal(g2.view(np.uint16), rnd(g2_32).view(np.uint16))


def test_backward_zero_coef_rows_and_nan():
    vp, real = 8, 6
    x = np.zeros((4, vp), F32)
    x[3, 2] = np.nan
    t = np.array([1, 2, 3, 0])
    act = np.array([True, True, False, True])
    g_logp = np.array([0.5, -0.0, 7.0, 1.0], F32)
    g_lse = np.array([0.5, 0.0, 0.0, 0.0], F32)  # coef: 0, -0 ... row 2 inactive -> coef 0
    lse = np.array([1.0, 1.0, 1.0, np.nan], F32)
    for dt, conv in (("float32", lambda a: a), ("bfloat16", sn.round_bf16),
                     ("float16", lambda a: a.astype(np.float16))):
        g = sn.backward(conv(x), dt, t, act, lse, g_logp, g_lse, real, 2)
        g32 = sn.to_f32(g, dt)
        u = g32.view(U32)
        # row 0: coef = 0 -> +0 everywhere but the target, which gets 0 + 0.5
        assert g32[0, 1] == 0.5 and np.all(np.delete(u[0], 1) == 0)
        # row 1: coef = 0 - (-0) = +0 ... target gets +0 + -0 = +0
        assert np.all(u[1] == 0)
        # row 2: inactive, g_lse = 0: all +0 (no target term)
        assert np.all(u[2] == 0)
        # row 3: coef = -1, LSE NaN -> canonical NaN on real columns, +0 padding
        nan_bits = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}[dt]
        raw = g.view(U32 if dt == "float32" else np.uint16)
        assert np.all(raw[3, :real] == nan_bits) and np.all(raw[3, real:] == 0)


# ---------------------------------------------------------------------------------------
# Section 10: inputs
# ---------------------------------------------------------------------------------------
def splitmix_py(s: int, i: int) -> int:
    M = (1 << 64) - 1
    z = (s * 0x9E3779B97F4A7C15 + i * 0xD1B54A32D192ED03 + 0x632BE59BD9B4E019) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def test_make_inputs():
    batch, seq, prompt, real, padded, seed, scale = 3, 5, 2, 1000, 1024, 7, 2.5
    x, t, a = sn.make_inputs(batch, seq, prompt, real, padded, seed, scale)
    assert x.dtype == F32 and x.shape == (15, padded) and t.dtype == np.int64 and a.dtype == bool
    x2, t2, a2 = sn.make_inputs(batch, seq, prompt, real, padded, seed, scale)
    assert np.array_equal(bits32(x), bits32(x2)) and np.array_equal(t, t2) and np.array_equal(a, a2)
    x3, _, _ = sn.make_inputs(batch, seq, prompt, real, padded, seed + 1, scale)
    assert not np.array_equal(x, x3)
    # pure-Python spot checks of the hash, the Irwin-Hall sum and the scale
    for row, col in ((0, 0), (4, 17), (14, 999), (7, 512)):
        z = splitmix_py(seed, row * padded + col)
        n = sum((z >> (16 * k)) & 0xFFFF for k in range(4))
        want = F32(F32(n - 131070) * sn.IH_SCALE) * F32(scale)
        assert bits32(x[row, col]) == bits32(want)
    for row in range(15):
        assert t[row] == splitmix_py(seed, 2 ** 62 + row) % real
    assert a.tolist() == [(r % seq) >= prompt for r in range(15)]
    assert np.all(x[:, real:] == 100.0)
    body = x[:, :real].astype(np.float64) / scale
    assert abs(body.mean()) < 0.03 and abs(body.var() - 1.0) < 0.05
    assert np.abs(x[:, :real]).max() <= 3.47 * scale
    assert np.all((t >= 0) & (t < real))


def test_make_inputs_blocks_do_not_change_bytes():
    # 2**21 // 152064 = 13 rows per block: 30 rows span three blocks
    x, _, _ = sn.make_inputs(2, 15, 3, 151936, 152064, 1234, 1.0)
    xr, _, _ = sn.make_inputs(1, 1, 0, 151936, 152064, 1234, 1.0)
    assert np.array_equal(bits32(xr[0]), bits32(x[0]))
    for row in (0, 12, 13, 29):
        for col in (5, 151935):
            z = splitmix_py(1234, row * 152064 + col)
            n = sum((z >> (16 * k)) & 0xFFFF for k in range(4))
            assert bits32(x[row, col]) == bits32(F32(F32(n - 131070) * sn.IH_SCALE) * F32(1.0))
    assert np.all(x[:, 151936:] == 100.0)
