/* The NEON integer dot kernels (aarch64), written once and compiled three times: by
 * quant_neon.c with plain NEON (SMULL / SMLAL2 into int16 pairs, SADALP into int32), by
 * quant_neon_dotprod.c with SDOT (Armv8.2 dotprod), and by quant_neon_i8mm.c (SDOT here,
 * SMMLA in its own 32-element kernels). dispatch.c says which the CPU runs.
 *
 * The includer defines NEON_SFX (the name suffix) and, for SDOT, NEON_SDOT 1.
 *
 * Every output of the 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) is summed as the
 * x86 kernels sum it (quant_x86.h), block by block in block order:
 *     isum = q . x_q                            (the block's exact integer dot)
 *     acc  = fma(float(isum), d * d_x, acc)     cor = fma(c, s_x, cor)
 *     y    = acc + cor                          (Q8_0: y = acc)
 * with c = -8 d (Q4_0), m (Q4_1), -16 d (Q5_0), m (Q5_1). float(isum) is exact, so how
 * the integer dot is formed never shows: plain NEON and SDOT give the same bits, and
 * each output depends on its row and token only (batch invariance, quant_impl.h). The
 * multiply-adds are spelled out (vfmas / fmaf), so contraction cannot differ.
 * The values are small enough for int16 pair sums: |2 * 128 * 127| < 32768. */
#ifndef ELLM_QUANT_NEON_H
#define ELLM_QUANT_NEON_H
#include <arm_neon.h>
#include <math.h>

#include "quant_impl.h"

#define NEON_INLINE static inline __attribute__((always_inline))
#define NEON_CAT2(a, b) a##b
#define NEON_CAT(a, b) NEON_CAT2(a, b)
#define NEON_NAME(n) NEON_CAT(n, NEON_SFX)

/* The exact dot of 32 signed bytes (w0 w1) with 32 signed bytes (x0 x1). */
NEON_INLINE int32_t dot32(int8x16_t w0, int8x16_t w1, int8x16_t x0, int8x16_t x1) {
#if NEON_SDOT
    int32x4_t acc = vdotq_s32(vdupq_n_s32(0), w0, x0);
    acc = vdotq_s32(acc, w1, x1);
#else
    int16x8_t p0 = vmull_s8(vget_low_s8(w0), vget_low_s8(x0));
    p0 = vmlal_high_s8(p0, w0, x0);
    int16x8_t p1 = vmull_s8(vget_low_s8(w1), vget_low_s8(x1));
    p1 = vmlal_high_s8(p1, w1, x1);
    int32x4_t acc = vpaddlq_s16(p0);
    acc = vpadalq_s16(acc, p1);
#endif
    return vaddvq_s32(acc);
}

