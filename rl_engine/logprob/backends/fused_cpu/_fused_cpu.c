/*
 * Fused CPU kernels of backend cpu-vocab-parallel-logp-ws2: docs/arithmetic.md
 * (rl-engine-arith/2) sections 1, 3, 4, 6 (steps 1-4), 7 and 8, in plain C.
 *
 * Built by setup.py as the extension module rl_engine.logprob.backends.fused_cpu._fused_cpu with
 * -O3 -ffp-contract=off -fno-fast-math: every a * b + c below is a multiply then an add,
 * each rounded, and every fusedMultiplyAdd the specification writes is written here as one
 * (RLE_VFMA in _fused_cpu_lanes.h): no contraction, no reassociation. Python loads the
 * module's file with ctypes (rl_engine/logprob/backends/fused_cpu/fused_cpu.py) and passes tensor data
 * pointers; ctypes releases the GIL for the call.
 *
 * Forward, per (row, tile): one pass upcasts the tile into an L1-resident FP32 buffer (with
 * its max and, for validation, the real-column minimum); a second pass computes E (the
 * forward form of section 3) and accumulates the lane sums G and G* of section 4 in vector
 * registers (a group of lanes walks the tile's chunks of 128 columns), then folds the 128
 * lanes with F; meanwhile the next tile's logits are prefetched. Backward, per row: E (the
 * general form) of x - lse, scaled, the target term, canonical NaN, one rounding.
 *
 * Three instruction-set variants of the same source (_fused_cpu_lanes.h): the baseline
 * (SSE2; no FMA instruction, so fma is the correctly rounded software one of section 1), an
 * AVX2 clone and an AVX-512 clone (target attributes with "fma": the vfmadd instruction).
 * Each evaluates the same IEEE-754 operations element by element in the same order, and a
 * correctly rounded fma has one result, so they give the same bytes; the test suite
 * compares them (and each variant's fma with spec_numpy.fma32).
 *
 * Threads split rows only: `threads` pthreads take blocks of rows from a shared counter.
 * A worker refuses to run if its thread flushes subnormals (FTZ/DAZ): return code 2.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__) || defined(__i386__)
#define RLE_X86 1
#include <immintrin.h>
#else
#define RLE_X86 0
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* rl-engine-arith/2 wants the fusedMultiplyAdds it writes and no other: fast-math
 * (reassociation, contraction, FTZ) is refused here; contraction has no macro to test, so
 * setup.py passes -ffp-contract=off and tests/test_fused_cpu.py checks, per variant, that a
 * written a * b + c rounds twice (the hook rle_elementwise_array, op 1). The old guard on
 * __FP_FAST_FMAF is gone: GCC defines it wherever the target has an FMA instruction, which
 * the AVX2 and AVX-512 variants now require. */
#if defined(__FAST_MATH__)
#error "rl-engine-arith/2 forbids fast-math: build with -ffp-contract=off -fno-fast-math"
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
#define ISA_AVX512 3

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
#define E_LO (-0x1.6p+6f)
#define E_HI (0x1.64p+6f)
#define E_LOG2E (0x1.715476p+0f)
#define E_BIAS (0x1.8000fep+23f)
#define E_LN2_HI (0x1.62e430p-1f)
#define E_LN2_LO (-0x1.05c610p-29f)
#define E_C6 (0x1.6a244cp-10f)
#define E_C5 (0x1.1239d4p-7f)
#define E_C4 (0x1.5558f2p-5f)
#define E_C3 (0x1.555492p-3f)
#define E_C2 (0x1.fffffcp-2f)
#define CANONICAL_NAN_BITS 0x7FC00000u
#define RLE_LANE_COUNT 128 /* L of the lane sum G (section 4) */

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

/* ------------------------------------------------------------------ argument blocks */

typedef struct {
    const void *logits;
    int dtype;
    int64_t rows, row_stride, local_vocab, tile_width, real_local;
    float *m, *s, *t, *row_min; /* t, row_min may be NULL */
    float t32;                  /* the temperature's T32 (section 6 step 0); 1: no division */
    const float *row_t32;       /* a temperature per row: row r's T32 in place of t32; NULL: none */
} fwd_args;

typedef struct {
    const void *logits;
    int dtype;
    int64_t rows, row_stride, local_vocab, real_local;
    const float *lse, *coef, *target_add;
    const int64_t *target_col;
    void *grad; /* [rows, local_vocab] contiguous, dtype of the logits */
    float t32;  /* the temperature's T32: x / T32 before E, the gradient / T32 before its rounding */
    const float *g_ent, *mb; /* the entropy gradient and Mb = LSE - H per row; both NULL without one */
    const float *row_t32;    /* a temperature per row: row r's T32 in place of t32; NULL: none */
} bwd_args;

/* ------------------------------------------------------------------ the three variants */

/* The baseline has no FMA instruction (x86-64's SSE2), so its fma is the software one of
 * section 1 (vfma_soft in _fused_cpu_lanes.h). Off x86 the baseline is the only variant and
 * uses the same software fma, not libm's fmaf: one code path, whose bytes depend on binary64
 * add/subtract/multiply alone (a hardware FMA there, e.g. ARMv8's fmadd, would give the same
 * bytes faster, but it is not tested here). */
