"""The division by ``T32`` (docs/arithmetic.md section 6 step 0, "Dividing by T32 on a GPU").

The specification divides (``RN32(x / T32)``). Three implementations use the IEEE division
(NumPy, PyTorch on the CPU, C); the Triton kernels use Markstein's sequence (``rl_engine.arith.division``)
where it is proved exact and the IEEE division elsewhere. Here, exactly (``spec_numpy.fma32`` rounds
once): the sequence is the quotient for every finite bf16 and binary16 value in its domain at each
listed temperature, and the kernels' choice is the quotient for every value; one step on every bf16
significand against sampled temperature significands (``scripts/markstein_proof.py`` runs every one
of the 2**23); two steps on sampled binary32 significands; ``-0`` keeps its sign; values below the
domain stay below the bound the kernels' guard uses; outside the domain the sequence is wrong
(negative control: the guard is needed). Triton's interpreter runs the kernels' own ``markstein``
with NumPy's bits; PyTorch's CPU division by a binary32 scalar is IEEE (and the multiply by the
reciprocal is not).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from rl_engine.arith import division
from rl_engine.arith.spec_numpy import fma32

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow) encountered:RuntimeWarning")

F32 = np.float32
# the issue's list, the campaign's and the tests' temperatures, the extremes of the range, a few random
TEMPERATURES = (0.1, 0.3, 0.6, 0.7, 0.9, 1.1, 1.5, 2.7, 3.0, 0.25, 1.3, 2.0 ** -64, 2.0 ** 64, 1e-10, 1e10,
                0.5372, 1.8123, 4.4011, 0.0731)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, F32).view(np.uint32)


def _values(dtype: str) -> np.ndarray:
    """Every finite value of ``dtype`` as binary32."""
    if dtype == "bfloat16":
        x = (np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)).view(F32)
    else:
        x = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32)
    return x[np.isfinite(x)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_step_is_the_quotient_for_every_value_in_the_domain(dtype: str) -> None:
    """Every finite bf16 (binary16) value at every listed temperature: on the domain the sequence
    is the IEEE quotient, and the kernels' choice (the IEEE division outside it) everywhere."""
    x = _values(dtype)
    for t in TEMPERATURES:
        t32 = float(F32(t))
        want = _bits(np.divide(x, F32(t32)))
        inside = division.in_domain(x, t32)
        got = _bits(division.markstein(x, t32, division.STEPS[dtype]))
        assert np.array_equal(got[inside], want[inside]), t
        assert np.array_equal(_bits(division.kernel_quotient(x, t32, 1)), want), t
        if dtype == "float16":
            assert inside.all(), t  # binary16's range lies in the domain at every temperature


def test_outside_the_domain_the_sequence_is_wrong() -> None:
    """Negative control: an infinity gives NaN, an overflowing quotient NaN, and quotients near the
    subnormal range are one unit off: the kernels must not use the sequence there."""
    x = _values("bfloat16")
    wrong = 0
    for t in (0.3, 0.7, 1.1, 2.7):
        got, want = division.markstein(x, t, 1), np.divide(x, F32(t))
        bad = (_bits(got) != _bits(want)) & ~(np.isnan(got) & np.isnan(want))
        assert not (bad & division.in_domain(x, t)).any()
        wrong += int(bad.sum())
    assert wrong > 100
    inf = np.array([np.inf, -np.inf], F32)
    assert np.isnan(division.markstein(inf, 0.7, 1)).all()
    assert np.isnan(division.markstein(np.array([3e38], F32), 0.25, 2)).all()  # 1.2e39: inf, not NaN


def test_one_step_on_every_bf16_significand_against_sampled_temperature_significands() -> None:
    """The all-temperature proof's sampled form: every bf16 significand A against 512 binary32
    significands B (with the extremes 1 and 2 - 2**-23); scripts/markstein_proof.py runs all 2**23."""
    rng = np.random.default_rng(5)
    b = division.significands(23)[np.concatenate([[0, (1 << 23) - 1], rng.integers(0, 1 << 23, 510)])]
    a = division.significands(7)
    aa, bb = np.meshgrid(a, b)
    assert division.significand_mismatches(aa.ravel(), bb.ravel(), 1).size == 0
    fp16 = division.significands(10)
    aa, bb = np.meshgrid(fp16, b[:64])
    assert division.significand_mismatches(aa.ravel(), bb.ravel(), 1).size == 0


