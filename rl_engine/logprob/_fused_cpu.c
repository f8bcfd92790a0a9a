/*
 * Fused CPU kernels of backend cpu-vocab-parallel-logp-ws2: docs/arithmetic.md
 * (rl-engine-arith/1) sections 3, 4, 6 (steps 1-4), 7 and 8, in plain C.
 *
 * Built by setup.py as the extension module rl_engine.logprob._fused_cpu with
 * -O3 -ffp-contract=off -fno-fast-math: every a * b + c below is a multiply then an add,
 * each rounded (no FMA contraction), and no reassociation. Python loads the module's file
 * with ctypes (rl_engine/logprob/fused_cpu.py) and passes tensor data pointers; ctypes
 * releases the GIL for the call.
 *
 * One pass per (row, tile): the tile is upcast into an L1-resident FP32 buffer (with its
 * max, NaN flag and, for validation, the real-column minimum), then E() and the products
 * of the entropy term are written into two more tile buffers, and the fixed fold F of
 * section 4 (in-place halving, grouping a function of the tile width alone) sums them.
 *
 * Two instruction-set variants of the same source: the baseline (SSE2) and an AVX2 clone
 * (target attribute, no FMA). Both evaluate the same IEEE-754 operations element by
 * element in the same order, so they give the same bytes; the test suite compares them.
 *
 * Threads split rows only: `threads` pthreads each take a contiguous range of rows.
 * A worker refuses to run if its thread flushes subnormals (FTZ/DAZ): return code 2.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__FP_FAST_FMAF) || defined(__FAST_MATH__)
#error "rl-engine-arith/1 forbids FMA contraction and fast-math: build with -ffp-contract=off -fno-fast-math"
#endif

#define RLE_OK 0
#define RLE_BAD_ARG 1
#define RLE_FLUSHES_SUBNORMALS 2
#define RLE_NO_MEMORY 3
#define RLE_THREAD_FAILED 4

#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2

#define ISA_AUTO 0
#define ISA_BASELINE 1
#define ISA_AVX2 2

typedef union {
    float f;
    uint32_t u;
} fbits;

static inline __attribute__((always_inline)) float f_of(uint32_t u) {
    fbits b;
    b.u = u;
    return b.f;
}

static inline __attribute__((always_inline)) uint32_t u_of(float f) {
    fbits b;
    b.f = f;
    return b.u;
}

/* Section 3 constants (hex floats, binary32). */
#define E_LO (-0x1.5cp+6f)
#define E_HI (0x1.64p+6f)
#define E_LOG2E (0x1.715476p+0f)
#define E_SHIFTER (0x1.8p+23f)
#define E_LN2_HI (0x1.62e4p-1f)
#define E_LN2_LO (0x1.7f7d1cp-20f)
#define E_C6 (0x1.6a244cp-10f)
#define E_C5 (0x1.1239d4p-7f)
#define E_C4 (0x1.5558f2p-5f)
#define E_C3 (0x1.555492p-3f)
#define E_C2 (0x1.fffffcp-2f)
#define CANONICAL_NAN_BITS 0x7FC00000u

/* E(y), section 3, steps 1-8 in order. Branch free so loops over it vectorize. */
static inline __attribute__((always_inline)) float rle_exp(float y) {
    int under = y < E_LO;                 /* 1. false for NaN */
    float yc = y < E_LO ? E_LO : y;       /* 2. max(y, LO); NaN stays NaN */
    yc = yc > E_HI ? E_HI : yc;           /*    min(., HI);  NaN stays NaN */
    float t = yc * E_LOG2E;               /* 3. */
    t = t + E_SHIFTER;
    float kf = t - E_SHIFTER;
    float a1 = kf * E_LN2_HI;             /* 4. */
    float r = yc - a1;
    float a2 = kf * E_LN2_LO;
    r = r - a2;
    float q = r * E_C6;                   /* 5. Horner: r * C6 + C5, ... */
    q = q + E_C5;
    q = q * r;
    q = q + E_C4;
    q = q * r;
    q = q + E_C3;
    q = q * r;
    q = q + E_C2;
    q = q * r;
    q = q + 1.0f;
    q = q * r;
    float p = q + 1.0f;
    /* 6. k exact; a NaN kf may become any integer (the result is NaN whatever the scale). */
    int32_t k = (kf == kf) ? (int32_t)kf : 0;
    int32_t ka = k >> 1;
    int32_t kb = k - ka;
    float sa = f_of((uint32_t)(ka + 127) << 23);
    float sb = f_of((uint32_t)(kb + 127) << 23);
    float res = p * sa;                   /* 7. */
    res = res * sb;
    return under ? 0.0f : res;            /* 8. */
}

