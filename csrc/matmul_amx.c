/* AMX int8 tile kernels for many tokens (prefill, batched decode): 16 weight rows x 16
 * tokens per tile multiply, activations in the 16-token groups of matmul_amx.h.
 *
 * How each output is summed (the same as quant_x86.h's qgemm32_tile, so AMX and the
 * AVX-512 VNNI level agree bit for bit):
 *   32-element types, per block, in block order:
 *     isum = q . x_q                       one tile multiply, K = 32 bytes: exact int32
 *     acc  = fma(float(isum), d * d_x, acc)       cor = fma(c, s_x, cor)
 *   and y = acc + cor (Q8_0: y = acc). q are the block's values as int8 (Q4: 0..15,
 *   Q5: 0..31, Q8_0: signed as stored), c its constant term (see quant_x86.h).
 * The tile unit only forms the exact integer dot; the float steps are the same
 * instructions in the same order, with the tokens (rather than the rows) in the lanes.
 *
 * Built with -mamx-tile -mamx-int8 and the AVX-512 flags; only called at the AMX level,
 * whose detection (dispatch.c) has asked the kernel for the tile state. A kernel call
 * loads its tile configuration unless the thread holds it already (amx_tile.h); the
 * matmul driver releases the tiles at the end of each of its tasks, so a thread never
 * holds tile state between linear calls. */
#include "matmul_amx.h"

#ifdef __x86_64__

#include <immintrin.h>
#include <string.h>

#include "amx_tile.h"
#include "quant.h"

#define INLINE static inline __attribute__((always_inline))

/* The tile registers: A = weights (16 rows x K bytes), B = activations (K / 4 rows x 64
 * bytes: 16 tokens x 4), C = 16 x 16 int32. Two sets, so that one block's multiply can
 * run while the other's result is taken apart. */
#define TA0 0
#define TB0 1
#define TC0 2
#define TA1 3
#define TB1 4
#define TC1 5
/* GCC's tile intrinsics paste their register number into the instruction text: these
 * expand the names above first */
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)

/* A and B tiles for K bytes of depth (a multiple of 4, at most 64): 32 for the 32-element
 * types, 16 for Q6_K's 16-runs, 64 for Q4_K (whose kernel uses all eight tiles: at 64
 * every tile is 16 rows of 64 bytes). */
static void load_tile_config(int k_bytes) {
    if (ellm_tile_config_held == k_bytes) return;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int a[2] = {TA0, TA1}, b[2] = {TB0, TB1}, c[2] = {TC0, TC1};
    for (int i = 0; i < 2; i++) {
        cfg.rows[a[i]] = 16;
        cfg.colsb[a[i]] = (uint16_t)k_bytes;
        cfg.rows[b[i]] = (uint8_t)(k_bytes / 4);
        cfg.colsb[b[i]] = 64;
        cfg.rows[c[i]] = 16;
        cfg.colsb[c[i]] = 64;
    }
    if (k_bytes == 64)
        for (int t = 6; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
    ellm_tile_load_config(&cfg);
    ellm_tile_config_held = k_bytes;
}

_Thread_local int ellm_tile_config_held;

void ellm_amx_release_tiles(void) {
    if (ellm_tile_config_held) {
        _tile_release();
        ellm_tile_config_held = 0;
    }
}

INLINE float f16_at(const uint8_t *p) { return _cvtsh_ss(ellm_rd_u16(p)); }

/* ====================================================================================
 * Activations into 16-token groups
 * ==================================================================================== */

void ellm_amx_put_token(int act_block, ellm_act_fn act, const float *x, int64_t nblk,
                        uint8_t *group, int lane) {
    if (act_block == QK32) {
        ellm_act32x16 *g = (ellm_act32x16 *)group;
        for (int64_t i = 0; i < nblk; i++) {
            ellm_act32 a;
            act(x + QK32 * i, QK32, &a);
            g[i].d[lane] = a.d;
            g[i].s[lane] = a.s;
            for (int m = 0; m < QK32 / 4; m++)
                memcpy(g[i].qs + 4 * (ELLM_AMX_TG * m + lane), a.qs + 4 * m, 4);
        }
    } else {
        ellm_act256x16 *g = (ellm_act256x16 *)group;
        for (int64_t i = 0; i < nblk; i++) {
            ellm_act256 a;
            act(x + QK256 * i, QK256, &a);
            g[i].d[lane] = a.d;
            for (int k = 0; k < 8; k++) {
                g[i].bsums[k][lane][0] = a.bsums[2 * k];
                g[i].bsums[k][lane][1] = a.bsums[2 * k + 1];
            }
            for (int m = 0; m < QK256 / 4; m++)
                memcpy(g[i].qs + 4 * (ELLM_AMX_TG * m + lane), a.qs + 4 * m, 4);
        }
    }
}

void ellm_amx_zero_lanes(int act_block, int64_t nblk, uint8_t *group, int used) {
    const int pad = ELLM_AMX_TG - used;
    if (pad <= 0) return;
    if (act_block == QK32) {
        ellm_act32x16 *g = (ellm_act32x16 *)group;
        for (int64_t i = 0; i < nblk; i++) {
            for (int m = 0; m < QK32 / 4; m++)
                memset(g[i].qs + 4 * (ELLM_AMX_TG * m + used), 0, (size_t)(4 * pad));
            memset(g[i].d + used, 0, (size_t)pad * sizeof(float));
            memset(g[i].s + used, 0, (size_t)pad * sizeof(float));
        }
    } else {
        ellm_act256x16 *g = (ellm_act256x16 *)group;
        for (int64_t i = 0; i < nblk; i++) {
            for (int m = 0; m < QK256 / 4; m++)
                memset(g[i].qs + 4 * (ELLM_AMX_TG * m + used), 0, (size_t)(4 * pad));
            for (int k = 0; k < 8; k++) memset(g[i].bsums[k][used], 0, (size_t)pad * 2 * sizeof(int16_t));
            memset(g[i].d + used, 0, (size_t)pad * sizeof(float));
        }
    }
}

/* ====================================================================================
 * Results: 16 rows x 16 tokens of accumulators (lanes = tokens) into Y (tokens x rows)
 * ==================================================================================== */

/* v[i] = row i (lanes j) -> v[j] = column j (lanes i): three rounds of shuffles */
INLINE void transpose16(__m512 v[16]) {
    __m512 t[16], u[16];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < 16; i += 2) { /* pairs of rows, 32-bit interleave in each 128-bit lane */
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    _Pragma("GCC unroll 4")
    for (int q = 0; q < 16; q += 4) { /* u[q + j]: rows q..q+3 of columns j, j+4, j+8, j+12 */
        u[q] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[q]), _mm512_castps_pd(t[q + 2])));
        u[q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[q]), _mm512_castps_pd(t[q + 2])));
        u[q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[q + 1]), _mm512_castps_pd(t[q + 3])));
        u[q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[q + 1]), _mm512_castps_pd(t[q + 3])));
    }
    _Pragma("GCC unroll 4")
    for (int j = 0; j < 4; j++) { /* gather lane L of u[j], u[4 + j], u[8 + j], u[12 + j] */
        const __m512 a0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88), a1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xDD);
        const __m512 b0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88), b1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xDD);
        v[j] = _mm512_shuffle_f32x4(a0, b0, 0x88);
        v[j + 8] = _mm512_shuffle_f32x4(a0, b0, 0xDD);
        v[j + 4] = _mm512_shuffle_f32x4(a1, b1, 0x88);
        v[j + 12] = _mm512_shuffle_f32x4(a1, b1, 0xDD);
    }
}

