"""Triton kernels of backend ``triton-vocab-parallel-logp-ws2`` (``docs/arithmetic.md``, ``rl-engine-arith/2``).

Written with IEEE-754 basic operations and the fused multiply-adds the specification writes
(``tl.fma``), in its order, shaped for what Triton compiles at launch:

* :func:`forward_partials_kernel`: one program (one warp) per (row, tile). The tile is read in
  chunks of 128 columns, column ``c`` in lane ``c % 128`` of the chunk: a first pass takes the
  lanes' maxima (and minima, for validation and a temperature), a second computes ``E(x - shift)`` and adds it
  into the 128 lane sums in column order (section 4's ``G``; the entropy's ``G*`` adds
  ``fma(e, max(y, LO), lane)``); the 128 lane sums are then folded by ``F``. The chunk loops are
  unrolled (a tile of up to ``MAX_UNROLL`` chunks), so every thread runs the same straight
  code and the loads of the second pass are the first pass's registers.
* :func:`backward_kernel`: one program per (row, block of columns), no branch (with a temperature,
  one the whole program takes alike: the guard of the division by ``T32``): ``E(x - lse)``
  (the general form: ``lse`` is an input) times ``coef``, the ``coef == 0`` override, canonical NaN, padding zeros, the one rounding of
  section 8. Launched over the whole blocks without masks, and once more, masked, over the
  last partial block.
* :func:`merge_kernel`: section 6 steps 5-10 in one launch over blocks of rows: the merge of the
  ``[rows, tiles]`` partials in global tile order (``F`` over the tiles by :func:`tile_fold`),
  the logprob and the canonical NaN; at TP = 1 it also reads the target logit and the forward's
  validity flags, so the forward is two launches. :func:`exp_kernel` and :func:`log_kernel`
  (``E`` and ``L`` of binary32 tensors, one launch each) serve the element tests.
* :func:`backward_terms_kernel`: the backward's per-row terms (``coef``, the target column and
  its addend, ``Mb``) in one launch.
* binary16 logits are read by the exact widening conversion (``cvt.f32.f16``: every binary16, its
  subnormals, infinities and NaN included, is a binary32 value), which ptxas emits for sm_90 as one
  ``HADD2.F32`` a column that reads either half of a 32-bit register: one instruction where
  bf16's shift or byte permute and shift are one and a half. The one rounding to binary16
  (:func:`round_f16_bits`) is binary32 arithmetic: an addition of a constant of the logit's
  binade rounds it to binary16's grid.
* :func:`backward_target_kernel`: the one column per row that gets the target term
  (``coef * E(x - lse) + gl``, or ``+0 + gl`` where ``coef == 0``), launched after the
  others on the same stream, so it overwrites that column's value: no per-column compare in
  the main kernel.

No ``tl.exp``, ``tl.log`` or libdevice is used, and no division but the temperature's ``x / T32``
(``docs/arithmetic.md`` section 6 step 0, section 7 step 2) and ``L``'s ``f / (f + 2)`` (section 5): :func:`markstein`'s fused
multiply-adds where they are exact, ``tl.div_rn`` (the IEEE division) elsewhere. Reductions: a max or min over the
128 lanes is ``tl.reduce`` with Triton's max or min (a maximum does not depend on grouping;
NaN is tracked apart, so a NaN lane gives a NaN maximum whichever way the reduction's NaN rule
goes, in the compiled kernel and under the interpreter alike); a sum is only ever a reduction
over an axis of exactly two values (:func:`lane_fold`): one addition, whose operand order
cannot change its result (IEEE addition commutes). Every fused multiply-add is a ``tl.fma`` written here;
launches pass ``enable_fp_fusion=False``, so the compiler contracts nothing else.

This file is loaded twice by :mod:`rl_engine.logprob.backends.triton.triton_backend`, once per mode: with
``KERNEL_MODE = "compiled"`` every function is a ``triton.jit`` function; with
``"interpreter"`` each is Triton's ``InterpretedFunction`` (NumPy on CPU tensors, one IEEE
operation at a time). The mode is chosen by the caller, never by a fallback.
"""

from __future__ import annotations

import triton
import triton.language as tl

KERNEL_MODE = globals().get("KERNEL_MODE", "compiled")


def _decorator(launched: bool):  # type: ignore[no-untyped-def]
    """``triton.jit`` when compiled. Under the interpreter, a launched kernel is an
    ``InterpretedFunction`` and a function it calls stays a plain Python function: it runs
    inside the kernel's interpreted scope all the same, without the interpreter re-patching
    the language module at every call (which cost more than the arithmetic)."""
    if KERNEL_MODE == "interpreter":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction if launched else (lambda fn: fn)
    if KERNEL_MODE != "compiled":
        raise ValueError(f"KERNEL_MODE={KERNEL_MODE!r} must be 'compiled' or 'interpreter'")
    return triton.jit


kernel = _decorator(launched=True)  # a function the backend launches
device = _decorator(launched=False)  # a function kernels call

# docs/arithmetic.md section 3 (binary32 values, exact as Python floats)
E_LO: tl.constexpr = tl.constexpr(float.fromhex("-0x1.6p+6"))
E_HI: tl.constexpr = tl.constexpr(float.fromhex("0x1.64p+6"))
E_LOG2E: tl.constexpr = tl.constexpr(float.fromhex("0x1.715476p+0"))
E_BIAS: tl.constexpr = tl.constexpr(float.fromhex("0x1.8000fep+23"))
E_NEG_LN2_HI: tl.constexpr = tl.constexpr(-float.fromhex("0x1.62e430p-1"))
E_NEG_LN2_LO: tl.constexpr = tl.constexpr(float.fromhex("0x1.05c610p-29"))  # -LN2_LO
E_C6: tl.constexpr = tl.constexpr(float.fromhex("0x1.6a244cp-10"))
E_C5: tl.constexpr = tl.constexpr(float.fromhex("0x1.1239d4p-7"))
E_C4: tl.constexpr = tl.constexpr(float.fromhex("0x1.5558f2p-5"))
E_C3: tl.constexpr = tl.constexpr(float.fromhex("0x1.555492p-3"))
E_C2: tl.constexpr = tl.constexpr(float.fromhex("0x1.fffffcp-2"))
CANONICAL_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
NEG_INF_BITS: tl.constexpr = tl.constexpr(-8388608)  # 0xFF800000
POS_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)
# the one rounding to binary16 (section 8)
F16_GRID_BITS: tl.constexpr = tl.constexpr(0x06C1C400)  # bits(1.5 * 2**13) - bits(1.0) + (113 << 10)
F16_INFINITY_BITS: tl.constexpr = tl.constexpr(0x7C00)  # binary16 infinity: the magnitude's cap
F16_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-14)
F16_MAGIC: tl.constexpr = tl.constexpr(12288.0)  # 1.5 * 2**13: its ulp at 2**e is binary16's at 2**e
NEG_ONE: tl.constexpr = tl.constexpr(-1.0)  # v * -1.0 is IEEE negation (:func:`negate`)
DT_F32: tl.constexpr = tl.constexpr(0)
DT_BF16: tl.constexpr = tl.constexpr(1)
DT_F16: tl.constexpr = tl.constexpr(2)
DIV_NONE: tl.constexpr = tl.constexpr(0)  # no temperature: step 0 is skipped
DIV_MARKSTEIN: tl.constexpr = tl.constexpr(1)  # x / T32 by Markstein's correction (its domain)
DIV_IEEE: tl.constexpr = tl.constexpr(2)  # x / T32 by the IEEE division (div.rn)
DIV_SPLIT: tl.constexpr = tl.constexpr(3)  # x / T32 as fma(x, r_lo, x * r_hi) (a temperature it is checked for)
LANES: tl.constexpr = tl.constexpr(128)  # L of the lane sum G (section 4)
LANE_LEVELS: tl.constexpr = tl.constexpr(7)  # log2(LANES): the levels of F over the lanes
THREADS: tl.constexpr = tl.constexpr(128)  # a backward program's threads (triton_backend.BACKWARD_WARPS = 4)
MAX_UNROLL: tl.constexpr = tl.constexpr(32)  # chunks of a tile unrolled (a wider tile loops)
# The combine functions of Triton's own tl.sum, tl.max and tl.min, given to the builtin tl.reduce:
# the compiler lowers them to +, max.f32 and min.f32; the interpreter (both modes call them from
# here, where tl.sum itself is a compiled function) to NumPy's sum, nanmax and nanmin. Neither
# max nor min sees a NaN here: a NaN lane is tracked apart.
SUM = tl.standard._sum_combine
MAX = tl.standard._elementwise_max
MIN = tl.standard._elementwise_min


