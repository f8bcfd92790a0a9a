/*
 * The vector kernels of rl_engine/logprob/backends/fused_cpu/_fused_cpu.c, included once per instruction set
 * with LANES (binary32 values per vector: SSE2 4, AVX2 8, AVX-512 16), RLE_NAME (a name
 * suffix) and RLE_HW_FMA (1 where the variant is compiled for an FMA instruction) defined.
 * The vector width changes how many elements one instruction handles, never an operation or
 * its order on an element: the reductions over vector lanes are max and min (order free), and
 * the sums are the lane sums G and G* of docs/arithmetic.md section 4, whose 128 lanes are
 * 128 / LANES vectors in every variant.
 */

/* GCC vector extensions: each operation is the same IEEE-754 operation on every lane, so a
 * lane computes exactly what the specification says for its element. */
typedef float RLE_NAME(vf) __attribute__((vector_size(4 * LANES)));
typedef int32_t RLE_NAME(vi) __attribute__((vector_size(4 * LANES)));
typedef uint32_t RLE_NAME(vu) __attribute__((vector_size(4 * LANES)));
typedef uint16_t RLE_NAME(vh) __attribute__((vector_size(2 * LANES)));
typedef double RLE_NAME(vd) __attribute__((vector_size(8 * LANES)));
typedef int64_t RLE_NAME(vl) __attribute__((vector_size(8 * LANES)));

#define VF RLE_NAME(vf)
#define VI RLE_NAME(vi)
#define VU RLE_NAME(vu)
#define VH RLE_NAME(vh)
#define VD RLE_NAME(vd)
#define VL RLE_NAME(vl)
#define AI static inline __attribute__((always_inline))

AI VF RLE_NAME(vsplat)(float x) {
    VF v;
    for (int l = 0; l < LANES; l++) v[l] = x; /* a broadcast (keeps -0.0 and NaN bits) */
    return v;
}

AI VI RLE_NAME(vsplati)(int32_t x) {
    VI v;
    for (int l = 0; l < LANES; l++) v[l] = x;
    return v;
}

#define VS(x) RLE_NAME(vsplat)(x)

AI VF RLE_NAME(vsel)(VI mask, VF a, VF b) {
    return (VF)(((VI)a & mask) | ((VI)b & ~mask));
}

AI VF RLE_NAME(vload)(const float *p) {
    VF v;
    memcpy(&v, p, sizeof v);
    return v;
}

AI void RLE_NAME(vstore)(float *p, VF v) { memcpy(p, &v, sizeof v); }

/* LANES bf16 values as binary32 (bits << 16, exact). x86: one zero-extending load and a shift
 * (AVX2, AVX-512), or an interleave with zeros (SSE2); GCC's generic lowering of the
 * conversion takes several shuffles more. */
AI VF RLE_NAME(vload_bf16)(const uint16_t *p) {
#if RLE_X86 && LANES == 16
    return (VF)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif RLE_X86 && LANES == 8
    return (VF)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#elif RLE_X86 && LANES == 4
    return (VF)_mm_unpacklo_epi16(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)p));
#else
    VH h;
    memcpy(&h, p, sizeof h);
    VU u = __builtin_convertvector(h, VU) << 16;
    return (VF)u;
#endif
}

/* max(a, b) and min(a, b) of the instruction set: `a > b ? a : b` and `a < b ? a : b` lane by
 * lane (x86 MAXPS/MINPS return the second operand when either is NaN). So RLE_VMAX(LO, y) is
 * section 3's max(y, LO) with a NaN y staying NaN, and RLE_VMIN(HI, .) its min(., HI). */
#if !RLE_X86
#define RLE_VMAX(a, b) RLE_NAME(vsel)((a) > (b), (a), (b))
#define RLE_VMIN(a, b) RLE_NAME(vsel)((a) < (b), (a), (b))
#elif LANES == 16
#define RLE_VMAX(a, b) ((VF)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define RLE_VMIN(a, b) ((VF)_mm512_min_ps((__m512)(a), (__m512)(b)))
#elif LANES == 8
#define RLE_VMAX(a, b) ((VF)_mm256_max_ps((__m256)(a), (__m256)(b)))
#define RLE_VMIN(a, b) ((VF)_mm256_min_ps((__m256)(a), (__m256)(b)))
#else
#define RLE_VMAX(a, b) ((VF)_mm_max_ps((__m128)(a), (__m128)(b)))
#define RLE_VMIN(a, b) ((VF)_mm_min_ps((__m128)(a), (__m128)(b)))
#endif