/* Section 4: F, in place on v[0..n), n >= 1. */
static inline __attribute__((always_inline)) float rle_fold(float *restrict v, int64_t n) {
    int64_t w = n;
    while (w > 1) {
        int64_t h = w / 2;
        float *restrict dst = v;
        const float *restrict src = v + (w - h);
        for (int64_t i = 0; i < h; i++) dst[i] = dst[i] + src[i];
        w -= h;
    }
    return v[0];
}

static inline __attribute__((always_inline)) float upcast(const void *base, int dtype, int64_t i) {
    if (dtype == DT_F32) return ((const float *)base)[i];
    if (dtype == DT_BF16) return f_of((uint32_t)((const uint16_t *)base)[i] << 16);
    /* binary16 -> binary32, exact (IEEE), by integer operations */
    uint32_t h = ((const uint16_t *)base)[i];
    uint32_t sign = (h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    if (e == 0x1Fu) return f_of(sign | 0x7F800000u | (m << 13));
    if (e != 0) return f_of(sign | ((e + 112u) << 23) | (m << 13));
    /* zero or subnormal: m * 2^-24, exact in binary32 */
    float v = (float)m * 0x1p-24f;
    return f_of(sign | u_of(v));
}

/* Section 8: binary32 (NaN canonical first) -> binary16, round to nearest even, with
 * subnormal results and overflow to infinity. Integer operations only. */
static inline __attribute__((always_inline)) uint16_t round_f16(float f) {
    uint32_t u = u_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7E00u; /* the canonical NaN */
    if (a >= 0x38800000u) {              /* |f| >= 2^-14: a normal binary16 or overflow */
        uint32_t r = a - 0x38000000u;    /* rebias the exponent: 127 - 15 = 112 */
        uint32_t q = r >> 13;
        uint32_t rem = r & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q += 1u;
        if (q >= 0x7C00u) q = 0x7C00u;   /* overflow (and +-inf) to infinity */
        return (uint16_t)(sign | q);
    }
    uint32_t e = a >> 23;                /* a binary16 subnormal or zero: units of 2^-24 */
    if (e < 102u) return (uint16_t)sign; /* |f| < 2^-25 rounds to zero */
    uint32_t mant = (a & 0x007FFFFFu) | 0x00800000u;
    uint32_t shift = 126u - e;           /* 14 .. 24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q += 1u;
    return (uint16_t)(sign | q);
}

static inline __attribute__((always_inline)) uint16_t round_bf16(float f) {
    uint32_t u = u_of(f);
    return (uint16_t)(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu);
}

static inline __attribute__((always_inline)) float canonical(float f) {
    return f != f ? f_of(CANONICAL_NAN_BITS) : f;
}

static int flushes_subnormals(void) {
    volatile float tiny = 0x1p-140f;
    volatile float one = 1.0f;
    float r = tiny * one;
    return r == 0.0f;
}

/* ------------------------------------------------------------------ 8-lane vectors */
/* GCC vector extensions: each operation is the same IEEE-754 operation on every lane (SSE2
 * pairs of 4 lanes in the baseline build, one AVX2 register in the AVX2 clone), so a lane
 * computes exactly what the scalar code above computes for its element. */
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
typedef uint16_t vh __attribute__((vector_size(16)));
#define LANES 8

static inline __attribute__((always_inline)) vf vsplat(float x) {
    return (vf){x, x, x, x, x, x, x, x};
}

static inline __attribute__((always_inline)) vf vsel(vi mask, vf a, vf b) {
    return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

static inline __attribute__((always_inline)) vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline __attribute__((always_inline)) vf vload_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    vu u = __builtin_convertvector(h, vu) << 16;
    return (vf)u;
}

/* E(y) on 8 lanes: rle_exp's operations, in its order. */
static inline __attribute__((always_inline)) vf vexp(vf y) {
    vi under = y < vsplat(E_LO);
    vf yc = vsel(y < vsplat(E_LO), vsplat(E_LO), y);
    yc = vsel(yc > vsplat(E_HI), vsplat(E_HI), yc);
    vf t = yc * vsplat(E_LOG2E);
    t = t + vsplat(E_SHIFTER);
    vf kf = t - vsplat(E_SHIFTER);
    vf a1 = kf * vsplat(E_LN2_HI);
    vf r = yc - a1;
    vf a2 = kf * vsplat(E_LN2_LO);
    r = r - a2;
    vf q = r * vsplat(E_C6);
    q = q + vsplat(E_C5);
    q = q * r;
    q = q + vsplat(E_C4);
    q = q * r;
    q = q + vsplat(E_C3);
    q = q * r;
    q = q + vsplat(E_C2);
    q = q * r;
    q = q + vsplat(1.0f);
    q = q * r;
    vf p = q + vsplat(1.0f);
    vf kfn = vsel(kf == kf, kf, vsplat(0.0f)); /* a NaN kf becomes 0 (any integer allowed) */
    vi k = __builtin_convertvector(kfn, vi);
    vi ka = k >> 1;
    vi kb = k - ka;
    vf sa = (vf)((vu)(ka + 127) << 23);
    vf sb = (vf)((vu)(kb + 127) << 23);
    vf res = p * sa;
    res = res * sb;
    return vsel(under, vsplat(0.0f), res);
}

static inline __attribute__((always_inline)) vf vcanonical(vf g) {
    return vsel(g != g, (vf)((vu){0, 0, 0, 0, 0, 0, 0, 0} + CANONICAL_NAN_BITS), g);
}

static inline __attribute__((always_inline)) vh vround_bf16(vf g) {
    vu u = (vu)g;
    vu r = ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu;
    return __builtin_convertvector(r, vh);
}

/* ------------------------------------------------------------------ forward */

typedef struct {
    const void *logits;
    int dtype;
    int64_t rows, row_stride, local_vocab, tile_width, real_local;
    float *m, *s, *t, *row_min; /* t, row_min may be NULL */
} fwd_args;

/* Upcast the real columns [c0, c0 + nreal) of a row into x, -inf on the rest of the tile. */
static inline __attribute__((always_inline)) void tile_upcast(const char *rowp, int dtype,
                                                              int64_t c0, int64_t nreal,
                                                              int64_t w, float *restrict x) {
    int64_t c = 0;
    if (dtype == DT_BF16) {
        const uint16_t *src = (const uint16_t *)rowp + c0;
        for (; c + LANES <= nreal; c += LANES) vstore(x + c, vload_bf16(src + c));
        for (; c < nreal; c++) x[c] = f_of((uint32_t)src[c] << 16);
    } else if (dtype == DT_F32) {
        memcpy(x, (const float *)rowp + c0, (size_t)nreal * sizeof(float));
    } else {
        for (; c < nreal; c++) x[c] = upcast(rowp, DT_F16, c0 + c);
    }
    for (c = nreal; c < w; c++) x[c] = -__builtin_inff();
}

/* Max (NaN if any lane saw a NaN), min and NaN flag of x[0..n), n >= 0. Both are order
 * free: max and min of a set do not depend on grouping, and a zero's sign is fixed by the
 * caller's + 0. */
static inline __attribute__((always_inline)) void tile_minmax(const float *restrict x, int64_t n,
                                                              float *mx_out, float *mn_out,
                                                              int *nan_out) {
    vf vmx = vsplat(-__builtin_inff()), vmn = vsplat(__builtin_inff());
    vi vnan = (vi){0, 0, 0, 0, 0, 0, 0, 0};
    int64_t c = 0;
    for (; c + LANES <= n; c += LANES) {
        vf v = vload(x + c);
        vmx = vsel(v > vmx, v, vmx);
        vmn = vsel(v < vmn, v, vmn);
        vnan |= v != v;
    }
    float mx = -__builtin_inff(), mn = __builtin_inff();
    int nan = 0;
    for (int l = 0; l < LANES; l++) {
        mx = vmx[l] > mx ? vmx[l] : mx;
        mn = vmn[l] < mn ? vmn[l] : mn;
        nan |= vnan[l] != 0;
    }
    for (; c < n; c++) {
        float v = x[c];
        mx = v > mx ? v : mx;
        mn = v < mn ? v : mn;
        nan |= v != v;
    }
    *mx_out = mx;
    *mn_out = mn;
    *nan_out = nan;
}

static inline __attribute__((always_inline)) void fwd_rows(const fwd_args *a, int64_t r0,
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
            tile_upcast(rowp, a->dtype, c0, nreal, w, x);
            float mx, mn;
            int nan;
            tile_minmax(x, nreal, &mx, &mn, &nan);
            if (nreal > 0) {
                rmin = mn < rmin ? mn : rmin;
                rnan |= nan;
            }
            /* section 6 step 1: max (NaN if any NaN), then + 0; step 2: the shift */
            float mj = nan ? f_of(CANONICAL_NAN_BITS) : mx;
            mj = mj + 0.0f;
            const float sh = mj == -__builtin_inff() ? 0.0f : mj;
            const vf vsh = vsplat(sh);
            /* steps 3-4 */
            int64_t c = 0;
            if (tb != NULL) {
                const int64_t nr8 = nreal - nreal % LANES;
                for (; c < nr8; c += LANES) {
                    vf y = vload(x + c) - vsh;
                    vf e = vexp(y);
                    vstore(eb + c, e);
                    vstore(tb + c, e * y);
                }
                for (; c < w; c++) {
                    float y = x[c] - sh;
                    float e = rle_exp(y);
                    float yp = c < nreal ? y : 0.0f; /* y' = 0 on padding columns */
                    eb[c] = e;
                    tb[c] = e * yp;
                }
                a->t[row * tiles + j] = rle_fold(tb, w);
            } else {
                for (; c + LANES <= w; c += LANES) vstore(eb + c, vexp(vload(x + c) - vsh));
                for (; c < w; c++) eb[c] = rle_exp(x[c] - sh);
            }
            a->s[row * tiles + j] = rle_fold(eb, w);
            a->m[row * tiles + j] = mj;
        }
        if (a->row_min != NULL && a->real_local > 0)
            a->row_min[row] = rnan ? f_of(CANONICAL_NAN_BITS) : rmin;
    }
}