def test_two_steps_on_sampled_binary32_significands() -> None:
    """Two steps on 2**17 random binary32 significands against the listed temperatures' and 32
    random ones (scripts/markstein_proof.py: every one of the 2**23 at the listed temperatures)."""
    rng = np.random.default_rng(6)
    a = division.significands(23)[rng.integers(0, 1 << 23, 1 << 17)]
    bs = [float(F32(t)) for t in TEMPERATURES] + list(division.significands(23)[rng.integers(0, 1 << 23, 32)])
    for t in bs:
        m, _ = np.frexp(np.float64(t))
        assert division.significand_mismatches(a, np.full_like(a, 2.0 * m), 2).size == 0, t


@pytest.mark.slow  # about 4 s on an idle core: 2 x 2**23 significands, two steps each
def test_two_steps_on_every_binary32_significand_at_two_temperatures() -> None:
    """The per-temperature exhaustive check of scripts/markstein_proof.py at 0.7 and 1.3: two steps
    on every binary32 significand ``A`` against the temperature's ``B``."""
    a = division.significands(23)
    for t in (0.7, 1.3):
        m, _ = np.frexp(np.float64(F32(t)))
        assert division.significand_mismatches(a, np.full_like(a, 2.0 * m), 2).size == 0, t


def test_binary32_values_of_the_domain_and_its_edges() -> None:
    """Two steps on random binary32 bit patterns and on 10,000 values each side of the domain's
    ends: the quotient wherever the domain says so, and the kernels' choice everywhere."""
    rng = np.random.default_rng(7)
    for t in TEMPERATURES:
        t32 = float(F32(t))
        lo, hi = division.domain(t32)
        parts = [rng.integers(0, 0x7F800000, 20000).astype(np.uint32)]
        for edge in (lo, hi if np.isfinite(hi) else 3.0e38):
            at = int(np.array([edge], F32).view(np.uint32)[0])
            parts.append(np.arange(at - 10000, at + 10000).astype(np.uint32))
        x = np.concatenate(parts).view(F32)
        x = np.concatenate([x, np.negative(x)])
        want = _bits(np.divide(x, F32(t32)))
        inside = division.in_domain(x, t32)
        assert np.array_equal(_bits(division.markstein(x, t32, 2))[inside], want[inside]), t
        assert np.array_equal(_bits(division.kernel_quotient(x, t32, 2)), want), t


def test_negative_zero_keeps_its_sign() -> None:
    """``fma(q, T32, -x)`` then ``fma(-e, r, q)``: ``-0 / T32 = -0``; written ``fma(-q, T32, x)``
    the residual of ``-0`` is ``+0`` and the quotient ``+0`` (negative control)."""
    zeros = np.array([-0.0, 0.0], F32)
    for steps in (1, 2):
        assert _bits(division.markstein(zeros, 0.7, steps)).tolist() == [0x80000000, 0]
    r = F32(division.reciprocal(0.7))
    q = np.multiply(zeros, r)
    e = fma32(np.negative(q), np.full_like(q, F32(0.7)), zeros)
    assert _bits(fma32(e, np.full_like(q, r), q)).tolist() == [0, 0]


