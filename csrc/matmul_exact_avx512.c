/* AVX-512 row dequantizers for the exact-activation path (matmul_exact.c): the same
 * float operations as quant.c's scalar ones (a multiply, then an add where the type has
 * an offset; never fused), so the values are bit-identical, 16 lanes at a time. */
#include <immintrin.h>

#include "quant_impl.h"

#define INLINE static inline __attribute__((always_inline))

typedef void (*dq_row_fn)(const uint8_t *src, float *dst, int64_t n);
dq_row_fn ellm_dq_row_avx512(int qtype);

INLINE float f16_at(const uint8_t *p) { return _cvtsh_ss(ellm_rd_u16(p)); }

/* 16 bytes of nibbles -> the low nibbles (elements 0..15) and high (16..31) as int32 */
INLINE void nibbles(const uint8_t *p, __m512i *lo, __m512i *hi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(0x0F);
    *lo = _mm512_cvtepu8_epi32(_mm_and_si128(v, m));
    *hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), m));
}

/* bits 0..15 of h -> 16 in lanes whose bit is set */
INLINE __m512i bit16(uint32_t h) { return _mm512_maskz_set1_epi32((__mmask16)(h & 0xFFFF), 16); }

static void dq_q4_0(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += Q4_0_BYTES, y += 32) {
        const __m512 d = _mm512_set1_ps(f16_at(b));
        __m512i lo, hi;
        nibbles(b + 2, &lo, &hi);
        const __m512i eight = _mm512_set1_epi32(8);
        _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight))));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight))));
    }
}

static void dq_q4_1(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += Q4_1_BYTES, y += 32) {
        const __m512 d = _mm512_set1_ps(f16_at(b)), m = _mm512_set1_ps(f16_at(b + 2));
        __m512i lo, hi;
        nibbles(b + 4, &lo, &hi);
        _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
        _mm512_storeu_ps(y + 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
    }
}

static void dq_q5_0(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += Q5_0_BYTES, y += 32) {
        const __m512 d = _mm512_set1_ps(f16_at(b));
        const uint32_t qh = ellm_rd_u32(b + 2);
        __m512i lo, hi;
        nibbles(b + 6, &lo, &hi);
        const __m512i sixteen = _mm512_set1_epi32(16);
        lo = _mm512_sub_epi32(_mm512_or_si512(lo, bit16(qh)), sixteen);
        hi = _mm512_sub_epi32(_mm512_or_si512(hi, bit16(qh >> 16)), sixteen);
        _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
    }
}

static void dq_q5_1(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += Q5_1_BYTES, y += 32) {
        const __m512 d = _mm512_set1_ps(f16_at(b)), m = _mm512_set1_ps(f16_at(b + 2));
        const uint32_t qh = ellm_rd_u32(b + 4);
        __m512i lo, hi;
        nibbles(b + 8, &lo, &hi);
        lo = _mm512_or_si512(lo, bit16(qh));
        hi = _mm512_or_si512(hi, bit16(qh >> 16));
        _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
        _mm512_storeu_ps(y + 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
    }
}

static void dq_q8_0(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += Q8_0_BYTES, y += 32) {
        const __m512 d = _mm512_set1_ps(f16_at(b));
        const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)));
        const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)));
        _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0)));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1)));
    }
}

/* Q4_K: per 64 elements c, scale / min pairs (2c, 2c+1): y = (d sc) q - (dmin mn), the
 * products d sc and dmin mn rounded first, as dq_q4_k forms them */
static void dq_q4_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += Q4_K_BYTES, y += 256) {
        const float d = f16_at(b), dmin = f16_at(b + 2);
        uint8_t sc[8], mn[8];
        ellm_unpack_k4_scales(b + 4, sc, mn);
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++) {
            const __m512 d0 = _mm512_set1_ps(d * sc[2 * c]), m0 = _mm512_set1_ps(dmin * mn[2 * c]);
            const __m512 d1 = _mm512_set1_ps(d * sc[2 * c + 1]), m1 = _mm512_set1_ps(dmin * mn[2 * c + 1]);
            for (int h = 0; h < 2; h++) {
                const __m128i v = _mm_loadu_si128((const __m128i *)(qs + 32 * c + 16 * h));
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(0x0F)));
                const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)));
                _mm512_storeu_ps(y + 64 * c + 16 * h, _mm512_sub_ps(_mm512_mul_ps(d0, _mm512_cvtepi32_ps(lo)), m0));
                _mm512_storeu_ps(y + 64 * c + 32 + 16 * h,
                                 _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(hi)), m1));
            }
        }
    }
}

