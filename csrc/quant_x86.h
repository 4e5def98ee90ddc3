/* The x86 integer dot kernels, written once and compiled twice: by quant_avx2.c with
 * maddubs + madd, and by quant_avx512.c with the AVX512-VNNI forms (vpdpbusd for
 * u8 x s8 -> s32 in one step, vpdpwssd for s16 x s16 accumulated into s32), at 256 bits:
 * a 32-block is one register, and on CPUs that split 512-bit work in two the wider form
 * buys nothing here.
 *
 * The includer defines, before including this file:
 *   DOT_US8(u, s)      -> __m256i: 8 lanes of s32, each the sum of 4 products u8 x s8
 *   DOT2_S16(p0, s0, p1, s1) -> s32 lanes of madd(p0, s0) + madd(p1, s1) (s16 pairs
 *                        multiplied and summed); each result is added to the running
 *                        sum with a 1-cycle add, so no long latency chain forms
 *   KINLINE / KFUNC    -> always-inline body / kernel function qualifiers (target flags)
 *   QX_VEC_SCALE       -> 1: form block scales d * d_x with vector multiplies even at
 *                        one token (see scale8)
 *
 * Weights are made unsigned (nibbles, or |w| with the sign moved onto x for Q8_0); no
 * maddubs pair sum can saturate int16: 2 * 63 * 127 and 2 * 128 * 127 are below 32767.
 * Per-block scales are unpacked once and broadcast with byte shuffles, not rebuilt per
 * token. Each kernel body takes compile-time tile sizes (tokens, and rows for the
 * 32-block types) and is instantiated for each, so its accumulators live in registers.
 * Every output is summed in one order whatever the tile (batch invariance, see
 * quant_impl.h): at one token (decode) the 32-block kernel hides FMA latency by adding
 * blocks in pairs -- the same pairs at any token count -- never by splitting a sum over
 * accumulators that only the decode path would have. */
#ifndef ELLM_QUANT_X86_H
#define ELLM_QUANT_X86_H
#include <immintrin.h>
#include <math.h>

#include "quant_impl.h"

#define INLINE static inline __attribute__((always_inline))
/* Tokens per kernel body (one weight row against up to QX_TILE tokens) */
#define QX_TILE 4

/* ====================================================================================
 * Helpers
 * ==================================================================================== */

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE int hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

INLINE float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

INLINE float f16_at(const uint8_t *p) { return _cvtsh_ss(ellm_rd_u16(p)); }

/* 16 bytes of packed nibbles -> 32 bytes: low nibbles first, then high nibbles (the
 * element order of every 32-block type). */
INLINE __m256i nibbles32(const uint8_t *p) {
    /* the 16 bytes in both lanes (a load, no shuffle), the high lane shifted down 4 bits */
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/* 32 bits -> 32 bytes, byte j = 0x10 when bit j is set (the fifth bit of Q5 values). */
INLINE __m256i bits32_to_0x10(uint32_t bits) {
    const __m256i pick = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                           0x0101010101010101LL, 0);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* ====================================================================================
 * 32-element types. Per block and token the kernel adds
 *     acc += float(sum q * x_q) * (d * d_x)      (vector, 8 lanes)
 *     cor += c * s_x                              (scalar)
 * where q are the block's values made unsigned and c its constant term: -8 d (Q4_0),
 * m (Q4_1), -16 d (Q5_0), m (Q5_1); s_x = d_x * sum(x_q). Q8_0 has signed q: it takes
 * |q| and moves the sign onto x instead (and has no constant term).
 * Scales stay scalar: one vcvtph2ps turns the block's leading f16 pair (d and m, or d
 * and two bytes of no interest) into floats.
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

/* The block's 32 values as unsigned bytes (Q8_0: |q|; *sq gets the signed values). */
INLINE __m256i values32(int type, const uint8_t *b, __m256i *sq) {
    switch (type) {
    case ELLM_T_Q4_0: return nibbles32(b + 2);
    case ELLM_T_Q4_1: return nibbles32(b + 4);
    case ELLM_T_Q5_0: return _mm256_or_si256(nibbles32(b + 6), bits32_to_0x10(ellm_rd_u32(b + 2)));
    case ELLM_T_Q5_1: return _mm256_or_si256(nibbles32(b + 8), bits32_to_0x10(ellm_rd_u32(b + 4)));
    default:
        *sq = _mm256_loadu_si256((const __m256i *)(b + 2));
        return _mm256_abs_epi8(*sq); /* |-128| reads as 128 unsigned: still right */
    }
}