def test_values_below_the_domain_stay_below_the_guards_bound() -> None:
    """Every bf16 and binary16 value below the domain (and binary32 ones), divided and through the
    sequence, is below ``tiny_bound``: the kernels' guard (a shift of magnitude at least
    ``2**SHIFT_MARGIN`` times it) makes such a value unable to change ``x - shift``."""
    rng = np.random.default_rng(8)
    f32 = rng.integers(1, 0x0D000000, 200000).astype(np.uint32).view(F32)  # up to 2**-101
    for t in TEMPERATURES:
        t32 = float(F32(t))
        bound = division.tiny_bound(t32)
        for x, steps in ((_values("bfloat16"), 1), (_values("float16"), 1), (f32, 2)):
            x = np.concatenate([x, np.negative(x)])
            low = ~division.in_domain(x, t32) & (np.abs(x) < division.domain(t32)[0])
            got, want = division.markstein(x[low], t32, steps), np.divide(x[low], F32(t32))
            assert (np.abs(got.astype(np.float64)) < bound).all() and (np.abs(want.astype(np.float64)) < bound).all()
        hi, lo, shift_min = division.kernel_bounds(t32)
        assert shift_min == 2.0 ** division.SHIFT_MARGIN * bound and (hi, lo) == division.domain(t32)[::-1]
        for v in (hi, lo, shift_min):  # binary32 values, as the kernels receive them
            assert not np.isfinite(v) or float(F32(v)) == v


def test_pytorch_divides_on_the_cpu_and_its_reciprocal_multiply_does_not() -> None:
    """The eager backend's step 0: ``tensor / T32`` (a binary32 scalar tensor, and a Python float,
    on the CPU) is NumPy's IEEE quotient on random bit patterns, 1 and 2 threads, contiguous and not;
    the multiply by ``RN32(1/T32)`` differs for about one in ten at 0.7 (negative control)."""
    rng = np.random.default_rng(9)
    x = rng.integers(0, 1 << 32, 1_000_003, dtype=np.uint64).astype(np.uint32).view(F32)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for t in (0.7, 0.3, 1.1, 2.7):
                t32 = F32(t)
                want = np.divide(x, t32)
                xt = torch.from_numpy(x.copy())
                for got in (xt / torch.tensor(float(t32)), xt / float(t32), xt[7:].view(-1, 4) / torch.tensor(float(t32))):
                    g = got.reshape(-1).numpy()
                    ref = want[want.size - g.size:]
                    same = (_bits(g) == _bits(ref)) | (np.isnan(g) & np.isnan(ref))
                    assert same.all(), (n, t)
            mul = (torch.from_numpy(x.copy()) * float(np.divide(F32(1), F32(0.7)))).numpy()
            differs = (_bits(mul) != _bits(np.divide(x, F32(0.7)))) & ~np.isnan(mul)
            assert 0.05 < differs.mean() < 0.2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the test extra installs triton")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_kernels_markstein_is_numpys_under_the_interpreter(dtype: str) -> None:
    """The Triton kernels' own ``markstein`` (``divide_kernel``, Triton's interpreter: NumPy on CPU
    tensors, one IEEE operation and one rounded ``tl.fma`` at a time) gives the NumPy sequence's bits
    on every bf16 (binary16) value, or binary32 bit patterns, and ``tl.div_rn`` the quotient's."""
    from rl_engine.logprob.backends.triton.triton_backend import triton_divide

    if dtype == "float32":
        x = np.random.default_rng(10).integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(F32)
    else:
        x = _values(dtype)
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    for t in (0.7, 2.7, 1e-10):
        t32 = float(F32(t))
        got = triton_divide(torch.from_numpy(x.copy()), t32, torch_dtype, mode="interpreter").numpy()
        want = division.markstein(x, t32, division.STEPS[dtype])
        assert np.array_equal(_bits(got), _bits(want)) or np.array_equal(
            _bits(got)[~np.isnan(want)], _bits(want)[~np.isnan(want)]), t
        ieee = triton_divide(torch.from_numpy(x.copy()), t32, torch_dtype, markstein=False, mode="interpreter").numpy()
        ref = np.divide(x, F32(t32))
        assert ((_bits(ieee) == _bits(ref)) | (np.isnan(ieee) & np.isnan(ref))).all(), t


