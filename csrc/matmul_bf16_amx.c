/* AMX bf16 tile kernels for BF16 weights against f32 activations split three ways
 * (matmul_bf16_amx.h says what is summed, and in which order).
 *
 * What the tile unit does (measured on a Sapphire Rapids class Xeon, see
 * tests/test_bf16_amx.py and the report of issue 17): TDPBF16PS multiplies bf16 pairs
 * exactly; a single pair is added as RN(c + RN(a0 b0 + a1 b1)); over a 64-byte row of
 * pairs it keeps a wider internal sum that matches no sequence of f32 roundings, but is
 * the same for every lane and position. Rounding is to nearest even whatever MXCSR says;
 * denormal inputs (bf16 and the f32 accumulator) read as 0 and denormal results are
 * flushed to 0. So an output is a deterministic function of its weight row, its token's
 * row and the order of the tile multiplies -- which the kernel fixes.
 *
 * Built with -mamx-tile -mamx-bf16 and the AVX-512 flags; only called at the AMX level
 * where ellm_cpu_has_amx_bf16(). A kernel call loads its tile configuration unless the
 * thread holds it already (amx_tile.h); the matmul driver releases the tiles. */
#include "matmul_bf16_amx.h"

#ifdef __x86_64__

#include <immintrin.h>
#include <string.h>

#include "amx_tile.h"
#include "quant.h"

#define INLINE static inline __attribute__((always_inline))

/* Tiles: two of weights (A: 16 rows x 32 bf16), two of activations (B: 16 pairs x 16
 * tokens), four of results (C: 16 rows x 16 tokens f32) -- 32 rows x 32 tokens a pass. */
#define TA0 0
#define TA1 1
#define TB0 2
#define TB1 3
#define TC00 4
#define TC01 5
#define TC10 6
#define TC11 7
/* GCC's tile intrinsics paste the register number into the instruction: expand first */
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)

/* every tile in use is 16 rows of 64 bytes */
static void load_tile_config(void) {
    if (ellm_tile_config_held == ELLM_TILE_CFG_BF16) return;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    ellm_tile_load_config(&cfg);
    ellm_tile_config_held = ELLM_TILE_CFG_BF16;
}

/* ====================================================================================
 * Activations: f32 -> three exact bf16 parts, 16 tokens (one group) at a time
 * ==================================================================================== */

#define PART_BYTES 1024 /* one B tile */

/* the high halves of 32 dwords (a: elements 0..15, b: 16..31), in element order: the
 * bf16 pairs (2j, 2j + 1) as 16 dwords */
INLINE __m512i high_halves(__m512i a, __m512i b) {
    const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37,
                                         35, 33, 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7,
                                         5, 3, 1);
    return _mm512_permutex2var_epi16(a, idx, b);
}

/* x = hi + mid + lo exactly: hi keeps x's top 16 bits, x - hi is exact in f32 and has at
 * most 16 significant bits, of which mid keeps the top 8; the rest, lo, fits a bf16 */
INLINE void split3(__m512 x, __m512i *hi, __m512i *mid, __m512i *lo) {
    const __m512i top = _mm512_set1_epi32((int)0xFFFF0000u);
    *hi = _mm512_and_si512(_mm512_castps_si512(x), top);
    const __m512 r1 = _mm512_sub_ps(x, _mm512_castsi512_ps(*hi));
    *mid = _mm512_and_si512(_mm512_castps_si512(r1), top);
    *lo = _mm512_castps_si512(_mm512_sub_ps(r1, _mm512_castsi512_ps(*mid)));
}

/* v[i][l] -> v[l][i]: four rounds, round s exchanging bit s of the register number with
 * bit s of the lane */
INLINE void transpose16(__m512 v[16]) {
    _Pragma("GCC unroll 4")
    for (int s = 1; s < 16; s <<= 1) {
        int lo_idx[16], hi_idx[16];
        for (int l = 0; l < 16; l++) {
            lo_idx[l] = (l & s) ? 16 + l - s : l;
            hi_idx[l] = (l & s) ? 16 + l : l + s;
        }
        const __m512i il = _mm512_loadu_si512(lo_idx), ih = _mm512_loadu_si512(hi_idx);
        _Pragma("GCC unroll 16")
        for (int i = 0; i < 16; i++) {
            if (i & s) continue;
            const __m512 a = v[i], b = v[i + s];
            v[i] = _mm512_permutex2var_ps(a, il, b);
            v[i + s] = _mm512_permutex2var_ps(a, ih, b);
        }
    }
}