/* One 32-block's weight side, unpacked once and used for every token. */
typedef struct {
    float d, c;  /* scale, constant term (0 for Q8_0) */
    __m256 vd;   /* d in every lane */
    __m256i q;   /* values made unsigned */
    __m256i sq;  /* Q8_0: the signed values (their signs go onto x) */
} blk32;

INLINE blk32 load32(int type, const uint8_t *b) {
    blk32 k;
    /* the first 4 bytes of every block type: d, then m (or bytes we ignore) */
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)ellm_rd_u32(b)));
    k.d = _mm_cvtss_f32(dm);
    k.vd = _mm256_broadcastss_ps(dm);
    k.c = 0.0f;
    if (type == ELLM_T_Q4_0) k.c = -8.0f * k.d;
    if (type == ELLM_T_Q5_0) k.c = -16.0f * k.d;
    if (type == ELLM_T_Q4_1 || type == ELLM_T_Q5_1) k.c = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    k.sq = _mm256_setzero_si256();
    k.q = values32(type, b, &k.sq);
    return k;
}

/* d * d_x in every lane: a vector multiply by a broadcast load, or a scalar multiply
 * and a broadcast. The product is the same either way (one correctly rounded float
 * multiply), so the choice cannot break batch invariance; it is only about speed: with
 * several tokens per block the vector form saves work, at one token the scalar form is
 * faster on AVX2 (QX_VEC_SCALE, set by the includer, says which to use there). */
INLINE __m256 scale8(const blk32 *k, const ellm_act32 *a, const int nt) {
    if (QX_VEC_SCALE || nt > 1) return _mm256_mul_ps(k->vd, _mm256_broadcast_ss(&a->d));
    return _mm256_set1_ps(k->d * a->d);
}

/* float(q . x_q) of one block and token, 8 lanes */
INLINE __m256 dot32(int type, const blk32 *k, const ellm_act32 *a) {
    __m256i xq = _mm256_loadu_si256((const __m256i *)a->qs);
    if (type == ELLM_T_Q8_0) xq = _mm256_sign_epi8(xq, k->sq);
    return _mm256_cvtepi32_ps(DOT_US8(k->q, xq));
}

/* One weight row against NT tokens. The summation order of each output (fixed, for
 * batch invariance; see quant_impl.h): blocks in pairs (2j, 2j+1),
 *     acc += fma(p1, d1 dx1, p0 * d0 dx0)      cor += fmaf(c1, s1, c0 * s0)
 * then a last odd block by acc = fma(p, d dx, acc), cor = fmaf(c, s, cor), and
 * y = hsum8(acc) + cor. Adding a pair's sum keeps one add per two blocks on the
 * dependency chain, so one token (decode) walks its row without waiting on FMA latency
 * -- and one row at a time, which the hardware prefetcher streams best. */