# a binary16 temperature whose split quotient is off on some significand (found by scanning
# 0.05 + 0.0137 k): the host divides with Markstein's step there
SPLIT_REFUSED_F16 = float(F32(1.3926000595092773))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_split_quotient_is_the_quotient_for_every_value_in_the_domain(dtype: str) -> None:
    """Every finite bf16 (binary16) value at every listed temperature the check accepts (all but
    1.8123 for bf16, all but a few for binary16): ``fma(x, r_lo, x * r_hi)`` is the IEEE quotient on
    the domain, ``-0`` keeps its sign, and below the domain it stays under ``tiny_bound`` (the guard's
    reasoning holds as for Markstein's sequence)."""
    x = _values(dtype)
    x = np.concatenate([x, np.array([-0.0, 0.0], F32)])
    accepted = 0
    for t in TEMPERATURES:
        t32 = float(F32(t))
        parts = division.split_reciprocal(t32, dtype)
        if parts is None:
            assert dtype == "float16" or t == 1.8123, t
            assert division.split_mismatches(t32, dtype).size > 0
            continue
        accepted += 1
        got = division.split_quotient(x, *parts)
        inside = division.in_domain(x, t32)
        assert np.array_equal(_bits(got[inside]), _bits(np.divide(x[inside], F32(t32)))), t
        assert _bits(got[-2:]).tolist() == [0x80000000, 0], t
        low = ~inside & (np.abs(x) < division.domain(t32)[0])
        assert (np.abs(got[low].astype(np.float64)) < division.tiny_bound(t32)).all(), t
    assert accepted >= len(TEMPERATURES) - 2


def test_the_split_check_refuses_a_temperature_where_a_significand_is_off() -> None:
    """Negative control: at :data:`SPLIT_REFUSED_F16` some binary16 significand's split quotient is
    not the IEEE quotient, so ``split_reciprocal`` returns ``None`` (bf16 is accepted there: its
    reciprocal keeps 16 bits in ``r_hi``, binary16's 13); ``split_parts`` keeps ``r_hi`` to its bits."""
    bad = division.split_mismatches(SPLIT_REFUSED_F16, "float16")
    assert bad.size > 0 and division.split_reciprocal(SPLIT_REFUSED_F16, "float16") is None
    r_hi, r_lo = division.split_parts(SPLIT_REFUSED_F16, "float16")
    assert _bits(division.split_quotient(bad, r_hi, r_lo)).tolist() != _bits(np.divide(bad, F32(SPLIT_REFUSED_F16))).tolist()
    assert division.split_reciprocal(SPLIT_REFUSED_F16, "bfloat16") is not None
    for dtype, bits in division.SPLIT_BITS.items():
        r_hi, _ = division.split_parts(0.7, dtype)
        assert int(_bits(np.array([r_hi], F32))[0]) & ((1 << (24 - bits)) - 1) == 0
    with pytest.raises(ValueError, match="dtype='float32'"):
        division.split_parts(0.7, "float32")
    assert division.split_reciprocal(0.7, "float32") is None and division.split_reciprocal(1.0, "bfloat16") is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the test extra installs triton")
def test_the_kernels_split_constants_are_the_checked_ones() -> None:
    """The Triton kernels widen a binary16 or bf16 logit exactly and divide it by ``split_args``'s
    constants: :func:`division.split_reciprocal`'s as they are (for binary16 too: ``T32 = 2**-20``,
    ``r_hi = 2**20``, included), so for binary16, whose every finite value is a normal binary32
    value, ``fma(h, r_lo, h * r_hi)`` is the IEEE quotient on every one; ``None`` where the check
    refuses the temperature and for binary32 logits."""
    from rl_engine.logprob.backends.triton.triton_backend import split_args

    h = _values("float16")
    for dtype, torch_dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        for t in (0.7, 2.7, 0.0731, 1e-4, 2.0 ** -20):
            t32 = float(F32(t))
            r_hi, r_lo = split_args(t32, torch_dtype)
            checked = division.split_reciprocal(t32, dtype)  # compared as binary32 bytes: -0 is not +0
            assert F32([r_hi, r_lo]).tobytes() == F32(checked).tobytes(), (dtype, t, checked)
            if dtype == "float16":
                got = fma32(h, np.full_like(h, F32(r_lo)), np.multiply(h, F32(r_hi)))
                assert np.array_equal(_bits(got), _bits(np.divide(h, F32(t32)))), t
    assert split_args(SPLIT_REFUSED_F16, torch.float16) is None and split_args(0.7, torch.float32) is None