/* y[t][r] = v[r] lane t for t < n tokens, r < rows: a transpose, then one masked store a
 * token (rows past `rows` are never written) */
INLINE void store_tile(__m512 v[16], int rows, int n, float *y, size_t ys) {
    transpose16(v);
    const __mmask16 m = (__mmask16)((1u << rows) - 1u);
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(y + (size_t)t * ys, m, v[t]);
}

/* ====================================================================================
 * 32-element types
 * ==================================================================================== */

INLINE int bytes32(int type) {
    switch (type) {
    case ELLM_T_Q4_0: return Q4_0_BYTES;
    case ELLM_T_Q4_1: return Q4_1_BYTES;
    case ELLM_T_Q5_0: return Q5_0_BYTES;
    case ELLM_T_Q5_1: return Q5_1_BYTES;
    default: return Q8_0_BYTES;
    }
}

/* 16 bytes of nibbles -> 32 values, low nibbles first (the 32-block element order): the
 * bytes in both lanes (a broadcast load), the high lane shifted down 4 bits, one mask */
INLINE __m256i nibbles32(const uint8_t *p) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* bit j of bits -> 0x10 in byte j (the fifth bit of the Q5 values) */
INLINE __m256i fifth_bits(uint32_t bits) {
    const __mmask32 k = (__mmask32)bits;
    return _mm256_maskz_mov_epi8(k, _mm256_set1_epi8(0x10));
}

/* The block's 32 values as int8, in element order */
INLINE __m256i values32(int type, const uint8_t *b) {
    switch (type) {
    case ELLM_T_Q4_0: return nibbles32(b + 2);
    case ELLM_T_Q4_1: return nibbles32(b + 4);
    case ELLM_T_Q5_0: return _mm256_or_si256(nibbles32(b + 6), fifth_bits(ellm_rd_u32(b + 2)));
    case ELLM_T_Q5_1: return _mm256_or_si256(nibbles32(b + 8), fifth_bits(ellm_rd_u32(b + 4)));
    default: return _mm256_loadu_si256((const __m256i *)(b + 2));
    }
}

/* The constant term, as quant_x86.h's const32 forms it */
INLINE float const32(int type, float d, float m) {
    switch (type) {
    case ELLM_T_Q4_0: return -8.0f * d;
    case ELLM_T_Q5_0: return -16.0f * d;
    case ELLM_T_Q4_1:
    case ELLM_T_Q5_1: return m;
    default: return 0.0f;
    }
}

/* const32 for 16 rows at once (the same products, so the same floats) */
INLINE __m512 const32x16(int type, __m512 d, __m512 m) {
    switch (type) {
    case ELLM_T_Q4_0: return _mm512_mul_ps(_mm512_set1_ps(-8.0f), d);
    case ELLM_T_Q5_0: return _mm512_mul_ps(_mm512_set1_ps(-16.0f), d);
    case ELLM_T_Q4_1:
    case ELLM_T_Q5_1: return m;
    default: return _mm512_setzero_ps();
    }
}

/* Blocks unpacked per chunk (16 rows x 32 bytes each: 24 KiB of L1 at 48; K = 1536, the
 * widest matrix of both models here, is one chunk) */
#define A32_CHUNK 48
/* Blocks ahead of its tile load that a block's activations are asked for (calls of more
 * than A32_GROUPS groups) */
#define A32_PREFETCH 2
/* Token groups sharing one unpacking of the weights */
#define A32_GROUPS 4
/* Result buffers of the tile multiplies in flight (a block is folded one block after
 * its result is stored) */
#define A32_BUFS 4

typedef struct {
    int8_t q[A32_CHUNK][16][32] __attribute__((aligned(64)));
    float d[A32_CHUNK][16] __attribute__((aligned(64)));
    float c[A32_CHUNK][16] __attribute__((aligned(64)));
} wchunk32;

/* acc[r] (lanes = 16 tokens) += the block's term, for each of the 16 rows; isum: the
 * tile's 16 x 16 int32 (row r = weight row r) */
INLINE void fold_block32(const int32_t isum[16][16], const float *dw, __m512 dx, __m512 acc[16]) {
    _Pragma("GCC unroll 16")
    for (int r = 0; r < 16; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(isum[r])),
                                 _mm512_mul_ps(_mm512_set1_ps(dw[r]), dx), acc[r]);
}

