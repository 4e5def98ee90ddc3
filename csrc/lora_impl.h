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

/* [bf16] Where a bfloat16 factor lies in its run (lora.h: a row of A^T, a block of B^T).
 * Each whole unit of 16 from the run's start has its middle two quarters swapped, so that
 * an AVX2 register of the unit widens into its first 8 and its last 8 in place, one
 * unpack each (lora_avx2.c); the factors past the last whole unit stay in order. The swap
 * is its own inverse. */
#define BF16_SWAP(i) ((i) ^ (((((i) >> 2) ^ ((i) >> 3)) & 1) * 12))
#define BF16_AT(i, whole) ((i) < (whole) ? BF16_SWAP(i) : (i))

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
 * same for a second row (x1, u1) when x1 is not NULL: both rows share each load of A.
 * Each sum runs as two, over the even and the odd k (two chains of adds in flight, not
 * one), added at the end: the same order on every path, so a row's bits do not depend
 * on its pairing. */
#define SHRINK_BODY(LOAD, AT)                                                                 \
    float e0[SHRINK_CHUNK] = {0}, o0[SHRINK_CHUNK] = {0};                                     \
    float e1[SHRINK_CHUNK] = {0}, o1[SHRINK_CHUNK] = {0};                                     \
    const int64_t K2 = K & ~(int64_t)1;                                                       \
    if (jn == SHRINK_CHUNK && x1) {                                                           \
        for (int64_t k = 0; k < K2; k += 2) {                                                 \
            const float xa = x0[k], xa2 = x0[k + 1], xb = x1[k], xb2 = x1[k + 1];             \
            for (int c = 0; c < SHRINK_CHUNK; c++) {                                          \
                const float a = LOAD(p + k * r + j0 + AT(c)), a2 = LOAD(p + (k + 1) * r + j0 + AT(c)); \
                e0[c] += a * xa;                                                              \
                o0[c] += a2 * xa2;                                                            \
                e1[c] += a * xb;                                                              \
                o1[c] += a2 * xb2;                                                            \
            }                                                                                 \
        }                                                                                     \
    } else if (jn == SHRINK_CHUNK) {                                                          \
        for (int64_t k = 0; k < K2; k += 2) {                                                 \
            const float xa = x0[k], xa2 = x0[k + 1];                                          \
            for (int c = 0; c < SHRINK_CHUNK; c++) {                                          \
                e0[c] += LOAD(p + k * r + j0 + AT(c)) * xa;                                   \
                o0[c] += LOAD(p + (k + 1) * r + j0 + AT(c)) * xa2;                            \
            }                                                                                 \
        }                                                                                     \
    } else {                                                                                  \
        for (int64_t k = 0; k < K2; k += 2) {                                                 \
            const float xa = x0[k], xa2 = x0[k + 1];                                          \
            const float xb = x1 ? x1[k] : 0.0f, xb2 = x1 ? x1[k + 1] : 0.0f;                  \
            for (int c = 0; c < jn; c++) {                                                    \
                const float a = LOAD(p + k * r + j0 + c), a2 = LOAD(p + (k + 1) * r + j0 + c); \
                e0[c] += a * xa;                                                              \
                o0[c] += a2 * xa2;                                                            \
                e1[c] += a * xb;                                                              \
                o1[c] += a2 * xb2;                                                            \
            }                                                                                 \
        }                                                                                     \
    }                                                                                         \
    if (K2 < K) { /* an odd K: the last k joins the even sums */                              \
        const float xa = x0[K2], xb = x1 ? x1[K2] : 0.0f;                                     \
        for (int c = 0; c < jn; c++) {                                                        \
            const float a = LOAD(p + K2 * r + j0 + (jn == SHRINK_CHUNK ? AT(c) : c));         \
            e0[c] += a * xa;                                                                  \
            e1[c] += a * xb;                                                                  \
        }                                                                                     \
    }                                                                                         \
    for (int c = 0; c < jn; c++) u0[c] = e0[c] + o0[c];                                       \
    if (x1)                                                                                   \
        for (int c = 0; c < jn; c++) u1[c] = e1[c] + o1[c];

#define LOAD_F32(q) (*(q))
#define LOAD_F16(q) LORA_FN(f16)(*(q))
#define LOAD_BF16(q) LORA_FN(bf16)(*(q))
#define IN_ORDER(i) (i)
#define IN_ORDER2(i, whole) (i)

__attribute__((unused)) static void LORA_FN(shrink)(const void *at, int32_t dtype, int64_t K, int32_t r, int32_t j0, int32_t jn,
                            const float *x0, const float *x1, float *u0, float *u1) {
    if (dtype == ELLM_LORA_F32) {
        const float *p = at;
        SHRINK_BODY(LOAD_F32, IN_ORDER)
    } else if (dtype == ELLM_LORA_BF16) {
        const uint16_t *p = at;
        SHRINK_BODY(LOAD_BF16, BF16_SWAP)
    } else {
        const uint16_t *p = at;
        SHRINK_BODY(LOAD_F16, IN_ORDER)
    }
}

/* y[c] += scale * (sum over j < r of u[j] * B^T[j][n0 + c]) for c < nc (<= EXPAND_BLOCK),
 * B^T in blocks of 8 outputs (lora.h): output n's factor j at (n / 8) * r * 8 + j * 8 +
 * n % 8. The sums run over whole groups of 8 from the group holding n0 (G of them, a
 * constant in each case of the switch, so the accumulators stay in registers: G chains
 * of adds in flight), and only outputs n0 .. n0 + nc are written. Every output is summed
 * alike (j ascending from 0, multiply then add). */
