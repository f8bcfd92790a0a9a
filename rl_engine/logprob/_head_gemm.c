/*
 * The fused head's logits in a fixed order: out[i, j] = round(s_depth) with s_0 = +0 and
 * s_(k+1) = fma(h[i, k], w[j, k], s_k), k = 0 .. depth - 1 in that order (binary32, each
 * input upcast exactly), then NaN made canonical and one rounding to the inputs' dtype
 * (docs/arithmetic.md section 12; section 8's roundings). A library GEMM picks its blocking,
 * its split of the sum and its kernel from the shape and the thread count, so a row's logits
 * there depend on how many rows and columns are multiplied with it; here they depend on the
 * row of `hidden` and the row of `weight` alone: the same bits whatever the rows in the call,
 * the columns in the call (a TP shard of any width), the thread count and the instruction set.
 *
 * Built by setup.py as rl_engine.logprob._head_gemm with the flags of _fused_cpu.c
 * (-ffp-contract=off -fno-fast-math): the only fused multiply-adds are those written through
 * RLE_VFMA. Three variants of one source (_head_gemm_lanes.h): a baseline without an FMA
 * instruction (the correctly rounded software fma of section 1), AVX2 and AVX-512 (vfmadd);
 * a correctly rounded fma has one result, so they give the same bytes (tested).
 *
 * Work: the columns are cut into panels of 2 vectors; a thread takes a panel from a shared
 * counter, packs its weight rows as [depth][panel] binary32, and runs every row of the call
 * through it in register blocks. Python calls the entry point through ctypes
 * (rl_engine/logprob/head_matmul.py), which releases the GIL.
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

#if defined(__FAST_MATH__)
#error "the fused head's logits forbid fast-math: build with -ffp-contract=off -fno-fast-math"
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

#define CANONICAL_NAN_BITS 0x7FC00000u
#define MAX_PANEL 32 /* 2 vectors of 16 binary32 (AVX-512) */
#define MAX_MR 12

typedef union {
    float f;
    uint32_t u;
} fbits;

static inline float f_of(uint32_t u) {
    fbits b;
    b.u = u;
    return b.f;
}

static inline uint32_t u_of(float f) {
    fbits b;
    b.f = f;
    return b.u;
}