/* ------------------------------------------------------------------ fma(a, b, c) */

/* Section 1's fusedMultiplyAdd: a * b + c rounded once. Every fma of this file is written
 * through RLE_VFMA; no other expression may become one (-ffp-contract=off). */
#if RLE_HW_FMA && LANES == 16
#define RLE_VFMA(a, b, c) ((VF)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif RLE_HW_FMA && LANES == 8
#define RLE_VFMA(a, b, c) ((VF)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
/* Without an FMA instruction (the SSE2 baseline; every non-x86 build, see _fused_cpu.c): the
 * algorithm of section 1 and of spec_numpy.fma32, in binary64 lanes. The product of two
 * binary32 values is exact in binary64; the binary64 sum s and its rounding error err are
 * exact (TwoSum: s + err == a * b + c); where err != 0 (inexact) and s's last bit is even,
 * s moves one binary64 ulp towards the exact value, which is the sum rounded to odd; one
 * rounding of that to binary32 is the correctly rounded fma, subnormal and overflowing
 * results included (53 >= 2 * 24 + 2 bits: Boldo and Melquiond 2008). Rounding the binary64
 * sum straight to binary32 would round twice. No libm call: the bytes depend on nothing but
 * IEEE binary64 add/subtract/multiply and the conversions. NaN and infinite operands: s is
 * NaN or infinite, err is NaN, nothing moves, and the conversion gives the IEEE result. */
AI VF RLE_NAME(vfma_soft)(VF a, VF b, VF c) {
    const VD a64 = __builtin_convertvector(a, VD), b64 = __builtin_convertvector(b, VD);
    const VD c64 = __builtin_convertvector(c, VD);
    VD z;
    for (int l = 0; l < LANES; l++) z[l] = 0.0;
    const VD p = a64 * b64; /* exact: 24 x 24 bits */
    const VD s = p + c64;
    const VD bb = s - p;
    const VD err = (p - (s - bb)) + (c64 - bb); /* TwoSum */
    VL u = (VL)s;
    const VL inexact = (err < z) | (err > z);           /* false where err is NaN */
    const VL toward_zero = (err > z) ^ (s > z);         /* the exact value is nearer 0 than s */
    const VL step = ((u & 1) ^ 1) & inexact;            /* 1 where inexact and s's last bit even */
    u = u + ((step ^ toward_zero) - toward_zero);       /* +step, or -step towards zero */
    return __builtin_convertvector((VD)u, VF);          /* the one rounding to binary32 */
}
#define RLE_VFMA(a, b, c) RLE_NAME(vfma_soft)((a), (b), (c))
#endif

/* ------------------------------------------------------------------ E(y), section 3 */

/* Steps 4-5: r, then p by Horner with fusedMultiplyAdd. */
AI VF RLE_NAME(vexp_poly)(VF yc, VF kf) {
    VF r = RLE_VFMA(kf, VS(-E_LN2_HI), yc); /* exact */
    r = RLE_VFMA(kf, VS(-E_LN2_LO), r);
    VF q = RLE_VFMA(VS(E_C6), r, VS(E_C5));
    q = RLE_VFMA(q, r, VS(E_C4));
    q = RLE_VFMA(q, r, VS(E_C3));
    q = RLE_VFMA(q, r, VS(E_C2));
    q = RLE_VFMA(q, r, VS(1.0f));
    return RLE_VFMA(q, r, VS(1.0f));
}

/* E, section 3: the general form, its 14 operations (every y). The backward's and the test
 * hook's: the backward's lse is the caller's, so the clamp at HI is kept although the
 * forward's own lse makes every argument <= 0. The forward's E is the forward form (the same
 * without min(., HI)), written out in tile_sums. */
AI VF RLE_NAME(vexp)(VF y) {
    const VF yc = RLE_VMIN(VS(E_HI), RLE_VMAX(VS(E_LO), y)); /* 1. NaN stays NaN */
    const VF t = RLE_VFMA(yc, VS(E_LOG2E), VS(E_BIAS));      /* 2. BIAS + k */
    const VF kf = t - VS(E_BIAS);                            /* 3. exact */
    const VF p = RLE_NAME(vexp_poly)(yc, kf);                /* 4-5. */
    const VF sc = (VF)((VU)t << 23);                         /* 6. 2**k; +0 at k = -127,
                                                                   +inf at k = 128 */
    return p * sc;                                           /* 7. */
}