INLINE void qgemm32_amx(int type, int64_t nb, const uint8_t *w, size_t ws, int64_t nr,
                        const uint8_t *x, size_t xs, int64_t nt, float *y, size_t ys) {
    const int bs = bytes32(type);
    const int has_c = type != ELLM_T_Q8_0;
    wchunk32 wc;
    int32_t ib[A32_BUFS][16][16] __attribute__((aligned(64)));
    __m512 acc_mem[A32_GROUPS][16], cor_mem[A32_GROUPS][16];
    const int64_t ngroups = (nt + ELLM_AMX_TG - 1) / ELLM_AMX_TG;
    /* a block's first dword holds d (and m for the _1 types) as two halves: gathered for
     * the 16 rows at once where the row offsets fit the gather's int32 indices */
    const int gather = ws <= (size_t)INT32_MAX / 16;
    load_tile_config(32);
    for (int64_t r0 = 0; r0 < nr; r0 += 16) {
        const int rows = nr - r0 < 16 ? (int)(nr - r0) : 16;
        int32_t offs[16] __attribute__((aligned(64)));
        for (int r = 0; r < 16; r++) offs[r] = gather ? (int32_t)((size_t)(r < rows ? r : rows - 1) * ws) : 0;
        const __m512i row_off = _mm512_load_si512(offs);
        /* Q8_0's values are int8 as stored: a full tile of rows is loaded straight from
         * the weights (row stride ws) rather than copied into the chunk first */
        const int direct = type == ELLM_T_Q8_0 && rows == 16;
        /* the call's next tile into L2 while this one is summed (for a batched decode step,
         * which reads its weights once, from memory) */
        const char *pf_next = NULL;
        size_t pf_bytes = 0;
        if (ngroups == 1 && r0 + 16 < nr) {
            const int64_t nrows = nr - r0 - 16 < 16 ? nr - r0 - 16 : 16;
            pf_next = (const char *)(w + (size_t)(r0 + 16) * ws);
            pf_bytes = (size_t)nrows * ws;
        }
        const size_t pf_step = nb > 0 ? (pf_bytes / (size_t)nb + 63) & ~(size_t)63 : 0;
        /* one chunk holds every block (K up to 32 x A32_CHUNK): each group is summed from
         * start to end against the one unpacking and its outputs stored at once, so every
         * token of the call shares it; more blocks: A32_GROUPS groups per unpacking, their
         * sums kept between chunks */
        const int single = nb <= A32_CHUNK;
        /* past A32_GROUPS groups the activations no longer stay in L1 from one call to the
         * next (the driver's 64-token items keep them there; prefetching those costs) */
        const int prefetch = ngroups > A32_GROUPS;
        const int64_t gstep = single ? ngroups : A32_GROUPS;
        for (int64_t g0 = 0; g0 < ngroups; g0 += gstep) {
            const int ng = ngroups - g0 < gstep ? (int)(ngroups - g0) : (int)gstep;
            for (int g = 0; g < ng && !single; g++)
                for (int r = 0; r < 16; r++) acc_mem[g][r] = cor_mem[g][r] = _mm512_setzero_ps();
            for (int64_t i0 = 0; i0 < nb; i0 += A32_CHUNK) {
                const int nc = nb - i0 < A32_CHUNK ? (int)(nb - i0) : A32_CHUNK;
                /* unpack: rows past nr repeat the last row (computed, never stored) */
                for (int ii = 0; ii < nc; ii++) {
                    const uint8_t *b0 = w + (size_t)r0 * ws + (size_t)(i0 + ii) * (size_t)bs;
                    if (gather) { /* the 16 rows' (d, m) halves in one gather */
                        const __m512i dm = _mm512_i32gather_epi32(row_off, (const void *)b0, 1);
                        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
                        const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
                        _mm512_store_ps(wc.d[ii], d);
                        _mm512_store_ps(wc.c[ii], const32x16(type, d, m));
                    }
                    for (int r = 0; r < 16 && !(gather && direct); r++) {
                        const uint8_t *b = b0 + (size_t)(r < rows ? r : rows - 1) * ws;
                        if (!gather) {
                            const float d = f16_at(b);
                            wc.d[ii][r] = d;
                            wc.c[ii][r] = const32(type, d, f16_at(b + 2));
                        }
                        if (!direct) _mm256_store_si256((__m256i *)wc.q[ii][r], values32(type, b));
                    }
                }
                /* block ii's weight tile: (16 rows, 32 bytes) at a_ptr(ii), rows a_stride apart */
                const uint8_t *a_base = direct ? w + (size_t)r0 * ws + (size_t)i0 * (size_t)bs + 2
                                               : (const uint8_t *)wc.q[0];
                const size_t a_step = direct ? (size_t)bs : sizeof wc.q[0];
                const size_t a_stride = direct ? ws : 32;
                for (int g = 0; g < ng; g++) {
                    const ellm_act32x16 *xg = (const ellm_act32x16 *)(x + (size_t)(g0 + g) * xs) + i0;
                    __m512 acc[16];
                    /* single: the sums of one group at a time, in acc_mem[0] / cor_mem[0] */
                    const int gm = single ? 0 : g;
                    _Pragma("GCC unroll 16")
                    for (int r = 0; r < 16; r++) acc[r] = single ? _mm512_setzero_ps() : acc_mem[gm][r];
                    /* software-pipelined: block ii + 1's multiply is issued before block
                     * ii's result is stored, and block ii is folded one block later, so
                     * the tile unit, the tile stores and the folds (still in block order)
                     * overlap rather than wait on one another */
                    TILE_LOAD(TA0, a_base, a_stride);
                    TILE_LOAD(TB0, xg[0].qs, 64);
                    TILE_ZERO(TC0);
                    TILE_DPBSSD(TC0, TA0, TB0);
                    for (int ii = 0; ii < nc; ii++) {
                        const int nx = ii + 1;
                        if (pf_next) { /* this block's share of the next tile's lines */
                            const size_t a0 = (size_t)(i0 + ii) * pf_step;
                            for (size_t l = a0; l < a0 + pf_step && l < pf_bytes; l += 64) _mm_prefetch(pf_next + l, _MM_HINT_T1);
                        }
                        /* then they are read from L2: ask for a block's lines a few
                         * blocks ahead of its tile load */
                        if (prefetch && ii + A32_PREFETCH < nc) {
                            const char *pf = (const char *)&xg[ii + A32_PREFETCH];
                            _Pragma("GCC unroll 10")
                            for (int l = 0; l < (int)sizeof(ellm_act32x16); l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
                        }
                        if ((ii & 1) == 0) {
                            if (nx < nc) {
                                TILE_LOAD(TA1, a_base + (size_t)nx * a_step, a_stride);
                                TILE_LOAD(TB1, xg[nx].qs, 64);
                                TILE_ZERO(TC1);
                                TILE_DPBSSD(TC1, TA1, TB1);
                            }
                            TILE_STORE(TC0, ib[ii % A32_BUFS], 64);
                        } else {
                            if (nx < nc) {
                                TILE_LOAD(TA0, a_base + (size_t)nx * a_step, a_stride);
                                TILE_LOAD(TB0, xg[nx].qs, 64);
                                TILE_ZERO(TC0);
                                TILE_DPBSSD(TC0, TA0, TB0);
                            }
                            TILE_STORE(TC1, ib[ii % A32_BUFS], 64);
                        }
                        if (ii >= 1) {
                            const int jj = ii - 1;
                            fold_block32(ib[jj % A32_BUFS], wc.d[jj], _mm512_loadu_ps(xg[jj].d), acc);
                        }
                    }
                    fold_block32(ib[(nc - 1) % A32_BUFS], wc.d[nc - 1], _mm512_loadu_ps(xg[nc - 1].d), acc);
                    _Pragma("GCC unroll 16")
                    for (int r = 0; r < 16; r++) acc_mem[gm][r] = acc[r];
                    if (has_c) {
                        __m512 cor[16];
                        _Pragma("GCC unroll 16")
                        for (int r = 0; r < 16; r++) cor[r] = single ? _mm512_setzero_ps() : cor_mem[gm][r];
                        for (int j = 0; j < nc; j++) {
                            const __m512 sx = _mm512_loadu_ps(xg[j].s);
                            _Pragma("GCC unroll 16")
                            for (int r = 0; r < 16; r++)
                                cor[r] = _mm512_fmadd_ps(_mm512_set1_ps(wc.c[j][r]), sx, cor[r]);
                        }
                        _Pragma("GCC unroll 16")
                        for (int r = 0; r < 16; r++) cor_mem[gm][r] = cor[r];
                    }
                    if (single) {
                        __m512 out[16];
                        _Pragma("GCC unroll 16")
                        for (int r = 0; r < 16; r++)
                            out[r] = has_c ? _mm512_add_ps(acc_mem[0][r], cor_mem[0][r]) : acc_mem[0][r];
                        const int64_t t0 = (g0 + g) * ELLM_AMX_TG;
                        const int n = nt - t0 < ELLM_AMX_TG ? (int)(nt - t0) : ELLM_AMX_TG;
                        store_tile(out, rows, n, y + (size_t)t0 * ys + (size_t)r0, ys);
                    }
                }
            }
            for (int g = 0; g < ng && !single; g++) {
                __m512 out[16];
                _Pragma("GCC unroll 16")
                for (int r = 0; r < 16; r++)
                    out[r] = has_c ? _mm512_add_ps(acc_mem[g][r], cor_mem[g][r]) : acc_mem[g][r];
                const int64_t t0 = (g0 + g) * ELLM_AMX_TG;
                const int n = nt - t0 < ELLM_AMX_TG ? (int)(nt - t0) : ELLM_AMX_TG;
                store_tile(out, rows, n, y + (size_t)t0 * ys + (size_t)r0, ys);
            }
        }
    }
}

#define DEFINE_QGEMM32_AMX(name, TYPE)                                                       \
    static void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,   \
                     size_t xs, int64_t nt, float *y, size_t ys) {                            \
        qgemm32_amx(TYPE, nb, w, ws, nr, x, xs, nt, y, ys);                                  \
    }