/* part p (0 hi, 1 mid, 2 lo) of the 32 elements at x (`left` of them real, the rest 0)
 * as 16 pair dwords */
INLINE __m512 part_pairs(const float *x, int64_t left, int p) {
    const __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1u);
    const __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0 : (__mmask16)((1u << (left - 16)) - 1u);
    __m512i h0, d0, l0, h1, d1, l1;
    split3(_mm512_maskz_loadu_ps(m0, x), &h0, &d0, &l0);
    split3(_mm512_maskz_loadu_ps(m1, x + 16), &h1, &d1, &l1);
    const __m512i v = p == 0 ? high_halves(h0, h1) : p == 1 ? high_halves(d0, d1) : high_halves(l0, l1);
    return _mm512_castsi512_ps(v);
}

/* Each block's part tile: the 16 tokens' pair dwords, one token a register, transposed
 * into one row per pair */
void ellm_bf16x3_put_group(const float *x, size_t x_stride, int n, int64_t k, uint8_t *group) {
    const int64_t nkb = (k + ELLM_BF16_KB - 1) / ELLM_BF16_KB;
    for (int64_t b = 0; b < nkb; b++) {
        const int64_t i = b * ELLM_BF16_KB;
        for (int p = 0; p < 3; p++) {
            __m512 v[16];
            for (int t = 0; t < 16; t++)
                v[t] = t < n ? part_pairs(x + (size_t)t * x_stride + i, k - i, p) : _mm512_setzero_ps();
            transpose16(v);
            float *dst = (float *)(group + ((size_t)b * 3 + (size_t)p) * PART_BYTES);
            _Pragma("GCC unroll 16")
            for (int j = 0; j < 16; j++) _mm512_store_ps(dst + 16 * j, v[j]);
        }
    }
}

/* ====================================================================================
 * Results: C (16 rows x 16 tokens) -> Y (tokens x rows)
 * ==================================================================================== */

/* y[t][r] = c[r][t] for t < n tokens, r < rows */
INLINE void store_result(const float c[16][16], int rows, int n, float *y, size_t ys) {
    __m512 v[16];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < 16; r++) v[r] = _mm512_load_ps(c[r]);
    transpose16(v);
    const __mmask16 m = (__mmask16)((1u << rows) - 1u);
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(y + (size_t)t * ys, m, v[t]);
}

/* ====================================================================================
 * The kernel
 * ==================================================================================== */

/* A weight tile that the matrix cannot give directly (a short last block of k, or fewer
 * than 16 rows left): copied into buf, zero past the row or block */
static void stage_weights(const uint8_t *w, size_t ws, int rows, int64_t k, int64_t b,
                          uint16_t buf[16][32]) {
    const int64_t i = b * ELLM_BF16_KB;
    const int64_t n = k - i < ELLM_BF16_KB ? k - i : ELLM_BF16_KB;
    memset(buf, 0, 16 * 32 * sizeof(uint16_t));
    for (int r = 0; r < rows; r++) memcpy(buf[r], w + (size_t)r * ws + 2 * (size_t)i, 2 * (size_t)n);
}