AI VF RLE_NAME(vcanonical)(VF g) {
    return RLE_NAME(vsel)(g != g, (VF)RLE_NAME(vsplati)((int32_t)CANONICAL_NAN_BITS), g);
}

AI VH RLE_NAME(vround_bf16)(VF g) {
    VU u = (VU)g;
    VU r = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu;
    return __builtin_convertvector(r, VH);
}

/* ------------------------------------------------------------------ forward */

/* Columns per lane group of the tile loop: RLE_GROUP_VECS vectors side by side, each its own
 * lanes (independent dependency chains for the out-of-order core). Divides 128. */
#define RLE_GROUP_VECS 4
#define RLE_GROUP (RLE_GROUP_VECS * LANES)

/* Upcast the real columns [c0, c0 + nreal) of a row into x (-inf on the rest of x[0, wv))
 * and return their max ignoring NaN (-inf when there is none) and, with want_min, their min
 * ignoring NaN. Max and min of a set do not depend on grouping; a zero's sign is fixed by
 * the caller's + 0. */
AI float RLE_NAME(tile_upcast_max)(const char *rowp, int dtype, int64_t c0, int64_t nreal,
                                    int64_t wv, float *restrict x, int want_min, float *mn_out) {
    VF vmx = VS(-__builtin_inff()), vmn = VS(__builtin_inff());
    int64_t c = 0;
    if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)rowp + c0;
        if (want_min) {
            for (; c + LANES <= nreal; c += LANES) {
                VF v = RLE_NAME(vload_bf16)(src + c);
                RLE_NAME(vstore)(x + c, v);
                vmx = RLE_VMAX(v, vmx);
                vmn = RLE_VMIN(v, vmn);
            }
        } else {
            for (; c + LANES <= nreal; c += LANES) {
                VF v = RLE_NAME(vload_bf16)(src + c);
                RLE_NAME(vstore)(x + c, v);
                vmx = RLE_VMAX(v, vmx);
            }
        }
        for (int64_t k = c; k < nreal; k++) x[k] = f_of((uint32_t)src[k] << 16);
    } else if (dtype == DT_F32) {
        const float *src = (const float *)rowp + c0;
        for (; c + LANES <= nreal; c += LANES) {
            VF v = RLE_NAME(vload)(src + c);
            RLE_NAME(vstore)(x + c, v);
            vmx = RLE_VMAX(v, vmx);
            vmn = RLE_VMIN(v, vmn);
        }
        for (int64_t k = c; k < nreal; k++) x[k] = src[k];
    } else {
        for (c = 0; c < nreal; c++) x[c] = upcast(rowp, DT_F16, c0 + c);
        for (c = 0; c + LANES <= nreal; c += LANES) {
            VF v = RLE_NAME(vload)(x + c);
            vmx = RLE_VMAX(v, vmx);
            vmn = RLE_VMIN(v, vmn);
        }
    }
    float mx = -__builtin_inff(), mn = __builtin_inff();
    for (int l = 0; l < LANES; l++) {
        mx = vmx[l] > mx ? vmx[l] : mx;
        mn = vmn[l] < mn ? vmn[l] : mn;
    }
    for (; c < nreal; c++) { /* the tail, already in x */
        float v = x[c];
        mx = v > mx ? v : mx;
        mn = v < mn ? v : mn;
    }
    for (c = nreal; c < wv; c++) x[c] = -__builtin_inff();
    *mn_out = mn;
    return mx;
}

/* F (section 4) of the 128 lanes in v: a[i] + a[i + 64], then + 32, ...: the levels down to
 * LANES are whole-vector additions. */
AI float RLE_NAME(fold_lanes)(float *restrict v) {
    for (int h = RLE_LANE_COUNT / 2; h >= LANES; h /= 2)
        for (int i = 0; i < h; i += LANES)
            RLE_NAME(vstore)(v + i, RLE_NAME(vload)(v + i) + RLE_NAME(vload)(v + i + h));
    for (int h = LANES / 2; h >= 1; h /= 2)
        for (int i = 0; i < h; i++) v[i] = v[i] + v[i + h];
    return v[0];
}

