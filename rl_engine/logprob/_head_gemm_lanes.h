/*
 * The panel kernel of rl_engine/logprob/_head_gemm.c, included once per instruction set with
 * LANES (binary32 values per vector), RLE_MR (rows per register block), RLE_HW_FMA and
 * RLE_NAME defined. A register block holds RLE_MR rows x 2 vectors of columns; every element
 * of it is one accumulator that walks k = 0, 1, ..., depth - 1 in that order with one fma per
 * k. The vector width and the block shape decide how many elements one instruction advances,
 * never an operation or its order on an element: every variant, block shape, thread count and
 * row or column offset gives an element the same chain, so the same bits.
 */

typedef float RLE_NAME(vf) __attribute__((vector_size(4 * LANES)));
typedef double RLE_NAME(vd) __attribute__((vector_size(8 * LANES)));
typedef int64_t RLE_NAME(vl) __attribute__((vector_size(8 * LANES)));

#define VF RLE_NAME(vf)
#define VD RLE_NAME(vd)
#define VL RLE_NAME(vl)
#define AI static inline __attribute__((always_inline))
#define PANEL (2 * LANES)

/* A broadcast that keeps every bit of x (-0.0, NaN payloads): one instruction on x86 (a
 * lane-by-lane loop becomes one masked insert per lane). */
AI VF RLE_NAME(vsplat)(float x) {
#if RLE_X86 && LANES == 16
    return (VF)_mm512_set1_ps(x);
#elif RLE_X86 && LANES == 8
    return (VF)_mm256_set1_ps(x);
#elif RLE_X86 && LANES == 4
    return (VF)_mm_set1_ps(x);
#else
    VF v;
    for (int l = 0; l < LANES; l++) v[l] = x;
    return v;
#endif
}

AI VF RLE_NAME(vload)(const float *p) {
    VF v;
    memcpy(&v, p, sizeof v);
    return v;
}

AI void RLE_NAME(vstore)(float *p, VF v) { memcpy(p, &v, sizeof v); }

#if RLE_HW_FMA && LANES == 16
#define RLE_VFMA(a, b, c) ((VF)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif RLE_HW_FMA && LANES == 8
#define RLE_VFMA(a, b, c) ((VF)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
/* The correctly rounded fma without an FMA instruction: docs/arithmetic.md section 1 and
 * _fused_cpu_lanes.h's vfma_soft (the binary64 product is exact, TwoSum gives the sum's
 * error, the sum is rounded to odd, then once to binary32). */
AI VF RLE_NAME(vfma_soft)(VF a, VF b, VF c) {
    const VD a64 = __builtin_convertvector(a, VD), b64 = __builtin_convertvector(b, VD);
    const VD c64 = __builtin_convertvector(c, VD);
    VD z;
    for (int l = 0; l < LANES; l++) z[l] = 0.0;
    const VD p = a64 * b64;
    const VD s = p + c64;
    const VD bb = s - p;
    const VD err = (p - (s - bb)) + (c64 - bb);
    VL u = (VL)s;
    const VL inexact = (err < z) | (err > z);
    const VL toward_zero = (err > z) ^ (s > z);
    const VL step = ((u & 1) ^ 1) & inexact;
    u = u + ((step ^ toward_zero) - toward_zero);
    return __builtin_convertvector((VD)u, VF);
}
#define RLE_VFMA(a, b, c) RLE_NAME(vfma_soft)((a), (b), (c))
#endif

/* `mr` rows (a compile-time constant after inlining) of the packed panel: acc = +0, then
 * acc = fma(h[i, k], w[j, k], acc) for k = 0 .. depth - 1; the binary32 results go to `tmp`
 * ([mr][PANEL]). */
AI void RLE_NAME(block)(const float *restrict h, int64_t h_stride, const float *restrict panel,
                        int64_t depth, int mr, float *restrict tmp) {
    VF acc0[RLE_MR], acc1[RLE_MR];
    for (int r = 0; r < mr; r++) {
        acc0[r] = RLE_NAME(vsplat)(0.0f);
        acc1[r] = RLE_NAME(vsplat)(0.0f);
    }
    for (int64_t k = 0; k < depth; k++) {
        const VF b0 = RLE_NAME(vload)(panel + k * PANEL);
        const VF b1 = RLE_NAME(vload)(panel + k * PANEL + LANES);
        for (int r = 0; r < mr; r++) {
            const VF a = RLE_NAME(vsplat)(h[r * h_stride + k]);
            acc0[r] = RLE_VFMA(a, b0, acc0[r]);
            acc1[r] = RLE_VFMA(a, b1, acc1[r]);
        }
    }
    for (int r = 0; r < mr; r++) {
        RLE_NAME(vstore)(tmp + r * PANEL, acc0[r]);
        RLE_NAME(vstore)(tmp + r * PANEL + LANES, acc1[r]);
    }
}

#define RLE_BLOCK_CASE(n)                                                                     \
    case n:                                                                                   \
        RLE_NAME(block)(h, h_stride, panel, depth, n, tmp);                                   \
        break;

static __attribute__((noinline)) void RLE_NAME(panel_rows)(const gemm_args *a, const float *panel,
                                                           int64_t j0, float *tmp) {
    const int64_t width = a->cols - j0 < PANEL ? a->cols - j0 : PANEL;
    for (int64_t i0 = 0; i0 < a->rows; i0 += RLE_MR) {
        const int mr = (int)(a->rows - i0 < RLE_MR ? a->rows - i0 : RLE_MR);
        const float *h = a->h32 + i0 * a->depth;
        const int64_t h_stride = a->depth, depth = a->depth;
        switch (mr) {
            RLE_BLOCK_CASE(1)
            RLE_BLOCK_CASE(2)
            RLE_BLOCK_CASE(3)
            RLE_BLOCK_CASE(4)
#if RLE_MR > 4
            RLE_BLOCK_CASE(5)
            RLE_BLOCK_CASE(6)
#endif
#if RLE_MR > 6
            RLE_BLOCK_CASE(7)
            RLE_BLOCK_CASE(8)
#endif
#if RLE_MR > 8
            RLE_BLOCK_CASE(9)
            RLE_BLOCK_CASE(10)
            RLE_BLOCK_CASE(11)
            RLE_BLOCK_CASE(12)
#endif
            default:
                break;
        }
        for (int r = 0; r < mr; r++)
            store_row(a, i0 + r, j0, width, tmp + r * PANEL);
    }
}

#undef RLE_BLOCK_CASE
#undef RLE_VFMA
#undef PANEL
#undef AI
#undef VF
#undef VD
#undef VL