DEFINE_QGEMM32_AMX(amx_q4_0, ELLM_T_Q4_0)
DEFINE_QGEMM32_AMX(amx_q4_1, ELLM_T_Q4_1)
DEFINE_QGEMM32_AMX(amx_q5_0, ELLM_T_Q5_0)
DEFINE_QGEMM32_AMX(amx_q5_1, ELLM_T_Q5_1)
DEFINE_QGEMM32_AMX(amx_q8_0, ELLM_T_Q8_0)

/* ====================================================================================
 * The K-quants: each weight row as three int8 rows (Q5_K four) whose tile products
 * with the token's bytes give the block's integers. A value times its run's scale does not
 * fit a byte, but it does times a part of that scale:
 *   Q4_K  q in 0..15, scale sc in 0..63 = 8 sh + sl (sh, sl <= 7: q sh, q sl <= 105), and
 *         the run's min mn <= 63 in every element of the third row:
 *           isum = 8 (q sh . x) + (q sl . x) = sum_j sc[j] (q_j . x_j)
 *           msum = (mn . x)                  = sum_j mn[j] (bsum[2j] + bsum[2j + 1])
 *           acc = fma(float(isum), d d_x, acc);  acc = fma(float(msum), -dmin d_x, acc)
 *   Q5_K  q in 0..31, sc in 0..63 = s0 + 4 s1 + 16 s2 (digits 0..3: q s <= 93), and the
 *         mins' row: isum = (q s0 . x) + 4 (q s1 . x) + 16 (q s2 . x), msum and the float
 *         steps as Q4_K's (quant_x86.h sums Q5_K that way at every level)
 *   Q6_K  v = q - 32 in -32..31, scale sc in -128..127 = s0 + 8 s1 + 64 s2 with every
 *         digit in -3..4 (v s in -128..124):
 *           isum = (v s0 . x) + 8 (v s1 . x) + 64 (v s2 . x) = sum_g sc[g] ((q_g - 32) . x_g)
 *           acc = fma(float(isum), d d_x, acc)
 *   Q2_K  Q4_K's three rows: q in 0..3 times sc (0..15) = 8 sh + sl, and the mins' row (a
 *         min per 16); Q4_K's sums and float steps
 *   Q3_K  Q6_K's three rows: v = q - 4 in -4..3 times the digits of sc in -32..31; Q6_K's
 *         sums and float step
 * Those are quant_x86.h's qgemmk_tile's integers (exact in int32: each chain's sum is at
 * most 256 * 128 * 127 in size, a block's total under 2^28) and its float steps in its order, with the tokens in the
 * lanes, so AMX and the AVX-512 level agree bit for bit. A block and token group is 12
 * tile multiplies of 64 bytes in three chains sharing each activation tile, and a few
 * vector adds; until 2026-12-07 it was a tile multiply per run (8 of 32 bytes, Q6_K 16
 * of 16) and a vector multiply per run and row to scale it (128, Q6_K 256), which left
 * the tile unit idle most of the time. Llama-3.2-1B's matrices, 2 threads, two builds in
 * turn, GMAC/s at 16 / 128 / 512 tokens: Q4_K 8192x2048 165 / 281 / 300 -> 206 / 442 /
 * 470, 512x2048 136 / 253 / 268 -> 169 / 379 / 399; Q6_K 2048x8192 155 / 211 / 210 -> 161
 * / 419 / 422. (Three chains share each activation tile; two token groups sharing each
 * weight tile with the mins on the vector units instead ran 5-13% slower.)
 * ==================================================================================== */

#define A3_CHUNK 2 /* blocks unpacked per chunk: 3 x 16 rows x 256 bytes each */
/* token groups per unpacking of a chunk: all of a 512-token work item, their sums kept in
 * memory between chunks (32 KiB) */
#define A3_GROUPS 32

typedef struct {
    int8_t a[A3_CHUNK][4][16][256] __attribute__((aligned(64))); /* the rows (Q5_K four), element order */
    float d[A3_CHUNK][16], dmin[A3_CHUNK][16];                    /* d, -dmin (Q2_K, Q4_K, Q5_K) */
} wchunk3;