/* Section 6 steps 3-4 on one tile: y = x - sh, e = E(y); lane l of the 128 adds, in column
 * order, the terms of columns l, l + 128, ... < w (G), and with_t, fma(e, max(y, LO), lane)
 * (G*). A group of RLE_GROUP lanes stays in registers while it walks the tile's chunks of 128
 * columns; the columns of x past w up to the group's end are -inf (E = +0, and
 * fma(+0, LO, lane) == lane: section 4 allows adding them). Groups with no column stay +0.
 *
 * E is section 3's forward form, its 13 operations: y = x - sh is <= 0 or NaN (sh is the
 * tile's max ignoring NaN, or 0 when that is -inf; a +inf max gives y = -inf or NaN), so
 * min(., HI) changes nothing. Its steps are written one at a time across the group's
 * vectors, so that the core has independent operations to issue while each vector's chain of
 * dependent FMAs waits on their latency. While it runs, the logits at [pf, pf_end) (the next
 * tile's) are prefetched, one cache line per step: the E pass reads no new memory, so the
 * next upcast pass would otherwise wait on it. */
#define RLE_EACH for (int v = 0; v < RLE_GROUP_VECS; v++)
AI void RLE_NAME(tile_sums)(const float *restrict x, int64_t w, float sh, float *restrict ls,
                            float *restrict lt, const int with_t, const char *pf,
                            const char *pf_end) {
    const VF vsh = VS(sh);
    for (int g = 0; g < RLE_LANE_COUNT; g += RLE_GROUP) {
        VF s[RLE_GROUP_VECS], t[RLE_GROUP_VECS];
        RLE_EACH s[v] = t[v] = VS(0.0f);
        for (int64_t c = g; c < w; c += RLE_LANE_COUNT) {
            if (pf < pf_end) { /* no effect on a value */
                __builtin_prefetch(pf);
                pf += 64;
            }
            VF yc[RLE_GROUP_VECS], tt[RLE_GROUP_VECS], kf[RLE_GROUP_VECS], r[RLE_GROUP_VECS];
            VF q[RLE_GROUP_VECS];
            RLE_EACH yc[v] = RLE_VMAX(VS(E_LO), RLE_NAME(vload)(x + c + v * LANES) - vsh);
            RLE_EACH tt[v] = RLE_VFMA(yc[v], VS(E_LOG2E), VS(E_BIAS));
            RLE_EACH kf[v] = tt[v] - VS(E_BIAS);
            RLE_EACH r[v] = RLE_VFMA(kf[v], VS(-E_LN2_HI), yc[v]);
            RLE_EACH r[v] = RLE_VFMA(kf[v], VS(-E_LN2_LO), r[v]);
            RLE_EACH q[v] = RLE_VFMA(VS(E_C6), r[v], VS(E_C5));
            RLE_EACH q[v] = RLE_VFMA(q[v], r[v], VS(E_C4));
            RLE_EACH q[v] = RLE_VFMA(q[v], r[v], VS(E_C3));
            RLE_EACH q[v] = RLE_VFMA(q[v], r[v], VS(E_C2));
            RLE_EACH q[v] = RLE_VFMA(q[v], r[v], VS(1.0f));
            RLE_EACH q[v] = RLE_VFMA(q[v], r[v], VS(1.0f)); /* p */
            RLE_EACH q[v] = q[v] * (VF)((VU)tt[v] << 23);   /* e = p * 2**k */
            RLE_EACH s[v] = s[v] + q[v];
            if (with_t) RLE_EACH t[v] = RLE_VFMA(q[v], yc[v], t[v]);
        }
        RLE_EACH {
            RLE_NAME(vstore)(ls + g + v * LANES, s[v]);
            if (with_t) RLE_NAME(vstore)(lt + g + v * LANES, t[v]);
        }
    }
}
#undef RLE_EACH

static __attribute__((noinline)) int RLE_NAME(has_nan)(const float *x, int64_t n) {
    for (int64_t c = 0; c < n; c++)
        if (x[c] != x[c]) return 1;
    return 0;
}