#define EXPAND_G(LOAD, AT, G)                                                                 \
    {                                                                                         \
        float acc[(G) * 8] = {0};                                                             \
        for (int32_t j = 0; j < r; j++) {                                                     \
            const float uj = u[j];                                                            \
            for (int g = 0; g < (G); g++)                                                     \
                for (int l = 0; l < 8; l++) acc[g * 8 + l] += uj * LOAD(q + g * R8 + AT(j * 8 + l, whole)); \
        }                                                                                     \
        for (int64_t c = 0; c < nc; c++) y[c] += scale * acc[o + c];                          \
    }                                                                                         \
    break;

#define EXPAND_BODY(LOAD, AT)                                                                 \
    const int64_t R8 = (int64_t)r * 8, o = n0 & 7, whole = R8 & ~(int64_t)15;                 \
    const TYPE *q = p + (n0 >> 3) * R8;                                                       \
    (void)whole;                                                                              \
    switch ((nc + o + 7) / 8) {                                                               \
    case 1: EXPAND_G(LOAD, AT, 1)                                                             \
    case 2: EXPAND_G(LOAD, AT, 2)                                                             \
    case 3: EXPAND_G(LOAD, AT, 3)                                                             \
    case 4: EXPAND_G(LOAD, AT, 4)                                                             \
    case 5: EXPAND_G(LOAD, AT, 5)                                                             \
    case 6: EXPAND_G(LOAD, AT, 6)                                                             \
    case 7: EXPAND_G(LOAD, AT, 7)                                                             \
    case 8: EXPAND_G(LOAD, AT, 8)                                                             \
    default: EXPAND_G(LOAD, AT, 9)                                                            \
    }

__attribute__((unused)) static void LORA_FN(expand)(const void *bt, int32_t dtype, int64_t N, int32_t r, int64_t n0, int64_t nc,
                            const float *u, float scale, float *y) {
    (void)N;
    if (dtype == ELLM_LORA_F32) {
#define TYPE float
        const TYPE *p = bt;
        EXPAND_BODY(LOAD_F32, IN_ORDER2)
#undef TYPE
    } else if (dtype == ELLM_LORA_BF16) {
#define TYPE uint16_t
        const TYPE *p = bt;
        EXPAND_BODY(LOAD_BF16, BF16_AT)
    } else {
        const TYPE *p = bt;
        EXPAND_BODY(LOAD_F16, IN_ORDER2)
#undef TYPE
    }
}

/* The expand of 4 rows of one adapter at once over outputs [n0, n0 + nc): y_i[c] +=
 * scale * (sum over j < r of u_i[j] * B^T[j][n0 + c]) for i < rows (<= 4; the u past
 * them repeat one and are not written), each load of B serving the four. 16 outputs at a
 * time from the group of 8 holding n0, so 8 chains of adds are in flight. The same sums,
 * term by term, as expand. */
#define EXPAND4_BODY(LOAD, AT)                                                                \
    const int64_t R8 = (int64_t)r * 8, o = n0 & 7, span = nc + o, ng = (span + 7) / 8;        \
    const int64_t whole = R8 & ~(int64_t)15;                                                  \
    (void)whole;                                                                              \
    const TYPE *base = p + (n0 >> 3) * R8;                                                    \
    for (int64_t g0 = 0; g0 < ng; g0 += 2) {                                                  \
        const int two = g0 + 1 < ng;                                                          \
        const TYPE *q = base + g0 * R8;                                                       \
        float a[4][16] = {{0}};                                                               \
        for (int32_t j = 0; j < r; j++) {                                                     \
            float b[16];                                                                      \
            for (int l = 0; l < 8; l++) b[l] = LOAD(q + AT(j * 8 + l, whole));                \
            for (int l = 0; l < 8; l++) b[8 + l] = two ? LOAD(q + R8 + AT(j * 8 + l, whole)) : 0.0f; \
            for (int i = 0; i < 4; i++) {                                                     \
                const float uj = u[i][j];                                                     \
                for (int l = 0; l < 16; l++) a[i][l] += uj * b[l];                            \
            }                                                                                 \
        }                                                                                     \
        const int64_t c0 = g0 * 8, lo = c0 < o ? o : c0, hi = c0 + 16 < span ? c0 + 16 : span; \
        for (int i = 0; i < rows; i++)                                                        \
            for (int64_t c = lo; c < hi; c++) y[i][c - o] += scale * a[i][c - c0];            \
    }

__attribute__((unused)) static void LORA_FN(expand4)(const void *bt, int32_t dtype, int32_t r, int64_t n0, int64_t nc,
                             const float *const u[4], float scale, float *const y[4], int rows) {
    if (dtype == ELLM_LORA_F32) {
#define TYPE float
        const TYPE *p = bt;
        EXPAND4_BODY(LOAD_F32, IN_ORDER2)
#undef TYPE
    } else if (dtype == ELLM_LORA_BF16) {
#define TYPE uint16_t
        const TYPE *p = bt;
        EXPAND4_BODY(LOAD_BF16, BF16_AT)
    } else {
        const TYPE *p = bt;
        EXPAND4_BODY(LOAD_F16, IN_ORDER2)
#undef TYPE
    }
}

#ifndef LORA_EXPAND   /* a variant may bring its own kernels (the same sums) */
#define LORA_SHRINK LORA_FN(shrink)
#define LORA_EXPAND LORA_FN(expand)
#define LORA_EXPAND4 LORA_FN(expand4)
#endif
static const ellm_lora_funcs LORA_FN(funcs) = {LORA_SHRINK, LORA_EXPAND, LORA_EXPAND4};

const ellm_lora_funcs *LORA_FN(ellm_lora_funcs)(void) { return &LORA_FN(funcs); }