/* 16 bits -> 16 bytes, byte j = 0x10 where bit j is set (the fifth bit of Q5 values) */
NEON_INLINE uint8x16_t bits16_to_0x10(uint32_t bits) {
    static const uint8_t sel[8] = {1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x8_t m = vld1_u8(sel);
    uint8x16_t v = vcombine_u8(vtst_u8(vdup_n_u8((uint8_t)bits), m), vtst_u8(vdup_n_u8((uint8_t)(bits >> 8)), m));
    return vandq_u8(v, vdupq_n_u8(0x10));
}

/* One 32-element block of `type` at b: its 32 values as signed bytes (w0: elements
 * 0-15, w1: 16-31), its f16 scale d and its constant term c. */
NEON_INLINE void block32(int type, const uint8_t *b, int8x16_t *w0, int8x16_t *w1, float *d, float *c) {
    *d = ellm_rd_f16(b);
    if (type == ELLM_T_Q8_0) {
        *w0 = vld1q_s8((const int8_t *)(b + 2));
        *w1 = vld1q_s8((const int8_t *)(b + 18));
        *c = 0.0f;
        return;
    }
    const int nib = type == ELLM_T_Q4_0 ? 2 : type == ELLM_T_Q4_1 ? 4 : type == ELLM_T_Q5_0 ? 6 : 8;
    const uint8x16_t q = vld1q_u8(b + nib);
    uint8x16_t lo = vandq_u8(q, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(q, 4);
    if (type == ELLM_T_Q5_0 || type == ELLM_T_Q5_1) {
        const uint32_t qh = ellm_rd_u32(b + (type == ELLM_T_Q5_0 ? 2 : 4));
        lo = vorrq_u8(lo, bits16_to_0x10(qh & 0xFFFFu));
        hi = vorrq_u8(hi, bits16_to_0x10(qh >> 16));
    }
    *w0 = vreinterpretq_s8_u8(lo);
    *w1 = vreinterpretq_s8_u8(hi);
    switch (type) {
    case ELLM_T_Q4_0: *c = -8.0f * *d; break;
    case ELLM_T_Q5_0: *c = -16.0f * *d; break;
    default: *c = ellm_rd_f16(b + 2); break; /* m */
    }
}

/* One weight row against nt tokens: each block unpacked once for all tokens. */
NEON_INLINE void row32(int type, int bs, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride,
                       int64_t nt, float *y, size_t y_stride) {
    enum { TILE = 4 };
    for (int64_t t0 = 0; t0 < nt; t0 += TILE) {
        const int n = nt - t0 < TILE ? (int)(nt - t0) : TILE;
        float acc[TILE] = {0}, cor[TILE] = {0};
        for (int64_t i = 0; i < nb; i++) {
            int8x16_t w0, w1;
            float d, c;
            block32(type, w + i * bs, &w0, &w1, &d, &c);
            for (int t = 0; t < n; t++) {
                const ellm_act32 *a = (const ellm_act32 *)(x + (size_t)(t0 + t) * x_stride) + i;
                const int32_t isum = dot32(w0, w1, vld1q_s8(a->qs), vld1q_s8(a->qs + 16));
                acc[t] = fmaf((float)isum, d * a->d, acc[t]);
                cor[t] = fmaf(c, a->s, cor[t]);
            }
        }
        for (int t = 0; t < n; t++) y[(size_t)(t0 + t) * y_stride] = type == ELLM_T_Q8_0 ? acc[t] : acc[t] + cor[t];
    }
}

#define NEON_QDOT32(fname, type, bs)                                                                      \
    static void fname(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr, const uint8_t *x,        \
                      size_t x_stride, int64_t nt, float *y, size_t y_stride) {                           \
        for (int64_t r = 0; r < nr; r++) row32(type, bs, nb, w + (size_t)r * w_stride, x, x_stride, nt, y + r, y_stride); \
    }

NEON_QDOT32(qdot_q4_0, ELLM_T_Q4_0, Q4_0_BYTES)
NEON_QDOT32(qdot_q4_1, ELLM_T_Q4_1, Q4_1_BYTES)
NEON_QDOT32(qdot_q5_0, ELLM_T_Q5_0, Q5_0_BYTES)
NEON_QDOT32(qdot_q5_1, ELLM_T_Q5_1, Q5_1_BYTES)
NEON_QDOT32(qdot_q8_0, ELLM_T_Q8_0, Q8_0_BYTES)

/* ------------------------------------------------------------------------------------
 * K-quants against act256, in the x86 kernels' float order (quant_x86.h):
 *   Q4_K  isum = sum_j sc[j] (q_j . x_j),  msum = sum_j mn[j] (bsum[2j] + bsum[2j+1])
 *         acc = fma(float(isum), d d_x, acc);  acc = fma(float(msum), -dmin d_x, acc)
 *   Q5_K  as Q4_K, with a fifth bit from qh
 *   Q6_K  tot = sum_g sc[g] (q_g . x_g) - 32 sum_g sc[g] bsum[g]   (values stored +32)
 *         acc = fma(float(tot), d d_x, acc)
 * The integer sums are exact, so only these FMAs round, once per block and output.
 * ------------------------------------------------------------------------------------ */

/* The exact dot of 16 signed bytes with 16 signed bytes. */
NEON_INLINE int32_t dot16(int8x16_t w, int8x16_t x) {
#if NEON_SDOT
    return vaddvq_s32(vdotq_s32(vdupq_n_s32(0), w, x));
#else
    int16x8_t p = vmull_s8(vget_low_s8(w), vget_low_s8(x));
    p = vmlal_high_s8(p, w, x);
    return vaddlvq_s16(p);
#endif
}

/* Q4_K and Q5_K (the fifth bit from qh: bit 2c of qh[l] is the 0x10 bit of element
 * 64c + l, bit 2c + 1 that of element 64c + 32 + l) */
NEON_INLINE void row_k45(int type, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                         float *y, size_t y_stride) {
    enum { TILE = 4 };
    const int q5 = type == ELLM_T_Q5_K;
    const int bs = q5 ? Q5_K_BYTES : Q4_K_BYTES;
    const uint8x16_t lo4 = vdupq_n_u8(0x0F), b5 = vdupq_n_u8(0x10);
    for (int64_t t0 = 0; t0 < nt; t0 += TILE) {
        const int n = nt - t0 < TILE ? (int)(nt - t0) : TILE;
        float acc[TILE] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * bs, *qs = b + (q5 ? 48 : 16);
            uint8_t sc[8], mn[8];
            ellm_unpack_k4_scales(b + 4, sc, mn);
            const float d = ellm_rd_f16(b), dmin = ellm_rd_f16(b + 2);
            const uint8x16_t h0 = q5 ? vld1q_u8(b + 16) : vdupq_n_u8(0), h1 = q5 ? vld1q_u8(b + 32) : vdupq_n_u8(0);
            int8x16_t q[4][4]; /* run c: low nibbles (2 halves), high nibbles (2 halves) */
            for (int c = 0; c < 4; c++) {
                const uint8x16_t v0 = vld1q_u8(qs + 32 * c), v1 = vld1q_u8(qs + 32 * c + 16);
                uint8x16_t l0 = vandq_u8(v0, lo4), l1 = vandq_u8(v1, lo4);
                uint8x16_t u0 = vshrq_n_u8(v0, 4), u1 = vshrq_n_u8(v1, 4);
                if (q5) {
                    const uint8x16_t m0 = vdupq_n_u8((uint8_t)(1u << (2 * c)));
                    const uint8x16_t m1 = vdupq_n_u8((uint8_t)(2u << (2 * c)));
                    l0 = vorrq_u8(l0, vandq_u8(vtstq_u8(h0, m0), b5));
                    l1 = vorrq_u8(l1, vandq_u8(vtstq_u8(h1, m0), b5));
                    u0 = vorrq_u8(u0, vandq_u8(vtstq_u8(h0, m1), b5));
                    u1 = vorrq_u8(u1, vandq_u8(vtstq_u8(h1, m1), b5));
                }
                q[c][0] = vreinterpretq_s8_u8(l0);
                q[c][1] = vreinterpretq_s8_u8(l1);
                q[c][2] = vreinterpretq_s8_u8(u0);
                q[c][3] = vreinterpretq_s8_u8(u1);
            }
            for (int t = 0; t < n; t++) {
                const ellm_act256 *a = (const ellm_act256 *)(x + (size_t)(t0 + t) * x_stride) + i;
                int32_t isum = 0, msum = 0;
                for (int c = 0; c < 4; c++) {
                    const int8_t *xq = a->qs + 64 * c;
                    isum += sc[2 * c] * dot32(q[c][0], q[c][1], vld1q_s8(xq), vld1q_s8(xq + 16));
                    isum += sc[2 * c + 1] * dot32(q[c][2], q[c][3], vld1q_s8(xq + 32), vld1q_s8(xq + 48));
                }
                for (int j = 0; j < 8; j++) msum += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
                acc[t] = fmaf((float)isum, d * a->d, acc[t]);
                acc[t] = fmaf((float)msum, -dmin * a->d, acc[t]);
            }
        }
        for (int t = 0; t < n; t++) y[(size_t)(t0 + t) * y_stride] = acc[t];
    }
}

/* Q2_K / Q3_K in the order of quant_x86.h's qdot_k23: per 128-half h, the 32-run s
 * (elements 128h + 32s + l) holds bits 2s, 2s+1 of qs[32h + l] (Q3_K: | 4 where bit 4h+s
 * of hmask[l] is set); groups of 16 g = 8h + 2s (+1).
 *   isum = sum_g sc[g] (q_g . x_g);  Q2_K msum = sum_g mn[g] bsum[g];
 *   Q3_K off = 4 sum_g sc[g] bsum[g]
 *   Q2_K acc = fma(float(isum), d d_x, acc);  acc = fma(float(msum), -dmin d_x, acc)
 *   Q3_K acc = fma(float(isum - off), d d_x, acc) */
NEON_INLINE void row_k23(int type, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                         float *y, size_t y_stride) {
    enum { TILE = 4 };
    const int bs = type == ELLM_T_Q2_K ? Q2_K_BYTES : Q3_K_BYTES;
    const uint8x16_t three = vdupq_n_u8(3), four = vdupq_n_u8(4);
    for (int64_t t0 = 0; t0 < nt; t0 += TILE) {
        const int n = nt - t0 < TILE ? (int)(nt - t0) : TILE;
        float acc[TILE] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * bs, *qs;
            int8_t sc[16];
            int16_t mn[16] = {0};
            float d, dmin = 0.0f;
            uint8x16_t hm0 = vdupq_n_u8(0), hm1 = vdupq_n_u8(0);
            if (type == ELLM_T_Q2_K) {
                for (int g = 0; g < 16; g++) sc[g] = (int8_t)(b[g] & 0x0F), mn[g] = (int16_t)(b[g] >> 4);
                qs = b + 16;
                d = ellm_rd_f16(b + 80);
                dmin = ellm_rd_f16(b + 82);
            } else {
                ellm_unpack_q3k_scales(b + 96, sc);
                hm0 = vld1q_u8(b), hm1 = vld1q_u8(b + 16);
                qs = b + 32;
                d = ellm_rd_f16(b + 108);
            }
            int8x16_t q[2][4][2]; /* [h][s][first / second 16 bytes of the run] */
            for (int h = 0; h < 2; h++) {
                const uint8x16_t v0 = vld1q_u8(qs + 32 * h), v1 = vld1q_u8(qs + 32 * h + 16);
                for (int s = 0; s < 4; s++) {
                    uint8x16_t a0 = vandq_u8(vshlq_u8(v0, vdupq_n_s8((int8_t)(-2 * s))), three);
                    uint8x16_t a1 = vandq_u8(vshlq_u8(v1, vdupq_n_s8((int8_t)(-2 * s))), three);
                    if (type == ELLM_T_Q3_K) {
                        const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << (4 * h + s)));
                        a0 = vorrq_u8(a0, vandq_u8(vtstq_u8(hm0, bit), four));
                        a1 = vorrq_u8(a1, vandq_u8(vtstq_u8(hm1, bit), four));
                    }
                    q[h][s][0] = vreinterpretq_s8_u8(a0);
                    q[h][s][1] = vreinterpretq_s8_u8(a1);
                }
            }
            for (int t = 0; t < n; t++) {
                const ellm_act256 *a = (const ellm_act256 *)(x + (size_t)(t0 + t) * x_stride) + i;
                int32_t isum = 0, bsum = 0; /* bsum: Q2_K sum_g mn[g] bsum[g], Q3_K sum_g sc[g] bsum[g] */
                for (int h = 0; h < 2; h++)
                    for (int s = 0; s < 4; s++) {
                        const int8_t *xq = a->qs + 128 * h + 32 * s;
                        const int g = 8 * h + 2 * s;
                        isum += sc[g] * dot16(q[h][s][0], vld1q_s8(xq));
                        isum += sc[g + 1] * dot16(q[h][s][1], vld1q_s8(xq + 16));
                    }
                for (int g = 0; g < 16; g++) bsum += (type == ELLM_T_Q2_K ? mn[g] : sc[g]) * a->bsums[g];
                if (type == ELLM_T_Q2_K) {
                    acc[t] = fmaf((float)isum, d * a->d, acc[t]);
                    acc[t] = fmaf((float)bsum, -dmin * a->d, acc[t]);
                } else {
                    acc[t] = fmaf((float)(isum - 4 * bsum), d * a->d, acc[t]);
                }
            }
        }
        for (int t = 0; t < n; t++) y[(size_t)(t0 + t) * y_stride] = acc[t];
    }
}