static void fwd_rows_baseline(const fwd_args *a, int64_t r0, int64_t r1, float *restrict x,
                              float *restrict eb, float *restrict tb) {
    fwd_rows(a, r0, r1, x, eb, tb);
}

__attribute__((target("avx2"))) static void fwd_rows_avx2(const fwd_args *a, int64_t r0,
                                                          int64_t r1, float *restrict x,
                                                          float *restrict eb,
                                                          float *restrict tb) {
    fwd_rows(a, r0, r1, x, eb, tb);
}

/* ------------------------------------------------------------------ backward */

typedef struct {
    const void *logits;
    int dtype;
    int64_t rows, row_stride, local_vocab, real_local;
    const float *lse, *coef, *target_add;
    const int64_t *target_col;
    void *grad; /* [rows, local_vocab] contiguous, dtype of the logits */
} bwd_args;

static inline __attribute__((always_inline)) void store_one(void *out, int dtype, int64_t c,
                                                            float g) {
    g = canonical(g);
    if (dtype == DT_F32) ((float *)out)[c] = g;
    else if (dtype == DT_BF16) ((uint16_t *)out)[c] = round_bf16(g);
    else ((uint16_t *)out)[c] = round_f16(g);
}

/* Section 7 step 1 and 3 for one column (scalar; tails and the target column). */
static inline __attribute__((always_inline)) float grad_one(const char *rowp, int dtype,
                                                            int64_t c, float lse, float coef) {
    float x = upcast(rowp, dtype, c);
    float y = x - lse;
    return coef * rle_exp(y);
}

