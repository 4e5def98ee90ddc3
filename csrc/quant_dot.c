/* Scalar integer dot products of GGML weight blocks with 8-bit activation blocks, the
 * activation quantizers, and the choice of kernel per SIMD level.
 *
 * These are the reference for the AVX2 / AVX-512 variants: the same integer sums, so
 * every level gives the same result up to float summation order. */
#include <float.h>
#include <math.h>

#include "quant_impl.h"
#include "simd.h"

/* ====================================================================================
 * Activation quantization: (k,) f32 -> k/32 act32 or k/256 act256 blocks
 * ==================================================================================== */

static int8_t q8_round(float v) { return (int8_t)lrintf(v); /* nearest, |v| <= 127 */ }

/* Largest |x[j]|, or NAN when some x[j] is NaN or infinite: such a block gets a NaN
 * scale (and zero values), so the outputs it feeds turn NaN as float math would. */
static float block_amax(const float *x, int n) {
    float amax = 0.0f;
    int bad = 0;
    for (int j = 0; j < n; j++) {
        float a = fabsf(x[j]);
        amax = fmaxf(amax, a);
        bad |= !(a <= FLT_MAX);
    }
    return bad ? NAN : amax;
}

void ellm_act32_scalar(const float *x, int64_t k, void *out) {
    ellm_act32 *a = (ellm_act32 *)out;
    for (int64_t i = 0; i < k / QK32; i++, x += QK32) {
        float amax = block_amax(x, QK32);
        if (isnan(amax)) {
            memset(a[i].qs, 0, sizeof a[i].qs);
            a[i].d = a[i].s = NAN;
            continue;
        }
        float d = amax / 127.0f, id = d != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK32; j++) {
            a[i].qs[j] = q8_round(x[j] * id);
            sum += a[i].qs[j];
        }
        a[i].d = d;
        a[i].s = d * (float)sum;
    }
}

void ellm_act256_scalar(const float *x, int64_t k, void *out) {
    ellm_act256 *a = (ellm_act256 *)out;
    for (int64_t i = 0; i < k / QK256; i++, x += QK256) {
        float amax = block_amax(x, QK256);
        if (isnan(amax)) {
            memset(a[i].qs, 0, sizeof a[i].qs);
            memset(a[i].bsums, 0, sizeof a[i].bsums);
            a[i].d = NAN;
            continue;
        }
        a[i].d = amax / 127.0f;
        float id = a[i].d != 0.0f ? 127.0f / amax : 0.0f;
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) {
                a[i].qs[16 * g + j] = q8_round(x[16 * g + j] * id);
                sum += a[i].qs[16 * g + j];
            }
            a[i].bsums[g] = (int16_t)sum;
        }
    }
}

/* ====================================================================================
 * 32-element types against act32. Each weight block is w = d * q + c with q the
 * stored integer and c a per-block constant (-8 d, m, -16 d, m, 0): the constant
 * term is c * sum(x) = c * s / d_x, i.e. it enters through a.s.
 * ==================================================================================== */

#define FOR_TOKENS for (int64_t t = 0; t < nt; t++)
#define ACT32(t, i) (((const ellm_act32 *)(x + (size_t)(t) * x_stride)) + (i))
#define ACT256(t, i) (((const ellm_act256 *)(x + (size_t)(t) * x_stride)) + (i))

static void row_q4_0(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q4_0_BYTES;
            const ellm_act32 *a = ACT32(t, i);
            int isum = 0;
            for (int j = 0; j < 16; j++)
                isum += (b[2 + j] & 0x0F) * a->qs[j] + (b[2 + j] >> 4) * a->qs[j + 16];
            float d = ellm_rd_f16(b);
            acc += d * (a->d * (float)isum - 8.0f * a->s);
        }
        y[t * y_stride] = acc;
    }
}

