"""Triton kernels of backend ``triton-vocab-parallel-logp-ws2`` (``docs/arithmetic.md``).

Two kernels, written with IEEE-754 basic operations only, in the specification's order:

* :func:`forward_partials_kernel`: one program per (row, tile): upcast (bf16 and binary16 by
  integer operations), the tile max, ``E(x - shift)`` (section 3), the fold ``F`` of section 4
  over the tile's ``w`` columns, the entropy terms (section 6 steps 1-4) and, for validation,
  whether every real column of the tile is finite;
* :func:`backward_kernel`: one program per (row, block of columns): ``E(x - lse)``, times
  ``coef``, plus the target term, canonical NaN, the one rounding of section 8, and the
  ``coef == 0`` and padding overrides of section 7.

No ``tl.exp``, ``tl.log``, ``tl.sum``, ``tl.max``, ``tl.reduce``, libdevice or division is
used. The fold is written out: the tile's ``w`` columns are placed in ``P`` (a power of two)
slots by a permutation (:func:`fold_slots`, computed once on the host) chosen so that the
halving ``A[i] + A[i + P/2]``, repeated, adds exactly the pairs ``F`` adds, level by level;
the slots that hold no column carry ``-0.0``, the identity of IEEE addition (``x + -0 = x``
for every ``x``, ``+0`` and NaN included). A halving is a ``reshape`` to ``[2, P/2]``, a
transpose and a ``split``: data movement, then one ``add`` per pair.

This file is loaded twice by :mod:`rl_engine.logprob.triton_backend`, once per mode: with
``KERNEL_MODE = "compiled"`` every function is a ``triton.jit`` function; with
``"interpreter"`` each is Triton's ``InterpretedFunction`` (NumPy on CPU tensors, one IEEE
operation at a time). The mode is chosen by the caller, never by a fallback.
"""

from __future__ import annotations

import triton
import triton.language as tl

KERNEL_MODE = globals().get("KERNEL_MODE", "compiled")


def _decorator():  # type: ignore[no-untyped-def]
    if KERNEL_MODE == "interpreter":
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction
    if KERNEL_MODE != "compiled":
        raise ValueError(f"KERNEL_MODE={KERNEL_MODE!r} must be 'compiled' or 'interpreter'")
    return triton.jit


kernel = _decorator()

# docs/arithmetic.md section 3 (binary32 values, exact as Python floats)
E_LO: tl.constexpr = tl.constexpr(float.fromhex("-0x1.5cp+6"))
E_HI: tl.constexpr = tl.constexpr(float.fromhex("0x1.64p+6"))
E_LOG2E: tl.constexpr = tl.constexpr(float.fromhex("0x1.715476p+0"))
E_SHIFTER: tl.constexpr = tl.constexpr(float.fromhex("0x1.8p+23"))
E_LN2_HI: tl.constexpr = tl.constexpr(float.fromhex("0x1.62e4p-1"))
E_LN2_LO: tl.constexpr = tl.constexpr(float.fromhex("0x1.7f7d1cp-20"))
E_C6: tl.constexpr = tl.constexpr(float.fromhex("0x1.6a244cp-10"))
E_C5: tl.constexpr = tl.constexpr(float.fromhex("0x1.1239d4p-7"))
E_C4: tl.constexpr = tl.constexpr(float.fromhex("0x1.5558f2p-5"))
E_C3: tl.constexpr = tl.constexpr(float.fromhex("0x1.555492p-3"))
E_C2: tl.constexpr = tl.constexpr(float.fromhex("0x1.fffffcp-2"))
CANONICAL_NAN_BITS: tl.constexpr = tl.constexpr(0x7FC00000)
NEG_INF_BITS: tl.constexpr = tl.constexpr(-8388608)  # 0xFF800000
NEG_ZERO_BITS: tl.constexpr = tl.constexpr(-2147483648)  # 0x80000000
DT_F32: tl.constexpr = tl.constexpr(0)
DT_BF16: tl.constexpr = tl.constexpr(1)
DT_F16: tl.constexpr = tl.constexpr(2)


