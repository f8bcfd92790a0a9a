/*
 * The vector kernels of rl_engine/logprob/_fused_cpu.c, included once per instruction set
 * with LANES (16-byte SSE2: 4, AVX2: 8, AVX-512: 16) and RLE_NAME (a name suffix) defined.
 * The lane count changes how many elements one instruction handles, never an operation or
 * its order on an element; the reductions over lanes are max and min (order free), and the
 * sums are the fold F over memory, the same loop for every variant.
 */

/* GCC vector extensions: each operation is the same IEEE-754 operation on every lane (four
 * SSE2 registers in the baseline build, two AVX2 registers or one AVX-512 register in the
 * clones), so a lane computes exactly what the scalar code above computes for its element. */
typedef float RLE_NAME(vf) __attribute__((vector_size(4 * LANES)));
typedef int32_t RLE_NAME(vi) __attribute__((vector_size(4 * LANES)));
typedef uint32_t RLE_NAME(vu) __attribute__((vector_size(4 * LANES)));
typedef uint16_t RLE_NAME(vh) __attribute__((vector_size(2 * LANES)));

static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vsplat)(float x) {
    RLE_NAME(vf) v;
    for (int l = 0; l < LANES; l++) v[l] = x; /* a broadcast (keeps -0.0 and NaN bits) */
    return v;
}

static inline __attribute__((always_inline)) RLE_NAME(vi) RLE_NAME(vsplati)(int32_t x) {
    RLE_NAME(vi) v;
    for (int l = 0; l < LANES; l++) v[l] = x;
    return v;
}

static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vsel)(RLE_NAME(vi) mask, RLE_NAME(vf) a, RLE_NAME(vf) b) {
    return (RLE_NAME(vf))(((RLE_NAME(vi))a & mask) | ((RLE_NAME(vi))b & ~mask));
}

static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vload)(const float *p) {
    RLE_NAME(vf) v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void RLE_NAME(vstore)(float *p, RLE_NAME(vf) v) { memcpy(p, &v, sizeof v); }

static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vload_bf16)(const uint16_t *p) {
    RLE_NAME(vh) h;
    memcpy(&h, p, sizeof h);
    RLE_NAME(vu) u = __builtin_convertvector(h, RLE_NAME(vu)) << 16;
    return (RLE_NAME(vf))u;
}

/* E(y) on 16 lanes: rle_exp's operations, in its order, with two shortcuts that give the
 * same value for every y (docs/arithmetic.md section 3):
 *  - step 2's max(y, LO) is left out: where y < LO the result is replaced by +0 in step 8
 *    whatever was computed, and elsewhere max(y, LO) == y (a NaN stays NaN either way);
 *  - with `le0` (the forward, where y = x - max <= 0 or NaN) step 2's min(., HI) is a no-op
 *    and is left out too;
 *  - a NaN kf is converted by the instruction set's truncation (x86: INT_MIN); any integer
 *    is allowed there since the result is NaN whatever the scale. */
static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vexp_impl)(RLE_NAME(vf) y, int le0) {
    RLE_NAME(vi) under = y < RLE_NAME(vsplat)(E_LO);
    RLE_NAME(vf) yc = le0 ? y : RLE_NAME(vsel)(y > RLE_NAME(vsplat)(E_HI), RLE_NAME(vsplat)(E_HI), y);
    RLE_NAME(vf) t = yc * RLE_NAME(vsplat)(E_LOG2E);
    t = t + RLE_NAME(vsplat)(E_SHIFTER);
    RLE_NAME(vf) kf = t - RLE_NAME(vsplat)(E_SHIFTER);
    RLE_NAME(vf) a1 = kf * RLE_NAME(vsplat)(E_LN2_HI);
    RLE_NAME(vf) r = yc - a1;
    RLE_NAME(vf) a2 = kf * RLE_NAME(vsplat)(E_LN2_LO);
    r = r - a2;
    RLE_NAME(vf) q = r * RLE_NAME(vsplat)(E_C6);
    q = q + RLE_NAME(vsplat)(E_C5);
    q = q * r;
    q = q + RLE_NAME(vsplat)(E_C4);
    q = q * r;
    q = q + RLE_NAME(vsplat)(E_C3);
    q = q * r;
    q = q + RLE_NAME(vsplat)(E_C2);
    q = q * r;
    q = q + RLE_NAME(vsplat)(1.0f);
    q = q * r;
    RLE_NAME(vf) p = q + RLE_NAME(vsplat)(1.0f);
    RLE_NAME(vi) k = __builtin_convertvector(kf, RLE_NAME(vi));
    if (le0) {
        /* y in [LO, 0]: k in [-126, 0], p in [0.7, 1.5], and every value of (p * 2^a) * 2^b
         * is a normal binary32, so both multiplications are exact and equal p * 2^k: one
         * multiplication by 2^k gives the same bits (lanes with y < LO are replaced below). */
        RLE_NAME(vf) sk = (RLE_NAME(vf))((RLE_NAME(vu))(k + 127) << 23);
        return (RLE_NAME(vf))((RLE_NAME(vi))(p * sk) & ~under);
    }
    RLE_NAME(vi) ka = k >> 1;
    RLE_NAME(vi) kb = k - ka;
    RLE_NAME(vf) sa = (RLE_NAME(vf))((RLE_NAME(vu))(ka + 127) << 23);
    RLE_NAME(vf) sb = (RLE_NAME(vf))((RLE_NAME(vu))(kb + 127) << 23);
    RLE_NAME(vf) res = p * sa;
    res = res * sb;
    return (RLE_NAME(vf))((RLE_NAME(vi))res & ~under); /* step 8: +0 where y < LO */
}