static void row_q4_1(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q4_1_BYTES;
            const ellm_act32 *a = ACT32(t, i);
            int isum = 0;
            for (int j = 0; j < 16; j++)
                isum += (b[4 + j] & 0x0F) * a->qs[j] + (b[4 + j] >> 4) * a->qs[j + 16];
            acc += ellm_rd_f16(b) * a->d * (float)isum + ellm_rd_f16(b + 2) * a->s;
        }
        y[t * y_stride] = acc;
    }
}

static void row_q5_0(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q5_0_BYTES;
            const ellm_act32 *a = ACT32(t, i);
            uint32_t qh = ellm_rd_u32(b + 2);
            int isum = 0;
            for (int j = 0; j < 16; j++) {
                int lo = (b[6 + j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
                int hi = (b[6 + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
                isum += lo * a->qs[j] + hi * a->qs[j + 16];
            }
            acc += ellm_rd_f16(b) * (a->d * (float)isum - 16.0f * a->s);
        }
        y[t * y_stride] = acc;
    }
}

static void row_q5_1(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q5_1_BYTES;
            const ellm_act32 *a = ACT32(t, i);
            uint32_t qh = ellm_rd_u32(b + 4);
            int isum = 0;
            for (int j = 0; j < 16; j++) {
                int lo = (b[8 + j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
                int hi = (b[8 + j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
                isum += lo * a->qs[j] + hi * a->qs[j + 16];
            }
            acc += ellm_rd_f16(b) * a->d * (float)isum + ellm_rd_f16(b + 2) * a->s;
        }
        y[t * y_stride] = acc;
    }
}

static void row_q8_0(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q8_0_BYTES;
            const ellm_act32 *a = ACT32(t, i);
            const int8_t *q = (const int8_t *)(b + 2);
            int isum = 0;
            for (int j = 0; j < 32; j++) isum += q[j] * a->qs[j];
            acc += ellm_rd_f16(b) * a->d * (float)isum;
        }
        y[t * y_stride] = acc;
    }
}

/* ====================================================================================
 * K-quants against act256. Per-group mins enter through the activation's 16-sums.
 * ==================================================================================== */

static void row_q2_k(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q2_K_BYTES;
            const uint8_t *sc = b, *qs = b + 16;
            const ellm_act256 *a = ACT256(t, i);
            int sumi = 0, summ = 0;
            for (int g = 0; g < 16; g++) {
                int half = g >> 3, s = (g >> 1) & 3, l0 = (g & 1) * 16;
                int gs = 0;
                for (int l = l0; l < l0 + 16; l++)
                    gs += ((qs[half * 32 + l] >> (2 * s)) & 3) * a->qs[16 * g + l - l0];
                sumi += (sc[g] & 0x0F) * gs;
                summ += (sc[g] >> 4) * a->bsums[g];
            }
            acc += a->d * (ellm_rd_f16(b + 80) * (float)sumi - ellm_rd_f16(b + 82) * (float)summ);
        }
        y[t * y_stride] = acc;
    }
}

static void row_q3_k(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q3_K_BYTES;
            const uint8_t *hm = b, *qs = b + 32;
            int8_t sc[16];
            ellm_unpack_q3k_scales(b + 96, sc);
            const ellm_act256 *a = ACT256(t, i);
            int sumi = 0;
            for (int g = 0; g < 16; g++) {
                int half = g >> 3, s = (g >> 1) & 3, l0 = (g & 1) * 16, j = g >> 1;
                int gs = 0;
                for (int l = l0; l < l0 + 16; l++) {
                    int q = ((qs[half * 32 + l] >> (2 * s)) & 3) - (((hm[l] >> j) & 1) ? 0 : 4);
                    gs += q * a->qs[16 * g + l - l0];
                }
                sumi += sc[g] * gs;
            }
            acc += a->d * ellm_rd_f16(b + 108) * (float)sumi;
        }
        y[t * y_stride] = acc;
    }
}

