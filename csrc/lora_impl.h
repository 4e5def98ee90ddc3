/* The LoRA inner loops (lora.h), compiled once per SIMD level by lora.c (baseline) and
 * lora_avx2.c: LORA_SUFFIX names the variant. Plain C the compiler vectorizes across the
 * rank (A) and the outputs (B); both files are built without FMA contraction
 * (-ffp-contract=off, CMakeLists.txt), so every level gives the same bits. */
#include <string.h>

#include "lora.h"

#define LORA_CAT2(a, b) a##_##b
#define LORA_CAT(a, b) LORA_CAT2(a, b)
#define LORA_FN(name) LORA_CAT(name, LORA_SUFFIX)

#define SHRINK_CHUNK 16   /* rank columns of A^T per pass (lora.c cuts the rank so) */
#define EXPAND_BLOCK 64   /* output columns of B^T per pass (lora.c cuts N so) */

/* float16 bits -> float32, exactly (normal, subnormal, zero, inf, NaN). */
static inline float LORA_FN(f16)(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    uint32_t bits;
    if (em >= 0x7c00u) {
        bits = sign | 0x7f800000u | ((em & 0x3ffu) << 13);
    } else if (em >= 0x0400u) {
        bits = sign | ((em << 13) + 0x38000000u);
    } else {   /* subnormal or zero: em * 2^-24, exact in float32 */
        const float f = (float)em * 5.9604644775390625e-08f;
        return sign ? -f : f;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float LORA_FN(bf16)(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* u0[j] = sum over k of A^T[k][j0 + j] * x0[k] for j < jn (jn <= SHRINK_CHUNK), and the
 * same for a second row (x1, u1) when x1 is not NULL: both rows share each load of A. */
#define SHRINK_BODY(LOAD)                                                                     \
    float a0[SHRINK_CHUNK] = {0}, a1[SHRINK_CHUNK] = {0};                                     \
    if (jn == SHRINK_CHUNK && x1) {                                                           \
        for (int64_t k = 0; k < K; k++) {                                                     \
            const float xa = x0[k], xb = x1[k];                                               \
            for (int c = 0; c < SHRINK_CHUNK; c++) {                                          \
                const float a = LOAD(p + k * r + j0 + c);                                     \
                a0[c] += a * xa;                                                              \
                a1[c] += a * xb;                                                              \
            }                                                                                 \
        }                                                                                     \
    } else if (jn == SHRINK_CHUNK) {                                                          \
        for (int64_t k = 0; k < K; k++) {                                                     \
            const float xa = x0[k];                                                           \
            for (int c = 0; c < SHRINK_CHUNK; c++) a0[c] += LOAD(p + k * r + j0 + c) * xa;   \
        }                                                                                     \
    } else {                                                                                  \
        for (int64_t k = 0; k < K; k++) {                                                     \
            const float xa = x0[k], xb = x1 ? x1[k] : 0.0f;                                   \
            for (int c = 0; c < jn; c++) {                                                    \
                const float a = LOAD(p + k * r + j0 + c);                                     \
                a0[c] += a * xa;                                                              \
                a1[c] += a * xb;                                                              \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    for (int c = 0; c < jn; c++) u0[c] = a0[c];                                               \
    if (x1)                                                                                   \
        for (int c = 0; c < jn; c++) u1[c] = a1[c];

#define LOAD_F32(q) (*(q))
#define LOAD_F16(q) LORA_FN(f16)(*(q))
#define LOAD_BF16(q) LORA_FN(bf16)(*(q))

static void LORA_FN(shrink)(const void *at, int32_t dtype, int64_t K, int32_t r, int32_t j0, int32_t jn,
                            const float *x0, const float *x1, float *u0, float *u1) {
    if (dtype == ELLM_LORA_F32) {
        const float *p = at;
        SHRINK_BODY(LOAD_F32)
    } else if (dtype == ELLM_LORA_BF16) {
        const uint16_t *p = at;
        SHRINK_BODY(LOAD_BF16)
    } else {
        const uint16_t *p = at;
        SHRINK_BODY(LOAD_F16)
    }
}

/* y[c] += scale * (sum over j < r of u[j] * B^T[j][n0 + c]) for c < nc (<= EXPAND_BLOCK). */
#define EXPAND_BODY(LOAD)                                                                     \
    float acc[EXPAND_BLOCK] = {0};                                                            \
    if (nc == EXPAND_BLOCK) {                                                                 \
        for (int32_t j = 0; j < r; j++) {                                                     \
            const float uj = u[j];                                                            \
            for (int c = 0; c < EXPAND_BLOCK; c++) acc[c] += uj * LOAD(p + j * N + n0 + c);   \
        }                                                                                     \
    } else {                                                                                  \
        for (int32_t j = 0; j < r; j++) {                                                     \
            const float uj = u[j];                                                            \
            for (int64_t c = 0; c < nc; c++) acc[c] += uj * LOAD(p + j * N + n0 + c);         \
        }                                                                                     \
    }                                                                                         \
    for (int64_t c = 0; c < nc; c++) y[c] += scale * acc[c];

static void LORA_FN(expand)(const void *bt, int32_t dtype, int64_t N, int32_t r, int64_t n0, int64_t nc,
                            const float *u, float scale, float *y) {
    if (dtype == ELLM_LORA_F32) {
        const float *p = bt;
        EXPAND_BODY(LOAD_F32)
    } else if (dtype == ELLM_LORA_BF16) {
        const uint16_t *p = bt;
        EXPAND_BODY(LOAD_BF16)
    } else {
        const uint16_t *p = bt;
        EXPAND_BODY(LOAD_F16)
    }
}

static const ellm_lora_funcs LORA_FN(funcs) = {LORA_FN(shrink), LORA_FN(expand)};

const ellm_lora_funcs *LORA_FN(ellm_lora_funcs)(void) { return &LORA_FN(funcs); }