/* x: a tile buffer of at least w rounded up to 128 floats. */
static __attribute__((noinline)) void RLE_NAME(fwd_rows)(const fwd_args *a, int64_t r0,
                                                           int64_t r1, float *restrict x) {
    const int64_t w = a->tile_width;
    const int64_t tiles = a->local_vocab / w;
    const int64_t wv = (w + RLE_GROUP - 1) / RLE_GROUP * RLE_GROUP;
    const size_t esz = a->dtype == DT_F32 ? 4 : 2;
    float ls[RLE_LANE_COUNT] __attribute__((aligned(64)));
    float lt[RLE_LANE_COUNT] __attribute__((aligned(64)));
    for (int64_t row = r0; row < r1; row++) {
        const char *rowp = (const char *)a->logits + (size_t)row * (size_t)a->row_stride * esz;
        const float t32 = a->row_t32 != NULL ? a->row_t32[row] : a->t32; /* this row's T32 */
        float rmin = __builtin_inff();
        int rnan = 0;
        for (int64_t j = 0; j < tiles; j++) {
            const int64_t c0 = j * w;
            int64_t nreal = a->real_local - c0;
            nreal = nreal < 0 ? 0 : (nreal > w ? w : nreal);
            float mn;
            float mx = RLE_NAME(tile_upcast_max)(rowp, a->dtype, c0, nreal, wv, x,
                                                 a->row_min != NULL, &mn);
            if (t32 != 1.0f) {
                /* section 6 step 0: x = x / T32, the IEEE division (vector and scalar alike).
                 * T32 > 0 and rounding is monotone, so the max and min of the quotients are the
                 * quotients of the max and min (NaN ignored as before; -inf stays -inf). */
                const VF vt = VS(t32);
                int64_t c = 0;
                for (; c + LANES <= nreal; c += LANES)
                    RLE_NAME(vstore)(x + c, RLE_NAME(vload)(x + c) / vt);
                for (; c < nreal; c++) x[c] = x[c] / t32;
                mx = mx / t32;
                mn = mn / t32;
            }
            if (nreal > 0) rmin = mn < rmin ? mn : rmin;
            /* Section 6 steps 1-2 take m = NaN when a column is NaN; here the shift comes from
             * the max ignoring NaN. Both give the same s and t: a NaN column makes its y, E(y),
             * and fma(E(y), max(y, LO), .) NaN, so the lane sums are NaN either way (payloads
             * do not matter: every output is made canonical). m itself is set to NaN below,
             * from the sum. */
            const float mj = mx + 0.0f;
            const float sh = mj == -__builtin_inff() ? 0.0f : mj;
            /* While E runs on this tile, the next tile's logits (or the next row's first) are
             * fetched: the E loop reads only the tile buffer, so without this the upcast pass
             * would wait on memory. */
            const char *pf = j + 1 < tiles ? rowp + (size_t)(c0 + w) * esz
                                           : rowp + (size_t)a->row_stride * esz;
            const char *pf_end = pf + (size_t)w * esz;
            float sj, tj = 0.0f;
            if (a->t != NULL) {
                RLE_NAME(tile_sums)(x, w, sh, ls, lt, 1, pf, pf_end);
                tj = RLE_NAME(fold_lanes)(lt);
            } else {
                RLE_NAME(tile_sums)(x, w, sh, ls, lt, 0, pf, pf_end);
            }
            sj = RLE_NAME(fold_lanes)(ls);
            if (a->t != NULL) a->t[row * tiles + j] = tj;
            /* A NaN column makes s NaN. Without one, s is NaN only when the max is +inf
             * (inf - inf); only then is the tile scanned. */
            const int nan = sj != sj && (mx != __builtin_inff() || RLE_NAME(has_nan)(x, nreal));
            rnan |= nan;
            a->s[row * tiles + j] = sj;
            a->m[row * tiles + j] = nan ? f_of(CANONICAL_NAN_BITS) : mj;
        }
        if (a->row_min != NULL && a->real_local > 0)
            a->row_min[row] = rnan ? f_of(CANONICAL_NAN_BITS) : rmin;
    }
}

/* ------------------------------------------------------------------ backward */

AI void RLE_NAME(store_one)(void *out, int dtype, int64_t c, float g) {
    g = canonical(g);
    if (dtype == DT_F32) ((float *)out)[c] = g;
    else if (dtype == DT_BF16) ((uint16_t *)out)[c] = round_bf16(g);
    else ((uint16_t *)out)[c] = round_f16(g);
}