static void row_q4_k(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q4_K_BYTES;
            const uint8_t *qs = b + 16;
            uint8_t sc[8], mn[8];
            ellm_unpack_k4_scales(b + 4, sc, mn);
            const ellm_act256 *a = ACT256(t, i);
            int sumi = 0, summ = 0;
            for (int c = 0; c < 4; c++) {
                int s0 = 0, s1 = 0;
                for (int l = 0; l < 32; l++) {
                    s0 += (qs[32 * c + l] & 0x0F) * a->qs[64 * c + l];
                    s1 += (qs[32 * c + l] >> 4) * a->qs[64 * c + 32 + l];
                }
                sumi += sc[2 * c] * s0 + sc[2 * c + 1] * s1;
            }
            for (int j = 0; j < 8; j++) summ += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
            acc += a->d * (ellm_rd_f16(b) * (float)sumi - ellm_rd_f16(b + 2) * (float)summ);
        }
        y[t * y_stride] = acc;
    }
}

static void row_q5_k(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q5_K_BYTES;
            const uint8_t *qh = b + 16, *qs = b + 48;
            uint8_t sc[8], mn[8];
            ellm_unpack_k4_scales(b + 4, sc, mn);
            const ellm_act256 *a = ACT256(t, i);
            int sumi = 0, summ = 0;
            for (int c = 0; c < 4; c++) {
                int s0 = 0, s1 = 0;
                for (int l = 0; l < 32; l++) {
                    int lo = (qs[32 * c + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4);
                    int hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
                    s0 += lo * a->qs[64 * c + l];
                    s1 += hi * a->qs[64 * c + 32 + l];
                }
                sumi += sc[2 * c] * s0 + sc[2 * c + 1] * s1;
            }
            for (int j = 0; j < 8; j++) summ += mn[j] * (a->bsums[2 * j] + a->bsums[2 * j + 1]);
            acc += a->d * (ellm_rd_f16(b) * (float)sumi - ellm_rd_f16(b + 2) * (float)summ);
        }
        y[t * y_stride] = acc;
    }
}