KINLINE void qdot32(int type, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride,
                    const int nt, float *y, size_t y_stride) {
    const int bs = bytes32(type);
    const int has_c = type != ELLM_T_Q8_0;
    __m256 acc[QX_TILE];
    float cor[QX_TILE];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        cor[t] = 0.0f;
    }
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const blk32 k0 = load32(type, w + i * bs), k1 = load32(type, w + (i + 1) * bs);
        _Pragma("GCC unroll 4")
        for (int t = 0; t < nt; t++) {
            const ellm_act32 *a0 = (const ellm_act32 *)(x + (size_t)t * x_stride) + i, *a1 = a0 + 1;
            __m256 lo = _mm256_mul_ps(dot32(type, &k0, a0), scale8(&k0, a0, nt));
            acc[t] = _mm256_add_ps(acc[t], _mm256_fmadd_ps(dot32(type, &k1, a1),
                                                           scale8(&k1, a1, nt), lo));
            if (has_c) cor[t] = cor[t] + fmaf(k1.c, a1->s, k0.c * a0->s);
        }
    }
    if (i < nb) {
        const blk32 k0 = load32(type, w + i * bs);
        _Pragma("GCC unroll 4")
        for (int t = 0; t < nt; t++) {
            const ellm_act32 *a0 = (const ellm_act32 *)(x + (size_t)t * x_stride) + i;
            acc[t] = _mm256_fmadd_ps(dot32(type, &k0, a0), scale8(&k0, a0, nt), acc[t]);
            if (has_c) cor[t] = fmaf(k0.c, a0->s, cor[t]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < nt; t++) {
        float v = hsum8(acc[t]);
        y[t * y_stride] = has_c ? v + cor[t] : v;
    }
}

/* The whole (nr x nt) block from a body that takes one weight row against nt <= 4
 * tokens: rows one by one (at one token, a single sequential stream through the
 * weights), tokens four at a time. */
#define DEFINE_QDOT(name, body_fn, TYPE)                                                     \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        for (int64_t r = 0; r < nr; r++) {                                                   \
            const uint8_t *wr = w + (size_t)r * ws;                                          \
            for (int64_t t = 0; t < nt; t += 4) {                                            \
                const uint8_t *xt = x + (size_t)t * xs;                                      \
                float *yt = y + (size_t)t * ys + r;                                          \
                switch (nt - t < 4 ? nt - t : 4) {                                           \
                case 1: body_fn(TYPE, nb, wr, xt, xs, 1, yt, ys); break;                     \
                case 2: body_fn(TYPE, nb, wr, xt, xs, 2, yt, ys); break;                     \
                case 3: body_fn(TYPE, nb, wr, xt, xs, 3, yt, ys); break;                     \
                default: body_fn(TYPE, nb, wr, xt, xs, 4, yt, ys); break;                    \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_QDOT(qdot_q4_0, qdot32, ELLM_T_Q4_0)
DEFINE_QDOT(qdot_q4_1, qdot32, ELLM_T_Q4_1)
DEFINE_QDOT(qdot_q5_0, qdot32, ELLM_T_Q5_0)
DEFINE_QDOT(qdot_q5_1, qdot32, ELLM_T_Q5_1)
DEFINE_QDOT(qdot_q8_0, qdot32, ELLM_T_Q8_0)

/* ====================================================================================
 * K-quants (256-blocks against act256)
 * ==================================================================================== */

/* Q4_K / Q5_K scales: 12 bytes = words A, B, C -> 8 six-bit scales and 8 mins:
 *   sc0..3 = A & 63    sc4..7 = (C & 15) | (A >> 6) << 4
 *   mn0..3 = B & 63    mn4..7 = (C >> 4) | (B >> 6) << 4     (bytewise)
 * out: *sc16 = the 8 scales as int16 in both 128-bit lanes (for byte shuffles),
 *      *mins = the 8 mins as int16, each twice: (m0 m0 m1 m1 ... m7 m7). */
INLINE void k4_scales(const uint8_t *p, __m256i *sc16, __m256i *mins) {
    uint32_t a, b, c;
    memcpy(&a, p, 4);
    memcpy(&b, p + 4, 4);
    memcpy(&c, p + 8, 4);
    uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
    uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
    uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
    __m128i sc8 = _mm_cvtsi64_si128((long long)(((uint64_t)sc_hi << 32) | sc_lo));
    __m128i mn8 = _mm_cvtsi64_si128((long long)(((uint64_t)mn_hi << 32) | mn_lo));
    *sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc8));
    *mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
}

/* bit `bit` (a compile-time constant after inlining) of every byte -> 0x10 of that byte;
 * 16-bit shifts are safe because the mask keeps only bits that stayed in their byte */
INLINE __m256i bit_to_0x10(__m256i v, const int bit) {
    const __m256i h = _mm256_set1_epi8(0x10);
    if (bit < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - bit), h);
    if (bit > 4) return _mm256_and_si256(_mm256_srli_epi16(v, bit - 4), h);
    return _mm256_and_si256(v, h);
}

/* 16 signed 8-bit scales (one per 16 values) -> per 128-half h, the 8 scales of that
 * half as int16 in both lanes; scale_pair() then broadcasts groups (2r, 2r+1) of a
 * half into the low / high lane, matching a maddubs of a 32-run. */
INLINE void scales16_halves(const int8_t *sc, __m256i half[2]) {
    __m128i v = _mm_loadu_si128((const __m128i *)sc);
    half[0] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(v));
    half[1] = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(v, 8)));
}

INLINE __m256i scale_pair(__m256i half, const int r) {
    return _mm256_shuffle_epi8(half, _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * r + 1))),
                                                      _mm_set1_epi16((short)(0x0100 + 0x0202 * 2 * r))));
}

/* Q4_K / Q5_K: sub-block j of 32 has scale sc[j] and min mn[j]:
 *   dot = d d_x sum_j sc[j] (q_j . x_j)  -  dmin d_x sum_j mn[j] (bsum[2j] + bsum[2j+1])
 * The min term is one madd of the 16 bsums with the mins repeated pairwise. */