/* Bytes times a factor in -3..4 whose products fit a signed byte, 32 at a time: the low
 * byte of a 16-bit product is the low bytes' product; the high bytes' comes from the
 * words with their low bytes cleared */
INLINE __m256i mul_bytes(__m256i v, __m256i f16) {
    const __m256i hi = _mm256_set1_epi16((short)0xFF00);
    return _mm256_or_si256(_mm256_andnot_si256(hi, _mm256_mullo_epi16(v, f16)),
                           _mm256_mullo_epi16(_mm256_and_si256(v, hi), f16));
}

/* Bytes j0 (low 256 bits) and j1 (high) of every 64 bits of v as 16-bit words, each
 * zero-extended, by one byte shuffle: from 8 bytes broadcast, two runs' factors */
INLINE __m512i halves_epi16(int w0, int w1) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)w0), _mm256_set1_epi16((short)w1), 1);
}
INLINE __m512i words_of_bytes(__m512i v, int j0, int j1) {
    return _mm512_shuffle_epi8(v, halves_epi16(0x8000 | j0, 0x8000 | j1));
}

/* The mins' row of runs j, j + 1 (64 elements): min j in every byte of run j, from the 8
 * min bytes broadcast */
INLINE __m512i mins_of_runs(__m512i mns, int j) {
    return _mm512_shuffle_epi8(mns, _mm512_inserti64x4(_mm512_set1_epi8((char)j), _mm256_set1_epi8((char)(j + 1)), 1));
}

/* Q4_K block b of one row into the chunk: 64 bytes of qs hold runs 2c and 2c + 2 in their
 * low nibbles and 2c + 1, 2c + 3 in their high ones; their 256-bit halves are put in
 * element order ([2c | 2c + 1], [2c + 2 | 2c + 3]) and multiplied by two runs' factors at
 * once, 64 bytes a store. At 16 tokens the unpack was most of the kernel's time; against
 * the 256-bit one (the scales decoded a byte at a time, a word broadcast per run and
 * factor, 24 stores a row and block), with unpack3_q6k's likewise: the 1B shape's Q4_K
 * 8192x2048 at 16 tokens 226 -> 255 GMAC/s and Q6_K 2048x8192 178 -> 245 (2 threads);
 * that file's batched decode of 16 sequences 134 -> 168 tok/s, of 64 221 -> 264, its
 * prefill@512 446 -> 477 (medians of 3 alternated rounds, Xeon, load ~2). Same rows. */
INLINE void unpack3_q4k(const uint8_t *b, wchunk3 *wc, int ii, int r) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    uint64_t sc8, mn8;
    ellm_k4_scale_words(b + 4, &sc8, &mn8);
    const __m512i hi3 = _mm512_set1_epi64((long long)((sc8 >> 3) & 0x0707070707070707ull));
    const __m512i lo3 = _mm512_set1_epi64((long long)(sc8 & 0x0707070707070707ull));
    const __m512i mns = _mm512_set1_epi64((long long)mn8);
    wc->d[ii][r] = f16_at(b);
    wc->dmin[ii][r] = -f16_at(b + 2);
    int8_t *h = wc->a[ii][0][r], *l = wc->a[ii][1][r], *m = wc->a[ii][2][r];
    _Pragma("GCC unroll 2")
    for (int c = 0; c < 4; c += 2) {
        const __m512i q = _mm512_loadu_si512((const void *)(b + 16 + 32 * c));
        const __m512i q0 = _mm512_and_si512(q, lo4), q1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo4);
        const __m512i v[2] = {_mm512_shuffle_i64x2(q0, q1, 0x44), _mm512_shuffle_i64x2(q0, q1, 0xEE)};
        _Pragma("GCC unroll 2")
        for (int k = 0; k < 2; k++) { /* runs 2c + 2k, 2c + 2k + 1: elements 64 (c + k) on */
            const int j = 2 * c + 2 * k, at = 64 * (c + k);
            /* values 0..15 times factors 0..7: no 16-bit product carries into the high byte */
            _mm512_store_si512((void *)(h + at), _mm512_mullo_epi16(v[k], words_of_bytes(hi3, j, j + 1)));
            _mm512_store_si512((void *)(l + at), _mm512_mullo_epi16(v[k], words_of_bytes(lo3, j, j + 1)));
            _mm512_store_si512((void *)(m + at), mins_of_runs(mns, j));
        }
    }
}

/* 16 signed scales (-128..127) -> their digits sc = d0 + 8 d1 + 64 d2, each in -3..4, as
 * 16 words each */
INLINE void scale_digit_words(const int8_t sc[16], __m256i d[3]) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    const __m256i three = _mm256_set1_epi16(3), seven = _mm256_set1_epi16(7);
    d[0] = _mm256_sub_epi16(_mm256_and_si256(_mm256_add_epi16(sc16, three), seven), three);
    const __m256i t1 = _mm256_srai_epi16(_mm256_sub_epi16(sc16, d[0]), 3);
    d[1] = _mm256_sub_epi16(_mm256_and_si256(_mm256_add_epi16(t1, three), seven), three);
    d[2] = _mm256_srai_epi16(_mm256_sub_epi16(t1, d[1]), 3);
}
INLINE void scale_digits8(const int8_t sc[16], int16_t dig[3][16]) {
    __m256i d[3];
    scale_digit_words(sc, d);
    for (int k = 0; k < 3; k++) _mm256_storeu_si256((__m256i *)dig[k], d[k]);
}

/* mul_bytes at 512 bits */
INLINE __m512i mul_bytes512(__m512i v, __m512i f16) {
    const __m512i hi = _mm512_set1_epi16((short)0xFF00);
    return _mm512_or_si512(_mm512_andnot_si512(hi, _mm512_mullo_epi16(v, f16)),
                           _mm512_mullo_epi16(_mm512_and_si512(v, hi), f16));
}

/* Q6_K block b of one row into the chunk, 64 elements (four groups of 16, one 128-bit lane
 * each) a register: a half's ql (64 bytes) holds elements 0..63 of the half in its low
 * nibbles and 64..127 in its high ones, their top two bits in qh at shifts 0, 2 (low)
 * and 4, 6 (high), for the register's two 32-element runs in turn; each lane's factor is
 * its group's digit, picked from the 16 digit words by one word permute */