static inline __attribute__((always_inline)) void bwd_rows(const bwd_args *a, int64_t r0,
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
            if (tc >= 0 && tc < R) store_one(out, dtype, tc, a->target_add[row] + 0.0f);
            continue;
        }
        const vf vlse = vsplat(lse), vcoef = vsplat(coef);
        int64_t c = 0;
        if (dtype == DT_BF16) {
            const uint16_t *src = (const uint16_t *)rowp;
            for (; c + LANES <= R; c += LANES) {
                vf g = vcoef * vexp(vload_bf16(src + c) - vlse);
                vh h = vround_bf16(vcanonical(g));
                memcpy((uint16_t *)out + c, &h, sizeof h);
            }
        } else if (dtype == DT_F32) {
            const float *src = (const float *)rowp;
            for (; c + LANES <= R; c += LANES) {
                vf g = vcoef * vexp(vload(src + c) - vlse);
                vstore((float *)out + c, vcanonical(g));
            }
        } else {
            float xs[LANES], gs[LANES];
            for (; c + LANES <= R; c += LANES) {
                for (int l = 0; l < LANES; l++) xs[l] = upcast(rowp, DT_F16, c + l);
                vf g = vcoef * vexp(vload(xs) - vlse);
                vstore(gs, g);
                for (int l = 0; l < LANES; l++) ((uint16_t *)out)[c + l] = round_f16(canonical(gs[l]));
            }
        }
        for (; c < R; c++) store_one(out, dtype, c, grad_one(rowp, dtype, c, lse, coef));
        if (tc >= 0 && tc < R) {
            /* step 2: the same operations for the one column, then + gl, rounded once */
            float g = grad_one(rowp, dtype, tc, lse, coef);
            g = g + a->target_add[row];
            store_one(out, dtype, tc, g);
        }
        if (R < V) memset(out + (size_t)R * esz, 0, (size_t)(V - R) * esz);
    }
}

