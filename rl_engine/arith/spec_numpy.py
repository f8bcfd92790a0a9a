"""A second, independent implementation of ``docs/arithmetic.md``: ``rl-engine-arith/2`` and,
for replaying archives made under it, ``rl-engine-arith/1`` (``docs/arithmetic-1.md``).

Written from those documents alone, in NumPy binary32 / 32-bit integer arithmetic. It shares
no code with the PyTorch path (``rl_engine.logprob``) and imports neither it nor ``torch``.

Only basic operations are used: element-wise ``np.add`` / ``np.subtract`` / ``np.multiply`` /
``np.divide`` on float32 arrays (each one IEEE binary32 operation rounded to nearest even;
NumPy never contracts two separate ufunc calls into a fused multiply-add), IEEE comparisons,
``np.where``, ``np.maximum`` / ``np.minimum`` (which propagate NaN), integer shifts/masks and
bit views. No ``np.exp``/``np.log``/``np.sum``/``np.dot``/``np.cumsum``: every sum is the
fold ``F`` or the lane sum ``G`` of section 4. NumPy does not set FTZ/DAZ, so subnormals are
gradual. NumPy has no fused multiply-add: :func:`fma32` computes one exactly (binary64 sum
rounded to odd, then rounded once to binary32; section 1 of ``docs/arithmetic.md``).

Public API::

    SPEC_VERSION, SPECS
    exp32(y), exp32_v1(y), log32(x), fma32(a, b, c), fold(v, axis=-1), lane_sum(v), lane_fma_sum(u, v)
    to_f32(bits_or_array, dtype)
    forward(logits, dtype, targets, active, real_vocab, num_tiles, with_entropy, spec=SPEC_VERSION)
    backward(logits, dtype, targets, active, lse, grad_logp, grad_lse, real_vocab, num_tiles, spec=SPEC_VERSION)
    kept_set(x, real_vocab, num_tiles, top_k, top_p, min_p)    # section 13: the processed kept set
    forward_processed(...), backward_processed(...)           # section 13: forward / backward on it
    make_inputs(batch, seq, prompt_tokens, real_vocab, padded_vocab, seed, logit_scale)
    canon_nan(x), round_bf16(x), round_f16(x)
    head_logits(hidden, weight, dtype)   # section 12: the fused head's logits
    measure_ulp()        # also: python -m rl_engine.arith.spec_numpy --measure

bfloat16 values are carried as their uint16 bit patterns (NumPy has no bfloat16 type).
"""

from __future__ import annotations

import sys
import time

import numpy as np

SPEC_V1 = "rl-engine-arith/1"
SPEC_VERSION = "rl-engine-arith/2"
SPECS = (SPEC_V1, SPEC_VERSION)  # every version this module computes (an archive records its own)

F32 = np.float32
U32 = np.uint32
I32 = np.int32


def _hx(s: str) -> np.float32:
    """A binary32 constant from a hex-float literal; refuses one that binary32 cannot hold."""
    d = float.fromhex(s)
    f = F32(d)
    if float(f) != d:
        raise AssertionError(f"constant {s} is not a binary32 value")
    return f


# ---- section 3 constants (rl-engine-arith/2) -----------------------------------------
E2_LO = _hx("-0x1.6p+6")  # -88
E_HI = _hx("0x1.64p+6")  # 89
LOG2E = _hx("0x1.715476p+0")
BIAS = _hx("0x1.8000fep+23")  # 0x1.8p+23 + 127
LN2_HI2 = _hx("0x1.62e430p-1")  # RN32(ln 2)
LN2_LO2 = _hx("-0x1.05c610p-29")  # RN32(ln 2 - LN2_HI2)
LANES = 128  # L of the lane sum G (section 4)
# ---- rl-engine-arith/1's E (docs/arithmetic-1.md section 3); C2..C6 are shared -------
E_LO = _hx("-0x1.5cp+6")  # -87
SHIFTER = _hx("0x1.8p+23")
LN2_HI = _hx("0x1.62e4p-1")
LN2_LO = _hx("0x1.7f7d1cp-20")
C6 = _hx("0x1.6a244cp-10")
C5 = _hx("0x1.1239d4p-7")
C4 = _hx("0x1.5558f2p-5")
C3 = _hx("0x1.555492p-3")
C2 = _hx("0x1.fffffcp-2")

# ---- section 5 constants ------------------------------------------------------------
SQRT2 = _hx("0x1.6a09e6p+0")
L1 = _hx("0x1.555554p-1")
L2 = _hx("0x1.999abcp-2")
L3 = _hx("0x1.242b1ap-2")
L4 = _hx("0x1.e4bc8ep-3")

# ---- section 10 constant ------------------------------------------------------------
IH_SCALE = _hx("0x1.bb67aep-16")

ONE = F32(1.0)
TWO = F32(2.0)
HALF = F32(0.5)
ZERO = F32(0.0)
NEG_INF = F32(-np.inf)
POS_INF = F32(np.inf)
TWO_P23 = _hx("0x1p+23")

CANON_NAN = np.array([0x7FC00000], dtype=U32).view(F32)[0]

_DTYPES = ("bfloat16", "float16", "float32")