INLINE void unpack3_q6k(const uint8_t *b, wchunk3 *wc, int ii, int r) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F), top2 = _mm512_set1_epi8(0x30), off = _mm512_set1_epi8(32);
    __m256i dg[3];
    scale_digit_words((const int8_t *)(b + 192), dg);
    wc->d[ii][r] = f16_at(b + 208);
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; h++) {
        const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h));
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)));
        /* runs 0, 1 of the half: qh bits 0-1 and 2-3 moved to 0x30; runs 2, 3: bits 4-5, 6-7 */
        const __m512i z[2] = {
            _mm512_or_si512(_mm512_and_si512(ql, lo4),
                            _mm512_and_si512(_mm512_sllv_epi16(qh, halves_epi16(4, 2)), top2)),
            _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4),
                            _mm512_and_si512(_mm512_srlv_epi16(qh, halves_epi16(0, 2)), top2))};
        _Pragma("GCC unroll 2")
        for (int p = 0; p < 2; p++) { /* elements 128 h + 64 p on: groups g .. g + 3 */
            const __m512i v = _mm512_sub_epi8(z[p], off);
            const int g = 8 * h + 4 * p;
            const __m512i idx = _mm512_set_epi16(g + 3, g + 3, g + 3, g + 3, g + 3, g + 3, g + 3, g + 3,
                                                 g + 2, g + 2, g + 2, g + 2, g + 2, g + 2, g + 2, g + 2,
                                                 g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1,
                                                 g, g, g, g, g, g, g, g);
            _Pragma("GCC unroll 3")
            for (int k = 0; k < 3; k++)
                _mm512_store_si512((void *)(wc->a[ii][k][r] + 128 * h + 64 * p),
                                   mul_bytes512(v, _mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(dg[k]))));
        }
    }
}

/* Q2_K block b of one row into the chunk, in Q4_K's three rows: q (0..3) times the scale's
 * (0..15) two 3-bit halves, and the mins' row (a min per 16 values) */
INLINE void unpack3_q2k(const uint8_t *b, wchunk3 *wc, int ii, int r) {
    const __m256i three = _mm256_set1_epi8(3);
    wc->d[ii][r] = f16_at(b + 80);
    wc->dmin[ii][r] = -f16_at(b + 82);
    int8_t *h = wc->a[ii][0][r], *l = wc->a[ii][1][r], *m = wc->a[ii][2][r];
    for (int half = 0; half < 2; half++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * half));
        for (int s = 0; s < 4; s++) {
            /* elements 128 half + 32 s on: groups g (the low 16 bytes) and g + 1 */
            const __m256i q = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * s), three);
            const int g = 8 * half + 2 * s, at = 128 * half + 32 * s;
            const int s0 = b[g] & 15, s1 = b[g + 1] & 15;
            /* values 0..3 times factors 0..7: no 16-bit product carries into the high byte */
            const __m256i fh = _mm256_set_m128i(_mm_set1_epi16((short)(s1 >> 3)), _mm_set1_epi16((short)(s0 >> 3)));
            const __m256i fl = _mm256_set_m128i(_mm_set1_epi16((short)(s1 & 7)), _mm_set1_epi16((short)(s0 & 7)));
            _mm256_store_si256((__m256i *)(h + at), _mm256_mullo_epi16(q, fh));
            _mm256_store_si256((__m256i *)(l + at), _mm256_mullo_epi16(q, fl));
            _mm256_store_si256((__m256i *)(m + at),
                               _mm256_set_m128i(_mm_set1_epi8((char)(b[g + 1] >> 4)), _mm_set1_epi8((char)(b[g] >> 4))));
        }
    }
}

/* Q3_K block b of one row into the chunk, in Q6_K's three rows: v = q - 4 (-4..3) times
 * the signed scale's (-32..31) three base-8 digits in -3..4 */
INLINE void unpack3_q3k(const uint8_t *b, wchunk3 *wc, int ii, int r) {
    const __m256i three8 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    int8_t sc8[16];
    int16_t dig[3][16] __attribute__((aligned(32)));
    ellm_unpack_q3k_scales(b + 96, sc8);
    scale_digits8(sc8, dig);
    wc->d[ii][r] = f16_at(b + 108);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    for (int half = 0; half < 2; half++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * half));
        for (int s = 0; s < 4; s++) {
            /* as quant_x86.h's qdot_k23: the third bit from hmask, set -> +4 */
            const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * half + s)));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
            const __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qv, 2 * s), three8),
                                              _mm256_and_si256(set, four));
            const __m256i v = _mm256_sub_epi8(q, four);
            const int g = 8 * half + 2 * s;
            for (int k = 0; k < 3; k++) {
                const __m256i f = _mm256_set_m128i(_mm_set1_epi16(dig[k][g + 1]), _mm_set1_epi16(dig[k][g]));
                _mm256_store_si256((__m256i *)(wc->a[ii][k][r] + 128 * half + 32 * s), mul_bytes(v, f));
            }
        }
    }
}

/* qh's bits k0 (low 256 bits) and k1 (high) of each byte at bit 4 (0x10) of the byte (k0,
 * k1 both at most 4, or both at least 4): the 16-bit shifts only move bits across bytes
 * below bit 4 (left) or above it (right), which the mask drops */
INLINE __m512i bits_at_0x10_512(__m512i qh, int k0, int k1) {
    const __m512i v = k1 <= 4 ? _mm512_sllv_epi16(qh, halves_epi16(4 - k0, 4 - k1))
                              : _mm512_srlv_epi16(qh, halves_epi16(k0 - 4, k1 - 4));
    return _mm512_and_si512(v, _mm512_set1_epi8(0x10));
}

/* Q5_K block b of one row into the chunk: q (0..31) times the scale's three base-4 digits
 * (q d <= 93), and the mins' row; the runs as unpack3_q4k takes them, each with its fifth
 * bit (bit j of qh's byte l for element l of run j). (One function for both types, the
 * digits in a loop, ran Q4_K's 16-token products ~5% slower: 287 -> 273 GMAC/s.) Against the 256-bit unpack: the 1B
 * shape's Q5_K 8192x2048 at 16 tokens 181-186 -> 210-227 GMAC/s (2 threads); that
 * Q5_K_M file's batched decode of 16 sequences 131-133 -> 144-155 tok/s (two alternated
 * rounds, Xeon). */
