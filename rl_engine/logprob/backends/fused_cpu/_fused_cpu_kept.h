/*
 * Processed logprobs (docs/arithmetic.md section 13) in the fused CPU kernels: included by
 * _fused_cpu_lanes.h once per instruction set, after its forward and backward.
 *
 * The kept set K of a row is a prefix of the key order (x_c descending, ties by the lower
 * column): min-p keeps every column at or above a value, top-k and top-p keep prefixes of
 * that. So one key (v, id) per row describes it: column c (global id g) is dropped iff
 * x_c < v, or x_c == v and g > id. A NaN x_c is never dropped (a row with a NaN keeps every
 * column); (v, id) = (-inf, INT64_MAX) drops nothing. The kernels take id as a local column
 * (the global id minus the shard's first column: below 0 drops every tie, past the shard
 * keeps them).
 *
 *  - fwd_rows_kept: section 6 steps 1-4 on the logits with x_c = -inf outside K; with a
 *    per-row shift (the row max B) in place of the tile's own, its s is section 13's G of
 *    e_c = E(RN32(x_c - B)) over the kept columns: the top-p sums Z are F of those.
 *  - bwd_rows_kept: section 7 on the same logits: the unmasked gradient of a kept column is
 *    the masked one (its operations read x_c, lse and the row's terms only), and every
 *    dropped column is written +0.
 *  - candidates_row: min-p's K1 on the shard (its size and its least x), and the first k
 *    columns of K1 in key order (top-k's rank-local candidates).
 * Top-p is the search on the key (rl_engine/logprob/kept_search.py) over fwd_rows_kept's sums:
 * measured on this project's CPU it beat a per-row sort of K2 with a bisection on the prefix
 * length (2.1 s against 4.7 s for 64 rows of 151936 bf16 columns, top_p = 0.9, a loaded machine).
 */

#ifndef RLE_KEPT_COMMON
#define RLE_KEPT_COMMON 1

/* A column's place in the key order as one unsigned integer: smaller is earlier. The high
 * 32 bits order binary32 values descending (both zeros as +0: they are equal values), the
 * low 32 bits are the column (ties by the lower one). NaN never reaches a key. */
static inline uint64_t rle_key(float x, int64_t c) {
    uint32_t u = x == 0.0f ? 0u : u_of(x);
    uint32_t asc = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending with x */
    return ((uint64_t)(~asc) << 32) | (uint64_t)(uint32_t)c;
}

static inline float rle_key_value(uint64_t key) {
    uint32_t asc = ~(uint32_t)(key >> 32);
    return f_of((asc & 0x80000000u) ? (asc & 0x7FFFFFFFu) : ~asc);
}

static int rle_key_cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : (x > y ? 1 : 0);
}

/* Move the n smallest of keys[0, len) to keys[0, n), in any order (Hoare's selection with a
 * median-of-three pivot; keys are distinct, their low bits being the column). */
static void rle_select(uint64_t *keys, int64_t len, int64_t n) {
    int64_t lo = 0, hi = len - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        uint64_t a = keys[lo], b = keys[mid], c = keys[hi];
        uint64_t pivot = a < b ? (b < c ? b : (a < c ? c : a)) : (a < c ? a : (b < c ? c : b));
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (keys[i] < pivot) i++;
            while (keys[j] > pivot) j--;
            if (i <= j) {
                uint64_t t = keys[i];
                keys[i] = keys[j];
                keys[j] = t;
                i++;
                j--;
            }
        }
        if (n - 1 <= j) hi = j;
        else if (n - 1 >= i) lo = i;
        else return;
    }
}

static inline int rle_dropped(float x, int64_t c, float v, int64_t id) {
    return x < v || (x == v && c > id);
}

#endif /* RLE_KEPT_COMMON */

/* The forward of the masked logits; see the file's comment. The same passes as fwd_rows, with
 * the mask applied in the tile buffer after step 0 (the maximum is taken again over the kept
 * columns; the validation minimum stays that of every real column). */