@kernel
def spec_exp(y):
    """``E(y)``, section 3 steps 1-8, on a binary32 tensor."""
    under = y < E_LO  # 1. false for NaN
    yc = tl.where(y < E_LO, E_LO, y)  # 2. NaN stays NaN (comparisons are false)
    yc = tl.where(yc > E_HI, E_HI, yc)
    t = yc * E_LOG2E  # 3.
    t = t + E_SHIFTER
    kf = t - E_SHIFTER
    a1 = kf * E_LN2_HI  # 4.
    r = yc - a1
    a2 = kf * E_LN2_LO
    r = r - a2
    q = r * E_C6  # 5. Horner, each step a multiply then an add
    q = q + E_C5
    q = q * r
    q = q + E_C4
    q = q * r
    q = q + E_C3
    q = q * r
    q = q + E_C2
    q = q * r
    q = q + 1.0
    q = q * r
    p = q + 1.0
    k = kf.to(tl.int32)  # 6. exact (kf is integral); a NaN kf gives some integer
    ka = k >> 1
    kb = k - ka
    sa = ((ka + 127) << 23).to(tl.float32, bitcast=True)
    sb = ((kb + 127) << 23).to(tl.float32, bitcast=True)
    res = p * sa  # 7.
    res = res * sb
    return tl.where(under, 0.0, res)  # 8.