INLINE void unpack4_q5k(const uint8_t *b, wchunk3 *wc, int ii, int r) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    uint64_t sc8, mn8;
    ellm_k4_scale_words(b + 4, &sc8, &mn8);
    __m512i dig[3];
    for (int k = 0; k < 3; k++) dig[k] = _mm512_set1_epi64((long long)((sc8 >> (2 * k)) & 0x0303030303030303ull));
    const __m512i mns = _mm512_set1_epi64((long long)mn8);
    wc->d[ii][r] = f16_at(b);
    wc->dmin[ii][r] = -f16_at(b + 2);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
    _Pragma("GCC unroll 2")
    for (int c = 0; c < 4; c += 2) {
        const __m512i q = _mm512_loadu_si512((const void *)(b + 48 + 32 * c));
        const __m512i q0 = _mm512_or_si512(_mm512_and_si512(q, lo4), bits_at_0x10_512(qh, 2 * c, 2 * c + 2));
        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), lo4),
                                           bits_at_0x10_512(qh, 2 * c + 1, 2 * c + 3));
        const __m512i v[2] = {_mm512_shuffle_i64x2(q0, q1, 0x44), _mm512_shuffle_i64x2(q0, q1, 0xEE)};
        _Pragma("GCC unroll 2")
        for (int k2 = 0; k2 < 2; k2++) {
            const int j = 2 * c + 2 * k2, at = 64 * (c + k2);
            /* values 0..31 times digits 0..3: no 16-bit product carries into the high byte */
            for (int k = 0; k < 3; k++)
                _mm512_store_si512((void *)(wc->a[ii][k][r] + at),
                                   _mm512_mullo_epi16(v[k2], words_of_bytes(dig[k], j, j + 1)));
            _mm512_store_si512((void *)(wc->a[ii][3][r] + at), mins_of_runs(mns, j));
        }
    }
}

/* Asks for the weights of the chunk after [r0, +16) x [i0, +chunk) into L2 -- the next
 * blocks of the same rows, or the next row tile's first -- while this one multiplies.
 * Sixteen rows a row's bytes apart are sixteen short streams, which the hardware
 * prefetcher picks up late; a call whose weights come from memory (a mixture of experts'
 * expert, read once per pass for a few dozen tokens) waited on each chunk's loads.
 * Qwen3-30B-A3B's Q4_K experts at 32 tokens each (512 tokens routed evenly), 2 threads,
 * alternated in one process: 158.4 -> 151.5 ms a layer; Llama-3.2-1B Q4_K_M prefill@512
 * 254.7 -> 257.6 tok/s (within the noise). Measured with the kernel before qgemm3_amx,
 * which took a run at a time. */
INLINE void prefetch_next_chunk(const uint8_t *w, size_t ws, int bs, int chunk, int64_t nb, int64_t nr,
                                int64_t r0, int64_t i0) {
    int64_t n0 = r0, b0 = i0 + chunk;
    if (b0 >= nb) {
        n0 = r0 + 16;
        b0 = 0;
    }
    if (n0 >= nr) return;
    const int64_t rows = nr - n0 < 16 ? nr - n0 : 16;
    const size_t bytes = (size_t)((nb - b0 < chunk ? nb - b0 : chunk) * bs);
    for (int64_t r = 0; r < rows; r++) {
        const char *p = (const char *)(w + (size_t)(n0 + r) * ws + (size_t)b0 * (size_t)bs);
        for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
    }
}

/* The tiles at K = 64 (every one 16 x 64 bytes): the three weight rows' A tiles, two
 * activation tiles taken in turn, the three sums */
#define T3_A0 0
#define T3_X0 1
#define T3_C0 2
#define T3_A1 3
#define T3_X1 4
#define T3_C1 5
#define T3_A2 6
#define T3_C2 7
/* One chain's step: its weights' 64 bytes of K into tile A, multiplied by the activation
 * tile X into its sum C */
#define CHAIN(A, C, X, wp, kk)                                            \
    do {                                                                  \
        TILE_LOAD(A, (wp) + 64 * (kk), 256);                              \
        TILE_DPBSSD(C, A, X);                                             \
    } while (0)
/* Step kk of 4 (64 bytes of K) of one block: the activations' tile into X, then each
 * chain's step */
#define A3_STEP(X, kk)                                                    \
    do {                                                                  \
        TILE_LOAD(X, xq + 1024 * (kk), 64);                               \
        CHAIN(T3_A0, T3_C0, X, w0, kk);                                   \
        CHAIN(T3_A1, T3_C1, X, w1, kk);                                   \
        CHAIN(T3_A2, T3_C2, X, w2, kk);                                   \
    } while (0)

/* acc[r] (lanes = 16 tokens) += block ii's term for each of the 16 rows, from the chains'
 * sums in ib and the block's activation scales dx */
INLINE void fold3(int type, const int32_t ib[4][16][16], const wchunk3 *wc, int ii, __m512 dx, __m512 acc[16]) {
    _Pragma("GCC unroll 4")
    for (int r = 0; r < 16; r++) {
        const __m512i c0 = _mm512_load_si512(ib[0][r]), c1 = _mm512_load_si512(ib[1][r]);
        const __m512i c2 = _mm512_load_si512(ib[2][r]);
        const __m512 ddx = _mm512_mul_ps(_mm512_set1_ps(wc->d[ii][r]), dx);
        if (type == ELLM_T_Q6_K || type == ELLM_T_Q3_K) {
            const __m512i isum = _mm512_add_epi32(c0, _mm512_add_epi32(_mm512_slli_epi32(c1, 3), _mm512_slli_epi32(c2, 6)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ddx, acc[r]);
            continue;
        }
        __m512i isum, msum;
        if (type == ELLM_T_Q4_K || type == ELLM_T_Q2_K) {
            isum = _mm512_add_epi32(_mm512_slli_epi32(c0, 3), c1);
            msum = c2;
        } else { /* Q5_K */
            isum = _mm512_add_epi32(c0, _mm512_add_epi32(_mm512_slli_epi32(c1, 2), _mm512_slli_epi32(c2, 4)));
            msum = _mm512_load_si512(ib[3][r]);
        }
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), ddx, acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(_mm512_set1_ps(wc->dmin[ii][r]), dx), acc[r]);
    }
}

/* Q5_K's four chains: the tiles as A3_STEP's but the A tiles taken in turn, the last sum
 * in the third A's place */
#define T4_C2 6
#define T4_C3 7
#define A4_STEP(X, kk)                                                    \
    do {                                                                  \
        TILE_LOAD(X, xq + 1024 * (kk), 64);                               \
        CHAIN(T3_A0, T3_C0, X, w0, kk);                                   \
        CHAIN(T3_A1, T3_C1, X, w1, kk);                                   \
        CHAIN(T3_A0, T4_C2, X, w2, kk);                                   \
        CHAIN(T3_A1, T4_C3, X, w3, kk);                                   \
    } while (0)