@device
def exp_core(yc):
    """Steps 2-5 of section 3 for ``yc`` (step 1's value): ``(p, t)``."""
    t = tl.fma(yc, E_LOG2E, E_BIAS)  # 2. BIAS + k
    kf = t - E_BIAS  # 3. exact
    r = tl.fma(kf, E_NEG_LN2_HI, yc)  # 4. exact
    r = tl.fma(kf, E_NEG_LN2_LO, r)
    q = tl.fma(r, E_C6, E_C5)  # 5. Horner with fusedMultiplyAdd
    q = tl.fma(q, r, E_C4)
    q = tl.fma(q, r, E_C3)
    q = tl.fma(q, r, E_C2)
    q = tl.fma(q, r, 1.0)
    p = tl.fma(q, r, 1.0)
    return p, t


@device
def spec_exp_forward(y):
    """``E(y)`` in the forward form of section 3 (every ``y < 88`` and NaN; 13 operations), and
    ``yc = max(y, LO)``, step 1's value, which the entropy term multiplies by."""
    yc = tl.maximum(y, E_LO, propagate_nan=tl.PropagateNan.ALL)  # 1. NaN stays NaN
    p, t = exp_core(yc)
    sc = (t.to(tl.int32, bitcast=True) << 23).to(tl.float32, bitcast=True)  # 6. 2**k (+0: k = -127)
    return p * sc, yc  # 7.


@device
def spec_exp(y):
    """``E(y)``, section 3's general form (every argument: the backward, whose ``x - lse`` is only
    ``<= 0`` when ``lse`` is the forward's, and the element tests)."""
    yc = tl.minimum(tl.maximum(y, E_LO, propagate_nan=tl.PropagateNan.ALL), E_HI,
                    propagate_nan=tl.PropagateNan.ALL)  # 1.
    p, t = exp_core(yc)
    sc = (t.to(tl.int32, bitcast=True) << 23).to(tl.float32, bitcast=True)  # 6. (+inf at k = 128)
    return p * sc  # 7.


@device
def upcast(raw, DTYPE: tl.constexpr):
    """Section 1's exact conversion to binary32 of a logit given as its bits: bf16 by integer
    operations (its bits are binary32's upper half), binary16 by the exact widening conversion
    (``cvt.f32.f16``; NumPy's ``astype`` under the interpreter), which keeps every subnormal,
    infinity and NaN a NaN (its payload is not kept: no result depends on it, as every output is
    a canonical NaN and the kernels' arithmetic does not keep one either); binary32 is returned
    as it is."""
    if DTYPE == DT_F32:
        out = raw
    elif DTYPE == DT_BF16:
        out = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        out = raw.to(tl.float16, bitcast=True).to(tl.float32)
    return out
@device
def lane_fold(v):
    """``F`` (section 4) over the 128 lane sums ``v``: ``v[i] + v[i + 64]``, then ``+ 32``, ...
    Each level is a reduction over an axis of exactly two values: one addition. Returns a
    one-element tensor."""
    for level in tl.static_range(LANE_LEVELS):
        v = tl.reduce(tl.reshape(v, (2, LANES >> (level + 1))), 0, SUM)
    return v


@device
def negate(v):
    """IEEE negation, ``-v`` with the sign of zero flipped, written ``v * -1.0`` (exact for every
    ``v``). Triton 3.6's unary minus on a float is ``0.0 - v``, which maps ``+0`` to ``+0``
    (``-e`` of a zero ``e`` would then lose ``markstein(-0) = -0``) and which ptxas cannot fold into
    an FMA's operand (one ``FADD`` a column and negation); its constant ``-0.0`` is read as ``+0``,
    so ``-0.0 - v`` is no better. ``v * -1.0`` is LLVM's ``fneg`` (``neg.f32``) on every supported
    Triton, which ptxas folds into the FMA that reads it."""
    return v * NEG_ONE


@device
def markstein(x, t32, inv_t, DTYPE: tl.constexpr):
    """``RN32(x / T32)`` on the division's domain (rl_engine/arith/division.py): ``q = x * r``, then per
    step ``e = fma(q, T32, -x)``, ``q = fma(-e, r, q)``; one step for bf16 and binary16 logits, two
    for binary32 values. ``x = -0`` gives ``-0`` (the negations are :func:`negate`'s)."""
    q = x * inv_t
    nx = negate(x)
    e = tl.fma(q, t32, nx)
    q = tl.fma(negate(e), inv_t, q)
    if DTYPE == DT_F32:
        e = tl.fma(q, t32, nx)
        q = tl.fma(negate(e), inv_t, q)
    return q


@device
def split_quotient(x, r_hi, r_lo):
    """``RN32(x / T32)`` as ``fma(x, r_lo, x * r_hi)`` for a bf16 or binary16 ``x``: the product
    ``x * r_hi`` is exact (``r_hi`` has ``24 -`` the logit's significant bits) and the FMA rounds
    ``x * (r_hi + r_lo)`` once; the host passes ``r_hi, r_lo`` only for a temperature where that is the
    quotient of every significand (rl_engine/arith/division.py, ``split_reciprocal``). Two operations
    where Markstein's step is three."""
    return tl.fma(x, r_lo, x * r_hi)


@device
def scaled(raw, d0, d1, DTYPE: tl.constexpr, DIVIDE: tl.constexpr):
    """Section 6 step 0: the exact upcast, then ``x / T32`` by :func:`markstein` (``DIVIDE ==
    DIV_MARKSTEIN``, where every value lies in its domain or cannot change a result; ``d0, d1`` are
    ``T32, r``), by :func:`split_quotient` (``DIV_SPLIT``, the same domain; ``d0, d1`` are ``r_hi,
    r_lo``) or by the IEEE division
    (``DIV_IEEE``, ``d0`` is ``T32``); without a temperature (``DIV_NONE``) no operation at all."""
    x = upcast(raw, DTYPE)
    if DIVIDE == DIV_MARKSTEIN:
        x = markstein(x, d0, d1, DTYPE)
    elif DIVIDE == DIV_SPLIT:
        x = split_quotient(x, d0, d1)
    elif DIVIDE == DIV_IEEE:
        x = tl.div_rn(x, d0)
    return x


