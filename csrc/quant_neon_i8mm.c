/* NEON integer dot kernels with SMMLA (Armv8.6 i8mm; CMake adds +i8mm to this file only,
 * dispatch.c checks HWCAP2_I8MM / FEAT_I8MM first) for the 32-element types: two weight
 * rows against two tokens per instruction (a 2 x 8 by 8 x 2 int8 product into 2 x 2
 * int32). Each output keeps the float order of quant_neon.h (one multiply and two FMAs
 * per block, the integer dot exact), so these give the same bits as the plain NEON and
 * SDOT kernels, whatever the tile. A missing second row or token of a pair is computed
 * with the first one's data and never stored. */
#if defined(__aarch64__)
#define NEON_SFX _i8mm
#define NEON_SDOT 1
#include "quant_neon.h"

/* rows (a, b) x tokens (c, d), 32 bytes each -> the four exact dots {ac, ad, bc, bd} */
static inline __attribute__((always_inline)) int32x4_t mm2x2(int8x16_t a0, int8x16_t a1, int8x16_t b0,
                                                             int8x16_t b1, int8x16_t c0, int8x16_t c1,
                                                             int8x16_t d0, int8x16_t d1) {
    /* each operand register: 8 bytes of the first row (token), then 8 of the second */
#define LO(x, y) vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)))
#define HI(x, y) vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y)))
    int32x4_t acc = vmmlaq_s32(vdupq_n_s32(0), LO(a0, b0), LO(c0, d0));
    acc = vmmlaq_s32(acc, HI(a0, b0), HI(c0, d0));
    acc = vmmlaq_s32(acc, LO(a1, b1), LO(c1, d1));
    acc = vmmlaq_s32(acc, HI(a1, b1), HI(c1, d1));
#undef LO
#undef HI
    return acc;
}

/* Rows r, r + 1 (r + 1 < nr, else row r twice) against tokens t, t + 1 likewise. */
static inline __attribute__((always_inline)) void pair32(int type, int bs, int64_t nb, const uint8_t *w0,
                                                         const uint8_t *w1, const uint8_t *x0, const uint8_t *x1,
                                                         float *y, size_t y_stride, int two_rows, int two_toks) {
    float acc[4] = {0}, cor[4] = {0}; /* (row 0, tok 0), (0, 1), (1, 0), (1, 1) */
    for (int64_t i = 0; i < nb; i++) {
        int8x16_t a0, a1, b0, b1;
        float da, db, ca, cb;
        block32(type, w0 + i * bs, &a0, &a1, &da, &ca);
        block32(type, w1 + i * bs, &b0, &b1, &db, &cb);
        const ellm_act32 *p = (const ellm_act32 *)x0 + i, *q = (const ellm_act32 *)x1 + i;
        int32_t s[4];
        vst1q_s32(s, mm2x2(a0, a1, b0, b1, vld1q_s8(p->qs), vld1q_s8(p->qs + 16), vld1q_s8(q->qs),
                           vld1q_s8(q->qs + 16)));
        const float d[4] = {da, da, db, db}, c[4] = {ca, ca, cb, cb};
        const ellm_act32 *tok[4] = {p, q, p, q};
        for (int k = 0; k < 4; k++) {
            acc[k] = fmaf((float)s[k], d[k] * tok[k]->d, acc[k]);
            cor[k] = fmaf(c[k], tok[k]->s, cor[k]);
        }
    }
    for (int k = 0; k < 4; k++) {
        const int r = k >> 1, t = k & 1;
        if ((r && !two_rows) || (t && !two_toks)) continue;
        y[(size_t)t * y_stride + (size_t)r] = type == ELLM_T_Q8_0 ? acc[k] : acc[k] + cor[k];
    }
}

static inline __attribute__((always_inline)) void qdot32_i8mm(int type, int bs, int64_t nb, const uint8_t *w,
                                                              size_t w_stride, int64_t nr, const uint8_t *x,
                                                              size_t x_stride, int64_t nt, float *y,
                                                              size_t y_stride) {
    for (int64_t r = 0; r < nr; r += 2) {
        const int two_rows = r + 1 < nr;
        const uint8_t *w0 = w + (size_t)r * w_stride, *w1 = two_rows ? w0 + w_stride : w0;
        for (int64_t t = 0; t < nt; t += 2) {
            const int two_toks = t + 1 < nt;
            const uint8_t *x0 = x + (size_t)t * x_stride, *x1 = two_toks ? x0 + x_stride : x0;
            pair32(type, bs, nb, w0, w1, x0, x1, y + (size_t)t * y_stride + r, y_stride, two_rows, two_toks);
        }
    }
}

#define I8MM_QDOT32(fname, type, bs)                                                                          \
    static void fname(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr, const uint8_t *x,            \
                      size_t x_stride, int64_t nt, float *y, size_t y_stride) {                               \
        qdot32_i8mm(type, bs, nb, w, w_stride, nr, x, x_stride, nt, y, y_stride);                             \
    }
I8MM_QDOT32(mm_q4_0, ELLM_T_Q4_0, Q4_0_BYTES)
I8MM_QDOT32(mm_q4_1, ELLM_T_Q4_1, Q4_1_BYTES)
I8MM_QDOT32(mm_q5_0, ELLM_T_Q5_0, Q5_0_BYTES)
I8MM_QDOT32(mm_q5_1, ELLM_T_Q5_1, Q5_1_BYTES)
I8MM_QDOT32(mm_q8_0, ELLM_T_Q8_0, Q8_0_BYTES)

/* The 32-element types with SMMLA; the others take the SDOT kernels of this file's
 * quant_neon.h copy. */
ellm_qdot_fn ellm_qdot_neon_i8mm_select(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return mm_q4_0;
    case ELLM_T_Q4_1: return mm_q4_1;
    case ELLM_T_Q5_0: return mm_q5_0;
    case ELLM_T_Q5_1: return mm_q5_1;
    case ELLM_T_Q8_0: return mm_q8_0;
    default: return ellm_qdot_neon_i8mm(qtype);
    }
}
#endif