NEON_INLINE void row_q6k(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt, float *y,
                         size_t y_stride) {
    enum { TILE = 4 };
    const uint8x16_t lo4 = vdupq_n_u8(0x0F), top2 = vdupq_n_u8(0x30);
    for (int64_t t0 = 0; t0 < nt; t0 += TILE) {
        const int n = nt - t0 < TILE ? (int)(nt - t0) : TILE;
        float acc[TILE] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q6_K_BYTES;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = ellm_rd_f16(b + 208);
            int8x16_t q[16]; /* group g = 16 values, g = 0..15 in element order */
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 2; k++) { /* 16-byte halves of the 32-byte runs */
                    const uint8x16_t ql0 = vld1q_u8(b + 64 * h + 16 * k), ql1 = vld1q_u8(b + 64 * h + 32 + 16 * k);
                    const uint8x16_t qh = vld1q_u8(b + 128 + 32 * h + 16 * k);
                    /* run r (32 values) = groups 8h + 2r, 8h + 2r + 1; k picks the group */
                    q[8 * h + 0 + k] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(ql0, lo4), vandq_u8(vshlq_n_u8(qh, 4), top2)));
                    q[8 * h + 2 + k] = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(ql1, lo4), vandq_u8(vshlq_n_u8(qh, 2), top2)));
                    q[8 * h + 4 + k] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(ql0, 4), vandq_u8(qh, top2)));
                    q[8 * h + 6 + k] = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8(ql1, 4), vandq_u8(vshrq_n_u8(qh, 2), top2)));
                }
            for (int t = 0; t < n; t++) {
                const ellm_act256 *a = (const ellm_act256 *)(x + (size_t)(t0 + t) * x_stride) + i;
                int32_t isum = 0, off = 0;
                for (int g = 0; g < 16; g++) {
                    isum += sc[g] * dot16(q[g], vld1q_s8(a->qs + 16 * g));
                    off += sc[g] * a->bsums[g];
                }
                acc[t] = fmaf((float)(isum - 32 * off), d * a->d, acc[t]);
            }
        }
        for (int t = 0; t < n; t++) y[(size_t)(t0 + t) * y_stride] = acc[t];
    }
}