/* Q6_K: element e of half H, r = e & 127: low nibble of ql[64 H + (r & 63)] at shift
 * 4 (r >> 6), two high bits of qh[32 H + (r & 31)] at shift 2 (r >> 5); y = (d sc) (q - 32)
 * with d sc rounded first (dq_q6_k: d * (float)sc * (float)(q - 32), left to right) */
static void dq_q6_k(const uint8_t *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b += Q6_K_BYTES, y += 256) {
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        for (int H = 0; H < 2; H++) {
            const uint8_t *ql = b + 64 * H, *qh = b + 128 + 32 * H;
            for (int s = 0; s < 8; s++) { /* 16 elements r = 16 s .. 16 s + 15 */
                const int r0 = 16 * s;
                const __m128i l = _mm_loadu_si128((const __m128i *)(ql + (r0 & 63)));
                const __m128i hb = _mm_loadu_si128((const __m128i *)(qh + (r0 & 31)));
                __m512i lo = _mm512_cvtepu8_epi32(l), hi = _mm512_cvtepu8_epi32(hb);
                lo = _mm512_and_si512(_mm512_srli_epi32(lo, 4 * (r0 >> 6)), _mm512_set1_epi32(0x0F));
                hi = _mm512_and_si512(_mm512_srli_epi32(hi, 2 * (r0 >> 5)), _mm512_set1_epi32(3));
                const __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)),
                                                   _mm512_set1_epi32(32));
                const int e0 = 128 * H + r0;
                const __m512 ds = _mm512_set1_ps(d * (float)sc[e0 >> 4]);
                _mm512_storeu_ps(y + e0, _mm512_mul_ps(ds, _mm512_cvtepi32_ps(q)));
            }
        }
    }
}

/* ====================================================================================
 * Few tokens: the row dequantized in registers (32-element types) or one block at a time
 * into L1 (K-quants) and multiplied by each token at once, with the chains and the final
 * reduction of matmul_avx512.c's f32 kernel (elements [32 j, 32 j + 16) into chain 0,
 * [32 j + 16, 32 j + 32) into chain 1, y = reduce_add(chain 0 + chain 1)): the same
 * bits as dequantizing the row and running that kernel, which the many-token path does.
 * ==================================================================================== */

#define FT 4 /* tokens per pass */

/* one 32-element block's values, as dq_q*'s compute them. The 4- and 5-bit types look
 * their values up in a table of the 16 or 32 possible ones, each formed by the scalar
 * code's operations (d * q, then + m) -- the same bits for fewer instructions. */
INLINE void block32(int type, const uint8_t *b, __m512 *lo, __m512 *hi) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (type == ELLM_T_Q8_0) {
        const __m512 d = _mm512_set1_ps(f16_at(b));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2)))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18)))));
        return;
    }
    const int off = type == ELLM_T_Q4_0 ? 2 : type == ELLM_T_Q4_1 ? 4 : type == ELLM_T_Q5_0 ? 6 : 8;
    /* vpermps reads the low 4 bits of each index (vpermt2ps 5): the byte itself for the
     * low nibble, shifted for the high one */
    __m512i il = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + off)));
    __m512i ih = _mm512_srli_epi32(il, 4);
    const __m512 d = _mm512_set1_ps(f16_at(b));
    if (type == ELLM_T_Q4_0 || type == ELLM_T_Q4_1) {
        const __m512 t = type == ELLM_T_Q4_0
                             ? _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)))
                             : _mm512_add_ps(_mm512_mul_ps(d, iota), _mm512_set1_ps(f16_at(b + 2)));
        *lo = _mm512_permutexvar_ps(il, t);
        *hi = _mm512_permutexvar_ps(ih, t);
        return;
    }
    /* Q5: the fifth bit selects the upper table */
    const uint32_t qh = ellm_rd_u32(b + (type == ELLM_T_Q5_1 ? 4 : 2));
    il = _mm512_and_si512(il, _mm512_set1_epi32(15));
    il = _mm512_mask_or_epi32(il, (__mmask16)(qh & 0xFFFF), il, _mm512_set1_epi32(16));
    ih = _mm512_mask_or_epi32(ih, (__mmask16)(qh >> 16), ih, _mm512_set1_epi32(16));
    __m512 t0, t1;
    if (type == ELLM_T_Q5_0) {
        t0 = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(16.0f)));
        t1 = _mm512_mul_ps(d, iota);
    } else {
        const __m512 m = _mm512_set1_ps(f16_at(b + 2));
        t0 = _mm512_add_ps(_mm512_mul_ps(d, iota), m);
        t1 = _mm512_add_ps(_mm512_mul_ps(d, _mm512_add_ps(iota, _mm512_set1_ps(16.0f))), m);
    }
    *lo = _mm512_permutex2var_ps(t0, il, t1);
    *hi = _mm512_permutex2var_ps(t0, ih, t1);
}