/* bf16 and binary16 to binary32, exact. */
static inline float upcast(const void *base, int dtype, int64_t i) {
    if (dtype == DT_F32) return ((const float *)base)[i];
    if (dtype == DT_BF16) return f_of((uint32_t)((const uint16_t *)base)[i] << 16);
    uint32_t h = ((const uint16_t *)base)[i];
    uint32_t sign = (h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu;
    uint32_t m = h & 0x3FFu;
    if (e == 0x1Fu) return f_of(sign | 0x7F800000u | (m << 13));
    if (e != 0) return f_of(sign | ((e + 112u) << 23) | (m << 13));
    float v = (float)m * 0x1p-24f; /* a subnormal or zero: m * 2^-24, exact */
    return f_of(sign | u_of(v));
}

/* Section 8's roundings (the same integer operations as _fused_cpu.c). */
static inline uint16_t round_f16(float f) {
    uint32_t u = u_of(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7E00u;
    if (a >= 0x38800000u) {
        uint32_t r = a - 0x38000000u;
        uint32_t q = r >> 13;
        uint32_t rem = r & 0x1FFFu;
        if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q += 1u;
        if (q >= 0x7C00u) q = 0x7C00u;
        return (uint16_t)(sign | q);
    }
    uint32_t e = a >> 23;
    if (e < 102u) return (uint16_t)sign;
    uint32_t mant = (a & 0x007FFFFFu) | 0x00800000u;
    uint32_t shift = 126u - e;
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q += 1u;
    return (uint16_t)(sign | q);
}

static inline uint16_t round_bf16(float f) {
    uint32_t u = u_of(f);
    return (uint16_t)(((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) & 0xFFFFu);
}

static int flushes_subnormals(void) {
    volatile float tiny = 0x1p-140f;
    volatile float one = 1.0f;
    float r = tiny * one;
    return r == 0.0f;
}

typedef struct {
    const float *h32; /* [rows][depth] binary32, the hidden rows upcast */
    const void *weight;
    int64_t w_stride; /* elements between weight rows */
    int dtype;
    int64_t rows, cols, depth;
    void *out;
    int64_t out_stride; /* elements between output rows */
} gemm_args;

/* The binary32 results of one row's `width` columns from column j0: NaN canonical, rounded
 * once to the dtype. */
static inline void store_row(const gemm_args *a, int64_t i, int64_t j0, int64_t width,
                             const float *v) {
    const int64_t base = i * a->out_stride + j0;
    for (int64_t c = 0; c < width; c++) {
        float x = v[c] != v[c] ? f_of(CANONICAL_NAN_BITS) : v[c];
        if (a->dtype == DT_F32) ((float *)a->out)[base + c] = x;
        else if (a->dtype == DT_BF16) ((uint16_t *)a->out)[base + c] = round_bf16(x);
        else ((uint16_t *)a->out)[base + c] = round_f16(x);
    }
}

/* Weight rows j0 .. j0 + panel - 1 as [depth][panel] binary32; +0 past the last column (those
 * lanes are computed and never stored). */
static void pack_panel(const gemm_args *a, int64_t j0, int panel, float *buf) {
    for (int c = 0; c < panel; c++) {
        const int64_t j = j0 + c;
        if (j >= a->cols) {
            for (int64_t k = 0; k < a->depth; k++) buf[k * panel + c] = 0.0f;
            continue;
        }
        const int64_t row = j * a->w_stride;
        for (int64_t k = 0; k < a->depth; k++) buf[k * panel + c] = upcast(a->weight, a->dtype, row + k);
    }
}

#define LANES 4
#define RLE_MR 4
#define RLE_HW_FMA 0
#define RLE_NAME(n) n##_baseline
#include "_head_gemm_lanes.h"
#undef RLE_NAME
#undef RLE_HW_FMA
#undef RLE_MR
#undef LANES

#if RLE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define LANES 8
#define RLE_MR 6
#define RLE_HW_FMA 1
#define RLE_NAME(n) n##_avx2
#include "_head_gemm_lanes.h"
#undef RLE_NAME
#undef RLE_HW_FMA
#undef RLE_MR
#undef LANES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,fma")
#define LANES 16
#define RLE_MR 12
#define RLE_HW_FMA 1
#define RLE_NAME(n) n##_avx512
#include "_head_gemm_lanes.h"
#undef RLE_NAME
#undef RLE_HW_FMA
#undef RLE_MR
#undef LANES
#pragma GCC pop_options
#endif

static int panel_width(int isa) {
    return isa == ISA_AVX512 ? 32 : (isa == ISA_AVX2 ? 16 : 8);
}

typedef struct {
    int isa;
    const gemm_args *args;
    int64_t panels;
    int64_t *next; /* shared: the first panel not yet taken */
    int status;
} job;

static void *run_job(void *p) {
    job *jb = (job *)p;
    if (flushes_subnormals()) {
        jb->status = RLE_FLUSHES_SUBNORMALS;
        return NULL;
    }
    const gemm_args *a = jb->args;
    const int panel = panel_width(jb->isa);
    float *buf = (float *)aligned_alloc(64, (size_t)((a->depth * panel * sizeof(float) + 63) / 64 * 64));
    float tmp[MAX_MR * MAX_PANEL] __attribute__((aligned(64)));
    if (buf == NULL) {
        jb->status = RLE_NO_MEMORY;
        return NULL;
    }
    int64_t q;
    while ((q = __atomic_fetch_add(jb->next, 1, __ATOMIC_RELAXED)) < jb->panels) {
        const int64_t j0 = q * panel;
        pack_panel(a, j0, panel, buf);
#if RLE_X86
        if (jb->isa == ISA_AVX512) panel_rows_avx512(a, buf, j0, tmp);
        else if (jb->isa == ISA_AVX2) panel_rows_avx2(a, buf, j0, tmp);
        else
#endif
            panel_rows_baseline(a, buf, j0, tmp);
    }
    free(buf);
    jb->status = RLE_OK;
    return NULL;
}

static int resolve_isa(int isa) {
    if (isa == ISA_BASELINE) return ISA_BASELINE;
#if !RLE_X86
    return isa == ISA_AUTO ? ISA_BASELINE : -1;
#else
    __builtin_cpu_init();
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

/* out[i, j] for i < rows, j < cols: hidden [rows][depth] at h_stride, weight [cols][depth] at
 * w_stride, out [rows][cols] at out_stride (elements), all of one dtype. */
__attribute__((visibility("default"))) int rle_head_logits(
    const void *hidden, int64_t h_stride, const void *weight, int64_t w_stride, int dtype,
    int64_t rows, int64_t cols, int64_t depth, void *out, int64_t out_stride, int threads,
    int isa) {
    int chosen = resolve_isa(isa);
    if (chosen < 0 || threads < 1 || hidden == NULL || weight == NULL || out == NULL ||
        dtype < DT_F32 || dtype > DT_F16 || rows < 0 || cols < 0 || depth < 0 ||
        h_stride < depth || w_stride < depth || out_stride < cols)
        return RLE_BAD_ARG;
    if (rows == 0 || cols == 0) return RLE_OK;
    if (flushes_subnormals()) return RLE_FLUSHES_SUBNORMALS;
    float *h32 = (float *)malloc((size_t)(rows * (depth > 0 ? depth : 1)) * sizeof(float));
    if (h32 == NULL) return RLE_NO_MEMORY;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t k = 0; k < depth; k++) h32[i * depth + k] = upcast(hidden, dtype, i * h_stride + k);
    gemm_args a = {h32, weight, w_stride, dtype, rows, cols, depth, out, out_stride};
    const int panel = panel_width(chosen);
    const int64_t panels = (cols + panel - 1) / panel;
    if ((int64_t)threads > panels) threads = (int)panels;
    if (threads > 256) threads = 256;
    job jobs[256];
    pthread_t tids[256];
    int64_t next = 0;
    for (int i = 0; i < threads; i++) {
        jobs[i].isa = chosen;
        jobs[i].args = &a;
        jobs[i].panels = panels;
        jobs[i].next = &next;
        jobs[i].status = RLE_THREAD_FAILED;
    }
    int started = 1;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&tids[i], NULL, run_job, &jobs[i]) != 0) break;
        started++;
    }
    run_job(&jobs[0]);
    for (int i = 1; i < started; i++) pthread_join(tids[i], NULL);
    free(h32);
    for (int i = 0; i < started; i++)
        if (jobs[i].status != RLE_OK) return jobs[i].status;
    return RLE_OK;
}

__attribute__((visibility("default"))) int rle_head_abi_version(void) { return 1; }

__attribute__((visibility("default"))) int rle_head_selected_isa(int isa) { return resolve_isa(isa); }

static struct PyModuleDef rle_head_module = {
    PyModuleDef_HEAD_INIT, "_head_gemm", "The fused head's fixed-order logits (ctypes entry points rle_head_*).",
    -1, NULL};

PyMODINIT_FUNC PyInit__head_gemm(void) { return PyModule_Create(&rle_head_module); }