static void qdot_q4_k(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr, const uint8_t *x, size_t x_stride,
                      int64_t nt, float *y, size_t y_stride) {
    for (int64_t r = 0; r < nr; r++)
        row_k45(ELLM_T_Q4_K, nb, w + (size_t)r * w_stride, x, x_stride, nt, y + r, y_stride);
}
static void qdot_q2_k(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr, const uint8_t *x, size_t x_stride,
                      int64_t nt, float *y, size_t y_stride) {
    for (int64_t r = 0; r < nr; r++)
        row_k23(ELLM_T_Q2_K, nb, w + (size_t)r * w_stride, x, x_stride, nt, y + r, y_stride);
}
static void qdot_q3_k(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr, const uint8_t *x, size_t x_stride,
                      int64_t nt, float *y, size_t y_stride) {
    for (int64_t r = 0; r < nr; r++)
        row_k23(ELLM_T_Q3_K, nb, w + (size_t)r * w_stride, x, x_stride, nt, y + r, y_stride);
}
static void qdot_q5_k(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr, const uint8_t *x, size_t x_stride,
                      int64_t nt, float *y, size_t y_stride) {
    for (int64_t r = 0; r < nr; r++)
        row_k45(ELLM_T_Q5_K, nb, w + (size_t)r * w_stride, x, x_stride, nt, y + r, y_stride);
}
static void qdot_q6_k(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr, const uint8_t *x, size_t x_stride,
                      int64_t nt, float *y, size_t y_stride) {
    for (int64_t r = 0; r < nr; r++) row_q6k(nb, w + (size_t)r * w_stride, x, x_stride, nt, y + r, y_stride);
}

ellm_qdot_fn NEON_NAME(ellm_qdot_neon)(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return qdot_q4_0;
    case ELLM_T_Q4_1: return qdot_q4_1;
    case ELLM_T_Q5_0: return qdot_q5_0;
    case ELLM_T_Q5_1: return qdot_q5_1;
    case ELLM_T_Q8_0: return qdot_q8_0;
    case ELLM_T_Q2_K: return qdot_q2_k;
    case ELLM_T_Q3_K: return qdot_q3_k;
    case ELLM_T_Q4_K: return qdot_q4_k;
    case ELLM_T_Q5_K: return qdot_q5_k;
    case ELLM_T_Q6_K: return qdot_q6_k;
    default: return NULL;
    }
}

#endif