static void row_q6_k(int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride, int64_t nt,
                     float *y, size_t y_stride) {
    FOR_TOKENS {
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * Q6_K_BYTES;
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const ellm_act256 *a = ACT256(t, i);
            int sumi = 0;
            for (int g = 0; g < 16; g++) {
                int gs = 0;
                for (int e = 16 * g; e < 16 * g + 16; e++) {
                    int half = e >> 7, r = e & 127;
                    int lo = (ql[half * 64 + (r & 63)] >> (4 * (r >> 6))) & 0x0F;
                    int hi = (qh[half * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
                    gs += (lo | (hi << 4)) * a->qs[e];
                }
                /* the +32 offset of every value: 32 * sum(x) over the group */
                sumi += sc[g] * (gs - 32 * a->bsums[g]);
            }
            acc += a->d * ellm_rd_f16(b + 208) * (float)sumi;
        }
        y[t * y_stride] = acc;
    }
}

/* The block kernels: row by row, each row against every token (one accumulation order
 * per output whatever nr and nt are). */
#define DEFINE_QDOT(name, row_fn)                                                            \
    static void name(int64_t nb, const uint8_t *w, size_t w_stride, int64_t nr,                \
                     const uint8_t *x, size_t x_stride, int64_t nt, float *y, size_t y_stride) { \
        for (int64_t r = 0; r < nr; r++)                                                     \
            row_fn(nb, w + (size_t)r * w_stride, x, x_stride, nt, y + r, y_stride);          \
    }

DEFINE_QDOT(qdot_q4_0, row_q4_0)
DEFINE_QDOT(qdot_q4_1, row_q4_1)
DEFINE_QDOT(qdot_q5_0, row_q5_0)
DEFINE_QDOT(qdot_q5_1, row_q5_1)
DEFINE_QDOT(qdot_q8_0, row_q8_0)
DEFINE_QDOT(qdot_q2_k, row_q2_k)
DEFINE_QDOT(qdot_q3_k, row_q3_k)
DEFINE_QDOT(qdot_q4_k, row_q4_k)
DEFINE_QDOT(qdot_q5_k, row_q5_k)
DEFINE_QDOT(qdot_q6_k, row_q6_k)

ellm_qdot_fn ellm_qdot_scalar(int qtype) {
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

/* ====================================================================================
 * Kernel choice per level
 * ==================================================================================== */

int ellm_act_block(int qtype) {
    int64_t be = ellm_qtype_block_elems(qtype);
    return be > 1 ? (int)be : 0;
}

size_t ellm_act_row_bytes(int qtype, int64_t k) {
    switch (ellm_act_block(qtype)) {
    case QK32: return (size_t)(k / QK32) * sizeof(ellm_act32);
    case QK256: return (size_t)(k / QK256) * sizeof(ellm_act256);
    default: return 0;
    }
}

int ellm_cpu_has_vnni(void) {
    static int cached = -1; /* racing first calls store the same value */
    if (cached < 0) cached = ellm_cpu_has_avx512_vnni();  /* CPUID + XGETBV, dispatch.c */
    return cached;
}

ellm_qdot_fn ellm_qdot_select(int qtype) {
    ellm_qdot_fn f = NULL;
#ifdef ELLM_HAVE_X86_KERNELS
    int level = ellm_simd_level();
    if (level >= ELLM_SIMD_AVX512) f = ellm_qdot_avx512(qtype, ellm_cpu_has_vnni());
    if (!f && level >= ELLM_SIMD_AVX2) f = ellm_qdot_avx2(qtype);
#endif
#ifdef ELLM_HAVE_NEON_KERNELS
    if (ellm_simd_level() == ELLM_SIMD_NEON) {
        const int ext = ellm_neon_features();
        if (ext & ELLM_NEON_I8MM) f = ellm_qdot_neon_i8mm_select(qtype);
        else if (ext & ELLM_NEON_DOTPROD) f = ellm_qdot_neon_dotprod(qtype);
        if (!f) f = ellm_qdot_neon(qtype);
    }
#endif
    return f ? f : ellm_qdot_scalar(qtype);
}

ellm_qdot_fn ellm_qdot_stream_select(int qtype) {
    ellm_qdot_fn f = NULL;
#ifdef ELLM_HAVE_X86_KERNELS
    int level = ellm_simd_level();
    /* paired with ellm_qdot_select's choice, as ellm_qgemm_select is */
    if (level >= ELLM_SIMD_AVX512 && ellm_cpu_has_vnni()) f = ellm_qdot_stream_avx512(qtype, 1);
    else if (level >= ELLM_SIMD_AVX2) f = ellm_qdot_stream_avx2(qtype);
#endif
    (void)qtype;
    return f;
}

ellm_qgemm_fn ellm_qgemm_select(int qtype) {
    ellm_qgemm_fn f = NULL;
#ifdef ELLM_HAVE_X86_KERNELS
    int level = ellm_simd_level();
    /* the pair of a level's qdot kernel: AVX-512 without VNNI runs the AVX2 qdot */
    if (level >= ELLM_SIMD_AVX512 && ellm_cpu_has_vnni()) f = ellm_qgemm_avx512(qtype, 1);
    else if (level >= ELLM_SIMD_AVX2) f = ellm_qgemm_avx2(qtype);
#endif
    (void)qtype;
    return f;
}

ellm_fmm_fn ellm_fmm_select(int qtype) {
    ellm_fmm_fn f = NULL;
#ifdef ELLM_HAVE_X86_KERNELS
    int level = ellm_simd_level();
    if (level >= ELLM_SIMD_AVX512) f = ellm_fmm_avx512(qtype);
    if (!f && level >= ELLM_SIMD_AVX2) f = ellm_fmm_avx2(qtype);
#endif
    return f ? f : ellm_fmm_scalar(qtype);
}

ellm_act_fn ellm_act_select(int qtype) {
    int blk = ellm_act_block(qtype);
    if (blk == 0) return NULL;
#ifdef ELLM_HAVE_X86_KERNELS
    if (ellm_simd_level() >= ELLM_SIMD_AVX2)
        return blk == QK32 ? ellm_act32_avx2 : ellm_act256_avx2;
#endif
    return blk == QK32 ? ellm_act32_scalar : ellm_act256_scalar;
}