@kernel
def upcast(raw, DTYPE: tl.constexpr):
    """Section 1's exact conversion to binary32: bf16 and binary16 (given as int16 bits) by
    integer operations; binary32 is returned as it is."""
    if DTYPE == DT_F32:
        out = raw
    elif DTYPE == DT_BF16:
        out = ((raw.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        h = raw.to(tl.int32) & 0xFFFF
        sign = (h & 0x8000) << 16
        e = (h >> 10) & 0x1F
        m = h & 0x3FF
        special = sign | 0x7F800000 | (m << 13)
        normal = sign | ((e + 112) << 23) | (m << 13)
        # zero or subnormal: m * 2**-24, exact in binary32 (a normal number or zero)
        small = sign | (m.to(tl.float32) * 5.9604644775390625e-08).to(tl.int32, bitcast=True)
        out = tl.where(e == 0x1F, special, tl.where(e != 0, normal, small)).to(tl.float32, bitcast=True)
    return out


@kernel
def fold_add(v, LEVELS: tl.constexpr):
    """``F`` over the ``2**LEVELS`` slots of ``v`` (laid out by :func:`fold_slots`): ``LEVELS``
    halvings ``v[i] + v[i + P/2]``; returns a one-element tensor."""
    for level in tl.static_range(LEVELS):
        a, b = tl.split(tl.trans(tl.reshape(v, (2, (1 << LEVELS) >> (level + 1)))))
        v = a + b
    return v


@kernel
def forward_partials_kernel(
    x_ptr, slot_ptr, m_ptr, s_ptr, t_ptr, bad_ptr,
    row_stride, real_local,
    TILES: tl.constexpr, WIDTH: tl.constexpr, LEVELS: tl.constexpr, DTYPE: tl.constexpr,
    WITH_ENTROPY: tl.constexpr, VALIDATE: tl.constexpr,
):
    """Section 6 steps 1-4 for the tile ``pid % TILES`` of row ``pid // TILES`` (a constant
    divisor: integer multiply and shift, no division sequence)."""
    SLOTS: tl.constexpr = 1 << LEVELS
    pid = tl.program_id(0)
    row = (pid // TILES).to(tl.int64)
    tile = pid % TILES
    local = tl.load(slot_ptr + tl.arange(0, SLOTS))  # the column in the tile, -1: no column
    held = local >= 0
    col = tile * WIDTH + local
    real = held & (col < real_local)
    raw = tl.load(x_ptr + row * row_stride + col, mask=real, other=0)
    neg_inf = tl.full((SLOTS,), NEG_INF_BITS, tl.int32).to(tl.float32, bitcast=True)
    neg_zero = tl.full((SLOTS,), NEG_ZERO_BITS, tl.int32).to(tl.float32, bitcast=True)
    x = tl.where(real, upcast(raw, DTYPE), neg_inf)  # padding and empty slots: -inf
    # 1. the tile max, NaN if any column is NaN (a max does not depend on grouping)
    mx = x
    for level in tl.static_range(LEVELS):
        a, b = tl.split(tl.trans(tl.reshape(mx, (2, SLOTS >> (level + 1)))))
        mx = tl.where((a > b) | (a != a), a, b)
    m = mx + 0.0  # one sign for zero (a one-element tensor)
    sh = tl.where(m == float("-inf"), 0.0, m)  # 2.
    y = x - sh  # 3.
    e = spec_exp(y)
    s = fold_add(tl.where(held, e, neg_zero), LEVELS)
    out = row * TILES + tile + tl.arange(0, 1)
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    if WITH_ENTROPY:  # 4. y' = 0 on padding columns
        te = e * tl.where(real, y, 0.0)
        t = fold_add(tl.where(held, te, neg_zero), LEVELS)
        tl.store(t_ptr + out, t)
    if VALIDATE:  # a real column that is NaN or infinite (an integer flag; order free)
        bad = tl.where(real & ((x != x) | (x == float("inf")) | (x == float("-inf"))), 1, 0)
        for level in tl.static_range(LEVELS):
            a2, b2 = tl.split(tl.trans(tl.reshape(bad, (2, SLOTS >> (level + 1)))))
            bad = a2 | b2
        tl.store(bad_ptr + out, bad.to(tl.int8))


@kernel
def round_f16_bits(u):
    """Section 8: binary32 bits (NaN canonical) to binary16 bits, round to nearest even, with
    subnormal results and overflow to infinity; integer operations only."""
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    r = a - 0x38000000  # |f| >= 2**-14: rebias the exponent (127 - 15 = 112)
    q = r >> 13
    rem = r & 0x1FFF
    q = tl.where((rem > 0x1000) | ((rem == 0x1000) & ((q & 1) == 1)), q + 1, q)
    q = tl.where(q >= 0x7C00, 0x7C00, q)
    e = a >> 23  # a binary16 subnormal or zero: units of 2**-24
    shift = tl.where(e < 102, 24, tl.where(e > 112, 14, 126 - e))
    mant = (a & 0x007FFFFF) | 0x00800000
    qs = mant >> shift
    rems = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    qs = tl.where((rems > half) | ((rems == half) & ((qs & 1) == 1)), qs + 1, qs)
    qs = tl.where(e < 102, 0, qs)
    out = tl.where(a >= 0x38800000, q, qs)
    return tl.where(a > 0x7F800000, 0x7E00, sign | out)  # NaN: the canonical 0x7E00


@kernel
def backward_kernel(
    x_ptr, lse_ptr, coef_ptr, col_ptr, add_ptr, g_ptr,
    row_stride, local_vocab, real_local,
    BLOCKS: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
):
    """Section 7 (and 8) for columns ``[b * BLOCK, (b + 1) * BLOCK)`` of row ``pid // BLOCKS``."""
    pid = tl.program_id(0)
    row = (pid // BLOCKS).to(tl.int64)
    cols = (pid % BLOCKS) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < local_vocab
    real = cols < real_local
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    target = tl.load(col_ptr + row)
    add = tl.load(add_ptr + row)
    raw = tl.load(x_ptr + row * row_stride + cols, mask=real, other=0)
    x = upcast(raw, DTYPE)
    g = coef * spec_exp(x - lse)  # 1.
    at_target = cols == target
    g = tl.where(at_target, g + add, g)  # 2. (add is -0.0, the identity, on rows owning no target)
    g = tl.where(coef == 0.0, tl.where(at_target, add + 0.0, 0.0), g)  # the coef == 0 override
    g = tl.where(real, g, 0.0)  # padding columns are +0
    bits = g.to(tl.int32, bitcast=True)
    bits = tl.where(g != g, CANONICAL_NAN_BITS, bits)  # 3. canonical NaN
    if DTYPE == DT_F32:
        tl.store(g_ptr + row * local_vocab + cols, bits.to(tl.float32, bitcast=True), mask=inside)
    elif DTYPE == DT_BF16:
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        tl.store(g_ptr + row * local_vocab + cols, r.to(tl.int16), mask=inside)
    else:
        tl.store(g_ptr + row * local_vocab + cols, round_f16_bits(bits).to(tl.int16), mask=inside)


def fold_slots(width: int) -> list[int]:
    """Where each of a tile's ``width`` columns goes among ``P = next_pow2(width)`` slots.

    Returns ``slot -> column`` (``-1`` for a slot holding no column) such that ``log2(P)``
    halvings ``A[i] + A[i + P/2]`` add the pairs the fold ``F`` of section 4 adds: at a level
    of ``w`` values, ``h = w // 2``, value ``i < h`` is paired with value ``w - h + i``, and
    when ``w`` is odd value ``h`` passes to the next level unchanged (it meets an empty slot).
    Built from the last level (one value in slot 0) back to the first.
    """
    if width < 1:
        raise ValueError(f"width={width} must be >= 1")
    widths = [width]
    while widths[-1] > 1:
        widths.append(widths[-1] - widths[-1] // 2)
    slots = 1
    while slots < width:
        slots *= 2
    size = 1
    position = [0]  # value -> slot at the last level
    for w in reversed(widths[:-1]):
        h = w // 2
        nxt = position  # positions of the w - h values of the next level
        position = [0] * w
        for i in range(w - h):
            position[i] = nxt[i]
        for i in range(h):
            position[w - h + i] = nxt[i] + size
        size *= 2
    assert size == slots, (size, slots)
    table = [-1] * slots
    for value, slot in enumerate(position):
        table[slot] = value
    return table