KINLINE void qdot_k45(int type, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride,
                     const int nt, float *y, size_t y_stride) {
    const int bs = type == ELLM_T_Q4_K ? Q4_K_BYTES : Q5_K_BYTES;
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256 acc[QX_TILE];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * bs;
        __m256i sc16, mins;
        k4_scales(b + 4, &sc16, &mins);
        const float d = f16_at(b), dmin = f16_at(b + 2);
        const uint8_t *qs = b + (type == ELLM_T_Q4_K ? 16 : 48);
        __m256i qh = _mm256_setzero_si256();
        if (type == ELLM_T_Q5_K) qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        __m256i sumi[QX_TILE];
        for (int t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            __m256i ql = _mm256_and_si256(q, lo4);
            __m256i qhi = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
            if (type == ELLM_T_Q5_K) {
                /* bit 2c of qh[l] is the 0x10 bit of element l; bit 2c+1 of element 32+l */
                ql = _mm256_or_si256(ql, bit_to_0x10(qh, 2 * c));
                qhi = _mm256_or_si256(qhi, bit_to_0x10(qh, 2 * c + 1));
            }
            /* sub-block scales 2c, 2c+1 broadcast as int16 (bytes 4c.. of sc16) */
            const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * 2 * c)));
            const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * c + 1))));
            for (int t = 0; t < nt; t++) {
                const int8_t *xq = ((const ellm_act256 *)(x + (size_t)t * x_stride) + i)->qs;
                __m256i p0 = _mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)(xq + 64 * c)));
                __m256i p1 = _mm256_maddubs_epi16(qhi, _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32)));
                sumi[t] = _mm256_add_epi32(sumi[t], DOT2_S16(p0, s0, p1, s1));
            }
        }
        for (int t = 0; t < nt; t++) {
            const ellm_act256 *a = (const ellm_act256 *)(x + (size_t)t * x_stride) + i;
            __m256i bsum = _mm256_loadu_si256((const __m256i *)a->bsums);
            __m256 fm = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsum, mins));
            __m256 fs = _mm256_cvtepi32_ps(sumi[t]);
            acc[t] = _mm256_fmadd_ps(fs, _mm256_set1_ps(d * a->d), acc[t]);
            acc[t] = _mm256_fmadd_ps(fm, _mm256_set1_ps(-dmin * a->d), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) y[t * y_stride] = hsum8(acc[t]);
}

/* Q6_K: per 128-half, ql (64 bytes) holds four 32-runs in its low / high nibbles and
 * qh (32 bytes) their top two bits at shifts 0, 2, 4, 6. Values are stored +32: the
 * offset comes off as 32 sum_g sc[g] bsum[g]. */
KINLINE void qdot_q6k_body(int type, int64_t nb, const uint8_t *w, const uint8_t *x,
                          size_t x_stride, const int nt, float *y, size_t y_stride) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    __m256 acc[QX_TILE];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * Q6_K_BYTES;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        __m256i sch[2];
        scales16_halves(sc, sch);
        __m256i sumi[QX_TILE];
        for (int t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(ql0, lo4),
                                   _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2));
            q[1] = _mm256_or_si256(_mm256_and_si256(ql1, lo4),
                                   _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), lo4),
                                   _mm256_and_si256(qh, top2));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), lo4),
                                   _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2));
            for (int r = 0; r < 4; r += 2) {
                /* groups 8h + 2r .. 8h + 2r + 3 cover runs r, r+1 */
                const __m256i s0 = scale_pair(sch[h], r), s1 = scale_pair(sch[h], r + 1);
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = ((const ellm_act256 *)(x + (size_t)t * x_stride) + i)->qs;
                    __m256i p0 = _mm256_maddubs_epi16(
                        q[r], _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * r)));
                    __m256i p1 = _mm256_maddubs_epi16(
                        q[r + 1], _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * r + 32)));
                    sumi[t] = _mm256_add_epi32(sumi[t], DOT2_S16(p0, s0, p1, s1));
                }
            }
        }
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int t = 0; t < nt; t++) {
            const ellm_act256 *a = (const ellm_act256 *)(x + (size_t)t * x_stride) + i;
            __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsums), sc16);
            __m256i tot = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(off, 5));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * a->d), acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) y[t * y_stride] = hsum8(acc[t]);
}

/* Q3_K's 12 bytes of scales -> 16 signed scales (as ellm_unpack_q3k_scales): low
 * nibbles from bytes 0..7 (then their high nibbles), 2 high bits from bytes 8..11 at
 * shifts 0, 2, 4, 6. */
INLINE void q3k_scales(const uint8_t *p, int8_t sc[16]) {
    uint64_t lo8;
    uint32_t hi4;
    memcpy(&lo8, p, 8);
    memcpy(&hi4, p + 8, 4);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    __m128i a = _mm_cvtsi64_si128((long long)lo8);
    __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(a, m4), _mm_and_si128(_mm_srli_epi16(a, 4), m4));
    /* dword lane k shifted right by 2k: bits 2k, 2k+1 of every byte land in bits 0, 1 */
    __m128i h = _mm_srlv_epi32(_mm_set1_epi32((int)hi4), _mm_setr_epi32(0, 2, 4, 6));
    h = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi8(3)), 4);
    _mm_storeu_si128((__m128i *)sc, _mm_sub_epi8(_mm_or_si128(lo, h), _mm_set1_epi8(32)));
}