static void bwd_rows_baseline(const bwd_args *a, int64_t r0, int64_t r1) { bwd_rows(a, r0, r1); }

__attribute__((target("avx2"))) static void bwd_rows_avx2(const bwd_args *a, int64_t r0,
                                                          int64_t r1) {
    bwd_rows(a, r0, r1);
}

/* ------------------------------------------------------------------ threads */

typedef struct {
    int kind; /* 0 forward, 1 backward */
    int isa;
    const void *args;
    int64_t r0, r1;
    int status;
} job;

static void *run_job(void *p) {
    job *jb = (job *)p;
    if (flushes_subnormals()) {
        jb->status = RLE_FLUSHES_SUBNORMALS;
        return NULL;
    }
    if (jb->kind == 0) {
        const fwd_args *a = (const fwd_args *)jb->args;
        size_t n = (size_t)a->tile_width;
        float *buf = (float *)malloc(3 * n * sizeof(float));
        if (buf == NULL) {
            jb->status = RLE_NO_MEMORY;
            return NULL;
        }
        float *tb = a->t != NULL ? buf + 2 * n : NULL;
        if (jb->isa == ISA_AVX2) fwd_rows_avx2(a, jb->r0, jb->r1, buf, buf + n, tb);
        else fwd_rows_baseline(a, jb->r0, jb->r1, buf, buf + n, tb);
        free(buf);
    } else {
        const bwd_args *a = (const bwd_args *)jb->args;
        if (jb->isa == ISA_AVX2) bwd_rows_avx2(a, jb->r0, jb->r1);
        else bwd_rows_baseline(a, jb->r0, jb->r1);
    }
    jb->status = RLE_OK;
    return NULL;
}

static int resolve_isa(int isa) {
    if (isa == ISA_BASELINE) return ISA_BASELINE;
    __builtin_cpu_init();
    int has_avx2 = __builtin_cpu_supports("avx2");
    if (isa == ISA_AVX2) return has_avx2 ? ISA_AVX2 : -1;
    return has_avx2 ? ISA_AVX2 : ISA_BASELINE;
}