@device
def chunk(base, col0, lane, real_left, t32, inv_t, DTYPE: tl.constexpr, VALID: tl.constexpr, PADDED: tl.constexpr,
          DIVIDE: tl.constexpr):
    """The binary32 logits of the tile's columns ``col0 + lane`` (divided by ``T32`` as ``DIVIDE``
    says, step 0):
    ``(x, xmin)``, where ``x`` is ``-inf`` past the tile's ``VALID`` columns of this chunk and
    (``PADDED``) on padding columns, and ``xmin`` is ``x`` with ``+inf`` there (what the
    validation minimum reads)."""
    neg_inf = tl.full((LANES,), NEG_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    pos_inf = tl.full((LANES,), POS_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    cols = col0 + lane
    if PADDED:
        real = (lane < VALID) & (cols < real_left)
        x = tl.where(real, scaled(tl.load(base + cols, mask=real, other=0), t32, inv_t, DTYPE, DIVIDE), neg_inf)
        xmin = tl.where(real, x, pos_inf)
    elif VALID < LANES:
        inside = lane < VALID
        x = tl.where(inside, scaled(tl.load(base + cols, mask=inside, other=0), t32, inv_t, DTYPE, DIVIDE), neg_inf)
        xmin = tl.where(inside, x, pos_inf)
    else:
        x = scaled(tl.load(base + cols), t32, inv_t, DTYPE, DIVIDE)
        xmin = x
    return x, xmin


@device
def extremes(base, col0, lane, real_left, mx, mn, DTYPE: tl.constexpr, VALID: tl.constexpr,
             PADDED: tl.constexpr, VALIDATE: tl.constexpr):
    """The first pass over one chunk: the lanes' maxima (NaN propagates) and minima, of the logits
    as they are (a temperature divides the tile's maximum once, after the pass)."""
    x, xmin = chunk(base, col0, lane, real_left, 1.0, 1.0, DTYPE, VALID, PADDED, DIV_NONE)
    mx = tl.maximum(mx, x, propagate_nan=tl.PropagateNan.ALL)
    if VALIDATE:
        mn = tl.minimum(mn, xmin)
    return mx, mn


@device
def lane_terms(base, col0, lane, real_left, sh, s, t, t32, inv_t, DTYPE: tl.constexpr, VALID: tl.constexpr,
               PADDED: tl.constexpr, WITH_ENTROPY: tl.constexpr, DIVIDE: tl.constexpr):
    """The second pass over one chunk (section 6 steps 3-4): ``s += E(y)``, ``t = fma(E(y), yc, t)``."""
    x, _ = chunk(base, col0, lane, real_left, t32, inv_t, DTYPE, VALID, PADDED, DIVIDE)
    e, yc = spec_exp_forward(x - sh)
    s = s + e
    if WITH_ENTROPY:
        t = tl.fma(e, yc, t)
    return s, t


@device
def pass_two(base, lane, real_left, sh, t32, inv_t, DTYPE: tl.constexpr, FULL: tl.constexpr, REST: tl.constexpr,
             PADDED: tl.constexpr, WITH_ENTROPY: tl.constexpr, DIVIDE: tl.constexpr):
    """Section 6 steps 3-4 over the tile: the 128 lane sums ``s`` and ``t``, each lane in column order."""
    s = tl.full((LANES,), 0.0, tl.float32)
    t = tl.full((LANES,), 0.0, tl.float32)
    if FULL <= MAX_UNROLL:
        for k in tl.static_range(FULL):
            s, t = lane_terms(base, k * LANES, lane, real_left, sh, s, t, t32, inv_t, DTYPE, LANES, PADDED,
                              WITH_ENTROPY, DIVIDE)
    else:
        for k in range(FULL):
            s, t = lane_terms(base, k * LANES, lane, real_left, sh, s, t, t32, inv_t, DTYPE, LANES, PADDED,
                              WITH_ENTROPY, DIVIDE)
    if REST > 0:
        s, t = lane_terms(base, FULL * LANES, lane, real_left, sh, s, t, t32, inv_t, DTYPE, REST, PADDED,
                          WITH_ENTROPY, DIVIDE)
    return s, t


@device
def lane_extremes(base, lane, real_left, DTYPE: tl.constexpr, FULL: tl.constexpr, REST: tl.constexpr,
                  PADDED: tl.constexpr, MINIMA: tl.constexpr):
    """Section 6 step 1's first pass over the tile: the 128 lanes' maxima and (``MINIMA``) minima."""
    mx = tl.full((LANES,), NEG_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    mn = tl.full((LANES,), POS_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    if FULL <= MAX_UNROLL:
        for k in tl.static_range(FULL):
            mx, mn = extremes(base, k * LANES, lane, real_left, mx, mn, DTYPE, LANES, PADDED, MINIMA)
    else:
        for k in range(FULL):
            mx, mn = extremes(base, k * LANES, lane, real_left, mx, mn, DTYPE, LANES, PADDED, MINIMA)
    if REST > 0:
        mx, mn = extremes(base, FULL * LANES, lane, real_left, mx, mn, DTYPE, REST, PADDED, MINIMA)
    return mx, mn


@kernel
def forward_partials_kernel(
    x_ptr, m_ptr, s_ptr, t_ptr, bad_ptr,
    row_stride, real_local, t32_arg, inv_t_arg, hi_x_arg, sh_min_arg, r_hi, r_lo,
    TILES: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr, VALIDATE: tl.constexpr, PADDED: tl.constexpr, TEMPERED: tl.constexpr,
    ROW_T: tl.constexpr, SPLIT: tl.constexpr,
):
    """Section 6 steps 1-4 for the tile ``pid % TILES`` of row ``pid // TILES`` (a constant
    divisor: integer multiply and shift, no division sequence).

    With a temperature (``TEMPERED``): the first pass reads the logits as they are, and the tile's
    maximum is divided by ``T32`` once (IEEE division: ``x -> RN32(x / T32)`` is monotone, so it is
    the maximum of the quotients; the minimum, which only validation reads, in the exotic branch
    alone: elsewhere its quotient is finite, ``-inf`` exactly when it is). The second pass divides every
    column by :func:`markstein`; a tile that holds a real logit of magnitude ``>= hi_x`` (an
    infinity, or a quotient that could overflow) or whose maximum's magnitude is below ``sh_min`` (a
    logit below the division's domain could then change ``y``) computes its sums again with the
    IEEE division, a branch every thread of the program takes alike (docs/arithmetic.md,
    "Dividing by T32 on a GPU"). With ``SPLIT`` (one temperature for the call, checked on the host
    for every significand of the logits' precision) the second pass's quotient is
    :func:`split_quotient` of ``r_hi, r_lo`` instead (the tile's maximum's too): two operations a
    column where Markstein's step is three.

    With a temperature per row (``ROW_T``, with ``TEMPERED``) the four division arguments are
    pointers to one value per row, and the program loads its row's: the guard's thresholds are
    that row's, still one branch for the whole program."""
    FULL: tl.constexpr = WIDTH // LANES
    REST: tl.constexpr = WIDTH - FULL * LANES
    pid = tl.program_id(0)
    row = (pid // TILES).to(tl.int64)
    tile = pid % TILES
    if ROW_T:
        t32 = tl.load(t32_arg + row)
        inv_t = tl.load(inv_t_arg + row)
        hi_x = tl.load(hi_x_arg + row)
        sh_min = tl.load(sh_min_arg + row)
    else:
        t32 = t32_arg
        inv_t = inv_t_arg
        hi_x = hi_x_arg
        sh_min = sh_min_arg
    base = x_ptr + row * row_stride + tile * WIDTH
    real_left = real_local - tile * WIDTH  # the tile's real columns (PADDED only)
    lane = tl.arange(0, LANES)
    # a bf16 or binary16 logit with the split quotient: the tile's maximum is divided by it too (one
    # FMUL and one FFMA where the IEEE division is a call)
    SPLIT_TOP: tl.constexpr = SPLIT and DTYPE != DT_F32
    MINIMA: tl.constexpr = VALIDATE or TEMPERED
    # 1. the lanes' maxima (a max does not depend on grouping)
    mx, mn = lane_extremes(base, lane, real_left, DTYPE, FULL, REST, PADDED, MINIMA)
    # the maximum of the lanes' maxima (a NaN lane left out by the reduction's max, in the compiled
    # kernel and the interpreter alike) and whether a lane is NaN, tracked apart: the tile's maximum
    # is NaN then (below), and a NaN tile's sums are NaN whichever way its minimum sends the guard
    nan = tl.reduce((mx != mx).to(tl.int32), 0, MAX)
    m = tl.reduce(mx, 0, MAX)
    if MINIMA:
        low = tl.reduce(mn, 0, MIN)  # never NaN: the lanes' minima leave NaN out
    if TEMPERED:  # step 0 on the maximum (and, in the exotic branch below, the minimum): exact, once per tile
        exotic = (m >= hi_x) | (low <= -hi_x)
        top = m
        if SPLIT_TOP:  # the split quotient of the maximum: the quotient wherever the tile is not exotic (a
            m = split_quotient(m, r_hi, r_lo)  # maximum below the domain gives one below sh_min either way);
            m = tl.where(top == float("-inf"), top, m)  # -inf kept (-inf * r_lo is NaN when r_lo = 0),
        else:  # and the exotic branch divides again
            m = tl.div_rn(m, t32)
        exotic = exotic | (tl.abs(m) < sh_min)
    m = tl.where(nan > 0, float("nan"), m) + tl.full((1,), 0.0, tl.float32)  # m + 0: one sign for zero
    sh = tl.where(m == float("-inf"), 0.0, m)  # 2.
    # 3.-4. the lane sums, each lane in column order
    if TEMPERED:  # the fast quotient straight after the first pass (its loads are the first pass's registers) ...
        if SPLIT:
            s, t = pass_two(base, lane, real_left, sh, r_hi, r_lo, DTYPE, FULL, REST, PADDED, WITH_ENTROPY,
                            DIV_SPLIT)
        else:
            s, t = pass_two(base, lane, real_left, sh, t32, inv_t, DTYPE, FULL, REST, PADDED, WITH_ENTROPY,
                            DIV_MARKSTEIN)
        if exotic:  # ... and again with the IEEE division where it may not be exact (rare)
            if SPLIT_TOP:  # the maximum's IEEE quotient, and the shift of it
                m = tl.where(nan > 0, float("nan"), tl.div_rn(top, t32)) + tl.full((1,), 0.0, tl.float32)
                sh = tl.where(m == float("-inf"), 0.0, m)
            if VALIDATE:  # the minimum's quotient is -inf only if the minimum is -inf or <= -hi_x: an
                low = tl.div_rn(low, t32)  # exotic tile, so elsewhere the minimum itself says as much
            s, t = pass_two(base, lane, real_left, sh, t32, inv_t, DTYPE, FULL, REST, PADDED, WITH_ENTROPY,
                            DIV_IEEE)
    else:
        s, t = pass_two(base, lane, real_left, sh, t32, inv_t, DTYPE, FULL, REST, PADDED, WITH_ENTROPY,
                        DIV_NONE)
    out = row * TILES + tile + tl.arange(0, 1)
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, lane_fold(s))
    if WITH_ENTROPY:
        tl.store(t_ptr + out, lane_fold(t))
    if VALIDATE:  # a real column that is NaN or infinite
        low = low + tl.full((1,), 0.0, tl.float32)
        bad = (m != m) | (m == float("inf")) | (low == float("-inf"))
        tl.store(bad_ptr + out, bad.to(tl.int8))


@device
def round_f16_bits(u):
    """Section 8: binary32 bits ``u`` to binary16 bits (in the low 16 bits), IEEE round to nearest
    even with subnormal results and overflow to infinity, any NaN the canonical ``0x7E00``; with
    binary32 operations, each exact but the one that rounds, and integer ones:

    ``b = max(2**e, 2**-14)`` for the binade ``2**e`` of ``f`` (its exponent bits) and ``c = 1.5 *
    2**13 * b``, whose binade's ulp is binary16's ulp at ``|f|`` (``2**(e - 10)``, and ``2**-24`` for a
    binary16 subnormal): ``s = fma(b, 1.5 * 2**13, |f|)`` (an exact product: the one rounding of
    ``|f| + c``) is ``c`` plus ``|f|`` rounded to nearest even on binary16's grid and lies in ``c``'s
    binade, so ``bits(s) - bits(c)`` counts the ulps of that rounded ``|f|``: ``2**10`` times its
    significand with the implicit bit (its bits for a binary16 subnormal). Adding ``(e + 14) << 10``
    (the binary16 exponent field less one; ``0`` below ``2**-14``) gives the magnitude's binary16 bits,
    a carry into the exponent included: with ``bits(c) = bits(b) + 0x06C00000`` and ``(e + 14) << 10 =
    (bits(b) >> 13) - 0x1C400``, ``bits(s) - bits(b) + (bits(b) >> 13) - 0x06C1C400``. From ``65520``
    up that is ``0x7C00`` (infinity) or more, and where ``c`` or the sum overflows (``s`` infinite, ``f``
    infinite included) it is negative: taken as unsigned and capped at ``0x7C00``. Then the sign."""
    f = u.to(tl.float32, bitcast=True)
    b = tl.maximum((u & POS_INF_BITS).to(tl.float32, bitcast=True), F16_MIN_NORMAL).to(tl.int32, bitcast=True)
    s = tl.fma(b.to(tl.float32, bitcast=True), F16_MAGIC, tl.abs(f)).to(tl.int32, bitcast=True)
    mag = tl.minimum(((s - b - F16_GRID_BITS) + (b >> 13)).to(tl.uint32, bitcast=True), F16_INFINITY_BITS)
    out = mag.to(tl.int32, bitcast=True) | ((u >> 16) & 0x8000)
    return tl.where(f != f, 0x7E00, out)


@device
def store_rounded(ptr, g, mask, DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """Section 7 step 3 and section 8: canonical NaN, then the one rounding to the logits dtype
    (:func:`round_f16_bits` makes any NaN binary16's canonical one itself)."""
    bits = g.to(tl.int32, bitcast=True)
    if DTYPE == DT_F16:
        value = round_f16_bits(bits).to(tl.int16)
    else:
        bits = tl.where(g != g, CANONICAL_NAN_BITS, bits)
        if DTYPE == DT_F32:
            value = bits.to(tl.float32, bitcast=True)
        else:
            value = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
    if MASKED:
        tl.store(ptr, value, mask=mask)
    else:
        tl.store(ptr, value)


@device
def column_grad(raw, lse, coef, ge, mb, d0, d1, DTYPE: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
                DIVIDE: tl.constexpr):
    """Section 7 step 1 for the loaded columns ``raw``, whose logits are divided by ``T32`` (step 0)
    as ``DIVIDE`` says (``d0, d1``: :func:`scaled`'s): the gradient before the temperature's chain
    rule, the override, the padding and the rounding."""
    x = scaled(raw, d0, d1, DTYPE, DIVIDE)
    p = spec_exp(x - lse)
    g = coef * p  # 1. (any lse: the general form)
    if ENTROPY_GRAD:  # 1. the entropy term where g_ent != 0 and p != 0
        term = g + (ge * p) * (mb - x)
        g = tl.where(ge != 0.0, tl.where(p != 0.0, term, g), g)
    return g


@kernel
def backward_kernel(
    x_ptr, lse_ptr, coef_ptr, g_ptr, gent_ptr, mb_ptr,
    row_stride, local_vocab, real_local, col0, t32_arg, inv_t_arg, hi_x_arg, lo_key_arg, sh_min_arg, r_hi, r_lo,
    BLOCKS: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
    MASKED: tl.constexpr, PADDED: tl.constexpr, TEMPERED: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
    ROW_T: tl.constexpr, SPLIT: tl.constexpr,
):
    """Section 7 (and 8) for columns ``col0 + [b * BLOCK, (b + 1) * BLOCK)`` of row
    ``pid // BLOCKS``, every column but the target term (:func:`backward_target_kernel`).

    With a temperature (``TEMPERED``) both divisions by ``T32`` (the logit's, step 0, and the
    gradient's, step 2) are :func:`markstein`'s; the block is computed again with the IEEE division
    when a logit or a gradient of it has a magnitude ``>= hi_x`` (an infinity, or a quotient that
    could overflow), a non-zero gradient one below the domain (``lo_key`` is ``2 * bits(lo) - 2``), or the
    row's ``lse`` (or, with the entropy term, ``Mb``) one below ``sh_min`` (a logit below the
    domain could then change ``x - lse`` or ``Mb - x``): a branch the whole program takes alike.
    With ``SPLIT`` (one temperature for the call, bf16 or binary16 logits, checked on the host) the
    logit's division is :func:`split_quotient`'s two operations instead of Markstein's three; the
    gradient's stays Markstein's (a binary32 value).
    With a temperature per row (``ROW_T``) the five division arguments point to one value per row."""
    pid = tl.program_id(0)
    row = (pid // BLOCKS).to(tl.int64)
    if ROW_T:
        t32 = tl.load(t32_arg + row)
        inv_t = tl.load(inv_t_arg + row)
        hi_x = tl.load(hi_x_arg + row)
        lo_key = tl.load(lo_key_arg + row)
        sh_min = tl.load(sh_min_arg + row)
    else:
        t32 = t32_arg
        inv_t = inv_t_arg
        hi_x = hi_x_arg
        lo_key = lo_key_arg
        sh_min = sh_min_arg
    cols = col0 + (pid % BLOCKS) * BLOCK + tl.arange(0, BLOCK)
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    inside = cols < local_vocab
    if MASKED:
        raw = tl.load(x_ptr + row * row_stride + cols, mask=inside, other=0)
    else:
        raw = tl.load(x_ptr + row * row_stride + cols)
    if ENTROPY_GRAD:
        ge = tl.load(gent_ptr + row)
        mb = tl.load(mb_ptr + row)
        zero = ((coef == 0.0).to(tl.int32) * (ge == 0.0).to(tl.int32)) != 0
    else:
        ge = 0.0
        mb = 0.0
        zero = coef == 0.0
    VEC: tl.constexpr = 4 if DTYPE == DT_F32 else 8
    if TEMPERED:
        if SPLIT:
            g = column_grad(raw, lse, coef, ge, mb, r_hi, r_lo, DTYPE, ENTROPY_GRAD, DIV_SPLIT)
        else:
            g = column_grad(raw, lse, coef, ge, mb, t32, inv_t, DTYPE, ENTROPY_GRAD, DIV_MARKSTEIN)
        mags = tl.maximum(tl.abs(upcast(raw, DTYPE)), tl.abs(g))
        key = (g.to(tl.uint32, bitcast=True) << 1) - 2  # 2 |g| - 2 in the bits; +-0: the largest key
        # The block's test as one reduction over the threads: each thread's largest magnitude and
        # smallest key over its own columns (a whole block's (BLOCK / (THREADS * VEC), THREADS, VEC) view
        # is the load's layout: VEC columns a thread a 16-byte load, repeated), its flag, then any flag:
        # the same branch as testing the block's maximum and minimum (max and min ignore the order),
        # with one exchange between warps instead of two (Triton 3.6 synchronizes twice for each).
        if BLOCK >= THREADS * VEC:  # powers of two: THREADS * VEC divides BLOCK
            big = tl.reduce(tl.reduce(tl.reshape(mags, (BLOCK // (THREADS * VEC), THREADS, VEC)), 2, MAX), 0, MAX)
            small = tl.reduce(tl.reduce(tl.reshape(key, (BLOCK // (THREADS * VEC), THREADS, VEC)), 2, MIN), 0, MIN)
            flag = ((big >= hi_x) | (small.to(tl.int64) < lo_key)).to(tl.int32)
            exotic = (tl.reduce(flag, 0, MAX) != 0) | (tl.abs(lse) < sh_min)
        else:
            big = tl.reduce(mags, 0, MAX)
            small = tl.reduce(key, 0, MIN)
            exotic = (big >= hi_x) | (small.to(tl.int64) < lo_key) | (tl.abs(lse) < sh_min)
        if ENTROPY_GRAD:
            exotic = exotic | ((ge != 0.0) & (tl.abs(mb) < sh_min))
        g = markstein(g, t32, inv_t, DT_F32)  # 2. the temperature's chain rule, g / T32
        if exotic:
            g = tl.div_rn(column_grad(raw, lse, coef, ge, mb, t32, inv_t, DTYPE, ENTROPY_GRAD, DIV_IEEE), t32)
    else:
        g = column_grad(raw, lse, coef, ge, mb, t32, inv_t, DTYPE, ENTROPY_GRAD, DIV_NONE)
    g = tl.where(zero, 0.0, g)  # the override (+0, NaN included)
    if PADDED:
        g = tl.where(cols < real_local, g, 0.0)  # padding columns are +0
    store_rounded(g_ptr + row * local_vocab + cols, g, inside, DTYPE, MASKED)


@kernel
def backward_target_kernel(
    x_ptr, lse_ptr, coef_ptr, col_ptr, add_ptr, g_ptr, gent_ptr, mb_ptr,
    rows, row_stride, local_vocab, real_local, t32_arg,
    ROWS: tl.constexpr, DTYPE: tl.constexpr, TEMPERED: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
    ROW_T: tl.constexpr,
):
    """Section 7 step 2 for ``ROWS`` rows: the target column's value, ``coef * E(x - lse) + gl``
    (``+0 + gl`` where ``coef == 0``), divided by ``T32`` with a temperature (the IEEE division:
    one column per row), canonical NaN, rounded once; ``gl`` is ``-0`` (the identity) on rows that
    own no target, so their column gets the main kernel's value again. Padding columns are left to
    the main kernel's ``+0``. With a temperature per row (``ROW_T``) ``t32_arg`` points to each row's."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = r < rows
    row = r.to(tl.int64)
    if ROW_T:
        t32 = tl.load(t32_arg + r, mask=inside, other=1.0)
    else:
        t32 = t32_arg
    col = tl.load(col_ptr + r, mask=inside, other=0)
    lse = tl.load(lse_ptr + r, mask=inside, other=0.0)
    coef = tl.load(coef_ptr + r, mask=inside, other=0.0)
    add = tl.load(add_ptr + r, mask=inside, other=0.0)
    raw = tl.load(x_ptr + row * row_stride + col, mask=inside, other=0)
    if TEMPERED:
        x = scaled(raw, t32, 1.0, DTYPE, DIV_IEEE)
    else:
        x = scaled(raw, t32, 1.0, DTYPE, DIV_NONE)
    p = spec_exp(x - lse)
    g = coef * p  # 1.
    if ENTROPY_GRAD:
        ge = tl.load(gent_ptr + r, mask=inside, other=0.0)
        term = g + (ge * p) * (tl.load(mb_ptr + r, mask=inside, other=0.0) - x)
        g = tl.where(ge != 0.0, tl.where(p != 0.0, term, g), g)
        zero = ((coef == 0.0).to(tl.int32) * (ge == 0.0).to(tl.int32)) != 0
    else:
        zero = coef == 0.0
    g = g + add  # 2.: a multiply, then an add, as written
    g = tl.where(zero, add + 0.0, g)
    if TEMPERED:
        g = tl.div_rn(g, t32)  # 2. the temperature's chain rule, the override's (+0 + gl) / T32 included
    store_rounded(g_ptr + row * local_vocab + col, g, inside & (col < real_local), DTYPE, True)


@kernel
def exp_kernel(y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``E`` (the general form) of ``n`` binary32 values: the merge's weights ``E(m_j - B)``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    tl.store(out_ptr + offs, spec_exp(tl.load(y_ptr + offs, mask=inside, other=0.0)), mask=inside)


# docs/arithmetic.md section 5 (binary32 values, exact as Python floats)
L_SQRT2: tl.constexpr = tl.constexpr(float.fromhex("0x1.6a09e6p+0"))
L_LN2_HI: tl.constexpr = tl.constexpr(float.fromhex("0x1.62e4p-1"))
L_LN2_LO: tl.constexpr = tl.constexpr(float.fromhex("0x1.7f7d1cp-20"))
L_TWO23: tl.constexpr = tl.constexpr(8388608.0)
L_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-126)


@device
def spec_log(x, L4, L3, L2, L1):
    """``L(x)`` of section 5, operation for operation as :func:`rl_engine.arith.portable.log`
    (the IEEE division of ``s = f / (f + 2)`` is ``tl.div_rn``); ``L4 .. L1``: its polynomial."""
    sub = (x > 0.0) & (x < L_MIN_NORMAL)
    xs = tl.where(sub, x * L_TWO23, x)  # exact for a positive subnormal
    u = xs.to(tl.int32, bitcast=True)
    e = (u >> 23) - 127 - tl.where(sub, 23, 0)
    m = ((u & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    big = m > L_SQRT2
    m = tl.where(big, m * 0.5, m)
    e = e + big.to(tl.int32)
    f = m - 1.0
    s = tl.div_rn(f, f + 2.0)
    z = s * s
    r = z * L4
    r = (r + L3) * z
    r = (r + L2) * z
    r = (r + L1) * z
    hf = (f * f) * 0.5
    ef = e.to(tl.float32)
    inner = (s * (hf + r)) + (ef * L_LN2_LO)
    result = (ef * L_LN2_HI) - ((hf - inner) - f)
    bits = result.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, NEG_INF_BITS, bits)
    bits = tl.where(x == float("inf"), POS_INF_BITS, bits)
    bits = tl.where((x < 0.0) | (x != x), CANONICAL_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@kernel
def log_kernel(x_ptr, out_ptr, n, L4, L3, L2, L1, BLOCK: tl.constexpr):
    """``L`` of ``n`` binary32 values: the merge's ``L(sum)`` (section 6 step 7)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    tl.store(out_ptr + offs, spec_log(tl.load(x_ptr + offs, mask=inside, other=1.0), L4, L3, L2, L1), mask=inside)


@kernel
def divide_kernel(x_ptr, out_ptr, n, t32, inv_t, BLOCK: tl.constexpr, DTYPE: tl.constexpr, DIVIDE: tl.constexpr):
    """``x / T32`` of ``n`` binary32 values as section 6 step 0 divides a logit of ``DTYPE``
    (:func:`markstein`'s steps for ``DTYPE``, or the IEEE division): the element tests' view of
    the division the kernels run."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0)
    if DIVIDE == DIV_MARKSTEIN:
        q = markstein(x, t32, inv_t, DTYPE)
    else:
        q = tl.div_rn(x, t32)
    tl.store(out_ptr + offs, q, mask=inside)



# ------------------------------------------------------------------ processed logprobs (section 13)
# A row's kept set is a prefix of the key order, given by its last key (keep_v, keep_id: a local
# column): column c is dropped iff x_c < keep_v, or x_c == keep_v and c > keep_id (NaN is never
# dropped). rl_engine/logprob/kept_search.py finds the keys with the scans below; the masked
# forward and backward read them. Step 0 divides by T32 with the IEEE division here (tl.div_rn):
# exact for every logit, without the guard of the raw kernels.


@device
def kept_chunk(base, col0, lane, real_left, first, kv, kid, t32, DTYPE: tl.constexpr, VALID: tl.constexpr,
               PADDED: tl.constexpr, TEMPERED: tl.constexpr):
    """One chunk of 128 columns ``col0 + lane`` of a tile whose first local column is ``first``:
    ``(x, xk, inside, kept)``: the logits after step 0 (``-inf`` past the tile's ``VALID`` columns and
    on padding), the same with ``-inf`` on the dropped columns, the real columns, the kept ones."""
    neg_inf = tl.full((LANES,), NEG_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    cols = col0 + lane
    if PADDED:
        inside = (lane < VALID) & (cols < real_left)
    else:
        inside = lane < VALID
    x = upcast(tl.load(base + cols, mask=inside, other=0), DTYPE)
    if TEMPERED:
        x = tl.div_rn(x, t32)
    x = tl.where(inside, x, neg_inf)
    dropped = (x < kv) | ((x == kv) & ((first + cols).to(tl.int64) > kid))
    kept = inside & (dropped == 0)
    return x, tl.where(dropped, neg_inf, x), inside, kept


@device
def kept_pass_one(base, col0, lane, real_left, first, kv, kid, t32, mx, rmx, rmn, DTYPE: tl.constexpr,
                  VALID: tl.constexpr, PADDED: tl.constexpr, TEMPERED: tl.constexpr, VALIDATE: tl.constexpr):
    """The lanes' maxima of the kept columns (NaN propagates) and, for validation, of every real column."""
    x, xk, inside, _ = kept_chunk(base, col0, lane, real_left, first, kv, kid, t32, DTYPE, VALID, PADDED, TEMPERED)
    mx = tl.maximum(mx, xk, propagate_nan=tl.PropagateNan.ALL)
    if VALIDATE:
        pos_inf = tl.full((LANES,), POS_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
        rmx = tl.maximum(rmx, x, propagate_nan=tl.PropagateNan.ALL)
        rmn = tl.minimum(rmn, tl.where(inside, x, pos_inf))
    return mx, rmx, rmn


@device
def kept_pass_two(base, col0, lane, real_left, first, kv, kid, t32, sh, s, t, n, DTYPE: tl.constexpr,
                  VALID: tl.constexpr, PADDED: tl.constexpr, TEMPERED: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """Section 6 steps 3-4 on the kept columns of one chunk, and the count of the kept real columns."""
    _, xk, _, kept = kept_chunk(base, col0, lane, real_left, first, kv, kid, t32, DTYPE, VALID, PADDED, TEMPERED)
    e, yc = spec_exp_forward(xk - sh)
    s = s + e
    if WITH_ENTROPY:
        t = tl.fma(e, yc, t)
    return s, t, n + kept.to(tl.int32)


@kernel
def kept_partials_kernel(
    x_ptr, kv_ptr, kid_ptr, sh_ptr, m_ptr, s_ptr, t_ptr, bad_ptr, n_ptr,
    row_stride, real_local, t32,
    TILES: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    VALIDATE: tl.constexpr, PADDED: tl.constexpr, TEMPERED: tl.constexpr, SHIFTED: tl.constexpr,
    MAXIMA: tl.constexpr,
):
    """Section 6 steps 1-4 on the logits with ``x_c = -inf`` outside the row's kept set, for the tile
    ``pid % TILES`` of row ``pid // TILES``; also the tile's count of kept real columns. With
    ``SHIFTED`` the shift is the row's ``sh_ptr[row]`` (the row max ``B``): ``s`` is then section 13's
    lane sum of ``E(RN32(x_c - B))`` over the kept columns (top-p's ``Z`` is ``F`` of it over the
    tiles), and the count is top-k's. Validation reads every real column, kept or not. Without
    ``MAXIMA`` (a search step: shifted, no validation) the first pass is skipped and ``m`` is not written."""
    FULL: tl.constexpr = WIDTH // LANES
    REST: tl.constexpr = WIDTH - FULL * LANES
    pid = tl.program_id(0)
    row = (pid // TILES).to(tl.int64)
    tile = pid % TILES
    first = tile.to(tl.int64) * WIDTH
    base = x_ptr + row * row_stride + tile * WIDTH
    real_left = real_local - tile * WIDTH
    kv = tl.load(kv_ptr + row)
    kid = tl.load(kid_ptr + row)
    lane = tl.arange(0, LANES)
    mx = tl.full((LANES,), NEG_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    rmx = mx
    rmn = tl.full((LANES,), POS_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    if MAXIMA:
        if FULL <= MAX_UNROLL:  # straight code, as the raw forward's (its SASS counts every column)
            for k in tl.static_range(FULL):
                mx, rmx, rmn = kept_pass_one(base, k * LANES, lane, real_left, first, kv, kid, t32, mx, rmx, rmn,
                                             DTYPE, LANES, PADDED, TEMPERED, VALIDATE)
        else:
            for k in range(FULL):
                mx, rmx, rmn = kept_pass_one(base, k * LANES, lane, real_left, first, kv, kid, t32, mx, rmx, rmn,
                                             DTYPE, LANES, PADDED, TEMPERED, VALIDATE)
        if REST > 0:
            mx, rmx, rmn = kept_pass_one(base, FULL * LANES, lane, real_left, first, kv, kid, t32, mx, rmx, rmn,
                                         DTYPE, REST, PADDED, TEMPERED, VALIDATE)
    lane_nan = mx != mx
    nan = tl.reduce(lane_nan.to(tl.int32), 0, MAX)
    m = tl.reduce(tl.where(lane_nan, float("-inf"), mx), 0, MAX)
    m = tl.where(nan > 0, float("nan"), m) + tl.full((1,), 0.0, tl.float32)  # m + 0
    if SHIFTED:
        sh = tl.load(sh_ptr + row + tl.arange(0, 1))
    else:
        sh = tl.where(m == float("-inf"), 0.0, m)
    s = tl.full((LANES,), 0.0, tl.float32)
    t = tl.full((LANES,), 0.0, tl.float32)
    n = tl.full((LANES,), 0, tl.int32)
    if FULL <= MAX_UNROLL:
        for k in tl.static_range(FULL):
            s, t, n = kept_pass_two(base, k * LANES, lane, real_left, first, kv, kid, t32, sh, s, t, n, DTYPE,
                                    LANES, PADDED, TEMPERED, WITH_ENTROPY)
    else:
        for k in range(FULL):
            s, t, n = kept_pass_two(base, k * LANES, lane, real_left, first, kv, kid, t32, sh, s, t, n, DTYPE,
                                    LANES, PADDED, TEMPERED, WITH_ENTROPY)
    if REST > 0:
        s, t, n = kept_pass_two(base, FULL * LANES, lane, real_left, first, kv, kid, t32, sh, s, t, n, DTYPE, REST,
                                PADDED, TEMPERED, WITH_ENTROPY)
    out = row * TILES + tile + tl.arange(0, 1)
    if MAXIMA:
        tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, lane_fold(s))
    for level in tl.static_range(LANE_LEVELS):  # integers: any grouping gives the same count
        n = tl.reduce(tl.reshape(n, (2, LANES >> (level + 1))), 0, SUM)
    tl.store(n_ptr + out, n)
    if WITH_ENTROPY:
        tl.store(t_ptr + out, lane_fold(t))
    if VALIDATE:
        rn = rmx != rmx
        big = tl.reduce(tl.where(rn, float("inf"), rmx), 0, MAX) + tl.full((1,), 0.0, tl.float32)
        low = tl.reduce(rmn, 0, MIN) + tl.full((1,), 0.0, tl.float32)
        bad = (big == float("inf")) | (low == float("-inf"))
        tl.store(bad_ptr + out, bad.to(tl.int8))


@device
def minp_chunk(base, col0, lane, real_left, big, lmp, t32, least, n, DTYPE: tl.constexpr, VALID: tl.constexpr,
               PADDED: tl.constexpr, TEMPERED: tl.constexpr):
    """min-p on one chunk: the columns with ``RN32(x_c - B) >= L(mp32)``, their least ``x`` and count."""
    pos_inf = tl.full((LANES,), POS_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    cols = col0 + lane
    if PADDED:
        inside = (lane < VALID) & (cols < real_left)
    else:
        inside = lane < VALID
    x = upcast(tl.load(base + cols, mask=inside, other=0), DTYPE)
    if TEMPERED:
        x = tl.div_rn(x, t32)
    keep = inside & ((x - big) >= lmp)
    return tl.minimum(least, tl.where(keep, x, pos_inf)), n + keep.to(tl.int32)


@kernel
def minp_kernel(
    x_ptr, b_ptr, lmp_ptr, least_ptr, n_ptr, row_stride, real_local, t32,
    TILES: tl.constexpr, WIDTH: tl.constexpr, DTYPE: tl.constexpr, PADDED: tl.constexpr, TEMPERED: tl.constexpr,
):
    """Section 13 step 1 on the tile ``pid % TILES`` of row ``pid // TILES``: the least logit of
    ``K1 = {c : RN32(x_c - B) >= lmp}`` in the tile (``+inf`` when none) and its count."""
    FULL: tl.constexpr = WIDTH // LANES
    REST: tl.constexpr = WIDTH - FULL * LANES
    pid = tl.program_id(0)
    row = (pid // TILES).to(tl.int64)
    tile = pid % TILES
    base = x_ptr + row * row_stride + tile * WIDTH
    real_left = real_local - tile * WIDTH
    big = tl.load(b_ptr + row)
    lmp = tl.load(lmp_ptr + row)
    lane = tl.arange(0, LANES)
    least = tl.full((LANES,), POS_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    n = tl.full((LANES,), 0, tl.int32)
    if FULL <= MAX_UNROLL:
        for k in tl.static_range(FULL):
            least, n = minp_chunk(base, k * LANES, lane, real_left, big, lmp, t32, least, n, DTYPE, LANES, PADDED,
                                  TEMPERED)
    else:
        for k in range(FULL):
            least, n = minp_chunk(base, k * LANES, lane, real_left, big, lmp, t32, least, n, DTYPE, LANES, PADDED,
                                  TEMPERED)
    if REST > 0:
        least, n = minp_chunk(base, FULL * LANES, lane, real_left, big, lmp, t32, least, n, DTYPE, REST, PADDED,
                              TEMPERED)
    out = row * TILES + tile + tl.arange(0, 1)
    tl.store(least_ptr + out, tl.reduce(least, 0, MIN) + tl.full((1,), 0.0, tl.float32))
    for level in tl.static_range(LANE_LEVELS):
        n = tl.reduce(tl.reshape(n, (2, LANES >> (level + 1))), 0, SUM)
    tl.store(n_ptr + out, n)


@kernel
def kept_zero_kernel(
    x_ptr, kv_ptr, kid_ptr, g_ptr, row_stride, local_vocab, real_local, t32,
    BLOCKS: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr, TEMPERED: tl.constexpr,
):
    """Section 13 step 5: ``+0`` in every dropped real column of the gradient, after the raw
    backward's launches (a kept column's gradient reads only its own logit and the row's terms, so
    the raw kernels computed it already; the dropped target column's ``+gl`` is overwritten too)."""
    pid = tl.program_id(0)
    row = (pid // BLOCKS).to(tl.int64)
    cols = (pid % BLOCKS) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < real_local
    x = upcast(tl.load(x_ptr + row * row_stride + cols, mask=inside, other=0), DTYPE)
    if TEMPERED:
        x = tl.div_rn(x, t32)
    kv = tl.load(kv_ptr + row)
    kid = tl.load(kid_ptr + row)
    dropped = inside & ((x < kv) | ((x == kv) & (cols.to(tl.int64) > kid)))
    if DTYPE == DT_F32:
        tl.store(g_ptr + row * local_vocab + cols, tl.full((BLOCK,), 0.0, tl.float32), mask=dropped)
    else:
        tl.store(g_ptr + row * local_vocab + cols, tl.full((BLOCK,), 0, tl.int16), mask=dropped)
@device
def tile_fold(v, col, TILES: tl.constexpr, LEVELS: tl.constexpr):
    """``F`` (section 4) over the first ``TILES`` values of each row of ``v`` (``[rows, cols]``,
    ``col`` its column index): level ``k`` has ``w = ceil(TILES / 2**k)`` values and adds
    ``v[i] + v[w - h + i]`` for ``i < h = w // 2``, the partner fetched by ``tl.gather`` (a register
    permutation: no arithmetic). Returns ``v[:, 0]`` in every column of its row."""
    for level in tl.static_range(LEVELS):
        w = (TILES + (1 << level) - 1) >> level
        h = w // 2
        low = col < h
        v = tl.where(low, v + tl.gather(v, tl.where(low, col + (w - h), col), 1), v)
    return tl.gather(v, col * 0, 1)


@device
def canonical(v):
    """Section 6 step 10: every NaN as ``0x7FC00000``."""
    return tl.where(v != v, tl.full(v.shape, CANONICAL_NAN_BITS, tl.int32).to(tl.float32, bitcast=True), v)


@kernel
def merge_kernel(
    m_ptr, s_ptr, t_ptr, bad_ptr, x_ptr, tgt_ptr, act_ptr, tv_ptr, poison_ptr,
    logp_ptr, lse_ptr, ent_ptr, flag_ptr,
    rows, row_stride, local_vocab, real_vocab, t32, L4, L3, L2, L1,
    TILES: tl.constexpr, COLS: tl.constexpr, LEVELS: tl.constexpr, ROWS: tl.constexpr, DTYPE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr, READ_TARGET: tl.constexpr, VALIDATE: tl.constexpr, POISON: tl.constexpr,
    TEMPERED: tl.constexpr,
):
    """Section 6 steps 5-10 for ``ROWS`` rows in one launch: the merge of the ``[rows, TILES]``
    partials in global tile order (``B``, the weights ``E(m_j - Bs)``, ``S = F(s_j w_j)``,
    ``LSE = Bs + L(S)``, the entropy's ``F(w_j (t_j + sh_j s_j)) / S``), the logprob
    ``x_target - LSE`` (``+0`` on inactive rows) and the canonical NaN, each value computed by the
    operations :func:`rl_engine.arith.tiles.merge_tiles` and the shared forward use, in their
    order. A row's values are kept in every one of its ``COLS`` columns and stored from column 0.

    ``READ_TARGET`` (one rank holds the whole vocabulary): the target logit is read here from the
    logits (``x[row, target]`` upcast, divided by ``T32`` with the IEEE division, ``+0`` where the
    target is not a column of the shard), and with ``VALIDATE`` the row's validity comes from the
    forward's ``bad`` flags: an active row with a non-finite real logit gets a NaN target logit,
    and ``flag`` is bit 0 for that and bit 1 for an active target outside ``[0, real_vocab)``
    (``POISON``: such a row's logprob is NaN instead, and no flag is written). Otherwise the
    target logit ``tv`` (copied from its owner rank) and, with ``POISON``, the rows to give a NaN
    logprob are inputs."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = r < rows
    row = r.to(tl.int64)
    col = tl.arange(0, COLS)[None, :] + tl.full((ROWS, 1), 0, tl.int32)
    here = (col < TILES) & inside[:, None]
    at = row[:, None] * TILES + col
    neg_inf = tl.full((ROWS, COLS), NEG_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    m = tl.load(m_ptr + at, mask=here, other=0.0)
    m = tl.where(here, m, neg_inf)
    s = tl.load(s_ptr + at, mask=here, other=0.0)
    lane_nan = m != m  # 5. B = max_j m_j, NaN if any (tracked apart from the maximum)
    nan = tl.reduce(lane_nan.to(tl.int32), 1, MAX)
    big = tl.reduce(tl.where(lane_nan, neg_inf, m), 1, MAX)
    big = tl.where(nan > 0, float("nan"), big)[:, None]
    bs = tl.where(big == float("-inf"), 0.0, big)
    weight = spec_exp(m - bs)  # 6.
    total = tile_fold(s * weight, col, TILES, LEVELS)
    lse = bs + spec_log(total, L4, L3, L2, L1)  # 7.
    if WITH_ENTROPY:  # 8.
        t = tl.load(t_ptr + at, mask=here, other=0.0)
        shift = tl.where(m == float("-inf"), 0.0, m)
        mean = tl.div_rn(tile_fold(weight * (t + shift * s), col, TILES, LEVELS), total)
        tl.store(ent_ptr + row[:, None] + col * 0, canonical(lse - mean), mask=(col == 0) & inside[:, None])
    active = tl.load(act_ptr + r, mask=inside, other=0) != 0
    if READ_TARGET:
        target = tl.load(tgt_ptr + r, mask=inside, other=0)
        owned = (target >= 0) & (target < local_vocab)
        raw = tl.load(x_ptr + row * row_stride + target, mask=inside & owned, other=0)
        if TEMPERED:
            value = scaled(raw, t32, 1.0, DTYPE, DIV_IEEE)
        else:
            value = scaled(raw, t32, 1.0, DTYPE, DIV_NONE)
        tv = tl.where(owned, value, 0.0)
        if VALIDATE:
            finite = tl.reduce(tl.load(bad_ptr + at, mask=here, other=0).to(tl.int32), 1, MAX) == 0
            tv = tl.where(active & (finite == 0), float("nan"), tv)
            out_of_range = active & ((target < 0) | (target >= real_vocab))
            if POISON:
                poison = active & ((tv != tv) | out_of_range)
            else:
                flag = (active & (tv != tv)).to(tl.int8) + 2 * out_of_range.to(tl.int8)
                tl.store(flag_ptr + r, flag, mask=inside)
    else:
        tv = tl.load(tv_ptr + r, mask=inside, other=0.0)
        if POISON:
            poison = tl.load(poison_ptr + r, mask=inside, other=0) != 0
    logp = tl.where(active[:, None], tv[:, None] - lse, 0.0)  # 9.
    if POISON:
        logp = tl.where(poison[:, None], float("nan"), logp)
    first = (col == 0) & inside[:, None]
    tl.store(logp_ptr + row[:, None] + col * 0, canonical(logp), mask=first)  # 10.
    tl.store(lse_ptr + row[:, None] + col * 0, canonical(lse), mask=first)


@kernel
def backward_terms_kernel(
    glogp_ptr, glse_ptr, gent_ptr, act_ptr, tgt_ptr, lse_ptr, ent_ptr,
    coef_ptr, col_ptr, add_ptr, gent_out_ptr, mb_ptr,
    rows, logp_stride, lse_stride, gent_stride, vocab_start, local_vocab,
    ROWS: tl.constexpr, HAS_LOGP: tl.constexpr, HAS_LSE: tl.constexpr, ENTROPY_GRAD: tl.constexpr,
):
    """The backward's per-row terms (section 7) for ``ROWS`` rows, as
    :func:`rl_engine.logprob.backends.eager.vocab_parallel.backward_terms` computes them: ``gl`` (the logprob's
    gradient on active rows, ``+0`` elsewhere or without one), ``coef = g_lse - gl``, the local target
    column of rows that own an active target (``0`` elsewhere) and ``target_add`` (``gl`` there, ``-0``
    elsewhere: the identity); with the entropy gradient its copy and ``Mb = LSE - H``. The upstream
    gradients are read through their row strides (an expanded gradient has stride 0: no copy)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    inside = r < rows
    active = tl.load(act_ptr + r, mask=inside, other=0) != 0
    zero = tl.full((ROWS,), 0.0, tl.float32)
    if HAS_LOGP:
        gl = tl.where(active, tl.load(glogp_ptr + r * logp_stride, mask=inside, other=0.0), zero)
    else:
        gl = zero
    if HAS_LSE:
        gs = tl.load(glse_ptr + r * lse_stride, mask=inside, other=0.0)
    else:
        gs = zero
    tl.store(coef_ptr + r, gs - gl, mask=inside)
    local = tl.load(tgt_ptr + r, mask=inside, other=0) - vocab_start
    owned = active & (local >= 0) & (local < local_vocab)
    tl.store(col_ptr + r, tl.where(owned, local, 0), mask=inside)
    neg_zero = tl.full((ROWS,), -2147483648, tl.int32).to(tl.float32, bitcast=True)
    tl.store(add_ptr + r, tl.where(owned, gl, neg_zero), mask=inside)
    if ENTROPY_GRAD:
        tl.store(gent_out_ptr + r, tl.load(gent_ptr + r * gent_stride, mask=inside, other=0.0), mask=inside)
        tl.store(mb_ptr + r, tl.load(lse_ptr + r, mask=inside, other=0.0) - tl.load(ent_ptr + r, mask=inside,
                                                                                      other=0.0), mask=inside)