/* 16 * na rows (r_ok of them real) x 16 * ng tokens (groups x0, x1), every block of k */
INLINE void pass(const int na, const int ng, int64_t k, const uint8_t *w, size_t ws, int r_ok,
                 const uint8_t *x0, const uint8_t *x1, float (*res)[16][16],
                 uint16_t (*stage)[16][32]) {
    const int64_t nkb = (k + ELLM_BF16_KB - 1) / ELLM_BF16_KB, full_kb = k / ELLM_BF16_KB;
    const int direct0 = r_ok >= 16, direct1 = r_ok >= 32;
    TILE_ZERO(TC00);
    if (ng > 1) TILE_ZERO(TC01);
    if (na > 1) TILE_ZERO(TC10);
    if (na > 1 && ng > 1) TILE_ZERO(TC11);
    for (int64_t b = 0; b < nkb; b++) {
        const uint8_t *wb = w + 64 * (size_t)b;
        if (direct0 && b < full_kb) {
            TILE_LOAD(TA0, wb, ws);
        } else {
            stage_weights(w, ws, r_ok < 16 ? r_ok : 16, k, b, stage[0]);
            TILE_LOAD(TA0, stage[0], 64);
        }
        if (na > 1) {
            if (direct1 && b < full_kb) {
                TILE_LOAD(TA1, wb + 16 * ws, ws);
            } else {
                stage_weights(w + 16 * ws, ws, r_ok - 16 < 16 ? r_ok - 16 : 16, k, b, stage[1]);
                TILE_LOAD(TA1, stage[1], 64);
            }
        }
        const uint8_t *xb0 = x0 + (size_t)b * 3 * PART_BYTES, *xb1 = x1 + (size_t)b * 3 * PART_BYTES;
        /* hi, mid, lo: the one order of every output's terms */
        _Pragma("GCC unroll 3")
        for (int p = 0; p < 3; p++) {
            TILE_LOAD(TB0, xb0 + p * PART_BYTES, 64);
            if (ng > 1) TILE_LOAD(TB1, xb1 + p * PART_BYTES, 64);
            TILE_DP(TC00, TA0, TB0);
            if (ng > 1) TILE_DP(TC01, TA0, TB1);
            if (na > 1) TILE_DP(TC10, TA1, TB0);
            if (na > 1 && ng > 1) TILE_DP(TC11, TA1, TB1);
        }
    }
    TILE_STORE(TC00, res[0], 64);
    if (ng > 1) TILE_STORE(TC01, res[1], 64);
    if (na > 1) TILE_STORE(TC10, res[2], 64);
    if (na > 1 && ng > 1) TILE_STORE(TC11, res[3], 64);
}

static void fmm_bf16_amx(int64_t k, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,
                         size_t xs, int64_t nt, float *y, size_t ys) {
    float res[4][16][16] __attribute__((aligned(64)));
    uint16_t stage[2][16][32] __attribute__((aligned(64)));
    const int64_t ngroups = (nt + ELLM_BF16_TG - 1) / ELLM_BF16_TG;
    load_tile_config();
    for (int64_t r0 = 0; r0 < nr; r0 += 32) {
        const int r_ok = nr - r0 < 32 ? (int)(nr - r0) : 32;
        const int na = r_ok > 16 ? 2 : 1;
        const uint8_t *wr = w + (size_t)r0 * ws;
        for (int64_t g = 0; g < ngroups; g += 2) {
            const int ng = ngroups - g > 1 ? 2 : 1;
            const uint8_t *x0 = x + (size_t)g * xs, *x1 = x0 + (ng > 1 ? xs : 0);
            if (na == 2 && ng == 2) pass(2, 2, k, wr, ws, r_ok, x0, x1, res, stage);
            else if (na == 2) pass(2, 1, k, wr, ws, r_ok, x0, x1, res, stage);
            else if (ng == 2) pass(1, 2, k, wr, ws, r_ok, x0, x1, res, stage);
            else pass(1, 1, k, wr, ws, r_ok, x0, x1, res, stage);
            for (int a = 0; a < na; a++)
                for (int q = 0; q < ng; q++) {
                    const int64_t t0 = (g + q) * ELLM_BF16_TG, r = r0 + 16 * a;
                    const int n = nt - t0 < ELLM_BF16_TG ? (int)(nt - t0) : ELLM_BF16_TG;
                    const int rows = nr - r < 16 ? (int)(nr - r) : 16;
                    store_result(res[2 * a + q], rows, n, y + (size_t)t0 * ys + (size_t)r, ys);
                }
        }
    }
}

ellm_qgemm_fn ellm_fmm_bf16_amx(int qtype) { return qtype == ELLM_T_BF16 ? fmm_bf16_amx : NULL; }

#endif /* __x86_64__ */