static int run_split(int kind, int isa, const void *args, int64_t rows, int threads) {
    int chosen = resolve_isa(isa);
    if (chosen < 0 || threads < 1) return RLE_BAD_ARG;
    if (rows <= 0) return RLE_OK;
    if ((int64_t)threads > rows) threads = (int)rows;
    job jobs[256];
    pthread_t tids[256];
    if (threads > 256) threads = 256;
    for (int i = 0; i < threads; i++) {
        jobs[i].kind = kind;
        jobs[i].isa = chosen;
        jobs[i].args = args;
        jobs[i].r0 = rows * i / threads;
        jobs[i].r1 = rows * (i + 1) / threads;
        jobs[i].status = RLE_THREAD_FAILED;
    }
    int started = 1;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tids[i], NULL, run_job, &jobs[i]) != 0) break;
        started++;
    }
    run_job(&jobs[0]); /* the calling thread takes the first range */
    for (int i = 1; i < started; i++) pthread_join(tids[i], NULL);
    for (int i = 0; i < threads; i++)
        if (jobs[i].status != RLE_OK) return jobs[i].status;
    return RLE_OK;
}

/* ------------------------------------------------------------------ exported API */

__attribute__((visibility("default"))) int rle_forward_partials(
    const void *logits, int dtype, int64_t rows, int64_t row_stride, int64_t local_vocab,
    int64_t tile_width, int64_t real_local, float *m, float *s, float *t, float *row_min,
    int threads, int isa) {
    if (logits == NULL || m == NULL || s == NULL || tile_width < 1 || local_vocab < 1 ||
        local_vocab % tile_width != 0 || dtype < DT_F32 || dtype > DT_F16 || rows < 0 ||
        row_stride < local_vocab || real_local < 0 || real_local > local_vocab)
        return RLE_BAD_ARG;
    fwd_args a = {logits, dtype, rows, row_stride, local_vocab, tile_width, real_local,
                  m, s, t, row_min};
    return run_split(0, isa, &a, rows, threads);
}

__attribute__((visibility("default"))) int rle_backward(
    const void *logits, int dtype, int64_t rows, int64_t row_stride, int64_t local_vocab,
    int64_t real_local, const float *lse, const float *coef, const int64_t *target_col,
    const float *target_add, void *grad, int threads, int isa) {
    if (logits == NULL || grad == NULL || lse == NULL || coef == NULL || target_col == NULL ||
        target_add == NULL || local_vocab < 1 || dtype < DT_F32 || dtype > DT_F16 || rows < 0 ||
        row_stride < local_vocab || real_local < 0 || real_local > local_vocab)
        return RLE_BAD_ARG;
    bwd_args a = {logits, dtype, rows, row_stride, local_vocab, real_local,
                  lse, coef, target_add, target_col, grad};
    return run_split(1, isa, &a, rows, threads);
}

/* Test hooks: the element functions on their own. */
__attribute__((visibility("default"))) void rle_exp_array(const float *y, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = rle_exp(y[i]);
}

__attribute__((visibility("default"))) void rle_round_f16_array(const float *x, uint16_t *out,
                                                                int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = round_f16(canonical(x[i]));
}

__attribute__((visibility("default"))) void rle_round_bf16_array(const float *x, uint16_t *out,
                                                                 int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = round_bf16(canonical(x[i]));
}

__attribute__((visibility("default"))) void rle_upcast_f16_array(const uint16_t *x, float *out,
                                                                 int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = upcast(x, DT_F16, i);
}

__attribute__((visibility("default"))) int rle_abi_version(void) { return 1; }

__attribute__((visibility("default"))) int rle_selected_isa(int isa) { return resolve_isa(isa); }

/* A module object so that setuptools builds and Python can locate this file; the kernels
 * are called through ctypes. */
static struct PyModuleDef rle_module = {PyModuleDef_HEAD_INIT, "_fused_cpu",
                                        "Fused CPU kernels (ctypes entry points rle_*).", -1,
                                        NULL};

PyMODINIT_FUNC PyInit__fused_cpu(void) { return PyModule_Create(&rle_module); }