static __attribute__((noinline)) void RLE_NAME(fwd_rows_kept)(const fwd_args *a, int64_t r0,
                                                                int64_t r1, float *restrict x) {
    const int64_t w = a->tile_width;
    const int64_t tiles = a->local_vocab / w;
    const int64_t wv = (w + RLE_GROUP - 1) / RLE_GROUP * RLE_GROUP;
    const size_t esz = a->dtype == DT_F32 ? 4 : 2;
    float ls[RLE_LANE_COUNT] __attribute__((aligned(64)));
    float lt[RLE_LANE_COUNT] __attribute__((aligned(64)));
    for (int64_t row = r0; row < r1; row++) {
        const char *rowp = (const char *)a->logits + (size_t)row * (size_t)a->row_stride * esz;
        const float kv = a->keep_v[row];
        const int64_t kid = a->keep_id[row];
        const float t32 = a->row_t32 != NULL ? a->row_t32[row] : a->t32; /* this row's T32 */
        float rmin = __builtin_inff();
        int rnan = 0;
        for (int64_t j = 0; j < tiles; j++) {
            const int64_t c0 = j * w;
            int64_t nreal = a->real_local - c0;
            nreal = nreal < 0 ? 0 : (nreal > w ? w : nreal);
            float mn;
            RLE_NAME(tile_upcast_max)(rowp, a->dtype, c0, nreal, wv, x, a->row_min != NULL, &mn);
            if (t32 != 1.0f) {
                const VF vt = VS(t32);
                int64_t c = 0;
                for (; c + LANES <= nreal; c += LANES)
                    RLE_NAME(vstore)(x + c, RLE_NAME(vload)(x + c) / vt);
                for (; c < nreal; c++) x[c] = x[c] / t32;
                mn = mn / t32;
            }
            if (nreal > 0) rmin = mn < rmin ? mn : rmin;
            float mx = -__builtin_inff();
            int32_t kept = 0;
            for (int64_t c = 0; c < nreal; c++) {
                if (rle_dropped(x[c], c0 + c, kv, kid)) {
                    x[c] = -__builtin_inff();
                } else {
                    mx = x[c] > mx ? x[c] : mx; /* NaN ignored, as tile_upcast_max does */
                    kept++;
                }
            }
            if (a->count != NULL) a->count[row * tiles + j] = kept;
            const float mj = mx + 0.0f;
            const float sh = a->shift != NULL ? a->shift[row] : (mj == -__builtin_inff() ? 0.0f : mj);
            const char *pf = j + 1 < tiles ? rowp + (size_t)(c0 + w) * esz
                                           : rowp + (size_t)a->row_stride * esz;
            const char *pf_end = pf + (size_t)w * esz;
            float tj = 0.0f;
            if (a->t != NULL) {
                RLE_NAME(tile_sums)(x, w, sh, ls, lt, 1, pf, pf_end);
                tj = RLE_NAME(fold_lanes)(lt);
                a->t[row * tiles + j] = tj;
            } else {
                RLE_NAME(tile_sums)(x, w, sh, ls, lt, 0, pf, pf_end);
            }
            const float sj = RLE_NAME(fold_lanes)(ls);
            const int nan = sj != sj && RLE_NAME(has_nan)(x, nreal);
            rnan |= nan;
            a->s[row * tiles + j] = sj;
            a->m[row * tiles + j] = nan ? f_of(CANONICAL_NAN_BITS) : mj;
        }
        if (a->row_min != NULL && a->real_local > 0)
            a->row_min[row] = rnan ? f_of(CANONICAL_NAN_BITS) : rmin;
    }
}

/* The backward of the masked logits: bwd_rows on the row, then +0 on every dropped column. */
static __attribute__((noinline)) void RLE_NAME(bwd_rows_kept)(const bwd_args *a, int64_t r0,
                                                                int64_t r1) {
    const size_t esz = a->dtype == DT_F32 ? 4 : 2;
    for (int64_t row = r0; row < r1; row++) {
        RLE_NAME(bwd_rows)(a, row, row + 1);
        const char *rowp = (const char *)a->logits + (size_t)row * (size_t)a->row_stride * esz;
        char *out = (char *)a->grad + (size_t)row * (size_t)a->local_vocab * esz;
        const float kv = a->keep_v[row];
        const int64_t kid = a->keep_id[row];
        const float t32 = a->row_t32 != NULL ? a->row_t32[row] : a->t32; /* this row's T32 */
        for (int64_t c = 0; c < a->real_local; c++) {
            const float xc = t32 != 1.0f ? upcast(rowp, a->dtype, c) / t32 : upcast(rowp, a->dtype, c);
            if (rle_dropped(xc, c, kv, kid)) RLE_NAME(store_one)(out, a->dtype, c, 0.0f);
        }
    }
}

/* Row `row`'s real binary32 logits after step 0, into x[0, R). */
static inline void RLE_NAME(row_logits)(const char *rowp, int dtype, int64_t R, float t32,
                                        float *restrict x) {
    for (int64_t c = 0; c < R; c++) x[c] = upcast(rowp, dtype, c);
    if (t32 != 1.0f) {
        const VF vt = VS(t32);
        int64_t c = 0;
        for (; c + LANES <= R; c += LANES) RLE_NAME(vstore)(x + c, RLE_NAME(vload)(x + c) / vt);
        for (; c < R; c++) x[c] = x[c] / t32;
    }
}

/* min-p's K1 on the shard and top-k's rank-local candidates for one row. K1 is every real
 * column when lmp is -inf (min-p off), else { c : RN32(x_c - B) >= lmp } (lmp = L(mp32)).
 * Writes |K1| on the shard, the least x over K1 (+inf when empty), and the first
 * min(k, |K1|) columns of K1 in key order (value, local column), -inf / -1 past them.
 * keys: room for R keys. */
static void RLE_NAME(candidates_row)(const float *x, int64_t R, float B, float lmp, int64_t k,
                                     int64_t kmax, uint64_t *keys, int64_t *count, float *least,
                                     float *cand_v, int64_t *cand_id) {
    int64_t n = 0;
    float lo = __builtin_inff();
    const int minp = lmp != -__builtin_inff();
    for (int64_t c = 0; c < R; c++) {
        const float xc = x[c];
        if (xc != xc) continue;
        if (minp && !((xc - B) >= lmp)) continue;
        lo = xc < lo ? xc : lo;
        keys[n++] = rle_key(xc, c);
    }
    *count = n;
    *least = lo;
    int64_t take = k < n ? k : n;
    if (take > 0) {
        if (take < n) rle_select(keys, n, take);
        qsort(keys, (size_t)take, sizeof(uint64_t), rle_key_cmp);
    }
    for (int64_t i = 0; i < kmax; i++) {
        cand_v[i] = i < take ? rle_key_value(keys[i]) : -__builtin_inff();
        cand_id[i] = i < take ? (int64_t)(uint32_t)keys[i] : -1;
    }
}