#define LANES 4
#define RLE_HW_FMA 0
#define RLE_NAME(n) n##_baseline
#include "_fused_cpu_lanes.h"
#undef RLE_NAME
#undef RLE_HW_FMA
#undef LANES

#if RLE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define LANES 8
#define RLE_HW_FMA 1
#define RLE_NAME(n) n##_avx2
#include "_fused_cpu_lanes.h"
#undef RLE_NAME
#undef RLE_HW_FMA
#undef LANES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,fma")
#define LANES 16
#define RLE_HW_FMA 1
#define RLE_NAME(n) n##_avx512
#include "_fused_cpu_lanes.h"
#undef RLE_NAME
#undef RLE_HW_FMA
#undef LANES
#pragma GCC pop_options
#endif /* RLE_X86 */

/* ------------------------------------------------------------------ threads */

/* Rows are handed out in blocks of RLE_BLOCK_ROWS from one atomic counter: a worker that
 * is descheduled (a busy machine) does not hold up the others with a fixed share. Which
 * worker computes a row never changes a bit: a row's operations involve that row alone. */
#define RLE_BLOCK_ROWS 4

typedef struct {
    int kind; /* 0 forward, 1 backward */
    int isa;
    const void *args;
    int64_t rows;
    int64_t *next; /* shared: the first row not yet handed out */
    int status;
} job;

static inline int64_t take_block(job *jb, int64_t *r1) {
    int64_t r0 = __atomic_fetch_add(jb->next, RLE_BLOCK_ROWS, __ATOMIC_RELAXED);
    *r1 = r0 + RLE_BLOCK_ROWS < jb->rows ? r0 + RLE_BLOCK_ROWS : jb->rows;
    return r0;
}

static void *run_job(void *p) {
    job *jb = (job *)p;
    if (flushes_subnormals()) {
        jb->status = RLE_FLUSHES_SUBNORMALS;
        return NULL;
    }
    if (jb->kind == 0) {
        const fwd_args *a = (const fwd_args *)jb->args;
        /* the tile buffer: the tile width rounded up to whole chunks of 128 columns (a lane
         * group reads -inf past the tile's end) */
        size_t n = (size_t)((a->tile_width + RLE_LANE_COUNT - 1) / RLE_LANE_COUNT * RLE_LANE_COUNT);
        float *buf = (float *)aligned_alloc(64, n * sizeof(float));
        if (buf == NULL) {
            jb->status = RLE_NO_MEMORY;
            return NULL;
        }
        int64_t r0, r1;
        while ((r0 = take_block(jb, &r1)) < jb->rows) {
#if RLE_X86
            if (jb->isa == ISA_AVX512) fwd_rows_avx512(a, r0, r1, buf);
            else if (jb->isa == ISA_AVX2) fwd_rows_avx2(a, r0, r1, buf);
            else
#endif
                fwd_rows_baseline(a, r0, r1, buf);
        }
        free(buf);
    } else {
        const bwd_args *a = (const bwd_args *)jb->args;
        int64_t r0, r1;
        while ((r0 = take_block(jb, &r1)) < jb->rows) {
#if RLE_X86
            if (jb->isa == ISA_AVX512) bwd_rows_avx512(a, r0, r1);
            else if (jb->isa == ISA_AVX2) bwd_rows_avx2(a, r0, r1);
            else
#endif
                bwd_rows_baseline(a, r0, r1);
        }
    }
    jb->status = RLE_OK;
    return NULL;
}

static int resolve_isa(int isa) {
    if (isa == ISA_BASELINE) return ISA_BASELINE;
#if !RLE_X86
    return isa == ISA_AUTO ? ISA_BASELINE : -1;
#else
    __builtin_cpu_init();
    /* both vector variants execute vfmadd: FMA3 is required beside AVX2 / AVX-512 */
    int has_fma = __builtin_cpu_supports("fma");
    int has_avx2 = has_fma && __builtin_cpu_supports("avx2");
    int has_avx512 = has_fma && __builtin_cpu_supports("avx512f") &&
                     __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl");
    if (isa == ISA_AVX2) return has_avx2 ? ISA_AVX2 : -1;
    if (isa == ISA_AVX512) return has_avx512 ? ISA_AVX512 : -1;
    if (isa != ISA_AUTO) return -1;
    return has_avx512 ? ISA_AVX512 : (has_avx2 ? ISA_AVX2 : ISA_BASELINE);
#endif
}