INLINE void qgemm3_amx(int type, int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,
                       size_t xs, int64_t nt, float *y, size_t ys) {
    const int bs = type == ELLM_T_Q2_K   ? Q2_K_BYTES
                   : type == ELLM_T_Q3_K ? Q3_K_BYTES
                   : type == ELLM_T_Q4_K ? Q4_K_BYTES
                   : type == ELLM_T_Q5_K ? Q5_K_BYTES
                                         : Q6_K_BYTES;
    wchunk3 wc;
    int32_t ib[4][16][16] __attribute__((aligned(64)));
    __m512 acc_mem[A3_GROUPS][16];
    const int64_t ngroups = (nt + ELLM_AMX_TG - 1) / ELLM_AMX_TG;
    /* a few groups' activations stay in L1 from one call to the next; more come from L2 */
    const int prefetch = ngroups > A32_GROUPS;
    load_tile_config(64);
    for (int64_t r0 = 0; r0 < nr; r0 += 16) {
        const int rows = nr - r0 < 16 ? (int)(nr - r0) : 16;
        for (int64_t g0 = 0; g0 < ngroups; g0 += A3_GROUPS) {
            const int ng = ngroups - g0 < A3_GROUPS ? (int)(ngroups - g0) : A3_GROUPS;
            for (int g = 0; g < ng; g++)
                for (int r = 0; r < 16; r++) acc_mem[g][r] = _mm512_setzero_ps();
            for (int64_t i0 = 0; i0 < nb; i0 += A3_CHUNK) {
                const int nc = nb - i0 < A3_CHUNK ? (int)(nb - i0) : A3_CHUNK;
                for (int ii = 0; ii < nc; ii++)
                    for (int r = 0; r < 16; r++) { /* rows past nr repeat the last (never stored) */
                        const uint8_t *b =
                            w + (size_t)(r0 + (r < rows ? r : rows - 1)) * ws + (size_t)(i0 + ii) * (size_t)bs;
                        if (type == ELLM_T_Q4_K) unpack3_q4k(b, &wc, ii, r);
                        else if (type == ELLM_T_Q5_K) unpack4_q5k(b, &wc, ii, r);
                        else if (type == ELLM_T_Q2_K) unpack3_q2k(b, &wc, ii, r);
                        else if (type == ELLM_T_Q3_K) unpack3_q3k(b, &wc, ii, r);
                        else unpack3_q6k(b, &wc, ii, r);
                    }
                prefetch_next_chunk(w, ws, bs, A3_CHUNK, nb, nr, r0, i0);
                for (int g = 0; g < ng; g++) {
                    const ellm_act256x16 *xg = (const ellm_act256x16 *)(x + (size_t)(g0 + g) * xs) + i0;
                    for (int ii = 0; ii < nc; ii++) {
                        /* the next block of this group (or the next group's first), from
                         * L2, asked for while this one multiplies */
                        const ellm_act256x16 *nx =
                            ii + 1 < nc  ? xg + ii + 1
                            : g + 1 < ng ? (const ellm_act256x16 *)(x + (size_t)(g0 + g + 1) * xs) + i0
                                         : NULL;
                        if (nx && prefetch) {
                            for (size_t l = 0; l < sizeof nx->qs; l += 64)
                                _mm_prefetch((const char *)nx->qs + l, _MM_HINT_T0);
                            _mm_prefetch((const char *)nx->d, _MM_HINT_T0);
                        }
                        const int8_t *xq = xg[ii].qs;
                        const int8_t *w0 = wc.a[ii][0][0], *w1 = wc.a[ii][1][0], *w2 = wc.a[ii][2][0];
                        TILE_ZERO(T3_C0);
                        TILE_ZERO(T3_C1);
                        if (type == ELLM_T_Q5_K) {
                            const int8_t *w3 = wc.a[ii][3][0];
                            TILE_ZERO(T4_C2);
                            TILE_ZERO(T4_C3);
                            A4_STEP(T3_X0, 0);
                            A4_STEP(T3_X1, 1);
                            A4_STEP(T3_X0, 2);
                            A4_STEP(T3_X1, 3);
                            TILE_STORE(T4_C2, ib[2], 64);
                            TILE_STORE(T4_C3, ib[3], 64);
                        } else {
                            TILE_ZERO(T3_C2);
                            A3_STEP(T3_X0, 0);
                            A3_STEP(T3_X1, 1);
                            A3_STEP(T3_X0, 2);
                            A3_STEP(T3_X1, 3);
                            TILE_STORE(T3_C2, ib[2], 64);
                        }
                        TILE_STORE(T3_C0, ib[0], 64);
                        TILE_STORE(T3_C1, ib[1], 64);
                        fold3(type, ib, &wc, ii, _mm512_loadu_ps(xg[ii].d), acc_mem[g]);
                    }
                }
            }
            for (int g = 0; g < ng; g++) {
                const int64_t t0 = (g0 + g) * ELLM_AMX_TG;
                const int n = nt - t0 < ELLM_AMX_TG ? (int)(nt - t0) : ELLM_AMX_TG;
                store_tile(acc_mem[g], rows, n, y + (size_t)t0 * ys + (size_t)r0, ys);
            }
        }
    }
}

#define DEFINE_AMX_K(name, TYPE)                                                                   \
    static void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x, size_t xs, \
                     int64_t nt, float *y, size_t ys) {                                             \
        qgemm3_amx(TYPE, nb, w, ws, nr, x, xs, nt, y, ys);                                          \
    }
DEFINE_AMX_K(amx_q2_k, ELLM_T_Q2_K)
DEFINE_AMX_K(amx_q3_k, ELLM_T_Q3_K)
DEFINE_AMX_K(amx_q4_k, ELLM_T_Q4_K)
DEFINE_AMX_K(amx_q5_k, ELLM_T_Q5_K)
DEFINE_AMX_K(amx_q6_k, ELLM_T_Q6_K)

ellm_qgemm_fn ellm_qgemm_amx(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return amx_q4_0;
    case ELLM_T_Q4_1: return amx_q4_1;
    case ELLM_T_Q5_0: return amx_q5_0;
    case ELLM_T_Q5_1: return amx_q5_1;
    case ELLM_T_Q8_0: return amx_q8_0;
    case ELLM_T_Q2_K: return amx_q2_k;
    case ELLM_T_Q3_K: return amx_q3_k;
    case ELLM_T_Q4_K: return amx_q4_k;
    case ELLM_T_Q5_K: return amx_q5_k;
    case ELLM_T_Q6_K: return amx_q6_k;
    default: return NULL;
    }
}

#endif /* __x86_64__ */