static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vexp)(RLE_NAME(vf) y) { return RLE_NAME(vexp_impl)(y, 0); }
static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vexp_le0)(RLE_NAME(vf) y) { return RLE_NAME(vexp_impl)(y, 1); }

static inline __attribute__((always_inline)) RLE_NAME(vf) RLE_NAME(vcanonical)(RLE_NAME(vf) g) {
    return RLE_NAME(vsel)(g != g, (RLE_NAME(vf))RLE_NAME(vsplati)((int32_t)CANONICAL_NAN_BITS), g);
}

static inline __attribute__((always_inline)) RLE_NAME(vh) RLE_NAME(vround_bf16)(RLE_NAME(vf) g) {
    RLE_NAME(vu) u = (RLE_NAME(vu))g;
    RLE_NAME(vu) r = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu;
    return __builtin_convertvector(r, RLE_NAME(vh));
}

/* ------------------------------------------------------------------ forward */



/* max(a, b) and min(a, b) of the instruction set: `a > b ? a : b` and `a < b ? a : b` lane by
 * lane (x86 MAXPS/MINPS return the second operand when either is NaN). A NaN is never picked:
 * the caller learns of NaN from the tile's sum (see fwd_rows). */
#if !RLE_X86
#define RLE_VMAX(a, b) RLE_NAME(vsel)((a) > (b), (a), (b))
#define RLE_VMIN(a, b) RLE_NAME(vsel)((a) < (b), (a), (b))
#elif LANES == 16
#define RLE_VMAX(a, b) ((RLE_NAME(vf))_mm512_max_ps((__m512)(a), (__m512)(b)))
#define RLE_VMIN(a, b) ((RLE_NAME(vf))_mm512_min_ps((__m512)(a), (__m512)(b)))
#elif LANES == 8
#define RLE_VMAX(a, b) ((RLE_NAME(vf))_mm256_max_ps((__m256)(a), (__m256)(b)))
#define RLE_VMIN(a, b) ((RLE_NAME(vf))_mm256_min_ps((__m256)(a), (__m256)(b)))
#else
#define RLE_VMAX(a, b) ((RLE_NAME(vf))_mm_max_ps((__m128)(a), (__m128)(b)))
#define RLE_VMIN(a, b) ((RLE_NAME(vf))_mm_min_ps((__m128)(a), (__m128)(b)))
#endif

/* Upcast the real columns [c0, c0 + nreal) of a row into x (-inf on the rest of the tile) and
 * return their max ignoring NaN (-inf when there is none) and, with want_min, their min
 * ignoring NaN. Max and min of a set do not depend on grouping; a zero's sign is fixed by
 * the caller's + 0. */