/* Q2_K: per 128-half h, qs[32h .. 32h+31] holds four 32-runs at shifts 0, 2, 4, 6;
 * scale (low nibble) and min (high nibble) per 16:
 *   dot = d d_x sum_g sc[g] (q_g . x_g)  -  dmin d_x sum_g mn[g] bsum[g]
 * Q3_K: the same 2-bit runs plus a third bit from hmask (bit 4h+s of hmask[l]); the
 * value is (low | third << 2) - 4 with a signed 6-bit scale per 16, so the -4 comes off
 * as 4 sum_g sc[g] bsum[g]. */
KINLINE void qdot_k23(int type, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride,
                      const int nt, float *y, size_t y_stride) {
    const int bs = type == ELLM_T_Q2_K ? Q2_K_BYTES : Q3_K_BYTES;
    const __m256i three = _mm256_set1_epi8(3);
    __m256 acc[QX_TILE];
    for (int t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * bs;
        int8_t sc[16];
        __m256i mins16 = _mm256_setzero_si256(); /* Q2_K: the 16 mins as int16 */
        const uint8_t *qs;
        __m256i hm = _mm256_setzero_si256();
        float d, dmin = 0.0f;
        if (type == ELLM_T_Q2_K) {
            __m128i raw = _mm_loadu_si128((const __m128i *)b);
            __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
            _mm_storeu_si128((__m128i *)sc, lo);
            mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
            qs = b + 16;
            d = f16_at(b + 80);
            dmin = f16_at(b + 82);
        } else {
            q3k_scales(b + 96, sc);
            hm = _mm256_loadu_si256((const __m256i *)b);
            qs = b + 32;
            d = f16_at(b + 108);
        }
        __m256i sch[2];
        scales16_halves(sc, sch);
        __m256i sumi[QX_TILE];
        for (int t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i qv = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            __m256i q[4];
            for (int s = 0; s < 4; s++) {
                q[s] = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * s), three);
                if (type == ELLM_T_Q3_K) {
                    const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + s)));
                    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                    q[s] = _mm256_or_si256(q[s], _mm256_and_si256(set, _mm256_set1_epi8(4)));
                }
            }
            for (int s = 0; s < 4; s += 2) {
                /* groups 8h + 2s .. 8h + 2s + 3 cover runs s, s+1 */
                const __m256i s0 = scale_pair(sch[h], s), s1 = scale_pair(sch[h], s + 1);
                for (int t = 0; t < nt; t++) {
                    const int8_t *xq = ((const ellm_act256 *)(x + (size_t)t * x_stride) + i)->qs;
                    __m256i p0 = _mm256_maddubs_epi16(
                        q[s], _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * s)));
                    __m256i p1 = _mm256_maddubs_epi16(
                        q[s + 1], _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * s + 32)));
                    sumi[t] = _mm256_add_epi32(sumi[t], DOT2_S16(p0, s0, p1, s1));
                }
            }
        }
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        for (int t = 0; t < nt; t++) {
            const ellm_act256 *a = (const ellm_act256 *)(x + (size_t)t * x_stride) + i;
            __m256i bsum = _mm256_loadu_si256((const __m256i *)a->bsums);
            if (type == ELLM_T_Q2_K) {
                __m256 fm = _mm256_cvtepi32_ps(_mm256_madd_epi16(bsum, mins16));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_set1_ps(d * a->d), acc[t]);
                acc[t] = _mm256_fmadd_ps(fm, _mm256_set1_ps(-dmin * a->d), acc[t]);
            } else {
                __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(bsum, sc16), 2);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[t], off)),
                                         _mm256_set1_ps(d * a->d), acc[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) y[t * y_stride] = hsum8(acc[t]);
}

DEFINE_QDOT(qdot_q2_k, qdot_k23, ELLM_T_Q2_K)
DEFINE_QDOT(qdot_q3_k, qdot_k23, ELLM_T_Q3_K)
DEFINE_QDOT(qdot_q4_k, qdot_k45, ELLM_T_Q4_K)
DEFINE_QDOT(qdot_q5_k, qdot_k45, ELLM_T_Q5_K)
DEFINE_QDOT(qdot_q6_k, qdot_q6k_body, ELLM_T_Q6_K)

#endif
