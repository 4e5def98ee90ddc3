/* Internals shared by quant*.c and matmul*.c: the 8-bit activation blocks, the dot
 * kernel signature, byte offsets inside each GGML block, and the per-level kernel
 * tables. Not part of the public API. */
#ifndef ELLM_QUANT_IMPL_H
#define ELLM_QUANT_IMPL_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "convert.h"
#include "quant.h"

/* ------------------------------------------------------------------------------------
 * Activation blocks: X quantized once per linear call to 8 bits, so the weight blocks
 * can be multiplied with integer dot products.
 *   act32  pairs with the 32-element types (Q4_0 .. Q8_0): scale d and s = d * sum(qs),
 *          which folds the constant offset / min of Q4_0, Q4_1, Q5_0, Q5_1 into one FMA.
 *   act256 pairs with the K-quants: one scale per 256 and the sum of every 16 values.
 * Values are rounded to nearest in [-127, 127] (symmetric, so negating one never
 * overflows an int8: the AVX2 sign trick relies on that).
 * ------------------------------------------------------------------------------------ */
typedef struct {
    float d;        /* scale: x ~= d * qs */
    float s;        /* d * sum(qs) */
    int8_t qs[32];
} ellm_act32;

typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16]; /* sum of qs[16 i .. 16 i + 15] */
} ellm_act256;

_Static_assert(sizeof(ellm_act32) == 40, "act32 layout");
_Static_assert(sizeof(ellm_act256) == 292, "act256 layout");

/* Quantizes (k,) f32 into k/32 act32 blocks or k/256 act256 blocks. */
typedef void (*ellm_act_fn)(const float *x, int64_t k, void *out);

/* Batch invariance. Every kernel below computes each output y[t][r] = dot(w_r, x_t) by
 * one fixed sequence of float operations that depends only on w_r, x_t and the SIMD
 * level -- never on how many rows or tokens the call holds, nor where in the call they
 * sit. So a token's outputs are bit-identical whether it is decoded alone (T = 1),
 * prefilled with 511 others, batched with other sequences, or run on any thread count.
 * Register tiles may hold several rows or tokens to share loads, but each (row, token)
 * pair keeps its own accumulators and the same step order (the same grouping of blocks
 * or k-steps, the same final reduction). In the SIMD kernels, which GCC builds with FMA
 * enabled, every multiply-add is spelled out as fmaf / an FMA intrinsic or kept apart,
 * so contraction cannot differ between tile shapes; the scalar kernels run one code path
 * per row and token whatever the shape. Activations are quantized per row, the same way
 * in every call. */

/* Quantized weights: a block of nr weight rows times nt activation rows (any nr, nt >= 1):
 *   w:  (nr, w_stride bytes) rows of nb blocks of the weight type
 *   x:  (nt, x_stride bytes) activation rows (act32 / act256 blocks)
 *   y:  y[t * y_stride + r] = dot(w_r, x_t) */
typedef void (*ellm_qdot_fn)(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr,
                             const uint8_t *x, size_t x_stride, int64_t nt, float *y,
                             size_t y_stride);

/* Many tokens (prefill, large decode batches; FEW_TOKENS in matmul.c), 32-element
 * types: activations in groups of ELLM_TG tokens, a block of every token of the group
 * side by side, so that one vector holds the same 4 values of 8 tokens (and one load the
 * 8 tokens' scales). Each token's d, s and qs are exactly its act32 block's; padding
 * tokens of a last, short group are 0. */
#define ELLM_TG 8
typedef struct {
    int8_t qs[32 * ELLM_TG]; /* qs[4 (ELLM_TG m + t) + j] = token t's qs[4 m + j] */
    float d[ELLM_TG];
    float s[ELLM_TG];
} ellm_act32x8;
_Static_assert(sizeof(ellm_act32x8) == 320, "act32x8 layout");

/* The K-quants' act256 blocks in the same group layout (the Q4_K, Q5_K and Q6_K kernels),
 * with the per-16 sums in pairs so that one madd applies two per-16 factors to 8 tokens */
typedef struct {
    int8_t qs[256 * ELLM_TG];      /* qs[4 (ELLM_TG m + t) + j] = token t's qs[4 m + j] */
    int16_t bsums[8][ELLM_TG][2];  /* [k][t] = token t's bsums[2 k], bsums[2 k + 1] */
    float d[ELLM_TG];
} ellm_act256x8;
_Static_assert(sizeof(ellm_act256x8) == 2336, "act256x8 layout");

/* As ellm_qdot_fn, with x in the group layout: (ceil(nt / ELLM_TG), x_stride bytes)
 * groups, each nb ellm_act32x8 (or ellm_act256x8) blocks, token 0 of x first in
 * group 0. Each output is summed exactly as the qdot kernel of the same type sums it. */
typedef ellm_qdot_fn ellm_qgemm_fn;

/* Float weights (f32, f16 or bf16 bits, converted in registers): a block of nr weight
 * rows times nt f32 activation rows, each kernel blocking it in registers its own way
 * (and summing each output in the one order above).
 *   w:  (nr, w_stride bytes), each row k elements
 *   x:  (nt, x_stride floats)
 *   y:  y[t * y_stride + r] = dot(w_r, x_t) */
typedef void (*ellm_fmm_fn)(int64_t k, const uint8_t *w, size_t w_stride, int64_t nr,
                            const float *x, size_t x_stride, int64_t nt, float *y,
                            size_t y_stride);

/* ------------------------------------------------------------------------------------
 * Block byte offsets (GGML layouts). Fields are read with memcpy: rows may sit at any
 * byte address, and a misaligned uint16_t* dereference is undefined behaviour.
 * ------------------------------------------------------------------------------------ */