static int run_split(int kind, int isa, const void *args, int64_t rows, int threads) {
    int chosen = resolve_isa(isa);
    if (chosen < 0 || threads < 1) return RLE_BAD_ARG;
    if (rows <= 0) return RLE_OK;
    int64_t blocks = (rows + RLE_BLOCK_ROWS - 1) / RLE_BLOCK_ROWS;
    if ((int64_t)threads > blocks) threads = (int)blocks;
    job jobs[256];
    pthread_t tids[256];
    if (threads > 256) threads = 256;
    int64_t next = 0;
    for (int i = 0; i < threads; i++) {
        jobs[i].kind = kind;
        jobs[i].isa = chosen;
        jobs[i].args = args;
        jobs[i].rows = rows;
        jobs[i].next = &next;
        jobs[i].status = RLE_THREAD_FAILED;
    }
    int started = 1;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tids[i], NULL, run_job, &jobs[i]) != 0) break;
        started++;
    }
    run_job(&jobs[0]); /* the calling thread works too (and alone if no thread started) */
    for (int i = 1; i < started; i++) pthread_join(tids[i], NULL);
    for (int i = 0; i < started; i++)
        if (jobs[i].status != RLE_OK) return jobs[i].status;
    return RLE_OK;
}

/* ------------------------------------------------------------------ exported API */

__attribute__((visibility("default"))) int rle_forward_partials(
    const void *logits, int dtype, int64_t rows, int64_t row_stride, int64_t local_vocab,
    int64_t tile_width, int64_t real_local, float *m, float *s, float *t, float *row_min,
    float t32, const float *row_t32, int threads, int isa) {
    /* local_vocab: the columns of the rank's whole tiles, which may run past the columns stored
     * (the grid's padding past the vocabulary, section 6); only the real columns [0, real_local)
     * of a row are read, so a row needs real_local stored columns. */
    if (logits == NULL || m == NULL || s == NULL || tile_width < 1 || local_vocab < 1 ||
        local_vocab % tile_width != 0 || dtype < DT_F32 || dtype > DT_F16 || rows < 0 ||
        row_stride < real_local || real_local < 0 || real_local > local_vocab || !(t32 > 0.0f) ||
        t32 == __builtin_inff() || (row_t32 != NULL && t32 != 1.0f))
        return RLE_BAD_ARG;
    fwd_args a = {logits, dtype, rows, row_stride, local_vocab, tile_width, real_local,
                  m, s, t, row_min, t32, row_t32};
    return run_split(0, isa, &a, rows, threads);
}

__attribute__((visibility("default"))) int rle_backward(
    const void *logits, int dtype, int64_t rows, int64_t row_stride, int64_t local_vocab,
    int64_t real_local, const float *lse, const float *coef, const int64_t *target_col,
    const float *target_add, void *grad, float t32, const float *g_ent, const float *mb,
    const float *row_t32, int threads, int isa) {
    if (logits == NULL || grad == NULL || lse == NULL || coef == NULL || target_col == NULL ||
        target_add == NULL || local_vocab < 1 || dtype < DT_F32 || dtype > DT_F16 || rows < 0 ||
        row_stride < local_vocab || real_local < 0 || real_local > local_vocab || !(t32 > 0.0f) ||
        t32 == __builtin_inff() || (g_ent == NULL) != (mb == NULL) || (row_t32 != NULL && t32 != 1.0f))
        return RLE_BAD_ARG;
    bwd_args a = {logits, dtype, rows, row_stride, local_vocab, real_local,
                  lse, coef, target_add, target_col, grad, t32, g_ent, mb, row_t32};
    return run_split(1, isa, &a, rows, threads);
}

/* Test hooks: the element functions on their own. */

/* out[i] = op(a[i], b[i], c[i]) in the variant `isa` selects (resolved as the kernels' isa=):
 * op 0 fma(a, b, c), op 1 a * b + c as written (two roundings), op 2 E(a) (the general form;
 * b and c unused, may be NULL), op 3 a / b (the temperature's division; c unused, may be NULL).
 * Returns RLE_BAD_ARG for an unknown op or an unsupported isa. */
__attribute__((visibility("default"))) int rle_elementwise_array(int op, const float *a,
                                                                 const float *b, const float *c,
                                                                 float *out, int64_t n, int isa) {
    int chosen = resolve_isa(isa);
    if (chosen < 0 || op < 0 || op > 3 || n < 0 || a == NULL || out == NULL ||
        (op < 2 && (b == NULL || c == NULL)) || (op == 3 && b == NULL))
        return RLE_BAD_ARG;
#if RLE_X86
    if (chosen == ISA_AVX512) elementwise_avx512(op, a, b, c, out, n);
    else if (chosen == ISA_AVX2) elementwise_avx2(op, a, b, c, out, n);
    else
#endif
        elementwise_baseline(op, a, b, c, out, n);
    return RLE_OK;
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

__attribute__((visibility("default"))) int rle_abi_version(void) { return 5; }

__attribute__((visibility("default"))) int rle_selected_isa(int isa) { return resolve_isa(isa); }

/* A module object so that setuptools builds and Python can locate this file; the kernels
 * are called through ctypes. */
static struct PyModuleDef rle_module = {PyModuleDef_HEAD_INIT, "_fused_cpu",
                                        "Fused CPU kernels (ctypes entry points rle_*).", -1,
                                        NULL};

PyMODINIT_FUNC PyInit__fused_cpu(void) { return PyModule_Create(&rle_module); }