static inline __attribute__((always_inline)) float RLE_NAME(tile_upcast_max)(
    const char *rowp, int dtype, int64_t c0, int64_t nreal, int64_t w, float *restrict x,
    int want_min, float *mn_out) {
    RLE_NAME(vf) vmx = RLE_NAME(vsplat)(-__builtin_inff()), vmn = RLE_NAME(vsplat)(__builtin_inff());
    int64_t c = 0;
    if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)rowp + c0;
        if (want_min) {
            for (; c + LANES <= nreal; c += LANES) {
                RLE_NAME(vf) v = RLE_NAME(vload_bf16)(src + c);
                RLE_NAME(vstore)(x + c, v);
                vmx = RLE_VMAX(v, vmx);
                vmn = RLE_VMIN(v, vmn);
            }
        } else {
            for (; c + LANES <= nreal; c += LANES) {
                RLE_NAME(vf) v = RLE_NAME(vload_bf16)(src + c);
                RLE_NAME(vstore)(x + c, v);
                vmx = RLE_VMAX(v, vmx);
            }
        }
        for (int64_t k = c; k < nreal; k++) x[k] = f_of((uint32_t)src[k] << 16);
    } else if (dtype == DT_F32) {
        const float *src = (const float *)rowp + c0;
        for (; c + LANES <= nreal; c += LANES) {
            RLE_NAME(vf) v = RLE_NAME(vload)(src + c);
            RLE_NAME(vstore)(x + c, v);
            vmx = RLE_VMAX(v, vmx);
            vmn = RLE_VMIN(v, vmn);
        }
        for (int64_t k = c; k < nreal; k++) x[k] = src[k];
    } else {
        for (c = 0; c < nreal; c++) x[c] = upcast(rowp, DT_F16, c0 + c);
        for (c = 0; c + LANES <= nreal; c += LANES) {
            RLE_NAME(vf) v = RLE_NAME(vload)(x + c);
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
    for (c = nreal; c < w; c++) x[c] = -__builtin_inff();
    *mn_out = mn;
    return mx;
}

static __attribute__((noinline)) int RLE_NAME(has_nan)(const float *x, int64_t n) {
    for (int64_t c = 0; c < n; c++)
        if (x[c] != x[c]) return 1;
    return 0;
}

static __attribute__((noinline)) void RLE_NAME(fwd_rows)(const fwd_args *a, int64_t r0,
                                                           int64_t r1, float *restrict x,
                                                           float *restrict eb,
                                                           float *restrict tb) {
    const int64_t w = a->tile_width;
    const int64_t tiles = a->local_vocab / w;
    const size_t esz = a->dtype == DT_F32 ? 4 : 2;
    for (int64_t row = r0; row < r1; row++) {
        const char *rowp = (const char *)a->logits + (size_t)row * (size_t)a->row_stride * esz;
        float rmin = __builtin_inff();
        int rnan = 0;
        for (int64_t j = 0; j < tiles; j++) {
            const int64_t c0 = j * w;
            int64_t nreal = a->real_local - c0;
            nreal = nreal < 0 ? 0 : (nreal > w ? w : nreal);
            float mn;
            const float mx = RLE_NAME(tile_upcast_max)(rowp, a->dtype, c0, nreal, w, x,
                                                       a->row_min != NULL, &mn);
            if (nreal > 0) rmin = mn < rmin ? mn : rmin;
            /* Section 6 steps 1-2 take m = NaN when a column is NaN; here the shift comes from
             * the max ignoring NaN. Both give the same s and t: a NaN column makes its y, E(y)
             * and E(y) * y NaN, so the folds are NaN either way (payloads do not matter: every
             * output is made canonical). m itself is set to NaN below, from the sum. */
            float mj = mx + 0.0f;
            const float sh = mj == -__builtin_inff() ? 0.0f : mj;
            const RLE_NAME(vf) vsh = RLE_NAME(vsplat)(sh);
            /* steps 3-4, with the first level of each fold F done as the terms are made:
             * F's level 1 adds v[i] + v[w - h + i] for i < h (h = w / 2), leaving v[h] alone
             * when w is odd; the rest of F then folds the first w - h values. */
            const int64_t h = w / 2, base = w - h;
            int64_t c = 0;
            if (tb != NULL) {
                for (; c + LANES <= h && base + c + LANES <= nreal; c += LANES) {
                    RLE_NAME(vf) y0 = RLE_NAME(vload)(x + c) - vsh;
                    RLE_NAME(vf) y1 = RLE_NAME(vload)(x + base + c) - vsh;
                    RLE_NAME(vf) e0 = RLE_NAME(vexp_le0)(y0);
                    RLE_NAME(vf) e1 = RLE_NAME(vexp_le0)(y1);
                    RLE_NAME(vstore)(eb + c, e0 + e1);
                    RLE_NAME(vstore)(tb + c, (e0 * y0) + (e1 * y1));
                }
                for (; c < base; c++) {
                    float y0 = x[c] - sh;
                    float e0 = rle_exp(y0);
                    float t0 = e0 * (c < nreal ? y0 : 0.0f); /* y' = 0 on padding columns */
                    if (c < h) {
                        float y1 = x[base + c] - sh;
                        float e1 = rle_exp(y1);
                        float t1 = e1 * (base + c < nreal ? y1 : 0.0f);
                        e0 = e0 + e1;
                        t0 = t0 + t1;
                    }
                    eb[c] = e0;
                    tb[c] = t0;
                }
                a->t[row * tiles + j] = rle_fold(tb, base);
            } else {
                for (; c + LANES <= h; c += LANES) {
                    RLE_NAME(vf) e0 = RLE_NAME(vexp_le0)(RLE_NAME(vload)(x + c) - vsh);
                    RLE_NAME(vf) e1 = RLE_NAME(vexp_le0)(RLE_NAME(vload)(x + base + c) - vsh);
                    RLE_NAME(vstore)(eb + c, e0 + e1);
                }
                for (; c < base; c++) {
                    float e0 = rle_exp(x[c] - sh);
                    if (c < h) e0 = e0 + rle_exp(x[base + c] - sh);
                    eb[c] = e0;
                }
            }
            const float sj = rle_fold(eb, base);
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



static inline __attribute__((always_inline)) void RLE_NAME(store_one)(void *out, int dtype, int64_t c,
                                                            float g) {
    g = canonical(g);
    if (dtype == DT_F32) ((float *)out)[c] = g;
    else if (dtype == DT_BF16) ((uint16_t *)out)[c] = round_bf16(g);
    else ((uint16_t *)out)[c] = round_f16(g);
}

/* Section 7 step 1 and 3 for one column (scalar; tails and the target column). */
static inline __attribute__((always_inline)) float RLE_NAME(grad_one)(const char *rowp, int dtype,
                                                            int64_t c, float lse, float coef) {
    float x = upcast(rowp, dtype, c);
    float y = x - lse;
    return coef * rle_exp(y);
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
        if (coef == 0.0f) {
            /* section 7 override: +0 everywhere, round(+0 + gl) at the owned target */
            memset(out, 0, (size_t)V * esz);
            if (tc >= 0 && tc < R) RLE_NAME(store_one)(out, dtype, tc, a->target_add[row] + 0.0f);
            continue;
        }
        const RLE_NAME(vf) vlse = RLE_NAME(vsplat)(lse), vcoef = RLE_NAME(vsplat)(coef);
        int64_t c = 0;
        if (dtype == DT_BF16) {
            const uint16_t *src = (const uint16_t *)rowp;
            for (; c + LANES <= R; c += LANES) {
                RLE_NAME(vf) g = vcoef * RLE_NAME(vexp)(RLE_NAME(vload_bf16)(src + c) - vlse);
                RLE_NAME(vh) h = RLE_NAME(vround_bf16)(RLE_NAME(vcanonical)(g));
                memcpy((uint16_t *)out + c, &h, sizeof h);
            }
        } else if (dtype == DT_F32) {
            const float *src = (const float *)rowp;
            for (; c + LANES <= R; c += LANES) {
                RLE_NAME(vf) g = vcoef * RLE_NAME(vexp)(RLE_NAME(vload)(src + c) - vlse);
                RLE_NAME(vstore)((float *)out + c, RLE_NAME(vcanonical)(g));
            }
        } else {
            float xs[LANES], gs[LANES];
            for (; c + LANES <= R; c += LANES) {
                for (int l = 0; l < LANES; l++) xs[l] = upcast(rowp, DT_F16, c + l);
                RLE_NAME(vf) g = vcoef * RLE_NAME(vexp)(RLE_NAME(vload)(xs) - vlse);
                RLE_NAME(vstore)(gs, g);
                for (int l = 0; l < LANES; l++) ((uint16_t *)out)[c + l] = round_f16(canonical(gs[l]));
            }
        }
        for (; c < R; c++) RLE_NAME(store_one)(out, dtype, c, RLE_NAME(grad_one)(rowp, dtype, c, lse, coef));
        if (tc >= 0 && tc < R) {
            /* step 2: the same operations for the one column, then + gl, rounded once */
            float g = RLE_NAME(grad_one)(rowp, dtype, tc, lse, coef);
            g = g + a->target_add[row];
            RLE_NAME(store_one)(out, dtype, tc, g);
        }
        if (R < V) memset(out + (size_t)R * esz, 0, (size_t)(V - R) * esz);
    }
}