INLINE int block_bytes(int type) {
    switch (type) {
    case ELLM_T_Q4_0: return Q4_0_BYTES;
    case ELLM_T_Q4_1: return Q4_1_BYTES;
    case ELLM_T_Q5_0: return Q5_0_BYTES;
    case ELLM_T_Q5_1: return Q5_1_BYTES;
    case ELLM_T_Q8_0: return Q8_0_BYTES;
    case ELLM_T_Q4_K: return Q4_K_BYTES;
    default: return Q6_K_BYTES;
    }
}

/* R weight rows (ws bytes apart) against nt tokens, R * nt <= FT: each (row, token)
 * keeps its own two chains, so several rows side by side at one token only add
 * independent work for the FMA latency to hide behind */
INLINE void fused_tile(int type, int64_t k, const uint8_t *w, size_t ws, const int R, const float *x,
                       size_t xs, const int nt, float *y, size_t ys) {
    const int bs = block_bytes(type);
    /* R rows side by side, each advancing one block a step, which the hardware
     * prefetcher follows poorly: fetch the next R rows (contiguous, as the item's rows
     * are) at the pace these are read, as quant_x86.h's qdot32_rows8 does. An address
     * formed as an integer: it may lie past the weights' end, and a prefetch never faults. */
    const uintptr_t next = (uintptr_t)w + (uintptr_t)R * ws;
    __m512 a0[FT][FT], a1[FT][FT];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4")
        for (int t = 0; t < nt; t++) a0[r][t] = a1[r][t] = _mm512_setzero_ps();
    if (type == ELLM_T_Q4_K || type == ELLM_T_Q6_K) {
        float v[FT][256] __attribute__((aligned(64)));
        for (int64_t i = 0; i < k / 256; i++) {
            for (uintptr_t o = (uintptr_t)(R * bs) * (uintptr_t)i; o < (uintptr_t)(R * bs) * (uintptr_t)(i + 1); o += 64)
                _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const uint8_t *b = w + (size_t)r * ws + (size_t)i * (size_t)bs;
                if (type == ELLM_T_Q4_K) dq_q4_k(b, v[r], 1);
                else dq_q6_k(b, v[r], 1);
            }
            for (int c = 0; c < 256; c += 32) {
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++) {
                    const __m512 lo = _mm512_load_ps(v[r] + c), hi = _mm512_load_ps(v[r] + c + 16);
                    _Pragma("GCC unroll 4")
                    for (int t = 0; t < nt; t++) {
                        const float *xt = x + (size_t)t * xs + 256 * i + c;
                        a0[r][t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xt), a0[r][t]);
                        a1[r][t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xt + 16), a1[r][t]);
                    }
                }
            }
        }
    } else {
        for (int64_t i = 0; i < k / 32; i++) {
            for (uintptr_t o = (uintptr_t)(R * bs) * (uintptr_t)i; o < (uintptr_t)(R * bs) * (uintptr_t)(i + 1); o += 64)
                _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                __m512 lo, hi;
                block32(type, w + (size_t)r * ws + (size_t)i * (size_t)bs, &lo, &hi);
                _Pragma("GCC unroll 4")
                for (int t = 0; t < nt; t++) {
                    const float *xt = x + (size_t)t * xs + 32 * i;
                    a0[r][t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xt), a0[r][t]);
                    a1[r][t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xt + 16), a1[r][t]);
                }
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 4")
        for (int t = 0; t < nt; t++)
            y[(size_t)t * ys + (size_t)r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][t], a1[r][t]));
}