#define QK32 32
#define QK256 256
#define Q4_0_BYTES 18  /* d f16 | qs[16] */
#define Q4_1_BYTES 20  /* d f16 | m f16 | qs[16] */
#define Q5_0_BYTES 22  /* d f16 | qh u32 | qs[16] */
#define Q5_1_BYTES 24  /* d f16 | m f16 | qh u32 | qs[16] */
#define Q8_0_BYTES 34  /* d f16 | qs[32] int8 */
#define Q2_K_BYTES 84  /* scales[16] | qs[64] | d f16 | dmin f16 */
#define Q3_K_BYTES 110 /* hmask[32] | qs[64] | scales[12] | d f16 */
#define Q4_K_BYTES 144 /* d f16 | dmin f16 | scales[12] | qs[128] */
#define Q5_K_BYTES 176 /* d f16 | dmin f16 | scales[12] | qh[32] | qs[128] */
#define Q6_K_BYTES 210 /* ql[128] | qh[64] | scales[16] int8 | d f16 */

static inline uint16_t ellm_rd_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline uint32_t ellm_rd_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static inline float ellm_rd_f16(const uint8_t *p) { return ellm_f16_to_f32(ellm_rd_u16(p)); }

/* Q4_K / Q5_K: 8 six-bit scales and 8 six-bit mins packed into 12 bytes. */
static inline void ellm_unpack_k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 0x0F) | ((s[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* The same, a word at a time: scale j in byte j of *sc8, min j in byte j of *mn8
 *   sc0..3 = A & 63    sc4..7 = (C & 15) | (A >> 6) << 4
 *   mn0..3 = B & 63    mn4..7 = (C >> 4) | (B >> 6) << 4     (bytewise, A B C the 3 words) */
static inline void ellm_k4_scale_words(const uint8_t *s, uint64_t *sc8, uint64_t *mn8) {
    const uint32_t a = ellm_rd_u32(s), b = ellm_rd_u32(s + 4), c = ellm_rd_u32(s + 8);
    const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    *sc8 = ((uint64_t)sc_hi << 32) | sc_lo;
    *mn8 = ((uint64_t)mn_hi << 32) | mn_lo;
}

/* Q3_K: 16 six-bit signed scales (stored +32) packed into 12 bytes. */
static inline void ellm_unpack_q3k_scales(const uint8_t *s, int8_t sc[16]) {
    for (int i = 0; i < 16; i++) {
        int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
        int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
        sc[i] = (int8_t)((lo | (hi << 4)) - 32);
    }
}

/* ------------------------------------------------------------------------------------
 * Kernel tables. Indexing by GGML type id; NULL where a level has no variant (the
 * caller then takes the scalar one). The *_avx2 / *_avx512 getters exist only on x86.
 * ------------------------------------------------------------------------------------ */
#define ELLM_NTYPES 31

/* Which activation format a weight type pairs with: 32, 256, or 0 for float types. */
int ellm_act_block(int qtype);
/* Bytes of one activation row of k elements for qtype (0 for float types). */
size_t ellm_act_row_bytes(int qtype, int64_t k);

ellm_qdot_fn ellm_qdot_scalar(int qtype);
ellm_fmm_fn ellm_fmm_scalar(int qtype);
void ellm_act32_scalar(const float *x, int64_t k, void *out);
void ellm_act256_scalar(const float *x, int64_t k, void *out);

#if defined(__x86_64__) || defined(__i386__)
#define ELLM_HAVE_X86_KERNELS 1
ellm_qdot_fn ellm_qdot_avx2(int qtype);
ellm_fmm_fn ellm_fmm_avx2(int qtype);
void ellm_act32_avx2(const float *x, int64_t k, void *out);
void ellm_act256_avx2(const float *x, int64_t k, void *out);
ellm_qdot_fn ellm_qdot_avx512(int qtype, int vnni);
ellm_qdot_fn ellm_qdot_stream_avx2(int qtype);
ellm_qdot_fn ellm_qdot_stream_avx512(int qtype, int vnni);
ellm_qgemm_fn ellm_qgemm_avx2(int qtype);
ellm_qgemm_fn ellm_qgemm_avx512(int qtype, int vnni);
ellm_fmm_fn ellm_fmm_avx512(int qtype);
#endif
#if defined(__aarch64__)
#define ELLM_HAVE_NEON_KERNELS 1
/* quant_neon.c (plain NEON), quant_neon_dotprod.c (SDOT): NULL where none */
ellm_qdot_fn ellm_qdot_neon(int qtype);
ellm_qdot_fn ellm_qdot_neon_dotprod(int qtype);
/* quant_neon_i8mm.c: SMMLA kernels where there are some, else its SDOT ones */
ellm_qdot_fn ellm_qdot_neon_i8mm_select(int qtype);
#endif
/* 1 when the CPU has AVX512-VNNI (vpdpbusd), checked apart from the AVX-512 level;
 * always 0 off x86. */
int ellm_cpu_has_vnni(void);

/* The kernels in force at the current SIMD level (falling back level by level). */
ellm_qdot_fn ellm_qdot_select(int qtype);
ellm_fmm_fn ellm_fmm_select(int qtype);
ellm_act_fn ellm_act_select(int qtype);
/* A qdot kernel with the same results as ellm_qdot_select's that reads one row at a
 * time (for weights streamed from DRAM), or NULL where there is no such variant. */
ellm_qdot_fn ellm_qdot_stream_select(int qtype);
/* The kernel in force for many tokens, or NULL (then the qdot kernel serves every T). */
ellm_qgemm_fn ellm_qgemm_select(int qtype);

#endif