/* Section 7 steps 1-2 for one column, in the general form: a temperature (T32 != 1) and an
 * entropy term (ge != 0): x = f32(X) / T32; p = E(x - lse); g = coef * p; g = g + (ge * p) * (mb - x)
 * where p != 0; at the target g + gl; then g / T32. Scalar code on one vector lane of vexp (the E of the
 * vector paths). */
AI float RLE_NAME(grad_general)(float x, float lse, float coef, float ge, float mb) {
    const VF p = RLE_NAME(vexp)(VS(x) - VS(lse));
    float g = coef * p[0];
    if (ge != 0.0f && p[0] != 0.0f) g = g + (ge * p[0]) * (mb - x);
    return g;
}

/* Section 7 step 1 for one column (the target column): the vector operations on one lane. */
AI float RLE_NAME(grad_one)(const char *rowp, int dtype, int64_t c, float lse, float coef, float t32,
                            float ge, float mb) {
    const float x = t32 != 1.0f ? upcast(rowp, dtype, c) / t32 : upcast(rowp, dtype, c);
    return RLE_NAME(grad_general)(x, lse, coef, ge, mb);
}

/* One row's gradient with a temperature or an entropy term (the target column is redone by the
 * caller): LANES columns at a time through the scalar upcast, the vector E, the products of
 * grad_general lane by lane (each an IEEE operation, so a lane's bits are grad_general's). */
static __attribute__((noinline)) void RLE_NAME(bwd_row_general)(const char *rowp, int dtype, char *out,
                                                                 int64_t R, float lse, float coef,
                                                                 float t32, float ge, float mb) {
    const VF vlse = VS(lse), vcoef = VS(coef), vt = VS(t32), vge = VS(ge), vmb = VS(mb);
    float xs[LANES], ps[LANES], gs[LANES], hs[LANES];
    for (int64_t c = 0; c < R; c += LANES) {
        for (int l = 0; l < LANES; l++) xs[l] = c + l < R ? upcast(rowp, dtype, c + l) : 0.0f;
        VF x = RLE_NAME(vload)(xs);
        if (t32 != 1.0f) x = x / vt;
        const VF p = RLE_NAME(vexp)(x - vlse);
        const VF g = vcoef * p;
        RLE_NAME(vstore)(gs, g);
        if (ge != 0.0f) {
            RLE_NAME(vstore)(ps, p);
            RLE_NAME(vstore)(hs, g + (vge * p) * (vmb - x));
            for (int l = 0; l < LANES; l++) gs[l] = ps[l] != 0.0f ? hs[l] : gs[l];
        }
        for (int64_t k = c; k < R && k < c + LANES; k++)
            RLE_NAME(store_one)(out, dtype, k, t32 != 1.0f ? gs[k - c] / t32 : gs[k - c]);
    }
}