ellm_fmm_fn ellm_exact_fused_avx512(int qtype);

/* one token: rows four at a time; more tokens: one row against up to FT tokens */
#define FUSED_FN(name, TYPE)                                                                 \
    static void name(int64_t k, const uint8_t *w, size_t ws, int64_t nr, const float *x,      \
                     size_t xs, int64_t nt, float *y, size_t ys) {                            \
        if (nt == 1) {                                                                       \
            int64_t r = 0;                                                                   \
            for (; r + FT <= nr; r += FT)                                                    \
                fused_tile(TYPE, k, w + (size_t)r * ws, ws, FT, x, xs, 1, y + r, ys);        \
            for (; r < nr; r++) fused_tile(TYPE, k, w + (size_t)r * ws, ws, 1, x, xs, 1, y + r, ys); \
            return;                                                                          \
        }                                                                                    \
        for (int64_t r = 0; r < nr; r++)                                                     \
            for (int64_t t = 0; t < nt; t += FT) {                                           \
                const float *xt = x + (size_t)t * xs;                                        \
                float *yt = y + (size_t)t * ys + (size_t)r;                                  \
                const uint8_t *wr = w + (size_t)r * ws;                                      \
                switch (nt - t < FT ? nt - t : FT) {                                         \
                case 1: fused_tile(TYPE, k, wr, ws, 1, xt, xs, 1, yt, ys); break;            \
                case 2: fused_tile(TYPE, k, wr, ws, 1, xt, xs, 2, yt, ys); break;            \
                case 3: fused_tile(TYPE, k, wr, ws, 1, xt, xs, 3, yt, ys); break;            \
                default: fused_tile(TYPE, k, wr, ws, 1, xt, xs, 4, yt, ys); break;           \
                }                                                                            \
            }                                                                                \
    }
_Static_assert(FT == 4, "FUSED_FN spells out the cases 1..4");

FUSED_FN(fused_q4_0, ELLM_T_Q4_0)
FUSED_FN(fused_q4_1, ELLM_T_Q4_1)
FUSED_FN(fused_q5_0, ELLM_T_Q5_0)
FUSED_FN(fused_q5_1, ELLM_T_Q5_1)
FUSED_FN(fused_q8_0, ELLM_T_Q8_0)
FUSED_FN(fused_q4_k, ELLM_T_Q4_K)
FUSED_FN(fused_q6_k, ELLM_T_Q6_K)

ellm_fmm_fn ellm_exact_fused_avx512(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return fused_q4_0;
    case ELLM_T_Q4_1: return fused_q4_1;
    case ELLM_T_Q5_0: return fused_q5_0;
    case ELLM_T_Q5_1: return fused_q5_1;
    case ELLM_T_Q8_0: return fused_q8_0;
    case ELLM_T_Q4_K: return fused_q4_k;
    case ELLM_T_Q6_K: return fused_q6_k;
    default: return NULL;
    }
}

#define ROW_FN(name, fn, BLK)                                                                \
    static void name(const uint8_t *src, float *dst, int64_t n) { fn(src, dst, n / (BLK)); }

ROW_FN(row_q4_0, dq_q4_0, 32)
ROW_FN(row_q4_1, dq_q4_1, 32)
ROW_FN(row_q5_0, dq_q5_0, 32)
ROW_FN(row_q5_1, dq_q5_1, 32)
ROW_FN(row_q8_0, dq_q8_0, 32)
ROW_FN(row_q4_k, dq_q4_k, 256)
ROW_FN(row_q6_k, dq_q6_k, 256)

dq_row_fn ellm_dq_row_avx512(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return row_q4_0;
    case ELLM_T_Q4_1: return row_q4_1;
    case ELLM_T_Q5_0: return row_q5_0;
    case ELLM_T_Q5_1: return row_q5_1;
    case ELLM_T_Q8_0: return row_q8_0;
    case ELLM_T_Q4_K: return row_q4_k;
    case ELLM_T_Q6_K: return row_q6_k;
    default: return NULL;
    }
}