def _f32(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype != F32:
        raise TypeError(f"expected a float32 array, got {a.dtype}")
    return a


def _chk(a: np.ndarray) -> np.ndarray:
    """Guard against silent promotion to float64 inside this module."""
    if a.dtype != F32:  # pragma: no cover - a bug in this module
        raise AssertionError(f"internal dtype drift: {a.dtype}")
    return a


# ------------------------------------------------------------------------------------
# Section 1: fusedMultiplyAdd, exactly
# ------------------------------------------------------------------------------------
def fma32(a, b, c) -> np.ndarray:
    """IEEE-754 binary32 ``fusedMultiplyAdd(a, b, c)``: ``a * b + c`` rounded once (section 1).

    The product of two binary32 values is exact in binary64. Its sum with ``c`` is rounded to
    binary64 and the rounding error recovered exactly (TwoSum); where the sum was inexact and
    its last bit is even, it is moved one binary64 ulp towards the exact value, which is the
    sum rounded to odd. Binary64 has 53 >= 2 * 24 + 2 significant bits, so rounding that once
    to binary32 is the correctly rounded result (Boldo and Melquiond, 2008), subnormal and
    overflowing results included. Rounding the binary64 sum to nearest instead would round
    twice, which is wrong near binary32 midpoints. Special operands (NaN, infinities) follow
    binary64 arithmetic, which gives the IEEE results.
    """
    a, b, c = (np.asarray(v, F32) for v in (a, b, c))
    with np.errstate(over="ignore", invalid="ignore"):
        p = np.multiply(a.astype(np.float64), b.astype(np.float64))  # exact
        c64 = c.astype(np.float64)
        s = np.add(p, c64)
        bb = np.subtract(s, p)  # TwoSum: s + err == p + c64 exactly
        err = np.add(np.subtract(p, np.subtract(s, bb)), np.subtract(c64, bb))
        bits = s.view(np.int64)
        fix = np.isfinite(s) & np.isfinite(err) & (err != 0) & ((bits & 1) == 0)
        away = (err > 0) == (s > 0)  # the exact value lies further from zero than s
        bits = np.where(fix, np.where(away, bits + 1, bits - 1), bits)
        return _chk(np.asarray(bits.view(np.float64).astype(F32)))


# ------------------------------------------------------------------------------------
# Section 3: E(y)
# ------------------------------------------------------------------------------------
def exp32(y: np.ndarray) -> np.ndarray:
    """``E(y)`` of section 3 (``rl-engine-arith/2``), element-wise on a float32 array."""
    y = _f32(y)
    with np.errstate(over="ignore", invalid="ignore"):
        yc = np.minimum(np.maximum(y, E2_LO), E_HI)  # 1. NaN stays NaN
        t = fma32(yc, LOG2E, BIAS)  # 2. BIAS + k, k the integer nearest yc * LOG2E
        kf = np.subtract(t, BIAS)  # 3. exact
        r = fma32(kf, -LN2_HI2, yc)  # 4. exact
        r = fma32(kf, -LN2_LO2, r)
        q = fma32(C6, r, C5)  # 5. Horner with fusedMultiplyAdd
        q = fma32(q, r, C4)
        q = fma32(q, r, C3)
        q = fma32(q, r, C2)
        q = fma32(q, r, ONE)
        p = fma32(q, r, ONE)
        sc = np.left_shift(t.view(U32), U32(23)).view(F32)  # 6. 2**k; +0 at k = -127, +inf at 128
        res = np.multiply(p, sc)  # 7.
    return _chk(res)


def exp32_v1(y: np.ndarray) -> np.ndarray:
    """``E(y)`` of ``rl-engine-arith/1`` (``docs/arithmetic-1.md`` section 3), element-wise."""
    y = _f32(y)
    with np.errstate(over="ignore", invalid="ignore"):
        under = np.less(y, E_LO)  # 1. false for NaN
        yc = np.minimum(np.maximum(y, E_LO), E_HI)  # 2. NaN stays NaN
        kf = np.subtract(np.add(np.multiply(yc, LOG2E), SHIFTER), SHIFTER)  # 3.
        r = np.subtract(np.subtract(yc, np.multiply(kf, LN2_HI)), np.multiply(kf, LN2_LO))  # 4.
        q = np.add(np.multiply(C6, r), C5)  # 5. Horner, each step a multiply then an add
        q = np.add(np.multiply(q, r), C4)
        q = np.add(np.multiply(q, r), C3)
        q = np.add(np.multiply(q, r), C2)
        q = np.add(np.multiply(q, r), ONE)
        p = np.add(np.multiply(q, r), ONE)
        # 6. exact float -> integer; a NaN kf may become any integer: use 0.
        k = np.where(np.isnan(kf), ZERO, kf).astype(I32)
        a = np.right_shift(k, 1)  # arithmetic shift on int32
        b = np.subtract(k, a)
        sa = np.left_shift(np.add(a, I32(127)), 23).astype(I32).view(F32)
        sb = np.left_shift(np.add(b, I32(127)), 23).astype(I32).view(F32)
        res = np.multiply(np.multiply(p, sa), sb)  # 7.
        res = np.where(under, ZERO, res)  # 8.
    return _chk(res)


# ------------------------------------------------------------------------------------
# Section 4: F
# ------------------------------------------------------------------------------------
def fold(v, axis: int = -1):
    """The fixed fold ``F`` of section 4 along ``axis`` (grouping depends on the length only).

    Works on any array whose ``+`` is the intended operation (float32 for the spec; object
    arrays are accepted so the grouping itself can be inspected symbolically).
    """
    v = np.moveaxis(np.asarray(v), axis, -1).copy()
    n = v.shape[-1]
    if n < 1:
        raise ValueError("fold of zero terms is undefined")
    w = n
    while w > 1:
        h = w // 2
        v[..., :h] = v[..., :h] + v[..., w - h : w]
        w = w - h
    return v[..., 0][()]  # a scalar for 1-D input, else an array


def _lanes(v: np.ndarray, fill) -> np.ndarray:
    """``v[..., w]`` as ``[..., chunks, LANES]``: column ``c`` in lane ``c % LANES`` of chunk
    ``c // LANES``, the missing columns of the last chunk set to ``fill``."""
    w = v.shape[-1]
    chunks = -(-w // LANES)
    out = np.full(v.shape[:-1] + (chunks * LANES,), fill, dtype=v.dtype)
    out[..., :w] = v
    return out.reshape(v.shape[:-1] + (chunks, LANES))


def lane_sum(v) -> np.ndarray:
    """The lane sum ``G`` of section 4 over the last axis of a float32 array.

    Lane ``l`` starts at ``+0`` and adds the terms of columns ``l, l + 128, l + 256, ...`` in
    that order; the 128 lane sums are then folded by ``F``. A lane never holds ``-0`` (it starts
    at ``+0``), so the ``+0`` added for a column past the tile's end leaves it unchanged.
    """
    v = _f32(v)
    chunks = _lanes(v, ZERO)
    acc = np.zeros(v.shape[:-1] + (LANES,), F32)
    for k in range(chunks.shape[-2]):
        acc = np.add(acc, chunks[..., k, :])
    return _chk(np.asarray(fold(acc)))


def lane_fma_sum(u, v) -> np.ndarray:
    """``G*`` of section 4: lane ``l`` is ``fma(u_c, v_c, lane)`` over its columns in order, then ``F``."""
    u, v = _f32(u), _f32(v)
    cu, cv = _lanes(u, ZERO), _lanes(v, ZERO)  # fma(0, 0, lane) == lane
    acc = np.zeros(u.shape[:-1] + (LANES,), F32)
    for k in range(cu.shape[-2]):
        acc = fma32(cu[..., k, :], cv[..., k, :], acc)
    return _chk(np.asarray(fold(acc)))


# ------------------------------------------------------------------------------------
# Section 5: L(x)
# ------------------------------------------------------------------------------------
def log32(x: np.ndarray) -> np.ndarray:
    """``L(x)`` of section 5, element-wise on a float32 array."""
    x = _f32(x)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        nan_or_neg = np.isnan(x) | np.less(x, ZERO)
        is_zero = np.equal(x, ZERO)
        is_inf = np.equal(x, POS_INF)
        sub = np.greater(x, ZERO) & np.less(x, F32(np.finfo(F32).tiny))
        xs = np.where(sub, np.multiply(x, TWO_P23), x)  # exact
        u = xs.view(U32).astype(I32)  # positive values: bits < 2**31
        e = np.subtract(np.right_shift(u, 23), I32(127))
        e = np.where(sub, np.subtract(e, I32(23)), e)
        m = np.bitwise_or(np.bitwise_and(u, I32(0x007FFFFF)), I32(0x3F800000)).view(F32)
        big = np.greater(m, SQRT2)
        m = np.where(big, np.multiply(m, HALF), m)
        e = np.where(big, np.add(e, I32(1)), e)
        f = np.subtract(m, ONE)
        s = np.divide(f, np.add(TWO, f))
        z = np.multiply(s, s)
        R = np.add(np.multiply(L4, z), L3)
        R = np.add(np.multiply(R, z), L2)
        R = np.add(np.multiply(R, z), L1)
        R = np.multiply(R, z)
        hf = np.multiply(HALF, np.multiply(f, f))
        ef = e.astype(F32)  # exact, |e| < 2**24
        inner = np.add(np.multiply(s, np.add(hf, R)), np.multiply(ef, LN2_LO))
        res = np.subtract(np.multiply(ef, LN2_HI), np.subtract(np.subtract(hf, inner), f))
        res = np.where(is_inf, POS_INF, res)
        res = np.where(is_zero, NEG_INF, res)
        res = np.where(nan_or_neg, CANON_NAN, res)
    return _chk(res.astype(F32, copy=False))


# ------------------------------------------------------------------------------------
# Conversions and the one rounding (sections 1, 2, 8)
# ------------------------------------------------------------------------------------
def _check_dtype(dtype: str) -> str:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
    return dtype


def to_f32(bits_or_array, dtype: str) -> np.ndarray:
    """Exact upcast to binary32: bf16 (uint16 bits) via ``bits << 16``, binary16 IEEE, binary32 as is."""
    _check_dtype(dtype)
    a = np.asarray(bits_or_array)
    if dtype == "bfloat16":
        if a.dtype != np.uint16:
            raise TypeError(f"bfloat16 logits are passed as uint16 bits, got {a.dtype}")
        return np.left_shift(a.astype(U32), U32(16)).view(F32)
    if dtype == "float16":
        if a.dtype != np.float16:
            raise TypeError(f"float16 logits must be np.float16, got {a.dtype}")
        return a.astype(F32)  # IEEE binary16 -> binary32 is exact (subnormals included)
    if a.dtype != F32:
        raise TypeError(f"float32 logits must be np.float32, got {a.dtype}")
    return a


def canon_nan(x: np.ndarray) -> np.ndarray:
    """Every NaN becomes the canonical quiet NaN ``0x7FC00000`` (section 2)."""
    x = _f32(x)
    return np.where(np.isnan(x), CANON_NAN, x)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """Section 8 bf16 rounding of a float32 array -> uint16 bits (NaN canonicalized first)."""
    u = canon_nan(x).view(U32)
    # After canonicalization u <= 0xFF800000 or u == 0x7FC00000, so u + 0x8000 cannot wrap.
    r = np.add(np.add(u, U32(0x7FFF)), np.bitwise_and(np.right_shift(u, U32(16)), U32(1)))
    return np.bitwise_and(np.right_shift(r, U32(16)), U32(0xFFFF)).astype(np.uint16)


def round_f16(x: np.ndarray) -> np.ndarray:
    """Section 8 binary16 rounding of a float32 array -> np.float16.

    NaN is canonicalized first (0x7FC00000 converts to 0x7E00). The conversion itself is
    NumPy's ``astype(np.float16)``, an IEEE convertFormat with round to nearest even,
    subnormal results and overflow to infinity (checked on hand-picked patterns in
    tests/test_spec_numpy.py); it is the one place where a library rounding is used.
    """
    with np.errstate(over="ignore"):
        return canon_nan(x).astype(np.float16)


def _round_to(g: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return canon_nan(g)
    if dtype == "bfloat16":
        return round_bf16(g)
    return round_f16(g)


# ------------------------------------------------------------------------------------
# Section 12: the fused head's logits
# ------------------------------------------------------------------------------------
def head_logits(hidden, weight, dtype: str) -> np.ndarray:
    """``[rows, cols]`` logits of ``hidden`` ``[rows, H]`` and ``weight`` ``[cols, H]`` (section 12):
    per element ``s = +0``, then ``s = fma32(h[k], w[k], s)`` for ``k = 0 .. H-1``, then the one
    rounding of section 8 to ``dtype`` (bf16 as uint16 bits, as :func:`to_f32` takes them)."""
    h, w = to_f32(hidden, dtype), to_f32(weight, dtype)
    if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[1]:
        raise ValueError(f"hidden {h.shape} and weight {w.shape} must be [rows, H] and [cols, H]")
    s = np.zeros((h.shape[0], w.shape[0]), F32)
    for k in range(h.shape[1]):
        s = fma32(h[:, k, None], w[None, :, k], s)
    return _round_to(s, dtype)


# ------------------------------------------------------------------------------------
# Section 6: forward
# ------------------------------------------------------------------------------------
def _rows_block(rows: int, vp: int) -> int:
    # ~2**22 elements per block of intermediates
    return max(1, min(rows, (1 << 22) // max(vp, 1)))


def _as_1d(a, rows: int, dtype, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (rows,):
        raise ValueError(f"{name} must have shape ({rows},), got {a.shape}")
    return a.astype(dtype, copy=False)


def _check_common(logits, dtype, targets, active, real_vocab, num_tiles, v1=False):
    _check_dtype(dtype)
    x_all = to_f32(logits, dtype)
    if x_all.ndim != 2:
        raise ValueError("logits must be [rows, padded_vocab]")
    rows, vp = x_all.shape
    if not (1 <= real_vocab <= vp):
        raise ValueError("need 1 <= real_vocab <= padded_vocab")
    if num_tiles < 1 or (v1 and vp % num_tiles):
        raise ValueError("num_tiles must divide padded_vocab (rl-engine-arith/1)")
    if (num_tiles - 1) * -(-vp // num_tiles) >= vp:  # section 6: w = ceil(Vp / T)
        raise ValueError("num_tiles leaves a tile with no column of padded_vocab")
    targets = _as_1d(targets, rows, np.int64, "targets")
    active = _as_1d(active, rows, bool, "active")
    if np.any(active & ((targets < 0) | (targets >= vp))):
        raise ValueError("active target outside [0, padded_vocab)")
    return x_all, rows, vp, targets, active


def _masked_block(x_all, r0, r1, real_vocab):
    x = x_all[r0:r1].copy()
    x[:, real_vocab:] = NEG_INF  # padding columns read as -inf
    return x


def _check_spec(spec: str) -> str:
    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    return spec


def temperature32(temperature):
    """Section 6 step 0: ``T32 = RN32(T)``, which must lie in ``[2**-64, 2**64]``: a np.float32 for a
    number, a float32 ``[rows]`` array for a temperature per row (an array of ``T``, each rounded once)."""
    if np.ndim(temperature):
        t32 = np.asarray(temperature).astype(F32)
        inside = (t32 >= F32(2.0 ** -64)) & (t32 <= F32(2.0 ** 64))
        if not inside.all():
            i = int(np.flatnonzero(~inside)[0])
            raise ValueError(f"temperature[{i}]={np.asarray(temperature)[i]!r} outside [2**-64, 2**64] in binary32")
        return t32
    t32 = F32(temperature)
    if not (F32(2.0 ** -64) <= t32 <= F32(2.0 ** 64)):
        raise ValueError(f"temperature {temperature!r} outside [2**-64, 2**64] in binary32")
    return t32


def _untempered(temperature) -> bool:
    """Whether the call has no temperature: the number 1 (a per-row array is a temperature)."""
    return not np.ndim(temperature) and temperature == 1.0


def _tempered(x: np.ndarray, temperature) -> np.ndarray:
    """Step 0: ``x' = RN32(x / T32)`` (IEEE binary32 division; per row, each row by its ``T32``); the
    identity (skipped) when ``T32 = 1``."""
    t32 = temperature32(temperature)
    if np.ndim(t32):
        if t32.shape != (x.shape[0],):
            raise ValueError(f"temperature has shape {t32.shape}; a temperature per row needs ({x.shape[0]},)")
        return np.divide(x, t32[:, None])
    return x if t32 == ONE else np.divide(x, t32)


def forward(logits, dtype: str, targets, active, real_vocab: int, num_tiles: int,
            with_entropy: bool, spec: str = SPEC_VERSION, temperature: float = 1.0, keep=None):
    """Section 6 over the full vocabulary in one process. Returns (logp, lse, entropy|None).

    ``temperature`` (``/2`` only): step 0 divides every logit by ``T32 = RN32(T)``; an array of one
    ``T`` per row divides each row by its own. ``keep`` (bool ``[rows, Vp]``, section 13): every column
    outside it reads as ``-inf`` after step 0."""
    v1 = _check_spec(spec) == SPEC_V1
    if v1 and not _untempered(temperature):
        raise ValueError(f"{SPEC_V1} has no temperature; got {temperature!r}")
    exp = exp32_v1 if v1 else exp32
    x_all, rows, vp, targets, active = _check_common(
        logits, dtype, targets, active, real_vocab, num_tiles, v1)
    with np.errstate(over="ignore", invalid="ignore"):
        x_all = _tempered(x_all, temperature)
    if keep is not None:
        x_all = np.where(keep, x_all, NEG_INF)
    T = int(num_tiles)
    w = -(-vp // T)  # section 6: tiles of ceil(Vp / T) columns; the grid's columns >= Vp are padding
    vt = T * w
    logp = np.empty(rows, F32)
    lse = np.empty(rows, F32)
    ent = np.empty(rows, F32) if with_entropy else None
    pad = np.arange(vp) >= real_vocab
    blk = _rows_block(rows, vp)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for r0 in range(0, rows, blk):
            r1 = min(rows, r0 + blk)
            x = _masked_block(x_all, r0, r1, real_vocab)
            if vt > vp:
                x = np.concatenate([x, np.full((r1 - r0, vt - vp), NEG_INF, F32)], axis=1)
            x = x.reshape(r1 - r0, T, w)
            m = np.maximum.reduce(x, axis=2)  # 1. NaN propagates (np.maximum)
            m = np.add(m, ZERO)  # -0 + 0 = +0
            sh = np.where(np.equal(m, NEG_INF), ZERO, m)  # 2.
            y = np.subtract(x, sh[:, :, None])  # 3.
            e = exp(y)
            if v1:
                s = fold(e, axis=2)
                if with_entropy:
                    yp = np.where(pad.reshape(T, w)[None], ZERO, y)  # 4. (/1)
                    t = fold(np.multiply(e, yp), axis=2)
            else:
                s = lane_sum(e)
                if with_entropy:  # 4. yc = max(y, LO), E's step 1 (y <= 0 here)
                    t = lane_fma_sum(e, np.maximum(y, E2_LO))
            B = np.maximum.reduce(m, axis=1)  # 5.
            Bs = np.where(np.equal(B, NEG_INF), ZERO, B)
            wj = exp(np.subtract(m, Bs[:, None]))  # 6.
            S = fold(np.multiply(s, wj), axis=1)
            L = np.add(Bs, log32(S))  # 7.
            if with_entropy:
                Mn = fold(np.multiply(wj, np.add(t, np.multiply(sh, s))), axis=1)  # 8.
                M = np.divide(Mn, S)
                ent[r0:r1] = canon_nan(_chk(np.subtract(L, M)))
            act = active[r0:r1]
            tg = np.where(act, targets[r0:r1], 0)
            xt = x.reshape(r1 - r0, vt)[np.arange(r1 - r0), tg]  # copied, never summed
            lp = np.where(act, np.subtract(xt, L), ZERO)  # 9.
            logp[r0:r1] = canon_nan(_chk(lp))  # 10.
            lse[r0:r1] = canon_nan(_chk(L))
    return logp, lse, ent


# ------------------------------------------------------------------------------------
# Sections 7, 8: backward
# ------------------------------------------------------------------------------------
def backward(logits, dtype: str, targets, active, lse, grad_logp, grad_lse,
             real_vocab: int, num_tiles: int, spec: str = SPEC_VERSION, temperature: float = 1.0,
             grad_entropy=None, entropy=None, keep=None):
    """Section 7 gradient, rounded once to the logits' representation (section 8).

    ``grad_logp`` / ``grad_lse``: float32 [rows] or None (absent = 0). Returns uint16 bf16
    bits, np.float16 or np.float32 of the logits' shape. ``temperature`` (a number, or one per row):
    step 0 on the logits, and the gradient divided by ``T32`` before its rounding (step 2, the chain
    rule of the division). ``grad_entropy`` (float32 [rows] or None) with the forward's ``entropy``: step 1's entropy term.
    ``keep`` (bool ``[rows, Vp]``, section 13 step 5): columns outside it read as ``-inf`` and get
    ``+0``; a row whose active target is outside it has ``gl = 0``.
    """
    v1 = _check_spec(spec) == SPEC_V1
    if v1 and not _untempered(temperature):
        raise ValueError(f"{SPEC_V1} has no temperature; got {temperature!r}")
    exp = exp32_v1 if v1 else exp32
    x_all, rows, vp, targets, active = _check_common(
        logits, dtype, targets, active, real_vocab, num_tiles, v1)
    t32 = temperature32(temperature)
    per_row = bool(np.ndim(t32))
    with np.errstate(over="ignore", invalid="ignore"):
        x_all = _tempered(x_all, temperature)
    if keep is not None:
        x_all = np.where(keep, x_all, NEG_INF)
        kept = keep[np.arange(rows), np.where(active, targets, 0)]
    else:
        kept = np.ones(rows, bool)
    lse = _f32(_as_1d(lse, rows, F32, "lse"))
    g_logp = np.zeros(rows, F32) if grad_logp is None else _as_1d(grad_logp, rows, F32, "grad_logp")
    g_lse = np.zeros(rows, F32) if grad_lse is None else _as_1d(grad_lse, rows, F32, "grad_lse")
    gl = np.where(active & kept, g_logp, ZERO)
    coef = np.subtract(g_lse, gl)
    if grad_entropy is not None:
        if v1:
            raise ValueError(f"{SPEC_V1} has no entropy gradient")
        g_ent = _as_1d(grad_entropy, rows, F32, "grad_entropy")
        mb = np.subtract(lse, _f32(_as_1d(entropy, rows, F32, "entropy")))  # Mb = LSE - H
    else:
        g_ent = np.zeros(rows, F32)
        mb = np.zeros(rows, F32)
    out_dtype = {"bfloat16": np.uint16, "float16": np.float16, "float32": F32}[dtype]
    out = np.empty((rows, vp), out_dtype)
    blk = _rows_block(rows, vp)
    with np.errstate(invalid="ignore", over="ignore"):
        for r0 in range(0, rows, blk):
            r1 = min(rows, r0 + blk)
            n = r1 - r0
            x = _masked_block(x_all, r0, r1, real_vocab)
            p = exp(np.subtract(x, lse[r0:r1, None]))  # 1.
            c = coef[r0:r1, None]
            g = np.multiply(c, p)
            ge = g_ent[r0:r1, None]
            term = np.multiply(np.multiply(ge, p), np.subtract(mb[r0:r1, None], x))  # (g_ent * p) * (Mb - x)
            g = np.where(np.not_equal(ge, ZERO) & np.not_equal(p, ZERO), np.add(g, term), g)
            zero_row = np.equal(coef[r0:r1], ZERO) & np.equal(g_ent[r0:r1], ZERO)
            g = np.where(zero_row[:, None], ZERO, g)  # coef == 0 rows: +0 everywhere ...
            act = active[r0:r1]
            ar = np.arange(n)[act]
            tc = targets[r0:r1][act]
            base = g[ar, tc]
            g[ar, tc] = np.add(base, gl[r0:r1][act])  # 2. ... except round(0 + gl) at target
            if per_row:
                g = np.divide(g, t32[r0:r1, None])  # 2. each row's T32
            elif t32 != ONE:
                g = np.divide(g, t32)  # 2. the temperature's chain rule (+0 stays +0: T32 > 0)
            if keep is not None:
                g = np.where(keep[r0:r1], g, ZERO)  # section 13 step 5: +0 outside the kept set
            g[:, real_vocab:] = ZERO  # padding columns are +0
            out[r0:r1] = _round_to(_chk(g), dtype)  # 3.
    return out


# ------------------------------------------------------------------------------------
# Section 13: processed logprobs (top-k, top-p, min-p)
# ------------------------------------------------------------------------------------
def _per_row(value, rows: int, dtype, name: str) -> np.ndarray:
    a = np.asarray(value)
    if a.ndim == 0:
        a = np.full(rows, a)
    if a.shape != (rows,):
        raise ValueError(f"{name} must be a number or have shape ({rows},), got {a.shape}")
    return a.astype(dtype)


def sampling32(top_k, top_p, min_p, rows: int):
    """Per-row ``k`` (int64), ``p32 = RN32(top_p)``, ``mp32 = RN32(min_p)``; refuses values out of range."""
    k = _per_row(top_k, rows, np.int64, "top_k")
    p32 = _per_row(top_p, rows, F32, "top_p")
    mp32 = _per_row(min_p, rows, F32, "min_p")
    if np.any(k < 0):
        raise ValueError("top_k must be >= 0 (0 = off; vLLM's -1 is refused: pass 0)")
    if np.any(~((p32 > ZERO) & (p32 <= ONE))):
        raise ValueError("top_p must lie in (0, 1] in binary32 (1 = off)")
    if np.any(~((mp32 >= ZERO) & (mp32 <= ONE))):
        raise ValueError("min_p must lie in [0, 1] in binary32 (0 = off)")
    return k, p32, mp32


def _z_prefix(e_row: np.ndarray, member: np.ndarray, num_tiles: int) -> np.float32:
    """``Z(P)``: the lane sum ``G`` of each tile's ``e_c`` (``+0`` off ``P``), folded by ``F`` over the tiles."""
    terms = np.where(member, e_row, ZERO).astype(F32)
    return F32(fold(lane_sum(terms.reshape(num_tiles, -1))))


def _top_p_prefix(prefix: np.ndarray, e: np.ndarray, num_tiles: int, p32: np.float32) -> np.ndarray:
    """The shortest prefix of ``prefix`` (columns in key order) with ``Z >= tau = RN32(p32 * Z(prefix))``,
    by bisection on its length (``Z`` is non-decreasing along prefixes)."""
    def z(n: int) -> np.float32:
        m = np.zeros(e.shape[0], bool)
        m[prefix[:n]] = True
        return _z_prefix(e, m, num_tiles)

    tau = np.multiply(p32, z(len(prefix)))
    lo, hi = 1, len(prefix)
    while lo < hi:
        mid = (lo + hi) // 2
        if z(mid) >= tau:
            hi = mid
        else:
            lo = mid + 1
    return prefix[:lo]


def kept_set(x, real_vocab: int, num_tiles: int, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """Section 13's kept set ``K`` of every row: bool ``[rows, Vp]`` (padding never kept).

    ``x``: the tempered binary32 logits of section 6 step 0, ``[rows, Vp]``. Min-p, then top-k,
    then top-p, each on the row's key order (``x`` descending, ties by the lower column id) from a
    sort; top-p's shortest prefix by bisection on its length. A row with a non-finite maximum
    (a NaN, a ``+inf``, or every real logit ``-inf``) keeps every real column.
    """
    x = _f32(x)
    rows, vp = x.shape
    if num_tiles < 1 or (num_tiles - 1) * -(-vp // num_tiles) >= vp:  # section 6: w = ceil(Vp / T)
        raise ValueError("num_tiles leaves a tile with no column of padded_vocab")
    grid = num_tiles * -(-vp // num_tiles)  # whole tiles; the columns past Vp are +0 terms of Z
    k, p32, mp32 = sampling32(top_k, top_p, min_p, rows)
    keep = np.zeros((rows, vp), bool)
    keep[:, :real_vocab] = True
    ids = np.arange(real_vocab)
    with np.errstate(invalid="ignore", over="ignore"):
        for r in range(rows):
            xr = x[r, :real_vocab]
            big = np.maximum.reduce(xr)  # NaN propagates
            if not np.isfinite(big) or (k[r] == 0 and p32[r] == ONE and mp32[r] == ZERO):
                continue
            y = np.subtract(xr, big)
            member = np.ones(real_vocab, bool)
            if mp32[r] > ZERO:  # 1. min-p
                member = y >= log32(np.array([mp32[r]], F32))[0]
            order = np.lexsort((ids, np.negative(xr)))  # key order: x descending, then the id
            prefix = order[member[order]]
            if k[r] > 0:  # 2. top-k
                prefix = prefix[: k[r]]
            if p32[r] < ONE:  # 3. top-p
                e = np.zeros(grid, F32)
                e[:real_vocab] = exp32(y)
                prefix = _top_p_prefix(prefix, e, num_tiles, p32[r])
            keep[r, :real_vocab] = False
            keep[r, prefix] = True
    return keep


def forward_processed(logits, dtype: str, targets, active, real_vocab: int, num_tiles: int,
                      with_entropy: bool, temperature: float = 1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Section 13's forward: ``(logp, lse, entropy|None, target_kept, keep)``.

    Section 6 on the logits with every column outside the kept set at ``-inf``; an active row
    whose target is outside it has ``logp = -inf`` and ``target_kept`` False."""
    x_all, rows, _vp, targets, active = _check_common(logits, dtype, targets, active, real_vocab, num_tiles)
    with np.errstate(over="ignore", invalid="ignore"):
        x = _tempered(x_all, temperature)
    keep = kept_set(x, real_vocab, num_tiles, top_k, top_p, min_p)
    logp, lse, ent = forward(logits, dtype, targets, active, real_vocab, num_tiles, with_entropy,
                             temperature=temperature, keep=keep)
    kept = ~active | keep[np.arange(rows), np.where(active, targets, 0)]
    return logp, lse, ent, kept, keep


def backward_processed(logits, dtype: str, targets, active, lse, grad_logp, grad_lse, real_vocab: int,
                       num_tiles: int, keep, temperature: float = 1.0, grad_entropy=None, entropy=None):
    """Section 13 step 5: :func:`backward` on the kept set ``keep`` (from :func:`forward_processed`)."""
    return backward(logits, dtype, targets, active, lse, grad_logp, grad_lse, real_vocab, num_tiles,
                    temperature=temperature, grad_entropy=grad_entropy, entropy=entropy, keep=keep)


# ------------------------------------------------------------------------------------
# Section 10: inputs
# ------------------------------------------------------------------------------------
_M64 = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15
_H = 0xD1B54A32D192ED03
_K = 0x632BE59BD9B4E019
_S1 = 0xBF58476D1CE4E5B9
_S2 = 0x94D049BB133111EB


def _splitmix(i: np.ndarray, seed: int) -> np.ndarray:
    """The section 10 hash of uint64 indices ``i`` (wrapping uint64 arithmetic)."""
    base = np.uint64(((int(seed) * _G) + _K) & _M64)
    z = np.add(np.multiply(i, np.uint64(_H)), base)
    z = np.multiply(np.bitwise_xor(z, np.right_shift(z, np.uint64(30))), np.uint64(_S1))
    z = np.multiply(np.bitwise_xor(z, np.right_shift(z, np.uint64(27))), np.uint64(_S2))
    return np.bitwise_xor(z, np.right_shift(z, np.uint64(31)))


def make_inputs(batch: int, seq: int, prompt_tokens: int, real_vocab: int,
                padded_vocab: int, seed: int, logit_scale: float):
    """Section 10 inputs: (logits float32 [batch*seq, padded_vocab], targets int64, active bool)."""
    rows = int(batch) * int(seq)
    vp = int(padded_vocab)
    if not (1 <= real_vocab <= vp):
        raise ValueError("need 1 <= real_vocab <= padded_vocab")
    scale = F32(logit_scale)  # f32(logit_scale)
    logits = np.empty((rows, vp), F32)
    cols = np.arange(vp, dtype=np.uint64)
    blk = max(1, min(rows, (1 << 21) // max(vp, 1)))
    mask16 = np.uint64(0xFFFF)
    for r0 in range(0, rows, blk):
        r1 = min(rows, r0 + blk)
        rr = np.arange(r0, r1, dtype=np.uint64)
        i = np.add(np.multiply(rr[:, None], np.uint64(vp)), cols[None, :])
        z = _splitmix(i, seed)
        n = (np.bitwise_and(z, mask16)
             + np.bitwise_and(np.right_shift(z, np.uint64(16)), mask16)
             + np.bitwise_and(np.right_shift(z, np.uint64(32)), mask16)
             + np.right_shift(z, np.uint64(48)))
        c = np.subtract(n.astype(np.int64), 131070).astype(I32).astype(F32)  # exact
        v = np.multiply(np.multiply(c, IH_SCALE), scale)
        v[:, real_vocab:] = F32(100.0)
        logits[r0:r1] = _chk(v)
    ti = np.add(np.arange(rows, dtype=np.uint64), np.uint64(1 << 62))
    targets = np.remainder(_splitmix(ti, seed), np.uint64(real_vocab)).astype(np.int64)
    active = (np.arange(rows, dtype=np.int64) % int(seq)) >= int(prompt_tokens)
    return logits, targets, active


# ------------------------------------------------------------------------------------
# Accuracy measurement
# ------------------------------------------------------------------------------------
def _bits_range(lo_bits: int, hi_bits: int, stride: int = 1, block: int = 1 << 24):
    """Yield uint32 arrays of bit patterns lo_bits..hi_bits (inclusive) with a stride."""
    b = lo_bits
    while b <= hi_bits:
        e = min(hi_bits + 1, b + block * stride)
        yield np.arange(b, e, stride, dtype=np.uint64).astype(U32)
        b = e


def _f32_bits(x: float) -> int:
    return int(np.array([x], F32).view(U32)[0])


def ulp_errors(res: np.ndarray, ref64: np.ndarray):
    """(|res - ref| / ulp(f32(ref)) as float64, correctly-rounded mask).

    The ULP is that of the float64 reference rounded to binary32 (``np.spacing`` of its
    magnitude; the subnormal spacing for tiny values). Equal values (infinities included)
    have error 0.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        ref32 = ref64.astype(F32)
        exact = (res == ref32) | (np.isnan(res) & np.isnan(ref32))
        ulp = np.spacing(np.abs(ref32)).astype(np.float64)
        err = np.abs(res.astype(np.float64) - ref64) / ulp
        err = np.where(exact, 0.0, err)
        err = np.where(np.isnan(err), np.inf, err)
    return err, exact


class _Acc:
    def __init__(self, name):
        self.name, self.n, self.cr, self.max, self.arg = name, 0, 0, -1.0, None

    def add(self, x, res, ref64):
        err, exact = ulp_errors(res, ref64)
        self.n += x.size
        self.cr += int(np.count_nonzero(exact))
        j = int(np.argmax(err))
        if err[j] > self.max:
            self.max, self.arg = float(err[j]), float(x[j])

    def line(self):
        return (f"{self.name}: n={self.n} max_ulp={self.max:.4f} at x={self.arg!r} "
                f"({float(np.float32(self.arg)).hex() if self.arg is not None else ''}) "
                f"correctly_rounded={self.cr / max(self.n, 1):.6f}")


def measure_ulp(full: bool = True, out=sys.stdout):
    """Sweep exp32/log32 against float64 np.exp/np.log (the reference only).

    full=True: every binary32 in [-87, 0], every 16th in [0, 88.376] and every binary32 in
    [-87.68, -87] (the subnormal results) for exp; every
    binary32 in [1, 2**18], every 64th positive normal and every 64th positive subnormal for
    log. Returns a dict name -> (max_ulp, argmax, fraction correctly rounded, n).
    """
    s = 1 if full else 64
    sweeps = {
        "exp[-87,0]": (exp32, np.exp, 0x80000000, _f32_bits(-87.0), s),
        "exp[0,88.376]": (exp32, np.exp, 0, _f32_bits(88.376), 16 if full else 64),
        "exp[-87.68,-87]": (exp32, np.exp, _f32_bits(-87.0), _f32_bits(-87.68), 1),
        "log[1,2^18]": (log32, np.log, _f32_bits(1.0), _f32_bits(2.0 ** 18), s),
        "log[normals]": (log32, np.log, 0x00800000, 0x7F7FFFFF, 64 if full else 1024),
        "log[subnormals]": (log32, np.log, 0x00000001, 0x007FFFFF, 64 if full else 1024),
    }
    out_d = {}
    for name, (fn, ref, lo, hi, st) in sweeps.items():
        t0 = time.time()
        acc = _Acc(name)
        for bits in _bits_range(lo, hi, st):
            x = bits.view(F32)
            acc.add(x, fn(x), ref(x.astype(np.float64)))
        print(acc.line() + f" [{time.time() - t0:.1f}s]", file=out, flush=True)
        out_d[name] = (acc.max, acc.arg, acc.cr / max(acc.n, 1), acc.n)
    return out_d


if __name__ == "__main__":  # pragma: no cover
    if "--measure" in sys.argv[1:]:
        measure_ulp(full="--quick" not in sys.argv[1:])
    else:
        print("usage: python -m rl_engine.arith.spec_numpy --measure [--quick]")