static __attribute__((noinline)) void RLE_NAME(bwd_rows)(const bwd_args *a, int64_t r0,
                                                           int64_t r1) {
    const int dtype = a->dtype;
    const size_t esz = dtype == DT_F32 ? 4 : 2;
    const int64_t V = a->local_vocab, R = a->real_local;
    for (int64_t row = r0; row < r1; row++) {
        const char *rowp = (const char *)a->logits + (size_t)row * (size_t)a->row_stride * esz;
        char *out = (char *)a->grad + (size_t)row * (size_t)V * esz;
        const float coef = a->coef[row];
        const float lse = a->lse[row];
        const int64_t tc = a->target_col[row];
        const float t32 = a->row_t32 != NULL ? a->row_t32[row] : a->t32; /* this row's T32 */
        const float ge = a->g_ent != NULL ? a->g_ent[row] : 0.0f;
        const float mb = a->mb != NULL ? a->mb[row] : 0.0f;
        if (coef == 0.0f && ge == 0.0f) {
            /* section 7 override: +0 everywhere, round((+0 + gl) / T32) at the owned target */
            memset(out, 0, (size_t)V * esz);
            const float g = a->target_add[row] + 0.0f;
            if (tc >= 0 && tc < R) RLE_NAME(store_one)(out, dtype, tc, t32 != 1.0f ? g / t32 : g);
            continue;
        }
        if (t32 != 1.0f || ge != 0.0f) { /* a temperature (section 6 step 0) or an entropy term */
            RLE_NAME(bwd_row_general)(rowp, dtype, out, R, lse, coef, t32, ge, mb);
        } else {
            const VF vlse = VS(lse), vcoef = VS(coef);
            int64_t c = 0;
            if (dtype == DT_BF16) {
                const uint16_t *src = (const uint16_t *)rowp;
                for (; c + LANES <= R; c += LANES) {
                    VF g = vcoef * RLE_NAME(vexp)(RLE_NAME(vload_bf16)(src + c) - vlse);
                    VH h = RLE_NAME(vround_bf16)(RLE_NAME(vcanonical)(g));
                    memcpy((uint16_t *)out + c, &h, sizeof h);
                }
            } else if (dtype == DT_F32) {
                const float *src = (const float *)rowp;
                for (; c + LANES <= R; c += LANES) {
                    VF g = vcoef * RLE_NAME(vexp)(RLE_NAME(vload)(src + c) - vlse);
                    RLE_NAME(vstore)((float *)out + c, RLE_NAME(vcanonical)(g));
                }
            } else {
                float xs[LANES], gs[LANES];
                for (; c + LANES <= R; c += LANES) {
                    for (int l = 0; l < LANES; l++) xs[l] = upcast(rowp, DT_F16, c + l);
                    VF g = vcoef * RLE_NAME(vexp)(RLE_NAME(vload)(xs) - vlse);
                    RLE_NAME(vstore)(gs, g);
                    for (int l = 0; l < LANES; l++) ((uint16_t *)out)[c + l] = round_f16(canonical(gs[l]));
                }
            }
            if (c < R) { /* the last R - c < LANES columns: one vector, lanes past R unused */
                float xs[LANES], gs[LANES];
                for (int l = 0; l < LANES; l++) xs[l] = c + l < R ? upcast(rowp, dtype, c + l) : 0.0f;
                RLE_NAME(vstore)(gs, vcoef * RLE_NAME(vexp)(RLE_NAME(vload)(xs) - vlse));
                for (int64_t k = c; k < R; k++) RLE_NAME(store_one)(out, dtype, k, gs[k - c]);
            }
        }
        if (tc >= 0 && tc < R) {
            /* step 2: the same operations for the one column, then + gl, / T32, rounded once */
            float g = RLE_NAME(grad_one)(rowp, dtype, tc, lse, coef, t32, ge, mb);
            g = g + a->target_add[row];
            RLE_NAME(store_one)(out, dtype, tc, t32 != 1.0f ? g / t32 : g);
        }
        if (R < V) memset(out + (size_t)R * esz, 0, (size_t)(V - R) * esz);
    }
}

/* ------------------------------------------------------------------ test hooks */

/* out[i] = op(a[i], b[i], c[i]) for op 0: fma(a, b, c) (RLE_VFMA), 1: a * b + c as two
 * roundings (written that way; a contracting compiler would make it an fma), 2: E(a) (the
 * general form), 3: a / b (the vector division of the temperature). Whole vectors, then one vector on a zero-padded copy of the tail. */
static __attribute__((noinline)) void RLE_NAME(elementwise)(int op, const float *a, const float *b,
                                                              const float *c, float *out,
                                                              int64_t n) {
    for (int64_t i = 0; i < n; i += LANES) {
        float xa[LANES], xb[LANES], xc[LANES], r[LANES];
        const int64_t m = n - i < LANES ? n - i : LANES;
        for (int l = 0; l < LANES; l++) {
            xa[l] = l < m ? a[i + l] : 0.0f;
            xb[l] = l < m && b != NULL ? b[i + l] : 0.0f;
            xc[l] = l < m && c != NULL ? c[i + l] : 0.0f;
        }
        const VF va = RLE_NAME(vload)(xa), vb = RLE_NAME(vload)(xb), vc = RLE_NAME(vload)(xc);
        VF vr;
        if (op == 0) vr = RLE_VFMA(va, vb, vc);
        else if (op == 1) vr = va * vb + vc;
        else if (op == 3) vr = va / vb;
        else vr = RLE_NAME(vexp)(va);
        RLE_NAME(vstore)(r, vr);
        memcpy(out + i, r, (size_t)m * sizeof(float));
    }
}

#undef RLE_GROUP
#undef RLE_GROUP_VECS
#undef RLE_VFMA
#undef RLE_VMAX
#undef RLE_VMIN
#undef VS
#undef AI
#undef VF
#undef VI
#undef VU
#undef VH
#undef VD
#undef VL
