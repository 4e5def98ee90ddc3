/* The x86 integer dot kernels, written once and compiled twice: by quant_avx2.c with
 * maddubs + madd, and by quant_avx512.c with the AVX512-VNNI forms (vpdpbusd for
 * u8 x s8 -> s32 in one step, vpdpwssd for s16 x s16 accumulated into s32). Their common
 * form is 256 bits, a 32-block to a register; with QX_ZMM the 512-bit level adds its own
 * forms where they measured faster (Zen 5: two 512-bit VNNI pipes): 32-element rows in
 * pairs, the K-quants' decode (qdot_kz_rows) and the token groups in pairs.
 *
 * The includer defines, before including this file:
 *   DOT_US8(u, s)      -> __m256i: 8 lanes of s32, each the sum of 4 products u8 x s8
 *   DOT2_S16(p0, s0, p1, s1) -> s32 lanes of madd(p0, s0) + madd(p1, s1) (s16 pairs
 *                        multiplied and summed); each result is added to the running
 *                        sum with a 1-cycle add, so no long latency chain forms
 *   KINLINE / KFUNC    -> always-inline body / kernel function qualifiers (target flags)
 *   QX_VNNI            -> 1: the prefill kernel of the 32-element types accumulates with
 *                        vpdpbusd; 0: maddubs into int16, then madd into int32
 *   QX_ROWS            -> weight rows per register tile of that kernel (registers: 16
 *                        on AVX2, 32 with AVX-512VL)
 *   QX_GROUPS, QX_ZMM  -> (quant_avx512.c) token groups per pass; 1: the 512-bit forms
 *
 * Weights are made unsigned (nibbles, or |w| with the sign moved onto x for Q8_0); no
 * maddubs pair sum can saturate int16: 2 * 63 * 127 and 2 * 128 * 127 are below 32767.
 * Per-block scales are unpacked once and broadcast with byte shuffles, not rebuilt per
 * token. Each kernel body takes compile-time tile sizes (tokens, and rows for the
 * 32-block types) and is instantiated for each, so its accumulators live in registers.
 * Every output is summed in one order whatever the tile (batch invariance, see
 * quant_impl.h), never by splitting a sum over accumulators that only one path has. */
#ifndef ELLM_QUANT_X86_H
#define ELLM_QUANT_X86_H
#include <immintrin.h>
#include <math.h>

#include "quant_impl.h"

#define INLINE static inline __attribute__((always_inline))
/* Tokens per pass of a decode kernel body over its weights (a few-token call) */
#define QX_TILE 4

/* FN(args..., xt, xs, n, yt, ys) for the nt tokens of x (rows xs bytes apart) and y
 * (rows ys floats apart), QX_TILE at a time: n is a constant in each call, so the body's
 * per-token accumulators are instantiated for it and stay in registers. */
#define QX_FOR_TOKEN_TILES(nt, x, xs, y, ys, FN, ...)                                        \
    for (int64_t t_ = 0; t_ < (nt); t_ += QX_TILE) {                                         \
        const uint8_t *xt_ = (x) + (size_t)t_ * (xs);                                        \
        float *yt_ = (y) + (size_t)t_ * (ys);                                                \
        switch ((nt) - t_ < QX_TILE ? (nt) - t_ : QX_TILE) {                                 \
        case 1: FN(__VA_ARGS__, xt_, xs, 1, yt_, ys); break;                                 \
        case 2: FN(__VA_ARGS__, xt_, xs, 2, yt_, ys); break;                                 \
        case 3: FN(__VA_ARGS__, xt_, xs, 3, yt_, ys); break;                                 \
        default: FN(__VA_ARGS__, xt_, xs, 4, yt_, ys); break;                                \
        }                                                                                    \
    }
_Static_assert(QX_TILE == 4, "QX_FOR_TOKEN_TILES spells out the cases 1..4");

/* ====================================================================================
 * Helpers
 * ==================================================================================== */

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

/* Software prefetch distance of the K-quant decode kernels that read one row at a time
 * (all but the K-quants at one token on AVX2, which read 4: qdot_k_rows):
 * a weight row (and the rows after it, which follow it in memory) is fetched this many
 * bytes ahead of the block being read. benchmarks/bench_stream.py: 2 threads read 14.8
 * GB/s with the hardware prefetcher alone and 19.2 with 2048 bytes of software prefetch.
 * (The 32-element types' decode kernel reads 8 rows side by side and fetches the next 8
 * ahead instead: qdot32_rows8.) */
#define QX_PF_BYTES 2048

/* Prefetches [p + QX_PF_BYTES, p + QX_PF_BYTES + n) (n > 0), one touch per cache line
 * (a line touched twice by two calls costs one load-port slot). The address is formed
 * as an integer: it may lie past the end of the weights, and a prefetch never faults. */
INLINE void prefetch_ahead(const uint8_t *p, const int n) {
    const uintptr_t a = (uintptr_t)p + QX_PF_BYTES;
    for (int o = 0; o < n; o += 64) _mm_prefetch((const char *)(a + (uintptr_t)o), _MM_HINT_T0);
}

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
 * 32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Every output is summed block by
 * block, in block order, as
 *     isum = q . x_q                                (the block's exact integer dot)
 *     acc  = fma(float(isum), d * d_x, acc)         cor = fma(c, s_x, cor)
 * and y = acc + cor (Q8_0, which has no constant term: y = acc). q are the block's
 * values made unsigned (Q8_0: signed, through |q| and the sign moved onto x), c its
 * constant term: -8 d (Q4_0), m (Q4_1), -16 d (Q5_0), m (Q5_1); s_x = d_x * sum(x_q).
 * float(isum) is exact (|isum| <= 32 * 128 * 127 < 2^24), so how the integer dot is
 * formed never shows; the float ops per output are the same one multiply and two FMAs
 * per block in every kernel (decode puts 8 weight rows in the vector lanes, prefill 8
 * tokens) and at every x86 level, so decode, prefill and batched decode agree bit for
 * bit. One float op per block and output (rather than per 4 products) is what lets
 * prefill run at the integer units' speed.
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

/* Q5 values: the nibbles at p, plus 16 where bit j of `bits` is set. With AVX-512BW the
 * bits are the byte mask of one masked add, in place of bits32_to_0x10's five operations:
 * Q5_0 decode (T=1, 8-row tiles), one thread, weights in cache, best of 400 by thread CPU
 * time, AMD EPYC: 1536x640 37.3 -> 31.8 us, 4096x640 96.8 -> 82.1 us. (From DRAM, two
 * threads, Gemma 3's layers stay at ~22 GB/s either way.) */
INLINE __m256i q5_values32(const uint8_t *p, uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i n = nibbles32(p);
    return _mm256_mask_add_epi8(n, (__mmask32)bits, n, _mm256_set1_epi8(0x10));
#else
    return _mm256_or_si256(nibbles32(p), bits32_to_0x10(bits));
#endif
}

/* Where the 16 nibble bytes and the fifth bits (Q5) of a 32-element block start */
INLINE int nibbles_at32(int type) {
    return type == ELLM_T_Q4_0 ? 2 : type == ELLM_T_Q4_1 ? 4 : type == ELLM_T_Q5_0 ? 6 : 8;
}
INLINE int fifth_bits_at32(int type) { return type == ELLM_T_Q5_0 ? 2 : 4; }

/* The block's 32 values as unsigned bytes (Q8_0: |q|; *sq gets the signed values). */
INLINE __m256i values32(int type, const uint8_t *b, __m256i *sq) {
    switch (type) {
    case ELLM_T_Q4_0:
    case ELLM_T_Q4_1: return nibbles32(b + nibbles_at32(type));
    case ELLM_T_Q5_0:
    case ELLM_T_Q5_1: return q5_values32(b + nibbles_at32(type), ellm_rd_u32(b + fifth_bits_at32(type)));
    default:
        *sq = _mm256_loadu_si256((const __m256i *)(b + 2));
        return _mm256_abs_epi8(*sq); /* |-128| reads as 128 unsigned: still right */
    }
}

/* The constant term c from d and the block's second f16 (m; ignored where there is none) */
INLINE float const32(int type, float d, float m) {
    switch (type) {
    case ELLM_T_Q4_0: return -8.0f * d;
    case ELLM_T_Q5_0: return -16.0f * d;
    case ELLM_T_Q4_1:
    case ELLM_T_Q5_1: return m;
    default: return 0.0f;
    }
}

/* lane j = the sum of v[j]'s 8 lanes */
INLINE __m256i hsum8x8_epi32(const __m256i v[8]) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    /* a: (rows 0-3 over lanes 0-3 | rows 0-3 over lanes 4-7), b likewise for rows 4-7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                            _mm256_permute2x128_si256(a, b, 0x31));
}

/* ------------------------------------------------------------------------------------
 * Decode: 8 weight rows (lane j = row j) against nt <= QX_TILE tokens, each block of the
 * 8 rows unpacked once for all nt. Row nr - 1 stands in for the rows past nr (computed,
 * never stored), so every load stays inside w.
 *
 * The block's exact integer dots of the 8 rows come from one of two cores. At 256 bits
 * each row's 32 values take a register and the 8 rows' lanes are summed by
 * hsum8x8_epi32. At 512 bits (QX_ZMM) rows j and j + 4 share a register, against the
 * token's block in both halves: 4 unpacks and 4 dots a block in place of 8, and one
 * reduction of 4 registers. One thread, weights in cache, in-process A/B (AMD EPYC Zen 5):
 * Q5_0 1024x640 at T=1 1.42x, Q4_1 1536x576 1.45x, Q8_0 1.12-1.15x, at T=4 1.5-1.8x.
 * The float steps after them are the same, so the outputs are too.
 * ------------------------------------------------------------------------------------ */

#if QX_ZMM
/* 32 bytes (8 floats) at lo in the low half, at hi in the high half */
KINLINE __m512i qx_pair_epi8(const int8_t *lo, const int8_t *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}
KINLINE __m512 qx_pair_ps(const float *lo, const float *hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(lo))),
                                               _mm256_castps_pd(_mm256_loadu_ps(hi)), 1));
}

/* The block's values of rows b0 (low half) and b1 (high half) as unsigned bytes; Q8_0:
 * |q|, with *neg the bytes where q < 0 (the token's value is negated there instead). */
KINLINE __m512i values32_rowpair(int type, const uint8_t *b0, const uint8_t *b1, __mmask64 *neg) {
    if (type == ELLM_T_Q8_0) {
        const __m512i q = qx_pair_epi8((const int8_t *)(b0 + 2), (const int8_t *)(b1 + 2));
        *neg = _mm512_movepi8_mask(q);
        return _mm512_abs_epi8(q); /* |-128| reads as 128 unsigned: still right */
    }
    /* b0's 16 nibble bytes in 128-bit lanes 0-1 and b1's in lanes 2-3 (two loads, no
     * shuffle), the odd lanes shifted down 4 bits: each row's low nibbles, then its high */
    const int at = nibbles_at32(type);
    __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b0 + at)));
    v = _mm512_mask_broadcast_i32x4(v, 0xFF00, _mm_loadu_si128((const __m128i *)(b1 + at)));
    v = _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4));
    v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    if (type == ELLM_T_Q5_0 || type == ELLM_T_Q5_1) { /* + 16 where the fifth bit is set */
        const int hb = fifth_bits_at32(type);
        const __mmask64 bits = (__mmask64)ellm_rd_u32(b0 + hb) | (__mmask64)ellm_rd_u32(b1 + hb) << 32;
        v = _mm512_mask_add_epi8(v, bits, v, _mm512_set1_epi8(0x10));
    }
    return v;
}

typedef struct {
    __m512i q[4];      /* rows k (low half) and k + 4 (high half) */
    __mmask64 neg[4];  /* Q8_0: the negative weights */
} rows8_values;

KINLINE void rows8_unpack(int type, const uint8_t *const wr[8], size_t off, rows8_values *v) {
    _Pragma("GCC unroll 4")
    for (int k = 0; k < 4; k++) {
        v->neg[k] = 0;
        v->q[k] = values32_rowpair(type, wr[k] + off, wr[k + 4] + off, &v->neg[k]);
    }
}

/* lane j = row j's exact dot with the token's block xq */
KINLINE __m256i rows8_isum(int type, const rows8_values *v, const int8_t *xq) {
    const __m512i x2 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xq));
    __m512i p[4];
    _Pragma("GCC unroll 4")
    for (int k = 0; k < 4; k++)
        p[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v->q[k],
                                   type == ELLM_T_Q8_0 ? _mm512_mask_sub_epi8(x2, v->neg[k], _mm512_setzero_si512(), x2)
                                                       : x2);
    /* 128-bit lane L of s: the sums over L's 4 dwords of rows 0-3 (L = 0, 1) or 4-7 (2, 3) */
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    const __m512i u = _mm512_shuffle_i64x2(s, s, _MM_SHUFFLE(3, 1, 2, 0)); /* lanes 0 2 | 1 3 */
    return _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
}
#else
typedef struct {
    __m256i q[8], sq[8]; /* row j's unsigned values; Q8_0: its signed ones in sq */
} rows8_values;

KINLINE void rows8_unpack(int type, const uint8_t *const wr[8], size_t off, rows8_values *v) {
    _Pragma("GCC unroll 8")
    for (int j = 0; j < 8; j++) {
        v->sq[j] = _mm256_setzero_si256();
        v->q[j] = values32(type, wr[j] + off, &v->sq[j]);
    }
}

KINLINE __m256i rows8_isum(int type, const rows8_values *v, const int8_t *xq8) {
    const __m256i xq = _mm256_loadu_si256((const __m256i *)xq8);
    __m256i p[8];
    _Pragma("GCC unroll 8")
    for (int j = 0; j < 8; j++)
        p[j] = DOT_US8(v->q[j], type == ELLM_T_Q8_0 ? _mm256_sign_epi8(xq, v->sq[j]) : xq);
    return hsum8x8_epi32(p);
}
#endif

KINLINE void qdot32_rows8(int type, int64_t nb, const uint8_t *w, size_t ws, int nr,
                          const uint8_t *x, size_t xs, const int nt, float *y, size_t ys) {
    const int bs = bytes32(type);
    const int has_c = type != ELLM_T_Q8_0;
    /* the 8 rows' leading f16 pair (d, then m or bytes of no interest) -> halves in the
     * order d0..d7 m0..m7 */
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const uint8_t *wr[8];
    _Pragma("GCC unroll 8")
    for (int j = 0; j < 8; j++) wr[j] = w + (size_t)(j < nr ? j : nr - 1) * ws;
    const uintptr_t next = (uintptr_t)w + 8 * ws; /* the next 8 rows (rows are ws apart) */
    __m256 acc[QX_TILE], cor[QX_TILE];
    _Pragma("GCC unroll 4")
    for (int t = 0; t < nt; t++) acc[t] = cor[t] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const size_t off = (size_t)i * (size_t)bs;
        /* 8 rows advance together, each by only bs bytes a step, which the hardware
         * prefetcher follows poorly: fetch the next 8 rows (contiguous) at the pace
         * these are read. An address computed as an integer, as it may lie past w's
         * end; a prefetch never faults. */
        for (size_t o = 8 * off; o < 8 * (off + (size_t)bs); o += 64)
            _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
        rows8_values v;
        rows8_unpack(type, wr, off, &v);
        __m256i dm = _mm256_setr_epi32((int)ellm_rd_u32(wr[0] + off), (int)ellm_rd_u32(wr[1] + off),
                                       (int)ellm_rd_u32(wr[2] + off), (int)ellm_rd_u32(wr[3] + off),
                                       (int)ellm_rd_u32(wr[4] + off), (int)ellm_rd_u32(wr[5] + off),
                                       (int)ellm_rd_u32(wr[6] + off), (int)ellm_rd_u32(wr[7] + off));
        dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dm, split), _MM_SHUFFLE(3, 1, 2, 0));
        const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
        __m256 c = _mm256_setzero_ps();
        if (type == ELLM_T_Q4_1 || type == ELLM_T_Q5_1)
            c = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
        else if (has_c) /* -8 d, -16 d: exact, as const32's */
            c = _mm256_mul_ps(_mm256_set1_ps(const32(type, 1.0f, 0.0f)), d);
        _Pragma("GCC unroll 4")
        for (int t = 0; t < nt; t++) {
            const ellm_act32 *a = (const ellm_act32 *)(x + (size_t)t * xs) + i;
            const __m256i isum = rows8_isum(type, &v, a->qs);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(a->d)),
                                     acc[t]);
            if (has_c) cor[t] = _mm256_fmadd_ps(c, _mm256_set1_ps(a->s), cor[t]);
        }
    }
    _Pragma("GCC unroll 4")
    for (int t = 0; t < nt; t++) {
        float out[8] __attribute__((aligned(32)));
        _mm256_store_ps(out, has_c ? _mm256_add_ps(acc[t], cor[t]) : acc[t]);
        for (int j = 0; j < nr; j++) y[(size_t)t * ys + (size_t)j] = out[j];
    }
}

/* Decode, one row at a time: the same sums as qdot32_rows8 (the block's 8 lanes summed
 * in integers first), for weights streamed from DRAM, where one sequential read per
 * thread keeps the hardware prefetcher ahead best. */
KINLINE void qdot32_row1(int type, int64_t nb, const uint8_t *w, const ellm_act32 *x, float *y) {
    const int bs = bytes32(type);
    const int has_c = type != ELLM_T_Q8_0;
    float acc = 0.0f, cor = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + (size_t)i * (size_t)bs;
        const ellm_act32 *a = x + i;
        const __m256i xq = _mm256_loadu_si256((const __m256i *)a->qs);
        __m256i sq = _mm256_setzero_si256();
        const __m256i q = values32(type, b, &sq);
        const int isum = hsum8_epi32(DOT_US8(q, type == ELLM_T_Q8_0 ? _mm256_sign_epi8(xq, sq) : xq));
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)ellm_rd_u32(b)));
        const float d = _mm_cvtss_f32(dm);
        acc = fmaf((float)isum, d * a->d, acc);
        if (has_c) cor = fmaf(const32(type, d, _mm_cvtss_f32(_mm_movehdup_ps(dm))), a->s, cor);
    }
    *y = has_c ? acc + cor : acc;
}

/* A decode kernel reading one row at a time (ROW1(TYPE, nb, w, x, y): one row, one token,
 * x an ACT block array) */
#define DEFINE_QDOT_STREAM(name, ROW1, ACT, TYPE)                                            \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        for (int64_t t = 0; t < nt; t++)                                                     \
            for (int64_t r = 0; r < nr; r++)                                                 \
                ROW1(TYPE, nb, w + (size_t)r * ws, (const ACT *)(x + (size_t)t * xs),       \
                     y + (size_t)t * ys + (size_t)r);                                        \
    }

DEFINE_QDOT_STREAM(qdots_q4_0, qdot32_row1, ellm_act32, ELLM_T_Q4_0)
DEFINE_QDOT_STREAM(qdots_q4_1, qdot32_row1, ellm_act32, ELLM_T_Q4_1)
DEFINE_QDOT_STREAM(qdots_q5_0, qdot32_row1, ellm_act32, ELLM_T_Q5_0)
DEFINE_QDOT_STREAM(qdots_q5_1, qdot32_row1, ellm_act32, ELLM_T_Q5_1)
DEFINE_QDOT_STREAM(qdots_q8_0, qdot32_row1, ellm_act32, ELLM_T_Q8_0)

/* This level's one-row decode kernel for qtype (the 32-element types), or NULL. */
static inline ellm_qdot_fn qdot_stream_kernel(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return qdots_q4_0;
    case ELLM_T_Q4_1: return qdots_q4_1;
    case ELLM_T_Q5_0: return qdots_q5_0;
    case ELLM_T_Q5_1: return qdots_q5_1;
    case ELLM_T_Q8_0: return qdots_q8_0;
    default: return NULL;
    }
}

#define DEFINE_QDOT32(name, TYPE)                                                            \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        for (int64_t r = 0; r < nr; r += 8) {                                                \
            const int n8 = nr - r < 8 ? (int)(nr - r) : 8;                                   \
            QX_FOR_TOKEN_TILES(nt, x, xs, y + r, ys, qdot32_rows8, TYPE, nb, w + (size_t)r * ws, \
                               ws, n8)                                                       \
        }                                                                                    \
    }

DEFINE_QDOT32(qdot_q4_0, ELLM_T_Q4_0)
DEFINE_QDOT32(qdot_q4_1, ELLM_T_Q4_1)
DEFINE_QDOT32(qdot_q5_0, ELLM_T_Q5_0)
DEFINE_QDOT32(qdot_q5_1, ELLM_T_Q5_1)
#if QX_ZMM
DEFINE_QDOT32(qdot_q8_0, ELLM_T_Q8_0)
#else /* one token: qdot_q8_rows4 (below, after hsum4x8_epi32) */
DEFINE_QDOT32(qdot_q8_0_tiles, ELLM_T_Q8_0)
#endif

/* ------------------------------------------------------------------------------------
 * Prefill / batched decode: R weight rows against a group of ELLM_TG tokens (lane t =
 * token t), activations in the group layout (ellm_act32x8): a block's dword m of all 8
 * tokens is one vector, so broadcasting the weight block's dword m and one u8 x s8
 * 4-way dot (vpdpbusd, or maddubs + madd) adds that dword's products for 8 tokens at
 * once -- no horizontal sums. Each row's block is unpacked once per group into L1 and
 * read back by broadcast loads (load ports, no ALU work).
 * ------------------------------------------------------------------------------------ */

/* maddubs pair sums of one dword step reach 2 * 15 * 127 (Q4), 2 * 31 * 127 (Q5) or
 * 2 * 128 * 127 (Q8_0); this many steps add up in int16 without overflow */
INLINE int s16_steps(int type) {
    switch (type) {
    case ELLM_T_Q4_0:
    case ELLM_T_Q4_1: return 8;
    case ELLM_T_Q5_0:
    case ELLM_T_Q5_1: return 4;
    default: return 1;
    }
}

/* Blocks unpacked ahead into L1 per register tile: the broadcast loads then read
 * stores long retired (a load from the middle of a store still in flight waits for it). */
#define QX_CHUNK 32

/* The token-group kernels fetch each weight block this many row tiles ahead as they
 * unpack it: a batched decode reads its weights from memory once, at a pace the hardware
 * prefetcher does not keep up with, and one request per block spreads the misses out
 * (a burst per chunk filled the miss buffers). SmolLM2 at T=16, one thread: Q4_1 layers
 * 29.6 -> 19.5 ms with the two-group tiles, the Q8_0 head 11.6 -> 8.7 ms. The address is
 * computed as an integer, as it may lie past w's end; a prefetch never faults. */
#define QX_PREFETCH_TILES 4

/* A 32-element block's scale d and constant term c; the block `ahead` bytes on (the same
 * one QX_PREFETCH_TILES row tiles later) is asked for, into L2 (T1): requests into L1 wait
 * for its few miss buffers. Q8_0 65536x640 at T=16 from DRAM, one thread: 145 -> 182-204
 * GFLOP/s; in the model at 16 rows, 2 threads, alternated: SmolLM2's head 3.70-3.95 ->
 * 2.62-3.18 ms, Gemma 3's 19.5-22.3 -> 16.3-18.4 ms; weights in cache: unchanged. */
INLINE void block32_scales(int type, const uint8_t *b, size_t ahead, float *d, float *c) {
    _mm_prefetch((const char *)((uintptr_t)b + ahead), _MM_HINT_T1);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)ellm_rd_u32(b)));
    *d = _mm_cvtss_f32(dm);
    *c = const32(type, *d, _mm_cvtss_f32(_mm_movehdup_ps(dm)));
}

/* Token groups one unpacking of a weight tile serves in the K-quant kernels below
 * (QX_GROUPS of the includer, 1 when it sets none): with 2, a batched decode step of 16
 * sequences unpacks and broadcasts each weight dword once for both its groups, and the
 * accumulators (4 rows x 2 groups x 2) still fit in AVX-512VL's 32 registers. (The
 * 32-element types pair their groups in 512-bit lanes instead: QX_ZMM.) */
#ifndef QX_GROUPS
#define QX_GROUPS 1
#endif

/* R <= 4 rows (the arrays below are sized for 4; QX_ROWS is at most 4) */
KINLINE void qgemm32_tile(int type, const int R, int64_t nb, const uint8_t *w, size_t ws,
                          const ellm_act32x8 *xg, const int nt, float *y, size_t ys) {
    const int bs = bytes32(type);
    const int has_c = type != ELLM_T_Q8_0;
    __m256 acc[4], cor[4];
    /* per block and row: the unsigned values, then (Q8_0) the signed ones; d and c */
    uint8_t wbuf[QX_CHUNK][4][2][32] __attribute__((aligned(32)));
    float dbuf[QX_CHUNK][4], cbuf[QX_CHUNK][4];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) acc[r] = cor[r] = _mm256_setzero_ps();
    for (int64_t i0 = 0; i0 < nb; i0 += QX_CHUNK) {
        const int nc = nb - i0 < QX_CHUNK ? (int)(nb - i0) : QX_CHUNK;
        for (int ii = 0; ii < nc; ii++) {
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const uint8_t *b = w + (size_t)r * ws + (size_t)(i0 + ii) * (size_t)bs;
                block32_scales(type, b, (size_t)(QX_PREFETCH_TILES * R) * ws, &dbuf[ii][r], &cbuf[ii][r]);
                __m256i sq = _mm256_setzero_si256();
                _mm256_store_si256((__m256i *)wbuf[ii][r][0], values32(type, b, &sq));
                if (type == ELLM_T_Q8_0) _mm256_store_si256((__m256i *)wbuf[ii][r][1], sq);
            }
        }
        /* GCC would otherwise forward the stores and broadcast from registers (two
         * shuffles per dword); the loads from L1 cost no ALU work */
        __asm__("" : "+m"(wbuf));
        for (int ii = 0; ii < nc; ii++) {
            const ellm_act32x8 *g = xg + i0 + ii;
            __m256i isum[4];
#if !QX_VNNI
            __m256i s16[4];
            const int G = s16_steps(type);
#endif
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8")
            for (int m = 0; m < 8; m++) {
                const __m256i xm = _mm256_loadu_si256((const __m256i *)(g->qs + 32 * m));
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++) {
                    const __m256i wm = _mm256_set1_epi32((int)ellm_rd_u32(wbuf[ii][r][0] + 4 * m));
                    __m256i xs = xm;
                    if (type == ELLM_T_Q8_0)
                        xs = _mm256_sign_epi8(
                            xm, _mm256_set1_epi32((int)ellm_rd_u32(wbuf[ii][r][1] + 4 * m)));
#if QX_VNNI
                    isum[r] = _mm256_dpbusd_epi32(isum[r], wm, xs);
#else
                    const __m256i p = _mm256_maddubs_epi16(wm, xs);
                    s16[r] = m % G == 0 ? p : _mm256_add_epi16(s16[r], p);
                    if (m % G == G - 1)
                        isum[r] = _mm256_add_epi32(isum[r],
                                                   _mm256_madd_epi16(s16[r], _mm256_set1_epi16(1)));
#endif
                }
            }
            const __m256 dx = _mm256_loadu_ps(g->d), sx = _mm256_loadu_ps(g->s);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]),
                                         _mm256_mul_ps(_mm256_set1_ps(dbuf[ii][r]), dx), acc[r]);
                if (has_c) cor[r] = _mm256_fmadd_ps(_mm256_set1_ps(cbuf[ii][r]), sx, cor[r]);
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        float out[ELLM_TG] __attribute__((aligned(32)));
        _mm256_store_ps(out, has_c ? _mm256_add_ps(acc[r], cor[r]) : acc[r]);
        for (int t = 0; t < nt; t++) y[(size_t)t * ys + (size_t)r] = out[t];
    }
}

#if QX_ZMM
/* ------------------------------------------------------------------------------------
 * The same pass with two token groups in the lanes of one 512-bit register (the group at
 * xg in lanes 0-7, the one xgs bytes on in lanes 8-15): half the instructions of two
 * 256-bit groups, and on a CPU that runs 512-bit VNNI at full width (AMD Zen 4: 224
 * against 150 G multiply-adds a second per core, measured) more of them at once. R <=
 * QX_ZROWS rows; n1 tokens in the second group. Every lane does the same integer sums
 * (exact) and the same float steps as qgemm32_tile's, so the outputs are bit-identical.
 * Q8_0 moves the sign the other way: the activations are made unsigned (x + 128) and meet
 * the signed weights, and 128 * (the block's weight sum) comes off the exact sum. One
 * thread, weights in cache, T=16: Q8_0 131-149 -> 177-217 GFLOP/s, Q4_1 about the same;
 * SmolLM2's Q8_0 head at T=16 8.4-9.9 -> 7.2-7.4 ms.
 * ------------------------------------------------------------------------------------ */
/* rows per tile: 8 was faster with the weights in cache but slower streaming them from
 * memory (SmolLM2's Q4_1 layers at T=16, one thread: 22.6-26.6 ms against 18.9-20.8) */
#define QX_ZROWS 4
_Static_assert(QX_ZROWS == 4, "QX_ZROW_TILES spells out the remainders 1..3");
/* sum of the 32 signed bytes at p */
KINLINE int32_t qx_sum_i8x32(const uint8_t *p) {
    const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), _mm256_set1_epi8((char)0x80));
    const __m256i q = _mm256_sad_epu8(u, _mm256_setzero_si256()); /* 4 sums of 8 (v + 128) */
    const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    return (int32_t)(_mm_cvtsi128_si64(h) + _mm_extract_epi64(h, 1)) - 32 * 128;
}

/* One 32-element block of QX_ZROWS weight rows, unpacked for the broadcast loads: the
 * unsigned values (Q8_0: the signed ones), d, c and (Q8_0) 128 * the weight sum. */
typedef struct {
    uint8_t v[QX_ZROWS][32] __attribute__((aligned(32))); /* (a struct of 192 bytes) */
    float d[QX_ZROWS], c[QX_ZROWS];
    int32_t o[QX_ZROWS];
} qx_zblock;

/* Blocks [0, nb) of R rows (ws bytes apart) into zb. */
KINLINE void qgemm32z_unpack(int type, const int R, int64_t nb, const uint8_t *w, size_t ws, qx_zblock *zb) {
    const int bs = bytes32(type);
    for (int64_t ii = 0; ii < nb; ii++) {
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            const uint8_t *b = w + (size_t)r * ws + (size_t)ii * (size_t)bs;
            block32_scales(type, b, (size_t)(QX_PREFETCH_TILES * R) * ws, &zb[ii].d[r], &zb[ii].c[r]);
            if (type == ELLM_T_Q8_0) {
                _mm256_store_si256((__m256i *)zb[ii].v[r], _mm256_loadu_si256((const __m256i *)(b + 2)));
                zb[ii].o[r] = 128 * qx_sum_i8x32(b + 2);
            } else {
                __m256i sq = _mm256_setzero_si256();
                _mm256_store_si256((__m256i *)zb[ii].v[r], values32(type, b, &sq));
            }
        }
    }
}

/* acc, cor (R,) += unpacked blocks zb[0, nb) against the token-group pair at xg
 * (blocks [0, nb) of it) and xgs bytes on. */
KINLINE void qgemm32z_blocks(int type, const int R, int64_t nb, const qx_zblock *zb, const ellm_act32x8 *xg,
                             size_t xgs, __m512 *acc, __m512 *cor) {
    const int q8 = type == ELLM_T_Q8_0;
    const ellm_act32x8 *xg1 = (const ellm_act32x8 *)((const uint8_t *)xg + xgs);
    for (int64_t ii = 0; ii < nb; ii++) {
        const ellm_act32x8 *g0 = xg + ii, *g1 = xg1 + ii;
        __m512i isum[QX_ZROWS];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m++) {
            __m512i xm = qx_pair_epi8(g0->qs + 32 * m, g1->qs + 32 * m);
            if (q8) xm = _mm512_xor_si512(xm, _mm512_set1_epi8((char)0x80));
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const __m512i wm = _mm512_set1_epi32((int)ellm_rd_u32(zb[ii].v[r] + 4 * m));
                isum[r] = q8 ? _mm512_dpbusd_epi32(isum[r], xm, wm) : _mm512_dpbusd_epi32(isum[r], wm, xm);
            }
        }
        const __m512 dx = qx_pair_ps(g0->d, g1->d), sx = qx_pair_ps(g0->s, g1->s);
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            if (q8) isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(zb[ii].o[r]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]),
                                     _mm512_mul_ps(_mm512_set1_ps(zb[ii].d[r]), dx), acc[r]);
            if (!q8) cor[r] = _mm512_fmadd_ps(_mm512_set1_ps(zb[ii].c[r]), sx, cor[r]);
        }
    }
}

/* qgemm32z_blocks for two pairs at once (xa and xb, each a pair of groups xgs bytes
 * apart), each weight dword broadcast once for both: eight independent dpbusd chains
 * instead of four. With four, a block's eight dependent dpbusd per row bound the loop
 * by their latency (a CPU with two 512-bit VNNI pipes, AMD Zen 5, ran qgemm_q4_1 at 38%
 * of its dpbusd rate); every output's sums and float steps are those of
 * qgemm32z_blocks, so the bits are too. acc, cor: (2, QX_ZROWS), pair a first. */
KINLINE void qgemm32z_blocks_2p(int type, const int R, int64_t nb, const qx_zblock *zb, const ellm_act32x8 *xa,
                                const ellm_act32x8 *xb, size_t xgs, __m512 *acc, __m512 *cor) {
    const int q8 = type == ELLM_T_Q8_0;
    const ellm_act32x8 *xa1 = (const ellm_act32x8 *)((const uint8_t *)xa + xgs);
    const ellm_act32x8 *xb1 = (const ellm_act32x8 *)((const uint8_t *)xb + xgs);
    for (int64_t ii = 0; ii < nb; ii++) {
        const ellm_act32x8 *a0 = xa + ii, *a1 = xa1 + ii, *b0 = xb + ii, *b1 = xb1 + ii;
        __m512i sa[QX_ZROWS], sb[QX_ZROWS];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) sa[r] = sb[r] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m++) {
            __m512i xma = qx_pair_epi8(a0->qs + 32 * m, a1->qs + 32 * m);
            __m512i xmb = qx_pair_epi8(b0->qs + 32 * m, b1->qs + 32 * m);
            if (q8) {
                xma = _mm512_xor_si512(xma, _mm512_set1_epi8((char)0x80));
                xmb = _mm512_xor_si512(xmb, _mm512_set1_epi8((char)0x80));
            }
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const __m512i wm = _mm512_set1_epi32((int)ellm_rd_u32(zb[ii].v[r] + 4 * m));
                sa[r] = q8 ? _mm512_dpbusd_epi32(sa[r], xma, wm) : _mm512_dpbusd_epi32(sa[r], wm, xma);
                sb[r] = q8 ? _mm512_dpbusd_epi32(sb[r], xmb, wm) : _mm512_dpbusd_epi32(sb[r], wm, xmb);
            }
        }
        const __m512 dxa = qx_pair_ps(a0->d, a1->d), dxb = qx_pair_ps(b0->d, b1->d);
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            if (q8) {
                sa[r] = _mm512_sub_epi32(sa[r], _mm512_set1_epi32(zb[ii].o[r]));
                sb[r] = _mm512_sub_epi32(sb[r], _mm512_set1_epi32(zb[ii].o[r]));
            }
            const __m512 dr = _mm512_set1_ps(zb[ii].d[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa[r]), _mm512_mul_ps(dr, dxa), acc[r]);
            acc[QX_ZROWS + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sb[r]), _mm512_mul_ps(dr, dxb),
                                                acc[QX_ZROWS + r]);
        }
        if (!q8) {
            const __m512 sxa = qx_pair_ps(a0->s, a1->s), sxb = qx_pair_ps(b0->s, b1->s);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const __m512 cr = _mm512_set1_ps(zb[ii].c[r]);
                cor[r] = _mm512_fmadd_ps(cr, sxa, cor[r]);
                cor[QX_ZROWS + r] = _mm512_fmadd_ps(cr, sxb, cor[QX_ZROWS + r]);
            }
        }
    }
}

/* The R rows' outputs v (R,) of a pair: tokens [0, ELLM_TG) and [ELLM_TG, ELLM_TG + n1). */
KINLINE void qx_store_pair(const int R, const __m512 *v, const int n1, float *y, size_t ys) {
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) {
        float out[2 * ELLM_TG] __attribute__((aligned(64)));
        _mm512_store_ps(out, v[r]);
        for (int t = 0; t < ELLM_TG; t++) y[(size_t)t * ys + (size_t)r] = out[t];
        for (int t = 0; t < n1; t++) y[(size_t)(ELLM_TG + t) * ys + (size_t)r] = out[ELLM_TG + t];
    }
}

/* ... of the 32-element types: acc + cor (Q8_0: acc) */
KINLINE void qgemm32z_store(int type, const int R, const __m512 *acc, const __m512 *cor, const int n1, float *y,
                            size_t ys) {
    __m512 v[QX_ZROWS];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) v[r] = type == ELLM_T_Q8_0 ? acc[r] : _mm512_add_ps(acc[r], cor[r]);
    qx_store_pair(R, v, n1, y, ys);
}

KINLINE void qgemm32z_tile(int type, const int R, int64_t nb, const uint8_t *w, size_t ws,
                           const ellm_act32x8 *xg, size_t xgs, const int n1, float *y, size_t ys) {
    const int bs = bytes32(type);
    __m512 acc[QX_ZROWS], cor[QX_ZROWS];
    qx_zblock zb[QX_CHUNK] __attribute__((aligned(64)));
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++) acc[r] = cor[r] = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < nb; i0 += QX_CHUNK) {
        const int nc = nb - i0 < QX_CHUNK ? (int)(nb - i0) : QX_CHUNK;
        qgemm32z_unpack(type, R, nc, w + (size_t)i0 * (size_t)bs, ws, zb);
        __asm__("" : "+m"(zb)); /* read back by broadcast loads, as in qgemm32_tile */
        qgemm32z_blocks(type, R, nc, zb, xg + i0, xgs, acc, cor);
    }
    qgemm32z_store(type, R, acc, cor, n1, y, ys);
}

/* A call of two or more token pairs unpacks each row tile once for all of them, this many
 * blocks at a time (4 rows x 64 blocks = 12 KiB of stack, in L1), rather than once per
 * pair: the unpack was ~10% of a prefill kernel's time. One thread, T=64
 * and 512, Q4_1 / Q5_0 / Q8_0 at SmolLM2's shapes, alternating builds: medians 177 -> 216
 * and 166 -> 193 GFLOP/s (a noisy host; single runs spread +-20%). */
#define QX_REUSE_BLOCKS 64

/* Pairs run against one unpacking of a chunk of blocks; their sums wait in acc, cor
 * between chunks (8 pairs: 128 tokens, a prefill item) */
#define QX_BATCH_PAIRS 8

/* R rows against the pairs p = 0 .. np - 1 (groups 2p and 2p + 1 of x, xs bytes apart;
 * the last pair's second group has n1_last tokens): for each batch of pairs, the rows'
 * blocks QX_REUSE_BLOCKS at a time, each chunk unpacked once for the whole batch. The same
 * sums, in the same order, as one qgemm32z_tile per pair. */
KINLINE void qgemm32z_rows_pairs(int type, const int R, int64_t nb, const uint8_t *w, size_t ws, const uint8_t *x,
                                 size_t xs, int64_t np, int n1_last, float *y, size_t ys) {
    const int bs = bytes32(type);
    /* Two pairs store 32 tokens' outputs per row tile. Token rows a multiple of 512
     * floats apart put those 32 lines in at most two L1 sets, which then evict each other
     * from row tile to row tile (1536 x 576: 0.88x); such widths keep one pair at a time
     * (matmul.c stages multiples of 1024 into a buffer, where pairs of pairs run). */
    const int two_pairs = ys % 512 != 0;
    qx_zblock zb[QX_REUSE_BLOCKS] __attribute__((aligned(64)));
    __m512 acc[QX_BATCH_PAIRS][QX_ZROWS], cor[QX_BATCH_PAIRS][QX_ZROWS];
    for (int64_t p0 = 0; p0 < np; p0 += QX_BATCH_PAIRS) {
        const int64_t p1 = np - p0 < QX_BATCH_PAIRS ? np : p0 + QX_BATCH_PAIRS;
        for (int64_t p = p0; p < p1; p++)
            _Pragma("GCC unroll 4")
            for (int r = 0; r < QX_ZROWS; r++) acc[p - p0][r] = cor[p - p0][r] = _mm512_setzero_ps();
        for (int64_t i0 = 0; i0 < nb; i0 += QX_REUSE_BLOCKS) {
            const int64_t nc = nb - i0 < QX_REUSE_BLOCKS ? nb - i0 : QX_REUSE_BLOCKS;
            qgemm32z_unpack(type, R, nc, w + (size_t)i0 * (size_t)bs, ws, zb);
            __asm__("" : "+m"(zb));
            /* a pair's outputs are stored as soon as its last chunk is summed: stored in
             * one burst after the batch, rows 1536 floats apart ran half as fast */
            const int last = i0 + nc == nb;
            int64_t p = p0;
            for (; two_pairs && p + 2 <= p1; p += 2) {
                const uint8_t *xp = x + (size_t)(2 * p) * xs;
                qgemm32z_blocks_2p(type, R, nc, zb, (const ellm_act32x8 *)xp + i0,
                                   (const ellm_act32x8 *)(xp + 2 * xs) + i0, xs, acc[p - p0], cor[p - p0]);
                if (last) {
                    qgemm32z_store(type, R, acc[p - p0], cor[p - p0], ELLM_TG, y + (size_t)(2 * p * ELLM_TG) * ys, ys);
                    qgemm32z_store(type, R, acc[p + 1 - p0], cor[p + 1 - p0], p + 2 == np ? n1_last : ELLM_TG,
                                   y + (size_t)((2 * p + 2) * ELLM_TG) * ys, ys);
                }
            }
            for (; p < p1; p++) {
                qgemm32z_blocks(type, R, nc, zb, (const ellm_act32x8 *)(x + (size_t)(2 * p) * xs) + i0, xs,
                                acc[p - p0], cor[p - p0]);
                if (last)
                    qgemm32z_store(type, R, acc[p - p0], cor[p - p0], p + 1 == np ? n1_last : ELLM_TG,
                                   y + (size_t)(2 * p * ELLM_TG) * ys, ys);
            }
        }
    }
}

/* CALL(TYPE, R, r) over the rows [0, nr): tiles of QX_ZROWS rows from r = 0, then the
 * last 1..3 rows as one tile (R a constant in every call) */
#define QX_ZROW_TILES(CALL, TYPE)                                                            \
    {                                                                                        \
        int64_t r = 0;                                                                       \
        for (; r + QX_ZROWS <= nr; r += QX_ZROWS) CALL(TYPE, QX_ZROWS, r);                   \
        switch (nr - r) {                                                                    \
        case 1: CALL(TYPE, 1, r); break;                                                     \
        case 2: CALL(TYPE, 2, r); break;                                                     \
        case 3: CALL(TYPE, 3, r); break;                                                     \
        default: break;                                                                      \
        }                                                                                    \
    }

/* The rows of one two-group pass in 512-bit lanes (n1 tokens in its second group) */
#define QGEMM32Z_TILE_AT(TYPE, R, r) qgemm32z_tile(TYPE, R, nb, w + (size_t)(r) * ws, ws, xg, xs, n1, yt + (r), ys)
/* R rows from r against every pair of the call (np, n1 in scope) */
#define QGEMM32Z_PAIRS_AT(TYPE, R, r) \
    qgemm32z_rows_pairs(TYPE, R, nb, w + (size_t)(r) * ws, ws, x, xs, np, n1, y + (r), ys)
#endif

/* The rows of one pass over one token group: QX_ROWS at a time, then the rest. */
#define QGEMM32_ROWS(TYPE, n)                                                                \
    {                                                                                        \
        int64_t r = 0;                                                                       \
        for (; r + QX_ROWS <= nr; r += QX_ROWS)                                              \
            qgemm32_tile(TYPE, QX_ROWS, nb, w + (size_t)r * ws, ws, xg, n, yt + r, ys);      \
        switch (nr - r) {                                                                    \
        case 1: qgemm32_tile(TYPE, 1, nb, w + (size_t)r * ws, ws, xg, n, yt + r, ys); break; \
        case 2: qgemm32_tile(TYPE, 2, nb, w + (size_t)r * ws, ws, xg, n, yt + r, ys); break; \
        case 3: qgemm32_tile(TYPE, 3, nb, w + (size_t)r * ws, ws, xg, n, yt + r, ys); break; \
        default: break;                                                                      \
        }                                                                                    \
    }

#if QX_ZMM
/* groups two at a time in 512-bit lanes, the last odd one alone */
#define QGEMM32_PAIRS(TYPE)                                                                  \
    if (nt > 3 * ELLM_TG) {                                                                  \
        /* two or more pairs: each row tile unpacked once for all of them */                 \
        const int64_t np = (nt + ELLM_TG - 1) / (2 * ELLM_TG); /* as the loop below counts */ \
        const int n1 = nt - (2 * np - 1) * ELLM_TG < ELLM_TG ? (int)(nt - (2 * np - 1) * ELLM_TG) : ELLM_TG; \
        QX_ZROW_TILES(QGEMM32Z_PAIRS_AT, TYPE)                                               \
        t = 2 * np * ELLM_TG;                                                                \
    }                                                                                        \
    for (; nt - t > ELLM_TG; t += 2 * ELLM_TG) {                                             \
        const ellm_act32x8 *xg = (const ellm_act32x8 *)(x + (size_t)(t / ELLM_TG) * xs);      \
        const int n1 = nt - t - ELLM_TG < ELLM_TG ? (int)(nt - t - ELLM_TG) : ELLM_TG;       \
        float *yt = y + (size_t)t * ys;                                                      \
        QX_ZROW_TILES(QGEMM32Z_TILE_AT, TYPE)                                                \
    }
#else
#define QGEMM32_PAIRS(TYPE)
#endif

/* The whole (nr x nt) block: token groups of ELLM_TG (x: groups of nb ellm_act32x8,
 * xs bytes apart), and within a group (or a pair of them) the rows QX_ROWS at a time,
 * so the groups' activations stay in L1 while the rows stream past. */
#define DEFINE_QGEMM32(name, TYPE)                                                           \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        int64_t t = 0;                                                                       \
        QGEMM32_PAIRS(TYPE)                                                                  \
        for (; t < nt; t += ELLM_TG) {                                                       \
            const ellm_act32x8 *xg = (const ellm_act32x8 *)(x + (size_t)(t / ELLM_TG) * xs);  \
            const int n = nt - t < ELLM_TG ? (int)(nt - t) : ELLM_TG;                        \
            float *yt = y + (size_t)t * ys;                                                  \
            QGEMM32_ROWS(TYPE, n)                                                            \
        }                                                                                    \
    }

#if !QX_VNNI
/* ------------------------------------------------------------------------------------
 * Q4_0, Q4_1, Q5_0 and Q5_1, many tokens, at the AVX2 level, on qgemm_q8_0's scheme
 * (below): a panel of up to QXN_PANEL weight rows is unpacked QXN_CHUNK blocks at a time
 * (the values as unsigned bytes, d and c) once for all the call's token groups (up to
 * QXN_GROUPS at once, their float sums waiting in memory between chunks), and each
 * chunk runs against the groups QXN_TG at a time, one row at a time: one broadcast of a
 * weight dword serves 32 tokens, and the groups' activations stay in L1 across the
 * panel's rows. (qgemm32_tile, which the VNNI level keeps, unpacks every block once per
 * 8-token group.) The constant terms' FMAs, which need no integer work, run apart, a
 * chunk at a time, so the tile's 4 groups keep their int16 runs and float sums in
 * registers.
 *
 * AMD EPYC Zen 3, one thread, thread CPU time, qgemm32_tile and this alternated in one
 * process, items of 16 rows x 128 tokens as matmul.c runs them, T=512, same bits (load
 * ~8-10 from other work): 576x1536, 1536x576 and 2048x2048, Q4_0 1.71-1.75x, Q4_1
 * 1.66-1.78x (62-90 -> 110-159 GFLOP/s), Q5_0 1.67-1.76x, Q5_1 1.61-1.73x; SmolLM2's
 * (Q4_1) prefill of 512 at 2 threads, alternated, 117 -> 182 tok/s (1.56x) under that load.
 *
 * Each output gets qgemm32_tile's integer sums (exact: maddubs pair sums of s16_steps
 * steps stay below 2^15) and its float steps, acc = fma(isum, d d_x, acc) and cor =
 * fma(c, s_x, cor) block by block in block order from 0, y = acc + cor, so the bits are
 * those of the decode kernels and of any batch or thread split.
 * ------------------------------------------------------------------------------------ */
#define QXN_PANEL 16
#define QXN_CHUNK 8
#define QXN_GROUPS 16
#define QXN_TG 4

/* acc[g * QXN_PANEL] (g < NG) += the integer parts of nc blocks of one row (values at
 * v[ii * QXN_PANEL], d at d[ii * QXN_PANEL]) against the groups at xg (the first
 * group's first block of the chunk; the next group xs bytes on) */
KINLINE void qxn_tile(const int type, const int NG, const int nc, const uint8_t (*v)[32], const float *d,
                      const ellm_act32x8 *xg, size_t xs, __m256 *acc) {
    const int G = s16_steps(type);
    __m256 a[QXN_TG];
    _Pragma("GCC unroll 4")
    for (int gi = 0; gi < NG; gi++) a[gi] = acc[gi * QXN_PANEL];
    for (int ii = 0; ii < nc; ii++) {
        const uint8_t *b = v[ii * QXN_PANEL];
        const ellm_act32x8 *x[QXN_TG];
        __m256i isum[QXN_TG], s16[QXN_TG];
        _Pragma("GCC unroll 4")
        for (int gi = 0; gi < NG; gi++) {
            x[gi] = (const ellm_act32x8 *)((const uint8_t *)xg + (size_t)gi * xs) + ii;
            isum[gi] = _mm256_setzero_si256();
        }
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m++) {
            const __m256i wm = _mm256_set1_epi32((int)ellm_rd_u32(b + 4 * m));
            _Pragma("GCC unroll 4")
            for (int gi = 0; gi < NG; gi++) {
                const __m256i p = _mm256_maddubs_epi16(wm, _mm256_loadu_si256((const __m256i *)(x[gi]->qs + 32 * m)));
                s16[gi] = m % G == 0 ? p : _mm256_add_epi16(s16[gi], p);
                /* one running sum in a register (see qx8_tile) */
                __asm__("" : "+x"(s16[gi]));
                if (m % G == G - 1)
                    isum[gi] = _mm256_add_epi32(isum[gi], _mm256_madd_epi16(s16[gi], _mm256_set1_epi16(1)));
            }
        }
        _Pragma("GCC unroll 4")
        for (int gi = 0; gi < NG; gi++)
            a[gi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[gi]),
                                    _mm256_mul_ps(_mm256_set1_ps(d[ii * QXN_PANEL]), _mm256_loadu_ps(x[gi]->d)),
                                    a[gi]);
    }
    _Pragma("GCC unroll 4")
    for (int gi = 0; gi < NG; gi++) acc[gi * QXN_PANEL] = a[gi];
}

/* The whole (nr x nt) block: tokens QXN_GROUPS groups at a time, rows a panel at a time */
KINLINE void qgemm32_panels(const int type, int64_t nb, const uint8_t *w, size_t ws, int64_t nr,
                            const uint8_t *x, size_t xs, int64_t nt, float *y, size_t ys) {
    const int bs = bytes32(type);
    uint8_t vbuf[QXN_CHUNK][QXN_PANEL][32] __attribute__((aligned(32)));
    float dbuf[QXN_CHUNK][QXN_PANEL], cbuf[QXN_CHUNK][QXN_PANEL];
    __m256 acc[QXN_GROUPS][QXN_PANEL], cor[QXN_GROUPS][QXN_PANEL];
    for (int64_t t0 = 0; t0 < nt; t0 += QXN_GROUPS * ELLM_TG) {
        const int64_t tn = nt - t0 < QXN_GROUPS * ELLM_TG ? nt - t0 : QXN_GROUPS * ELLM_TG;
        const int ng = (int)((tn + ELLM_TG - 1) / ELLM_TG);
        const uint8_t *xt = x + (size_t)(t0 / ELLM_TG) * xs;
        for (int64_t r0 = 0; r0 < nr; r0 += QXN_PANEL) {
            const int np = nr - r0 < QXN_PANEL ? (int)(nr - r0) : QXN_PANEL;
            const uint8_t *wp = w + (size_t)r0 * ws;
            for (int g = 0; g < ng; g++)
                for (int r = 0; r < np; r++) acc[g][r] = cor[g][r] = _mm256_setzero_ps();
            for (int64_t i0 = 0; i0 < nb; i0 += QXN_CHUNK) {
                const int nc = nb - i0 < QXN_CHUNK ? (int)(nb - i0) : QXN_CHUNK;
                for (int r = 0; r < np; r++)
                    for (int ii = 0; ii < nc; ii++) {
                        const uint8_t *b = wp + (size_t)r * ws + (size_t)(i0 + ii) * (size_t)bs;
                        block32_scales(type, b, (size_t)QXN_PANEL * ws, &dbuf[ii][r], &cbuf[ii][r]);
                        __m256i sq = _mm256_setzero_si256(); /* (Q8_0 only) */
                        _mm256_store_si256((__m256i *)vbuf[ii][r], values32(type, b, &sq));
                    }
                __asm__("" : "+m"(vbuf)); /* read back by broadcast loads (see qgemm32_tile) */
                for (int g = 0; g < ng; g++) {
                    const ellm_act32x8 *xg = (const ellm_act32x8 *)(xt + (size_t)g * xs) + i0;
                    for (int ii = 0; ii < nc; ii++) {
                        const __m256 sx = _mm256_loadu_ps(xg[ii].s);
                        for (int r = 0; r < np; r++)
                            cor[g][r] = _mm256_fmadd_ps(_mm256_set1_ps(cbuf[ii][r]), sx, cor[g][r]);
                    }
                }
                for (int g = 0; g < ng; g += QXN_TG) {
                    const int whole = ng - g >= QXN_TG; /* else the last groups one at a time */
                    for (int gg = g; gg < (whole ? g + 1 : ng); gg++) {
                        const ellm_act32x8 *xg = (const ellm_act32x8 *)(xt + (size_t)gg * xs) + i0;
                        for (int r = 0; r < np; r++) {
                            if (whole) qxn_tile(type, QXN_TG, nc, &vbuf[0][r], &dbuf[0][r], xg, xs, &acc[gg][r]);
                            else qxn_tile(type, 1, nc, &vbuf[0][r], &dbuf[0][r], xg, xs, &acc[gg][r]);
                        }
                    }
                }
            }
            for (int g = 0; g < ng; g++) {
                const int n = tn - (int64_t)g * ELLM_TG < ELLM_TG ? (int)(tn - (int64_t)g * ELLM_TG) : ELLM_TG;
                float *yg = y + (size_t)(t0 + (int64_t)g * ELLM_TG) * ys + (size_t)r0;
                for (int r = 0; r < np; r++) {
                    float out[ELLM_TG] __attribute__((aligned(32)));
                    _mm256_store_ps(out, _mm256_add_ps(acc[g][r], cor[g][r]));
                    for (int t = 0; t < n; t++) yg[(size_t)t * ys + (size_t)r] = out[t];
                }
            }
        }
    }
}

#define DEFINE_QGEMM32_PANELS(name, TYPE)                                                    \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        qgemm32_panels(TYPE, nb, w, ws, nr, x, xs, nt, y, ys);                               \
    }
DEFINE_QGEMM32_PANELS(qgemm_q4_0, ELLM_T_Q4_0)
DEFINE_QGEMM32_PANELS(qgemm_q4_1, ELLM_T_Q4_1)
DEFINE_QGEMM32_PANELS(qgemm_q5_0, ELLM_T_Q5_0)
DEFINE_QGEMM32_PANELS(qgemm_q5_1, ELLM_T_Q5_1)
#else
DEFINE_QGEMM32(qgemm_q4_0, ELLM_T_Q4_0)
DEFINE_QGEMM32(qgemm_q4_1, ELLM_T_Q4_1)
DEFINE_QGEMM32(qgemm_q5_0, ELLM_T_Q5_0)
DEFINE_QGEMM32(qgemm_q5_1, ELLM_T_Q5_1)
#endif
#if !QX_VNNI
/* ------------------------------------------------------------------------------------
 * Q8_0, many tokens, at the AVX2 level, as qgemmk_avx2 does the K-quants: a panel of up
 * to QX8_PANEL weight rows is unpacked QX8_CHUNK blocks at a time (|q| and q, d) once for
 * all the call's token groups (up to QX8_GROUPS at once, their float sums waiting in
 * memory between chunks), and each chunk runs against the groups QX8_TG at a time, one
 * row at a time: one broadcast of a weight dword (and of its signs) serves 32 tokens, and
 * the groups' activations stay in L1 across the panel's rows. (qgemm32_tile unpacked
 * every block once per 8-token group and read each weight dword twice per group.)
 *
 * Each output gets qgemm32_tile's integer sums (exact: psign moves q's sign onto x,
 * maddubs' pair sums stay below 2 x 128 x 127, madd widens each dword step) and its
 * float step, fma(isum, d d_x, acc) block by block in block order from 0, so the bits
 * are those of the decode kernels and of any batch or thread split.
 *
 * AMD EPYC Zen 3, one thread, thread CPU time, old and new alternated in one process,
 * items of 16 rows x 128 tokens as matmul.c runs them, T=512, same bits (load ~3-4 on 2
 * cores): 2048 x 2048 1.22-1.52x, 8192 x 2048 1.36x, 2048 x 8192 1.28-1.67x (~75 -> ~100
 * GFLOP/s); the 1B Llama-shape Q8_0 file's prefill of 512 at one thread 14.2-16.1 ->
 * 10.8-11.2 s of CPU. Chunks of 4 or 16 blocks measured the same; weights and activations
 * widened to int16 (two madds a dword, no psign) ran slower (~85 GFLOP/s).
 * ------------------------------------------------------------------------------------ */
#define QX8_PANEL 16
#define QX8_CHUNK 8
#define QX8_GROUPS 16
#define QX8_TG 4

/* One unpacked block of one row: |q| (maddubs' unsigned operand) and q (the signs) */
typedef struct {
    uint8_t u[32] __attribute__((aligned(32)));
    uint8_t s[32] __attribute__((aligned(32))); /* (the bytes of q) */
} qx8_block;

/* acc[g * QX8_PANEL] (g < NG) += the nc blocks of one row (blk[ii * QX8_PANEL], d[ii *
 * QX8_PANEL]) against the groups at xg (the first group's first block of the chunk; the
 * next group xs bytes on) */
KINLINE void qx8_tile(const int NG, const int nc, const qx8_block *blk, const float *d,
                      const ellm_act32x8 *xg, size_t xs, __m256 *acc) {
    __m256 a[QX8_TG];
    _Pragma("GCC unroll 4")
    for (int gi = 0; gi < NG; gi++) a[gi] = acc[gi * QX8_PANEL];
    for (int ii = 0; ii < nc; ii++) {
        const qx8_block *b = blk + ii * QX8_PANEL;
        const ellm_act32x8 *x[QX8_TG];
        __m256i isum[QX8_TG];
        _Pragma("GCC unroll 4")
        for (int gi = 0; gi < NG; gi++) {
            x[gi] = (const ellm_act32x8 *)((const uint8_t *)xg + (size_t)gi * xs) + ii;
            isum[gi] = _mm256_setzero_si256();
        }
        _Pragma("GCC unroll 8")
        for (int m = 0; m < 8; m++) {
            const __m256i wu = _mm256_set1_epi32((int)ellm_rd_u32(b->u + 4 * m));
            const __m256i ws = _mm256_set1_epi32((int)ellm_rd_u32(b->s + 4 * m));
            _Pragma("GCC unroll 4")
            for (int gi = 0; gi < NG; gi++) {
                const __m256i xm = _mm256_loadu_si256((const __m256i *)(x[gi]->qs + 32 * m));
                const __m256i p = _mm256_maddubs_epi16(wu, _mm256_sign_epi8(xm, ws));
                isum[gi] = _mm256_add_epi32(isum[gi], _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
                /* one running sum in a register: GCC would otherwise sum the products as
                 * a tree, keeping them all live (spilled) */
                __asm__("" : "+x"(isum[gi]));
            }
        }
        _Pragma("GCC unroll 4")
        for (int gi = 0; gi < NG; gi++)
            a[gi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[gi]),
                                    _mm256_mul_ps(_mm256_set1_ps(d[ii * QX8_PANEL]), _mm256_loadu_ps(x[gi]->d)),
                                    a[gi]);
    }
    _Pragma("GCC unroll 4")
    for (int gi = 0; gi < NG; gi++) acc[gi * QX8_PANEL] = a[gi];
}

/* The whole (nr x nt) block: tokens QX8_GROUPS groups at a time, rows a panel at a time */
KFUNC void qgemm_q8_0(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x, size_t xs,
                      int64_t nt, float *y, size_t ys) {
    qx8_block blk[QX8_CHUNK][QX8_PANEL];
    float dbuf[QX8_CHUNK][QX8_PANEL];
    __m256 acc[QX8_GROUPS][QX8_PANEL];
    for (int64_t t0 = 0; t0 < nt; t0 += QX8_GROUPS * ELLM_TG) {
        const int64_t tn = nt - t0 < QX8_GROUPS * ELLM_TG ? nt - t0 : QX8_GROUPS * ELLM_TG;
        const int ng = (int)((tn + ELLM_TG - 1) / ELLM_TG);
        const uint8_t *xt = x + (size_t)(t0 / ELLM_TG) * xs;
        for (int64_t r0 = 0; r0 < nr; r0 += QX8_PANEL) {
            const int np = nr - r0 < QX8_PANEL ? (int)(nr - r0) : QX8_PANEL;
            const uint8_t *wp = w + (size_t)r0 * ws;
            for (int g = 0; g < ng; g++)
                for (int r = 0; r < np; r++) acc[g][r] = _mm256_setzero_ps();
            for (int64_t i0 = 0; i0 < nb; i0 += QX8_CHUNK) {
                const int nc = nb - i0 < QX8_CHUNK ? (int)(nb - i0) : QX8_CHUNK;
                for (int r = 0; r < np; r++)
                    for (int ii = 0; ii < nc; ii++) {
                        const uint8_t *b = wp + (size_t)r * ws + (size_t)(i0 + ii) * Q8_0_BYTES;
                        float c;
                        block32_scales(ELLM_T_Q8_0, b, (size_t)QX8_PANEL * ws, &dbuf[ii][r], &c);
                        __m256i sq = _mm256_setzero_si256();
                        _mm256_store_si256((__m256i *)blk[ii][r].u, values32(ELLM_T_Q8_0, b, &sq));
                        _mm256_store_si256((__m256i *)blk[ii][r].s, sq);
                    }
                __asm__("" : "+m"(blk)); /* read back by broadcast loads (see qgemm32_tile) */
                for (int g = 0; g < ng; g += QX8_TG) {
                    const int whole = ng - g >= QX8_TG; /* else the last groups one at a time */
                    for (int gg = g; gg < (whole ? g + 1 : ng); gg++) {
                        const ellm_act32x8 *xg = (const ellm_act32x8 *)(xt + (size_t)gg * xs) + i0;
                        for (int r = 0; r < np; r++) {
                            if (whole) qx8_tile(QX8_TG, nc, &blk[0][r], &dbuf[0][r], xg, xs, &acc[gg][r]);
                            else qx8_tile(1, nc, &blk[0][r], &dbuf[0][r], xg, xs, &acc[gg][r]);
                        }
                    }
                }
            }
            for (int g = 0; g < ng; g++) {
                const int n = tn - (int64_t)g * ELLM_TG < ELLM_TG ? (int)(tn - (int64_t)g * ELLM_TG) : ELLM_TG;
                float *yg = y + (size_t)(t0 + (int64_t)g * ELLM_TG) * ys + (size_t)r0;
                for (int r = 0; r < np; r++) {
                    float out[ELLM_TG] __attribute__((aligned(32)));
                    _mm256_store_ps(out, acc[g][r]);
                    for (int t = 0; t < n; t++) yg[(size_t)t * ys + (size_t)r] = out[t];
                }
            }
        }
    }
}
#else
DEFINE_QGEMM32(qgemm_q8_0, ELLM_T_Q8_0)
#endif

/* The whole (nr x nt) block from a body that takes one weight row against nt <= 4
 * tokens (the K-quants): rows one by one (at one token, a single sequential stream
 * through the weights), tokens four at a time. */
#define DEFINE_QDOT(name, body_fn, TYPE)                                                     \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        for (int64_t r = 0; r < nr; r++)                                                     \
            QX_FOR_TOKEN_TILES(nt, x, xs, y + r, ys, body_fn, TYPE, nb, w + (size_t)r * ws)  \
    }

/* ====================================================================================
 * K-quants (256-blocks against act256)
 * ==================================================================================== */

/* Q4_K / Q5_K scales (12 bytes, ellm_k4_scale_words) -> 8 six-bit scales and 8 mins:
 * out: *sc16 = the 8 scales as int16 in both 128-bit lanes (for byte shuffles),
 *      *mins = the 8 mins as int16, each twice: (m0 m0 m1 m1 ... m7 m7). */
INLINE void k4_scales(const uint8_t *p, __m256i *sc16, __m256i *mins) {
    uint64_t sc, mn;
    ellm_k4_scale_words(p, &sc, &mn);
    const __m128i sc8 = _mm_cvtsi64_si128((long long)sc), mn8 = _mm_cvtsi64_si128((long long)mn);
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

/* Q4_K / Q5_K block b: its 32 bytes of digits c as two runs of 32 values, *lo (values 64c..)
 * and *hi (values 64c + 32..), unsigned bytes; Q5_K's fifth bit of value l of those runs is
 * bit 2c / 2c + 1 of qh[l] */
INLINE void k45_digits(int type, const uint8_t *b, int c, __m256i *lo, __m256i *hi) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    const int q5 = type == ELLM_T_Q5_K;
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * c));
    *lo = _mm256_and_si256(q, lo4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo4);
    if (q5) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        *lo = _mm256_or_si256(*lo, bit_to_0x10(qh, 2 * c));
        *hi = _mm256_or_si256(*hi, bit_to_0x10(qh, 2 * c + 1));
    }
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

/* The K-quants' shapes as the many-token kernels see them: the bytes of a block; runs of
 * 32 values sharing a scale (Q4_K, Q5_K) or of 16 (Q2_K, Q3_K, Q6_K); a min per run
 * taken off in a second FMA (Q2_K, Q4_K, Q5_K), or else an offset on every value taken
 * off the integer sum (Q3_K 4 = 1 << 2, Q6_K 32 = 1 << 5) */
INLINE int qk_block_bytes(int type) {
    switch (type) {
    case ELLM_T_Q2_K: return Q2_K_BYTES;
    case ELLM_T_Q3_K: return Q3_K_BYTES;
    case ELLM_T_Q4_K: return Q4_K_BYTES;
    case ELLM_T_Q5_K: return Q5_K_BYTES;
    default: return Q6_K_BYTES;
    }
}
INLINE int qk_runs_of_32(int type) { return type == ELLM_T_Q4_K || type == ELLM_T_Q5_K; }
INLINE int qk_has_mins(int type) { return type != ELLM_T_Q3_K && type != ELLM_T_Q6_K; }
INLINE int qk_offset_shift(int type) { return type == ELLM_T_Q6_K ? 5 : 2; }
/* Every K-quant: d (and dmin, the f16 after it) at this offset of a block */
INLINE int qk_d_offset(int type) {
    switch (type) {
    case ELLM_T_Q2_K: return 80;
    case ELLM_T_Q3_K: return 108;
    case ELLM_T_Q6_K: return 208;
    default: return 0;
    }
}

/* Q4_K / Q5_K: sub-block j of 32 has scale sc[j] and min mn[j]:
 *   dot = d d_x sum_j sc[j] (q_j . x_j)  -  dmin d_x sum_j mn[j] (bsum[2j] + bsum[2j+1])
 * The min term is one madd of the 16 bsums with the mins repeated pairwise. Each block's
 * sums are reduced to integers and added in one float chain per output -- the order of
 * the many-token kernels (qgemmk_tile, qxa_tile, and matmul_amx.c's tiles) -- so every
 * token count gives the same bits. */
KINLINE void qdot_k45(int type, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride,
                     const int nt, float *y, size_t y_stride) {
    const int bs = type == ELLM_T_Q4_K ? Q4_K_BYTES : Q5_K_BYTES;
    float accs[QX_TILE]; /* one float chain per output, two FMAs per block */
    for (int t = 0; t < nt; t++) accs[t] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * bs;
        prefetch_ahead(b, bs);
        __m256i sc16, mins;
        k4_scales(b + 4, &sc16, &mins);
        const float d = f16_at(b), dmin = f16_at(b + 2);
        __m256i sumi[QX_TILE];
        for (int t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) {
            __m256i ql, qhi;
            k45_digits(type, b, c, &ql, &qhi);
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
            __m256i msum = _mm256_madd_epi16(bsum, mins);
            /* both horizontal sums at once: (isum, msum) in the low two lanes */
            __m256i h = _mm256_hadd_epi32(sumi[t], msum);
            __m128i v = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            v = _mm_hadd_epi32(v, v);
            accs[t] = fmaf((float)_mm_cvtsi128_si32(v), d * a->d, accs[t]);
            accs[t] = fmaf((float)_mm_extract_epi32(v, 1), -dmin * a->d, accs[t]);
        }
    }
    for (int t = 0; t < nt; t++) y[t * y_stride] = accs[t];
}

/* Q6_K: per 128-half, ql (64 bytes) holds four 32-runs in its low / high nibbles and
 * qh (32 bytes) their top two bits at shifts 0, 2, 4, 6. Values are stored +32: the
 * offset comes off as 32 sum_g sc[g] bsum[g]. */
KINLINE void qdot_q6k_body(int type, int64_t nb, const uint8_t *w, const uint8_t *x,
                          size_t x_stride, const int nt, float *y, size_t y_stride) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    float acc[QX_TILE];
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * Q6_K_BYTES;
        prefetch_ahead(b, Q6_K_BYTES);
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
            /* one float chain per output, one FMA per block: the order of qgemm_k */
            acc[t] = fmaf((float)hsum8_epi32(tot), d * a->d, acc[t]);
        }
    }
    for (int t = 0; t < nt; t++) y[t * y_stride] = acc[t];
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

/* Q2_K / Q3_K run s of 128-half h (elements 128h + 32s + l) from that half's 32 bytes of
 * qs (qv): bits 2s, 2s+1 of each byte, and for Q3_K its third bit, bit 4h+s of hmask[l]
 * (hm), as 4 */
INLINE __m256i k23_run(int q3, __m256i qv, __m256i hm, int h, int s) {
    const __m256i q = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * s), _mm256_set1_epi8(3));
    if (!q3) return q;
    const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + s)));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
    return _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(4)));
}

/* Q2_K: per 128-half h, qs[32h .. 32h+31] holds four 32-runs at shifts 0, 2, 4, 6;
 * scale (low nibble) and min (high nibble) per 16:
 *   dot = d d_x sum_g sc[g] (q_g . x_g)  -  dmin d_x sum_g mn[g] bsum[g]
 * Q3_K: the same 2-bit runs plus a third bit from hmask (bit 4h+s of hmask[l]); the
 * value is (low | third << 2) - 4 with a signed 6-bit scale per 16, so the -4 comes off
 * as 4 sum_g sc[g] bsum[g]. Each block's sums become integers and are added in one float
 * chain per output (Q2_K two FMAs as Q4_K, Q3_K one as Q6_K), the order of the
 * many-token kernels (qgemmk_tile below). */
KINLINE void qdot_k23(int type, int64_t nb, const uint8_t *w, const uint8_t *x, size_t x_stride,
                      const int nt, float *y, size_t y_stride) {
    const int bs = type == ELLM_T_Q2_K ? Q2_K_BYTES : Q3_K_BYTES;
    float acc[QX_TILE]; /* one float chain per output: the order of the many-token kernels */
    for (int t = 0; t < nt; t++) acc[t] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * bs;
        prefetch_ahead(b, bs);
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
            for (int s = 0; s < 4; s++) q[s] = k23_run(type == ELLM_T_Q3_K, qv, hm, h, s);
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
            if (type == ELLM_T_Q2_K) { /* (isum, msum) in the low two lanes, as qdot_k45 */
                __m256i h = _mm256_hadd_epi32(sumi[t], _mm256_madd_epi16(bsum, mins16));
                __m128i v = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                v = _mm_hadd_epi32(v, v);
                acc[t] = fmaf((float)_mm_cvtsi128_si32(v), d * a->d, acc[t]);
                acc[t] = fmaf((float)_mm_extract_epi32(v, 1), -dmin * a->d, acc[t]);
            } else {
                __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(bsum, sc16), 2);
                acc[t] = fmaf((float)hsum8_epi32(_mm256_sub_epi32(sumi[t], off)), d * a->d, acc[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) y[t * y_stride] = acc[t];
}

/* ------------------------------------------------------------------------------------
 * K-quant decode at one token: QXK_ROWS weight rows side by side (lane r = row r
 * of the float steps). Per block the rows' integer dots are formed as in qdot_k45 /
 * qdot_k23 / qdot_q6k_body (exact, so their order never shows), the rows' 8-lane partial
 * sums reduced together (one hadd tree for all the rows, in place of one per row), and the
 * float steps -- Q2_K, Q4_K, Q5_K fma(isum, d d_x), then fma(msum, -dmin d_x); Q3_K, Q6_K
 * fma(isum, d d_x) -- run with row r in lane r: the same single-rounding operations per output as the
 * one-row kernels, so the outputs are bit for bit theirs. Row nr - 1 stands in for the
 * rows past nr (computed, never stored), so every load stays inside w.
 *
 * The rows advance together, each by one block a step, which the hardware prefetcher
 * follows poorly: the next QXK_ROWS rows (contiguous, after these) are fetched at the
 * pace these are read, as qdot32_rows8 does (fetching QX_PF_BYTES ahead in each of the
 * 4 rows instead ran 1.3-1.9x slower from DRAM).
 *
 * AVX2 level, AMD EPYC Zen 3, one thread, by thread CPU time (the host under a load of
 * ~20 from other work), old one-row kernel -> this one, same bits: 256 x 2048 in L2,
 * best of 300 calls, Q4_K 21.9 -> 18.2 us (1.20x), Q6_K 24.1 -> 20.6 us (1.16x);
 * through _quant.linear in cache 1.07-1.13x; Llama-3.2-1B's matrices from DRAM
 * (2048 x 2048, 512 x 2048, 8192 x 2048, 2048 x 8192, 128256 x 2048), medians of
 * alternated calls, 0.96-1.12x, within the noise of that load; Gemma 3 270M decode 1.02x.
 * Q2_K, Q3_K and Q5_K took it when they took Q4_K's one float chain a block (on this
 * Xeon at ELLM_SIMD=avx2, the 1B Q2_K file's decode: see docs/benchmarks.md).
 * At the AVX-512 level (QX_ZMM) this kernel at 256 bits took the 1B Q4_K_M file's decode
 * on the Xeon (AMX level, 2 threads) from 29.0-29.8 to 21.3-22.8 tok/s and the Q2_K
 * file's from 32.5-34.1 to 29.8-31.8, so that level kept one-row kernels until the
 * 512-bit form of the 4-row tile below (qdot_kz_rows) beat them on Zen 5.
 * ------------------------------------------------------------------------------------ */
#define QXK_ROWS 4

/* lanes 0-3 = the sums of v[0..3]'s 8 lanes */
INLINE __m128i hsum4x8_epi32(const __m256i v[4]) {
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The f16 scales of a block in each of QXK_ROWS rows, lane r = row r: *d (at d_at), and for
 * types with mins *ndmin = -dmin (the f16 after d) */
INLINE void qk_rows_scales(const uint8_t *const wr[QXK_ROWS], size_t off, int d_at, int mins, __m128 *d,
                           __m128 *ndmin) {
    if (mins) {
        uint32_t dm[QXK_ROWS]; /* (d, dmin) of each row */
        for (int r = 0; r < QXK_ROWS; r++) dm[r] = ellm_rd_u32(wr[r] + off + d_at);
        /* halves d0 dmin0 d1 dmin1 ... -> d0..d3 | dmin0..dmin3 */
        const __m256 f = _mm256_cvtph_ps(_mm_setr_epi32((int)dm[0], (int)dm[1], (int)dm[2], (int)dm[3]));
        const __m256 g = _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
        *d = _mm256_castps256_ps128(g);
        *ndmin = _mm_xor_ps(_mm256_extractf128_ps(g, 1), _mm_set1_ps(-0.0f));
    } else {
        *d = _mm_cvtph_ps(_mm_setr_epi16((short)ellm_rd_u16(wr[0] + off + d_at), (short)ellm_rd_u16(wr[1] + off + d_at),
                                         (short)ellm_rd_u16(wr[2] + off + d_at), (short)ellm_rd_u16(wr[3] + off + d_at),
                                         0, 0, 0, 0));
        *ndmin = _mm_setzero_ps();
    }
}

/* Q4_K / Q5_K block b of one row against the token's act256 block a: *sumi the 8-lane
 * partial sums of sum_j sc[j] (q_j . x_j), *msum those of sum_j mn[j] (bsum[2j] + bsum[2j+1]) */
KINLINE void k4_block_isums(int type, const uint8_t *b, const ellm_act256 *a, __m256i *sumi, __m256i *msum) {
    __m256i sc16, mins;
    k4_scales(b + 4, &sc16, &mins);
    __m256i acc = _mm256_setzero_si256();
    _Pragma("GCC unroll 4")
    for (int c = 0; c < 4; c++) {
        __m256i ql, qhi;
        k45_digits(type, b, c, &ql, &qhi);
        const __m256i s0 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * 2 * c)));
        const __m256i s1 = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * c + 1))));
        const __m256i p0 = _mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)(a->qs + 64 * c)));
        const __m256i p1 = _mm256_maddubs_epi16(qhi, _mm256_loadu_si256((const __m256i *)(a->qs + 64 * c + 32)));
        acc = _mm256_add_epi32(acc, DOT2_S16(p0, s0, p1, s1));
    }
    *sumi = acc;
    *msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsums), mins);
}

/* Q6_K block b of one row against a: the 8-lane partial sums of isum (the +32 offset
 * taken off), as qdot_q6k_body forms them */
KINLINE __m256i q6k_block_isum(const uint8_t *b, const ellm_act256 *a) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const int8_t *sc = (const int8_t *)(b + 192);
    __m256i sch[2];
    scales16_halves(sc, sch);
    __m256i sumi = _mm256_setzero_si256();
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; h++) {
        const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
        const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(ql0, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2));
        q[1] = _mm256_or_si256(_mm256_and_si256(ql1, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), lo4), _mm256_and_si256(qh, top2));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), lo4),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2));
        _Pragma("GCC unroll 2")
        for (int r = 0; r < 4; r += 2) {
            const __m256i s0 = scale_pair(sch[h], r), s1 = scale_pair(sch[h], r + 1);
            const __m256i p0 = _mm256_maddubs_epi16(q[r], _mm256_loadu_si256((const __m256i *)(a->qs + 128 * h + 32 * r)));
            const __m256i p1 = _mm256_maddubs_epi16(q[r + 1], _mm256_loadu_si256((const __m256i *)(a->qs + 128 * h + 32 * r + 32)));
            sumi = _mm256_add_epi32(sumi, DOT2_S16(p0, s0, p1, s1));
        }
    }
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a->bsums), sc16);
    return _mm256_sub_epi32(sumi, _mm256_slli_epi32(off, 5));
}

/* Q2_K / Q3_K block b of one row against the token's act256 block a, as qdot_k23 forms
 * them: *sumi the 8-lane partial sums of sum_g sc[g] (q_g . x_g) (Q3_K less its offset,
 * 4 sum_g sc[g] bsum[g]), *msum (Q2_K) those of sum_g mn[g] bsum[g] */
KINLINE void k23_block_isums(int type, const uint8_t *b, const ellm_act256 *a, __m256i *sumi, __m256i *msum) {
    const int q3 = type == ELLM_T_Q3_K;
    int8_t sc[16];
    __m256i hm = _mm256_setzero_si256();
    if (q3) {
        q3k_scales(b + 96, sc);
        hm = _mm256_loadu_si256((const __m256i *)b);
    } else {
        _mm_storeu_si128((__m128i *)sc, _mm_and_si128(_mm_loadu_si128((const __m128i *)b), _mm_set1_epi8(0x0F)));
    }
    const uint8_t *qs = b + (q3 ? 32 : 16);
    __m256i sch[2];
    scales16_halves(sc, sch);
    __m256i acc = _mm256_setzero_si256();
    _Pragma("GCC unroll 2")
    for (int h = 0; h < 2; h++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
        __m256i q[4];
        _Pragma("GCC unroll 4")
        for (int s = 0; s < 4; s++) q[s] = k23_run(q3, qv, hm, h, s);
        _Pragma("GCC unroll 2")
        for (int s = 0; s < 4; s += 2) {
            const __m256i s0 = scale_pair(sch[h], s), s1 = scale_pair(sch[h], s + 1);
            const __m256i p0 =
                _mm256_maddubs_epi16(q[s], _mm256_loadu_si256((const __m256i *)(a->qs + 128 * h + 32 * s)));
            const __m256i p1 =
                _mm256_maddubs_epi16(q[s + 1], _mm256_loadu_si256((const __m256i *)(a->qs + 128 * h + 32 * s + 32)));
            acc = _mm256_add_epi32(acc, DOT2_S16(p0, s0, p1, s1));
        }
    }
    const __m256i bsum = _mm256_loadu_si256((const __m256i *)a->bsums);
    if (q3) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        *sumi = _mm256_sub_epi32(acc, _mm256_slli_epi32(_mm256_madd_epi16(bsum, sc16), 2));
        *msum = _mm256_setzero_si256();
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)b);
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
        *sumi = acc;
        *msum = _mm256_madd_epi16(bsum, mins16);
    }
}

KINLINE void qdot_k_rows(int type, int64_t nb, const uint8_t *w, size_t ws, int nr, const ellm_act256 *x,
                         float *y) {
    const size_t bs = (size_t)qk_block_bytes(type);
    const int d_at = qk_d_offset(type);
    const uint8_t *wr[QXK_ROWS];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < QXK_ROWS; r++) wr[r] = w + (size_t)(r < nr ? r : nr - 1) * ws;
    const uintptr_t next = (uintptr_t)w + QXK_ROWS * ws; /* the next rows (an integer: may lie past w) */
    __m128 acc = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const size_t off = (size_t)i * bs;
        for (size_t o = QXK_ROWS * off; o < QXK_ROWS * (off + bs); o += 64)
            _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
        const ellm_act256 *a = x + i;
        const __m128 ad = _mm_set1_ps(a->d);
        __m256i is[QXK_ROWS];
        if (qk_has_mins(type)) {
            __m256i ms[QXK_ROWS];
            _Pragma("GCC unroll 4")
            for (int r = 0; r < QXK_ROWS; r++) {
                if (type == ELLM_T_Q2_K) k23_block_isums(type, wr[r] + off, a, &is[r], &ms[r]);
                else k4_block_isums(type, wr[r] + off, a, &is[r], &ms[r]);
            }
            __m128 d, ndmin;
            qk_rows_scales(wr, off, d_at, 1, &d, &ndmin);
            const __m128 isum = _mm_cvtepi32_ps(hsum4x8_epi32(is)), msum = _mm_cvtepi32_ps(hsum4x8_epi32(ms));
            acc = _mm_fmadd_ps(isum, _mm_mul_ps(d, ad), acc);
            acc = _mm_fmadd_ps(msum, _mm_mul_ps(ndmin, ad), acc);
        } else {
            _Pragma("GCC unroll 4")
            for (int r = 0; r < QXK_ROWS; r++) {
                __m256i unused;
                if (type == ELLM_T_Q3_K) k23_block_isums(type, wr[r] + off, a, &is[r], &unused);
                else is[r] = q6k_block_isum(wr[r] + off, a);
            }
            __m128 d, unused_ndmin;
            qk_rows_scales(wr, off, d_at, 0, &d, &unused_ndmin);
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4x8_epi32(is)), _mm_mul_ps(d, ad), acc);
        }
    }
    float out[QXK_ROWS] __attribute__((aligned(16)));
    _mm_store_ps(out, acc);
    for (int r = 0; r < nr; r++) y[r] = out[r];
}
_Static_assert(QXK_ROWS == 4, "qdot_k_rows spells out 4 rows");

/* Q4_K (or Q5_K) at two tokens: the QXK_ROWS rows of qdot_k_rows against tokens x0 and x1 at once.
 * Each row's block is unpacked once (nibbles, scales) for both tokens, and the reductions
 * and float steps run with row r in lane r, per token, as qdot_k_rows does for one: the
 * same exact integer sums and the same roundings in the same order as qdot_k45 and
 * qdot_k_rows, so the bits are theirs at every token count. The one-row few-token kernel
 * (qdot_k45, up to 4 tokens) ran each extra token at nearly a whole token's cost. One
 * thread, thread CPU time, the Q4_K matrices of 4 layers of the 1B Llama shape (117 MB, on
 * 2 MiB pages), alternated call by call against it, same bits (AMD EPYC Zen 3, load ~5):
 * T=2 13.8 -> 11.2 ms (1.23x), T=3 1.07x, T=4 1.07x, T=8 1.08x, T=15 1.10x; T=1 7.5 ms. */
KINLINE void qdot_k4_rows_t2(int type, int64_t nb, const uint8_t *w, size_t ws, int nr, const ellm_act256 *x0,
                             const ellm_act256 *x1, float *y0, float *y1) {
    const size_t bs = (size_t)qk_block_bytes(type);
    const uint8_t *wr[QXK_ROWS];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < QXK_ROWS; r++) wr[r] = w + (size_t)(r < nr ? r : nr - 1) * ws;
    const uintptr_t next = (uintptr_t)w + QXK_ROWS * ws; /* the next rows (an integer: may lie past w) */
    __m128 acc0 = _mm_setzero_ps(), acc1 = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const size_t off = (size_t)i * bs;
        for (size_t o = QXK_ROWS * off; o < QXK_ROWS * (off + bs); o += 64)
            _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
        const ellm_act256 *a0 = x0 + i, *a1 = x1 + i;
        __m256i is0[QXK_ROWS], is1[QXK_ROWS], ms0[QXK_ROWS], ms1[QXK_ROWS];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < QXK_ROWS; r++) {
            const uint8_t *b = wr[r] + off;
            __m256i sc16, mins;
            k4_scales(b + 4, &sc16, &mins);
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            _Pragma("GCC unroll 4")
            for (int c = 0; c < 4; c++) {
                __m256i ql, qhi;
                k45_digits(type, b, c, &ql, &qhi);
                const __m256i sa = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * 2 * c)));
                const __m256i sb = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (2 * c + 1))));
                s0 = _mm256_add_epi32(s0, DOT2_S16(_mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)(a0->qs + 64 * c))), sa,
                                                   _mm256_maddubs_epi16(qhi, _mm256_loadu_si256((const __m256i *)(a0->qs + 64 * c + 32))), sb));
                s1 = _mm256_add_epi32(s1, DOT2_S16(_mm256_maddubs_epi16(ql, _mm256_loadu_si256((const __m256i *)(a1->qs + 64 * c))), sa,
                                                   _mm256_maddubs_epi16(qhi, _mm256_loadu_si256((const __m256i *)(a1->qs + 64 * c + 32))), sb));
            }
            is0[r] = s0;
            is1[r] = s1;
            ms0[r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a0->bsums), mins);
            ms1[r] = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a1->bsums), mins);
        }
        __m128 d, ndmin;
        qk_rows_scales(wr, off, 0, 1, &d, &ndmin);
        const __m128 ad0 = _mm_set1_ps(a0->d), ad1 = _mm_set1_ps(a1->d);
        acc0 = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4x8_epi32(is0)), _mm_mul_ps(d, ad0), acc0);
        acc0 = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4x8_epi32(ms0)), _mm_mul_ps(ndmin, ad0), acc0);
        acc1 = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4x8_epi32(is1)), _mm_mul_ps(d, ad1), acc1);
        acc1 = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4x8_epi32(ms1)), _mm_mul_ps(ndmin, ad1), acc1);
    }
    float out0[QXK_ROWS] __attribute__((aligned(16))), out1[QXK_ROWS] __attribute__((aligned(16)));
    _mm_store_ps(out0, acc0);
    _mm_store_ps(out1, acc1);
    for (int r = 0; r < nr; r++) {
        y0[r] = out0[r];
        y1[r] = out1[r];
    }
}

/* The K-quants at 256 bits (the 512-bit levels: qdot_kz_rows below): one token in row
 * tiles (qdot_k_rows); several: Q4_K and Q5_K in row tiles, tokens in pairs
 * (qdot_k4_rows_t2) and an odd last one alone; the others row by row as DEFINE_QDOT */
#define DEFINE_QDOT_K_ROWS(name, body_fn, TYPE)                                              \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        if (nt == 1) {                                                                       \
            for (int64_t r = 0; r < nr; r += QXK_ROWS)                                       \
                qdot_k_rows(TYPE, nb, w + (size_t)r * ws, ws, nr - r < QXK_ROWS ? (int)(nr - r) : QXK_ROWS, \
                            (const ellm_act256 *)x, y + r);                                  \
            return;                                                                          \
        }                                                                                    \
        if (TYPE == ELLM_T_Q4_K || TYPE == ELLM_T_Q5_K) { /* token pairs in row tiles */   \
            for (int64_t r = 0; r < nr; r += QXK_ROWS) {                                     \
                const int n4 = nr - r < QXK_ROWS ? (int)(nr - r) : QXK_ROWS;                 \
                int64_t t = 0;                                                               \
                for (; t + 2 <= nt; t += 2)                                                  \
                    qdot_k4_rows_t2(TYPE, nb, w + (size_t)r * ws, ws, n4, (const ellm_act256 *)(x + (size_t)t * xs), \
                                    (const ellm_act256 *)(x + (size_t)(t + 1) * xs), y + (size_t)t * ys + r, \
                                    y + (size_t)(t + 1) * ys + r);                           \
                if (t < nt)                                                                  \
                    qdot_k_rows(TYPE, nb, w + (size_t)r * ws, ws, n4, (const ellm_act256 *)(x + (size_t)t * xs), \
                                y + (size_t)t * ys + r);                                     \
            }                                                                                \
            return;                                                                          \
        }                                                                                    \
        for (int64_t r = 0; r < nr; r++)                                                     \
            QX_FOR_TOKEN_TILES(nt, x, xs, y + r, ys, body_fn, TYPE, nb, w + (size_t)r * ws)  \
    }

#if QX_ZMM
/* ------------------------------------------------------------------------------------
 * K-quant decode at 512 bits (the AVX-512 and AMX levels, up to 8 tokens a pass): a block of one
 * row unpacked once into four vectors of 64 values in the activation's order (q[k] =
 * values 64k .. 64k + 63, unsigned bytes) with the int16 scale of each maddubs pair
 * (s[k]), so a token's block is 4 maddubs + 4 dpwssd where the 256-bit body takes 8 + 4
 * + 4; then, per 16 values, the factor of the activation's bsums (m: the mins of Q2_K,
 * Q4_K, Q5_K; -offset x scale of Q3_K and Q6_K, folded into the integer sum by one more
 * dpwssd). The sums are exact integers, and the float steps are qdot_k_rows', four rows
 * to a vector, so the bits are those of every other kernel of the level. The rows are
 * QXK_ROWS side by side with the next ones fetched at their pace, as qdot_k_rows.
 *
 * Against the kernels it replaced (one row at a time, a block's float steps one output at
 * a time at 256 bits; Q4_K / Q5_K at 2-4 tokens qdot_k4_rows_t2), one thread, 8192 x
 * 2048, GMAC/s by thread CPU time, alternated builds (AMD EPYC Zen 5), same bits:
 *   in cache, T = 1 / 2 / 4:  Q2_K 54 / 63 / 70 -> 79 / 103 / 124, Q3_K 33 / 47 / 64 ->
 *     57 / 91 / 112, Q4_K 53 / 83 / 84 -> 69 / 96 / 118, Q5_K 44 / 73 / 75 -> 57 / 85 /
 *     104, Q6_K 50 / 67 / 78 -> 79 / 109 / 136;
 *   from DRAM (400 MB of copies), T = 1: Q2_K 50 -> 72, Q3_K 31 -> 54, Q4_K 46 -> 58, Q5_K
 *     38 -> 50, Q6_K 37 -> 44.
 * Up to 8 tokens share a pass over the rows, so each unpacked block serves them all (one
 * thread, GMAC/s, tokens in passes of 4 -> 8: Q4_K T=6 112 / 115 -> 122 / 126, T=7 117 ->
 * 124-133; Q3_K T=6 102-108 -> 133-140, T=8 113-118 -> 142-144; Q6_K T=6 133 -> 143-146);
 * up to 11 tokens they beat the token groups of the many-token kernels (matmul.c:
 * FEW_TOKENS_VNNI512_K).
 * ------------------------------------------------------------------------------------ */
typedef struct {
    __m512i q[4];
    __m512i s[4];
    __m256i m;
} kz_block;

/* 128-bit lane i of the result: word wi of lane i of v, in all 8 words */
INLINE __m512i kz_word_per_lane(__m512i v, const int w0, const int w1, const int w2, const int w3) {
#define KZ_CTRL(wd) ((int)((0x0100 + 0x0202 * (wd)) * 0x10001u))
    const __m512i ctrl = _mm512_set_epi32(KZ_CTRL(w3), KZ_CTRL(w3), KZ_CTRL(w3), KZ_CTRL(w3), KZ_CTRL(w2),
                                          KZ_CTRL(w2), KZ_CTRL(w2), KZ_CTRL(w2), KZ_CTRL(w1), KZ_CTRL(w1),
                                          KZ_CTRL(w1), KZ_CTRL(w1), KZ_CTRL(w0), KZ_CTRL(w0), KZ_CTRL(w0),
                                          KZ_CTRL(w0));
#undef KZ_CTRL
    return _mm512_shuffle_epi8(v, ctrl);
}

/* per 16-bit element of v: shifted by lo in the low 256 bits and hi in the high 256 --
 * left when both counts are >= 0, else right by -lo and -hi, so a count may be zero
 * beside a negative one but never positive (the callers' counts are constants) */
INLINE __m512i kz_shift_halves(__m512i v, const int lo, const int hi) {
    if (lo >= 0 && hi >= 0)
        return _mm512_sllv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16((short)lo), _mm256_set1_epi16((short)hi), 1));
    return _mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16((short)-lo), _mm256_set1_epi16((short)-hi), 1));
}

INLINE __m512i kz_dup256(const uint8_t *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }

/* the scales of the four 64-runs of a block with 16 scales of 16 values, sc16 (int16) */
INLINE void kz_scales16(__m256i sc16, kz_block *z) {
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_broadcast_i32x4(h ? _mm256_extracti128_si256(sc16, 1) : _mm256_castsi256_si128(sc16));
        z->s[2 * h] = kz_word_per_lane(v, 0, 1, 2, 3);
        z->s[2 * h + 1] = kz_word_per_lane(v, 4, 5, 6, 7);
    }
}

KINLINE void kz_unpack(int type, const uint8_t *b, kz_block *z) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    if (type == ELLM_T_Q4_K || type == ELLM_T_Q5_K) {
        __m256i sc16, mins;
        k4_scales(b + 4, &sc16, &mins);
        const __m512i scz = _mm512_broadcast_i32x4(_mm256_castsi256_si128(sc16));
        const int q5 = type == ELLM_T_Q5_K;
        const __m512i qh = q5 ? kz_dup256(b + 16) : _mm512_setzero_si512();
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            /* the low nibbles are run 2c, the high ones run 2c + 1 */
            __m512i v = _mm512_and_si512(kz_shift_halves(kz_dup256(b + (q5 ? 48 : 16) + 32 * c), 0, -4), lo4);
            if (q5) /* bits 2c and 2c + 1 of qh -> 0x10 */
                v = _mm512_or_si512(v, _mm512_and_si512(kz_shift_halves(qh, 4 - 2 * c, 3 - 2 * c),
                                                        _mm512_set1_epi8(0x10)));
            z->q[c] = v;
            z->s[c] = kz_word_per_lane(scz, 2 * c, 2 * c, 2 * c + 1, 2 * c + 1);
        }
        z->m = mins;
    } else if (type == ELLM_T_Q6_K) {
        const __m512i top2 = _mm512_set1_epi8(0x30);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * h)); /* runs 0 | 1 (then >> 4: 2 | 3) */
            const __m512i qh = kz_dup256(b + 128 + 32 * h);
            z->q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, lo4), _mm512_and_si512(kz_shift_halves(qh, 4, 2), top2));
            z->q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4),
                                              _mm512_and_si512(kz_shift_halves(qh, 0, -2), top2));
        }
        kz_scales16(sc16, z);
        z->m = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 5)); /* values stored +32 */
    } else { /* Q2_K, Q3_K: runs s of half h at bits 2s of qs[32h + l]; Q3_K's third bit 4h + s of hmask[l] */
        const int q3 = type == ELLM_T_Q3_K;
        const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
        const __m512i hm = q3 ? kz_dup256(b) : _mm512_setzero_si512();
        const uint8_t *qs = b + (q3 ? 32 : 16);
        _Pragma("GCC unroll 2")
        for (int h = 0; h < 2; h++) {
            const __m512i qv = kz_dup256(qs + 32 * h);
            __m512i q01 = _mm512_and_si512(kz_shift_halves(qv, 0, -2), three);
            __m512i q23 = _mm512_and_si512(kz_shift_halves(qv, -4, -6), three);
            if (q3) { /* bit p of hmask -> bit 2 */
                const int p = 4 * h;
                q01 = _mm512_or_si512(q01, _mm512_and_si512(kz_shift_halves(hm, 2 - p, 1 - p), four));
                q23 = _mm512_or_si512(q23, _mm512_and_si512(kz_shift_halves(hm, -p, -1 - p), four));
            }
            z->q[2 * h] = q01;
            z->q[2 * h + 1] = q23;
        }
        __m256i sc16;
        if (q3) {
            int8_t sc[16];
            q3k_scales(b + 96, sc);
            sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
            z->m = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16, 2)); /* values stored +4 */
        } else {
            const __m128i raw = _mm_loadu_si128((const __m128i *)b);
            sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(0x0F)));
            z->m = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
        }
        kz_scales16(sc16, z);
    }
}

/* a block of one row against a token's act256 block: the 8-lane partial sums of the block's
 * isum, and (types with mins) of its msum, as (isum, msum) pairs by one hadd, where types
 * without mins have the offset taken off */
KINLINE __m256i kz_block_sums(int type, const kz_block *z, const ellm_act256 *a) {
    __m512i acc = _mm512_setzero_si512();
    _Pragma("GCC unroll 4")
    for (int k = 0; k < 4; k++)
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(z->q[k], _mm512_loadu_si512((const void *)(a->qs + 64 * k))),
                                  z->s[k]);
    const __m256i is = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    const __m256i bsum = _mm256_loadu_si256((const __m256i *)a->bsums);
    if (qk_has_mins(type)) return _mm256_hadd_epi32(is, _mm256_madd_epi16(bsum, z->m));
    return _mm256_dpwssd_epi32(is, bsum, z->m);
}

#define QXZ_TILE 8
/* QXK_ROWS rows (row nr - 1 standing in for those past nr, never stored) against NT tokens */
KINLINE void qdot_kz_rows(int type, const int NT, int64_t nb, const uint8_t *w, size_t ws, int nr, const uint8_t *x,
                          size_t xs, float *y, size_t ys) {
    const size_t bs = (size_t)qk_block_bytes(type);
    const int d_at = qk_d_offset(type), mins = qk_has_mins(type);
    const uint8_t *wr[QXK_ROWS];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < QXK_ROWS; r++) wr[r] = w + (size_t)(r < nr ? r : nr - 1) * ws;
    const uintptr_t next = (uintptr_t)w + QXK_ROWS * ws; /* the next rows (an integer: may lie past w) */
    __m128 acc[QXZ_TILE];
    for (int t = 0; t < NT; t++) acc[t] = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const size_t off = (size_t)i * bs;
        for (size_t o = QXK_ROWS * off; o < QXK_ROWS * (off + bs); o += 64)
            _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
        __m256i pair[QXZ_TILE][2]; /* per token: rows (0, 1) and (2, 3) by one more hadd */
        _Pragma("GCC unroll 2")
        for (int rp = 0; rp < 2; rp++) {
            __m256i v[2][QXZ_TILE];
            _Pragma("GCC unroll 2")
            for (int j = 0; j < 2; j++) {
                kz_block z;
                kz_unpack(type, wr[2 * rp + j] + off, &z);
                for (int t = 0; t < NT; t++) v[j][t] = kz_block_sums(type, &z, (const ellm_act256 *)(x + (size_t)t * xs) + i);
            }
            for (int t = 0; t < NT; t++) pair[t][rp] = _mm256_hadd_epi32(v[0][t], v[1][t]);
        }
        __m128 d, ndmin;
        qk_rows_scales(wr, off, d_at, mins, &d, &ndmin);
        if (mins) {
            for (int t = 0; t < NT; t++) {
                /* pair[t][p] lanes: (isum, msum) of rows 2p, 2p + 1 in each half -> (i0 m0 i1 m1), (i2 m2 i3 m3) */
                const __m256i h = _mm256_add_epi32(_mm256_permute2x128_si256(pair[t][0], pair[t][1], 0x20),
                                                   _mm256_permute2x128_si256(pair[t][0], pair[t][1], 0x31));
                const __m256 s = _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)));
                const __m128 ad = _mm_set1_ps(((const ellm_act256 *)(x + (size_t)t * xs) + i)->d);
                acc[t] = _mm_fmadd_ps(_mm256_castps256_ps128(s), _mm_mul_ps(d, ad), acc[t]);
                acc[t] = _mm_fmadd_ps(_mm256_extractf128_ps(s, 1), _mm_mul_ps(ndmin, ad), acc[t]);
            }
        } else {
            for (int t = 0; t < NT; t++) {
                const __m256i h = _mm256_hadd_epi32(pair[t][0], pair[t][1]);
                const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                const __m128 ad = _mm_set1_ps(((const ellm_act256 *)(x + (size_t)t * xs) + i)->d);
                acc[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(s), _mm_mul_ps(d, ad), acc[t]);
            }
        }
    }
    for (int t = 0; t < NT; t++) {
        float out[QXK_ROWS] __attribute__((aligned(16)));
        _mm_store_ps(out, acc[t]);
        for (int r = 0; r < nr; r++) y[(size_t)t * ys + r] = out[r];
    }
}

/* One row at one token, a single stream through the weights (fetched QX_PF_BYTES ahead):
 * the same sums and float steps as qdot_kz_rows, one output at a time */
KINLINE void qdot_kz_row1(int type, int64_t nb, const uint8_t *w, const ellm_act256 *x, float *y) {
    const int bs = qk_block_bytes(type), d_at = qk_d_offset(type);
    float acc = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * bs;
        prefetch_ahead(b, bs);
        kz_block z;
        kz_unpack(type, b, &z);
        const __m256i v = kz_block_sums(type, &z, x + i);
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        const float ad = x[i].d;
        if (qk_has_mins(type)) { /* (i i' m m') -> (isum, msum) */
            s = _mm_hadd_epi32(s, s);
            acc = fmaf((float)_mm_cvtsi128_si32(s), f16_at(b + d_at) * ad, acc);
            acc = fmaf((float)_mm_extract_epi32(s, 1), -f16_at(b + d_at + 2) * ad, acc);
        } else {
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
            acc = fmaf((float)_mm_cvtsi128_si32(s), f16_at(b + d_at) * ad, acc);
        }
    }
    *y = acc;
}

DEFINE_QDOT_STREAM(qdots_q2_k, qdot_kz_row1, ellm_act256, ELLM_T_Q2_K)
DEFINE_QDOT_STREAM(qdots_q3_k, qdot_kz_row1, ellm_act256, ELLM_T_Q3_K)
DEFINE_QDOT_STREAM(qdots_q4_k, qdot_kz_row1, ellm_act256, ELLM_T_Q4_K)
DEFINE_QDOT_STREAM(qdots_q5_k, qdot_kz_row1, ellm_act256, ELLM_T_Q5_K)
DEFINE_QDOT_STREAM(qdots_q6_k, qdot_kz_row1, ellm_act256, ELLM_T_Q6_K)

#define DEFINE_QDOT_KZ(name, TYPE)                                                           \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        for (int64_t r = 0; r < nr; r += QXK_ROWS) {                                         \
            const int n4 = nr - r < QXK_ROWS ? (int)(nr - r) : QXK_ROWS;                     \
            for (int64_t t_ = 0; t_ < nt; t_ += QXZ_TILE) {                                  \
                const uint8_t *xt_ = x + (size_t)t_ * xs;                                    \
                float *yt_ = y + (size_t)t_ * ys + r;                                        \
                const uint8_t *wr_ = w + (size_t)r * ws;                                     \
                switch (nt - t_ < QXZ_TILE ? nt - t_ : QXZ_TILE) {                           \
                case 1: qdot_kz_rows(TYPE, 1, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;     \
                case 2: qdot_kz_rows(TYPE, 2, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;     \
                case 3: qdot_kz_rows(TYPE, 3, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;     \
                case 4: qdot_kz_rows(TYPE, 4, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;     \
                case 5: qdot_kz_rows(TYPE, 5, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;     \
                case 6: qdot_kz_rows(TYPE, 6, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;     \
                case 7: qdot_kz_rows(TYPE, 7, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;     \
                default: qdot_kz_rows(TYPE, 8, nb, wr_, ws, n4, xt_, xs, yt_, ys); break;    \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }
DEFINE_QDOT_KZ(qdot_q2_k, ELLM_T_Q2_K)
DEFINE_QDOT_KZ(qdot_q3_k, ELLM_T_Q3_K)
DEFINE_QDOT_KZ(qdot_q4_k, ELLM_T_Q4_K)
DEFINE_QDOT_KZ(qdot_q5_k, ELLM_T_Q5_K)
DEFINE_QDOT_KZ(qdot_q6_k, ELLM_T_Q6_K)
#else
DEFINE_QDOT_K_ROWS(qdot_q2_k, qdot_k23, ELLM_T_Q2_K)
DEFINE_QDOT_K_ROWS(qdot_q3_k, qdot_k23, ELLM_T_Q3_K)
DEFINE_QDOT_K_ROWS(qdot_q4_k, qdot_k45, ELLM_T_Q4_K)
DEFINE_QDOT_K_ROWS(qdot_q5_k, qdot_k45, ELLM_T_Q5_K)
DEFINE_QDOT_K_ROWS(qdot_q6_k, qdot_q6k_body, ELLM_T_Q6_K)
#endif

#if !QX_ZMM
/* Q8_0 at one token, at 256 bits: 4 rows side by side (as qdot_k_rows), each block's 4
 * exact integer dots summed across their lanes at once, the next 4 rows (contiguous)
 * fetched at the pace these are read; the float step per row and block is qdot32_rows8's
 * and qdot32_row1's, fma(isum, d d_x, acc), so the bits are theirs. One thread, weights
 * from DRAM, thread CPU time, in one process against the 8-row tiles and the one-row
 * stream (AMD EPYC Zen 3, load ~5 on 2 cores): 8192 x 2048 1.37 / 1.65 -> 0.91 ms,
 * 2048 x 2048 0.34 / 0.35 -> 0.17 ms. It also takes the large matrices the one-row
 * stream had (ellm_qdot_stream_avx2). The 1B Llama-shape Q8_0 file's decode at 2
 * threads, old and new processes alternated (load ~5): 6.3-6.6 -> 8.4-9.9 tok/s. */
#define QX8_DROWS 4
KINLINE void qdot_q8_rows4(int64_t nb, const uint8_t *w, size_t ws, int nr, const ellm_act32 *x, float *y) {
    const uint8_t *wr[QX8_DROWS];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < QX8_DROWS; r++) wr[r] = w + (size_t)(r < nr ? r : nr - 1) * ws;
    const uintptr_t next = (uintptr_t)w + QX8_DROWS * ws; /* an integer: may lie past w */
    __m128 acc = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const size_t off = (size_t)i * Q8_0_BYTES;
        for (size_t o = QX8_DROWS * off; o < QX8_DROWS * (off + Q8_0_BYTES); o += 64)
            _mm_prefetch((const char *)(next + o), _MM_HINT_T0);
        const ellm_act32 *a = x + i;
        const __m256i xq = _mm256_loadu_si256((const __m256i *)a->qs);
        __m256i is[QX8_DROWS];
        _Pragma("GCC unroll 4")
        for (int r = 0; r < QX8_DROWS; r++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(wr[r] + off + 2));
            is[r] = DOT_US8(_mm256_abs_epi8(q), _mm256_sign_epi8(xq, q));
        }
        const __m128 d = _mm_cvtph_ps(_mm_setr_epi16((short)ellm_rd_u16(wr[0] + off), (short)ellm_rd_u16(wr[1] + off),
                                                     (short)ellm_rd_u16(wr[2] + off), (short)ellm_rd_u16(wr[3] + off),
                                                     0, 0, 0, 0));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum4x8_epi32(is)), _mm_mul_ps(d, _mm_set1_ps(a->d)), acc);
    }
    float out[QX8_DROWS] __attribute__((aligned(16)));
    _mm_store_ps(out, acc);
    for (int r = 0; r < nr; r++) y[r] = out[r];
}
KFUNC void qdot_q8_0(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x, size_t xs,
                     int64_t nt, float *y, size_t ys) {
    if (nt != 1) {
        qdot_q8_0_tiles(nb, w, ws, nr, x, xs, nt, y, ys);
        return;
    }
    for (int64_t r = 0; r < nr; r += QX8_DROWS)
        qdot_q8_rows4(nb, w + (size_t)r * ws, ws, nr - r < QX8_DROWS ? (int)(nr - r) : QX8_DROWS,
                      (const ellm_act32 *)x, y + r);
}
#endif

/* ====================================================================================
 * Q4_K, Q5_K and Q6_K, many tokens: R weight rows against NG groups of ELLM_TG tokens
 * (lane t = token t), activations in the ellm_act256x8 layout, as qgemm32 does for the
 * 32-element types. Per block and output the integer sums are exact and the float steps
 * are those of qdot_k45 / qdot_q6k_body:
 *   Q4_K  isum = sum_j sc[j] (q_j . x_j),  msum = sum_j mn[j] (bsum[2j] + bsum[2j+1])
 *         (Q5_K the same, with q_j in 0..31)
 *         acc = fma(float(isum), d d_x, acc);  acc = fma(float(msum), -dmin d_x, acc)
 *   Q6_K  isum = sum_g sc[g] (q_g . x_g) - 32 sum_g sc[g] bsum[g]
 *         acc = fma(float(isum), d d_x, acc)
 * and y = acc. (|isum| < 2^31: at most 256 * 63 * 127 * 128.)
 * ==================================================================================== */

/* Blocks unpacked ahead per register tile (256 value bytes per row and block) */
#define QXK_CHUNK 2

/* 16 signed byte scales as 16 dwords (sc) and as 8 dwords of int16 pairs (pk[k] = (s[2k],
 * s[2k + 1]), the low half first: the bsums madd's operand) */
INLINE void qk_scale_dwords(__m128i s16, int32_t *sc) {
    _mm256_storeu_si256((__m256i *)sc, _mm256_cvtepi8_epi32(s16));
    _mm256_storeu_si256((__m256i *)(sc + 8), _mm256_cvtepi8_epi32(_mm_srli_si128(s16, 8)));
}
INLINE void qk_scale_pairs(__m128i s16, int32_t *pk) {
    _mm256_storeu_si256((__m256i *)pk, _mm256_cvtepi8_epi16(s16));
}

/* One Q4_K, Q5_K or Q6_K block b of a row, unpacked for the broadcast loads: its 256
 * values as unsigned bytes (v, 32-aligned), the per-run scales (sc: Q4_K / Q5_K 8, Q6_K
 * 16), the int16 pairs for the bsums madd (pk: Q4_K / Q5_K (mn, mn), Q6_K (sc, sc')), d
 * and (Q4_K / Q5_K) -dmin
 * (*m). The same block `ahead` bytes on is asked for into L2, as block32_scales does
 * (Q4_K / Q6_K 65536x1024 at T=16 from DRAM, one thread: 171 -> 174, 195 -> 206 GFLOP/s). */
INLINE void qgemmk_unpack_block(int type, const uint8_t *b, size_t ahead, uint8_t *v, int32_t *sc,
                                int32_t *pk, float *d, float *m) {
    const int bs = qk_block_bytes(type);
    const __m256i lo4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    for (int o = 0; o < bs; o += 64)
        _mm_prefetch((const char *)((uintptr_t)b + ahead + (size_t)o), _MM_HINT_T1);
    if (qk_runs_of_32(type)) { /* Q4_K, Q5_K: one head; Q5_K's fifth bits as qdot_k45 takes them */
        uint64_t s6, mn; /* eight scales and eight mins, a byte each, widened to dwords at once */
        ellm_k4_scale_words(b + 4, &s6, &mn);
        const __m256i mnw = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)mn));
        _mm256_storeu_si256((__m256i *)sc, _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s6)));
        _mm256_storeu_si256((__m256i *)pk, _mm256_or_si256(mnw, _mm256_slli_epi32(mnw, 16))); /* (mn, mn) */
        *d = f16_at(b);
        *m = -f16_at(b + 2);
        for (int c = 0; c < 4; c++) {
            __m256i lo, hi;
            k45_digits(type, b, c, &lo, &hi);
            _mm256_store_si256((__m256i *)(v + 64 * c), lo);
            _mm256_store_si256((__m256i *)(v + 64 * c + 32), hi);
        }
    } else if (type != ELLM_T_Q6_K) { /* Q2_K, Q3_K: runs of 32 from qs[32h + l] at shift 2s */
        const int q3 = type == ELLM_T_Q3_K;
        int8_t s8[16] __attribute__((aligned(16)));
        __m128i s16;
        if (q3) {
            q3k_scales(b + 96, s8); /* signed; the -4 on every value is an offset */
            s16 = _mm_load_si128((const __m128i *)s8);
            qk_scale_pairs(s16, pk); /* (sc, sc') */
            *d = f16_at(b + 108);
            *m = 0.0f;
        } else {
            const __m128i lo4 = _mm_set1_epi8(0x0F), sm = _mm_loadu_si128((const __m128i *)b);
            s16 = _mm_and_si128(sm, lo4);
            qk_scale_pairs(_mm_and_si128(_mm_srli_epi16(sm, 4), lo4), pk); /* the mins (high nibbles) in pairs */
            *d = f16_at(b + 80);
            *m = -f16_at(b + 82);
        }
        qk_scale_dwords(s16, sc);
        const __m256i hm = q3 ? _mm256_loadu_si256((const __m256i *)b) : _mm256_setzero_si256();
        const uint8_t *qs = b + (q3 ? 32 : 16);
        for (int h = 0; h < 2; h++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(qs + 32 * h));
            for (int r = 0; r < 4; r++) /* as qdot_k23 */
                _mm256_store_si256((__m256i *)(v + 128 * h + 32 * r), k23_run(q3, qv, hm, h, r));
        }
    } else {
        const __m128i s16 = _mm_loadu_si128((const __m128i *)(b + 192));
        qk_scale_dwords(s16, sc);
        qk_scale_pairs(s16, pk); /* (sc, sc') */
        *d = f16_at(b + 208);
        *m = 0.0f;
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            uint8_t *vh = v + 128 * h;
            /* the four 32-runs of this half, as qdot_q6k_body forms them */
            const __m256i l0 = _mm256_and_si256(ql0, lo4), l1 = _mm256_and_si256(ql1, lo4);
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(ql0, 4), lo4);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(ql1, 4), lo4);
            _mm256_store_si256((__m256i *)vh, _mm256_or_si256(l0, _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2)));
            _mm256_store_si256((__m256i *)(vh + 32),
                               _mm256_or_si256(l1, _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2)));
            _mm256_store_si256((__m256i *)(vh + 64), _mm256_or_si256(h0, _mm256_and_si256(qh, top2)));
            _mm256_store_si256((__m256i *)(vh + 96),
                               _mm256_or_si256(h1, _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2)));
        }
    }
}

#if QX_VNNI
KINLINE void qgemmk_tile(int type, const int R, const int NG, int64_t nb, const uint8_t *w, size_t ws,
                         const ellm_act256x8 *xg, size_t xgs, const int n0, const int n1, float *y,
                         size_t ys) {
    const ellm_act256x8 *xg1 = (const ellm_act256x8 *)((const uint8_t *)xg + xgs);
    const int bs = qk_block_bytes(type);
    /* runs of dwords sharing one scale: Q4_K / Q5_K 8 runs of 8 (32 values), the others 16 of 4 */
    const int nrun = qk_runs_of_32(type) ? 8 : 16, rdw = qk_runs_of_32(type) ? 8 : 4;
    __m256 acc[4][2];
    uint8_t wbuf[QXK_CHUNK][4][256] __attribute__((aligned(32)));
    int32_t sbuf[QXK_CHUNK][4][16]; /* the per-run scales */
    int32_t pbuf[QXK_CHUNK][4][8];  /* int16 pairs for the bsums madd: (mn, mn) / (sc, sc') */
    float dbuf[QXK_CHUNK][4], mbuf[QXK_CHUNK][4];
    _Pragma("GCC unroll 4")
    for (int r = 0; r < R; r++)
        _Pragma("GCC unroll 2")
        for (int gi = 0; gi < NG; gi++) acc[r][gi] = _mm256_setzero_ps();
    for (int64_t i0 = 0; i0 < nb; i0 += QXK_CHUNK) {
        const int nc = nb - i0 < QXK_CHUNK ? (int)(nb - i0) : QXK_CHUNK;
        for (int ii = 0; ii < nc; ii++) {
            for (int r = 0; r < R; r++) {
                const uint8_t *b = w + (size_t)r * ws + (size_t)(i0 + ii) * (size_t)bs;
                qgemmk_unpack_block(type, b, (size_t)(QX_PREFETCH_TILES * R) * ws, wbuf[ii][r], sbuf[ii][r],
                                    pbuf[ii][r], &dbuf[ii][r], &mbuf[ii][r]);
            }
        }
        /* read back by broadcast loads (see qgemm32_tile) */
        __asm__("" : "+m"(wbuf), "+m"(sbuf), "+m"(pbuf));
        for (int ii = 0; ii < nc; ii++) {
            const ellm_act256x8 *g[2] = {xg + i0 + ii, xg1 + i0 + ii};
            __m256i tot[4][2];
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++)
                _Pragma("GCC unroll 2")
                for (int gi = 0; gi < NG; gi++) tot[r][gi] = _mm256_setzero_si256();
            for (int j = 0; j < nrun; j++) {
                __m256i s[4][2];
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++)
                    _Pragma("GCC unroll 2")
                    for (int gi = 0; gi < NG; gi++) s[r][gi] = _mm256_setzero_si256();
                _Pragma("GCC unroll 8")
                for (int m = 0; m < rdw; m++) {
                    const int dw = rdw * j + m;
                    __m256i xm[2];
                    _Pragma("GCC unroll 2")
                    for (int gi = 0; gi < NG; gi++) xm[gi] = _mm256_loadu_si256((const __m256i *)(g[gi]->qs + 32 * dw));
                    _Pragma("GCC unroll 4")
                    for (int r = 0; r < R; r++) {
                        const __m256i wm = _mm256_set1_epi32((int)ellm_rd_u32(wbuf[ii][r] + 4 * dw));
                        _Pragma("GCC unroll 2")
                        for (int gi = 0; gi < NG; gi++) s[r][gi] = _mm256_dpbusd_epi32(s[r][gi], wm, xm[gi]);
                    }
                }
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++) {
                    const __m256i sc = _mm256_set1_epi32(sbuf[ii][r][j]);
                    _Pragma("GCC unroll 2")
                    for (int gi = 0; gi < NG; gi++)
                        tot[r][gi] = _mm256_add_epi32(tot[r][gi], _mm256_mullo_epi32(s[r][gi], sc));
                }
            }
            _Pragma("GCC unroll 2")
            for (int gi = 0; gi < NG; gi++) {
                const __m256 dx = _mm256_loadu_ps(g[gi]->d);
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++) {
                    __m256i bsp = _mm256_setzero_si256();
                    _Pragma("GCC unroll 8")
                    for (int k = 0; k < 8; k++)
                        bsp = _mm256_add_epi32(
                            bsp, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)g[gi]->bsums[k]),
                                                   _mm256_set1_epi32(pbuf[ii][r][k])));
                    if (qk_has_mins(type)) {
                        acc[r][gi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[r][gi]),
                                                     _mm256_mul_ps(_mm256_set1_ps(dbuf[ii][r]), dx), acc[r][gi]);
                        acc[r][gi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bsp),
                                                     _mm256_mul_ps(_mm256_set1_ps(mbuf[ii][r]), dx), acc[r][gi]);
                    } else {
                        const __m256i isum =
                            _mm256_sub_epi32(tot[r][gi], _mm256_slli_epi32(bsp, qk_offset_shift(type)));
                        acc[r][gi] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                                     _mm256_mul_ps(_mm256_set1_ps(dbuf[ii][r]), dx), acc[r][gi]);
                    }
                }
            }
        }
    }
    _Pragma("GCC unroll 2")
    for (int gi = 0; gi < NG; gi++) {
        const int n = gi == 0 ? n0 : n1;
        float *yg = y + (size_t)(gi * ELLM_TG) * ys;
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) {
            float out[ELLM_TG] __attribute__((aligned(32)));
            _mm256_store_ps(out, acc[r][gi]);
            for (int t = 0; t < n; t++) yg[(size_t)t * ys + (size_t)r] = out[t];
        }
    }
}

/* The rows of one pass over NG token groups: QX_ROWS at a time, then the rest. */
#define QGEMMK_ROWS(TYPE, NG, n0, n1)                                                        \
    {                                                                                        \
        int64_t r = 0;                                                                       \
        for (; r + QX_ROWS <= nr; r += QX_ROWS)                                              \
            qgemmk_tile(TYPE, QX_ROWS, NG, nb, w + (size_t)r * ws, ws, xg, xs, n0, n1, yt + r, ys); \
        switch (nr - r) {                                                                    \
        case 1: qgemmk_tile(TYPE, 1, NG, nb, w + (size_t)r * ws, ws, xg, xs, n0, n1, yt + r, ys); break; \
        case 2: qgemmk_tile(TYPE, 2, NG, nb, w + (size_t)r * ws, ws, xg, xs, n0, n1, yt + r, ys); break; \
        case 3: qgemmk_tile(TYPE, 3, NG, nb, w + (size_t)r * ws, ws, xg, xs, n0, n1, yt + r, ys); break; \
        default: break;                                                                      \
        }                                                                                    \
    }

#if QX_ZMM
/* ------------------------------------------------------------------------------------
 * Q4_K, Q5_K and Q6_K with two token groups in the lanes of one 512-bit register (a pair: the
 * group at xa in lanes 0-7, the one xgs bytes on in lanes 8-15), as qgemm32z does for the
 * 32-element types: each chunk of a row tile's blocks unpacked once for up to
 * QXK_BATCH_PAIRS pairs, two pairs per weight broadcast where the output rows allow it.
 * Every lane forms qgemmk_tile's integer sums (exact) and does its float steps in its
 * order, so the bits are the same.
 * ------------------------------------------------------------------------------------ */
#define QXK_REUSE_BLOCKS 8 /* blocks unpacked at once: 8 x 4 rows, ~11.5 KiB of stack */
typedef struct {
    uint8_t v[QX_ZROWS][256] __attribute__((aligned(32)));
    int32_t sc[QX_ZROWS][16]; /* the per-run scales */
    int32_t pk[QX_ZROWS][8];  /* int16 pairs for the bsums madd */
    float d[QX_ZROWS], m[QX_ZROWS];
} qxk_zblock;

/* acc (NP, QX_ZROWS) += the unpacked blocks zb[0, nb) against NP (1 or 2) pairs, the
 * first at xa, the second at xb. */
KINLINE void qgemmkz_blocks(int type, const int R, const int NP, int64_t nb, const qxk_zblock *zb,
                            const ellm_act256x8 *xa, const ellm_act256x8 *xb, size_t xgs, __m512 *acc) {
    const int nrun = qk_runs_of_32(type) ? 8 : 16, rdw = qk_runs_of_32(type) ? 8 : 4;
    const ellm_act256x8 *first[2] = {xa, xb};
    for (int64_t ii = 0; ii < nb; ii++) {
        const ellm_act256x8 *a0[2], *a1[2];
        _Pragma("GCC unroll 2")
        for (int pp = 0; pp < NP; pp++) {
            a0[pp] = first[pp] + ii;
            a1[pp] = (const ellm_act256x8 *)((const uint8_t *)first[pp] + xgs) + ii;
        }
        __m512i tot[2][QX_ZROWS];
        _Pragma("GCC unroll 2")
        for (int pp = 0; pp < NP; pp++)
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) tot[pp][r] = _mm512_setzero_si512();
        for (int j = 0; j < nrun; j++) {
            __m512i sm[2][QX_ZROWS];
            _Pragma("GCC unroll 2")
            for (int pp = 0; pp < NP; pp++)
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++) sm[pp][r] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8")
            for (int m = 0; m < rdw; m++) {
                const int dw = rdw * j + m;
                __m512i xm[2];
                _Pragma("GCC unroll 2")
                for (int pp = 0; pp < NP; pp++) xm[pp] = qx_pair_epi8(a0[pp]->qs + 32 * dw, a1[pp]->qs + 32 * dw);
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++) {
                    const __m512i wm = _mm512_set1_epi32((int)ellm_rd_u32(zb[ii].v[r] + 4 * dw));
                    _Pragma("GCC unroll 2")
                    for (int pp = 0; pp < NP; pp++) sm[pp][r] = _mm512_dpbusd_epi32(sm[pp][r], wm, xm[pp]);
                }
            }
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                const __m512i sc = _mm512_set1_epi32(zb[ii].sc[r][j]);
                _Pragma("GCC unroll 2")
                for (int pp = 0; pp < NP; pp++)
                    tot[pp][r] = _mm512_add_epi32(tot[pp][r], _mm512_mullo_epi32(sm[pp][r], sc));
            }
        }
        _Pragma("GCC unroll 2")
        for (int pp = 0; pp < NP; pp++) {
            const __m512 dx = qx_pair_ps(a0[pp]->d, a1[pp]->d);
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                __m512i bsp = _mm512_setzero_si512();
                _Pragma("GCC unroll 8")
                for (int k = 0; k < 8; k++)
                    bsp = _mm512_add_epi32(bsp, _mm512_madd_epi16(
                        qx_pair_epi8((const int8_t *)a0[pp]->bsums[k], (const int8_t *)a1[pp]->bsums[k]),
                        _mm512_set1_epi32(zb[ii].pk[r][k])));
                __m512 *a = &acc[pp * QX_ZROWS + r];
                if (qk_has_mins(type)) {
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot[pp][r]), _mm512_mul_ps(_mm512_set1_ps(zb[ii].d[r]), dx), *a);
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(bsp), _mm512_mul_ps(_mm512_set1_ps(zb[ii].m[r]), dx), *a);
                } else {
                    const __m512i isum =
                        _mm512_sub_epi32(tot[pp][r], _mm512_slli_epi32(bsp, qk_offset_shift(type)));
                    *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(zb[ii].d[r]), dx), *a);
                }
            }
        }
    }
}

/* Pairs run against one unpacking of a chunk of blocks; their sums wait in acc between
 * chunks (8 pairs: 128 tokens, a prefill item) */
#define QXK_BATCH_PAIRS 8

/* R rows against the pairs p = 0 .. np - 1 (groups 2p and 2p + 1 of x, xs bytes apart;
 * the last pair's second group has n1_last tokens): for each batch of pairs, the rows'
 * blocks QXK_REUSE_BLOCKS at a time, each chunk unpacked once for the whole batch, the
 * blocks still summed in order into each output. */
KINLINE void qgemmkz_rows_pairs(int type, const int R, int64_t nb, const uint8_t *w, size_t ws, const uint8_t *x,
                                size_t xs, int64_t np, int n1_last, float *y, size_t ys) {
    const int bs = qk_block_bytes(type);
    const int two_pairs = ys % 512 != 0; /* as in qgemm32z_rows_pairs */
    qxk_zblock zb[QXK_REUSE_BLOCKS] __attribute__((aligned(64)));
    __m512 acc[QXK_BATCH_PAIRS][QX_ZROWS];
    for (int64_t p0 = 0; p0 < np; p0 += QXK_BATCH_PAIRS) {
        const int64_t p1 = np - p0 < QXK_BATCH_PAIRS ? np : p0 + QXK_BATCH_PAIRS;
        for (int64_t p = p0; p < p1; p++)
            _Pragma("GCC unroll 4")
            for (int r = 0; r < QX_ZROWS; r++) acc[p - p0][r] = _mm512_setzero_ps();
        for (int64_t i0 = 0; i0 < nb; i0 += QXK_REUSE_BLOCKS) {
            const int64_t nc = nb - i0 < QXK_REUSE_BLOCKS ? nb - i0 : QXK_REUSE_BLOCKS;
            for (int64_t ii = 0; ii < nc; ii++)
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++)
                    qgemmk_unpack_block(type, w + (size_t)r * ws + (size_t)(i0 + ii) * (size_t)bs,
                                        (size_t)(QX_PREFETCH_TILES * R) * ws, zb[ii].v[r], zb[ii].sc[r],
                                        zb[ii].pk[r], &zb[ii].d[r], &zb[ii].m[r]);
            __asm__("" : "+m"(zb)); /* read back by broadcast loads, as in qgemm32_tile */
            const int last = i0 + nc == nb; /* each pair stored at once, as in qgemm32z_rows_pairs */
            int64_t p = p0;
            for (; two_pairs && p + 2 <= p1; p += 2) {
                const uint8_t *xp = x + (size_t)(2 * p) * xs;
                qgemmkz_blocks(type, R, 2, nc, zb, (const ellm_act256x8 *)xp + i0,
                               (const ellm_act256x8 *)(xp + 2 * xs) + i0, xs, acc[p - p0]);
                if (last) {
                    qx_store_pair(R, acc[p - p0], ELLM_TG, y + (size_t)(2 * p * ELLM_TG) * ys, ys);
                    qx_store_pair(R, acc[p + 1 - p0], p + 2 == np ? n1_last : ELLM_TG,
                                  y + (size_t)((2 * p + 2) * ELLM_TG) * ys, ys);
                }
            }
            for (; p < p1; p++) {
                const ellm_act256x8 *xp = (const ellm_act256x8 *)(x + (size_t)(2 * p) * xs) + i0;
                qgemmkz_blocks(type, R, 1, nc, zb, xp, xp, xs, acc[p - p0]);
                if (last)
                    qx_store_pair(R, acc[p - p0], p + 1 == np ? n1_last : ELLM_TG, y + (size_t)(2 * p * ELLM_TG) * ys, ys);
            }
        }
    }
}

#define QGEMMKZ_PAIRS_AT(TYPE, R, r) \
    qgemmkz_rows_pairs(TYPE, R, nb, w + (size_t)(r) * ws, ws, x, xs, np, n1, y + (r), ys)
/* every pair of the call (the second group of the last one may be part-filled), then
 * t past them: what is left is one group at most */
#define QGEMMK_PAIRS(TYPE)                                                                   \
    if (nt > ELLM_TG) {                                                                      \
        const int64_t np = (nt + ELLM_TG - 1) / (2 * ELLM_TG);                               \
        const int n1 = nt - (2 * np - 1) * ELLM_TG < ELLM_TG ? (int)(nt - (2 * np - 1) * ELLM_TG) : ELLM_TG; \
        QX_ZROW_TILES(QGEMMKZ_PAIRS_AT, TYPE)                                                \
        t = 2 * np * ELLM_TG;                                                                \
    }
#else
#define QGEMMK_PAIRS(TYPE)
#endif

/* The whole block, as DEFINE_QGEMM32: QX_GROUPS token groups per pass over the rows. */
#define DEFINE_QGEMMK(name, TYPE)                                                            \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        int64_t t = 0;                                                                       \
        QGEMMK_PAIRS(TYPE)                                                                   \
        if (QX_GROUPS > 1)                                                                   \
            for (; nt - t > ELLM_TG; t += 2 * ELLM_TG) {                                     \
                const ellm_act256x8 *xg = (const ellm_act256x8 *)(x + (size_t)(t / ELLM_TG) * xs); \
                const int n1 = nt - t - ELLM_TG < ELLM_TG ? (int)(nt - t - ELLM_TG) : ELLM_TG; \
                float *yt = y + (size_t)t * ys;                                              \
                QGEMMK_ROWS(TYPE, 2, ELLM_TG, n1)                                            \
            }                                                                                \
        for (; t < nt; t += ELLM_TG) {                                                       \
            const ellm_act256x8 *xg = (const ellm_act256x8 *)(x + (size_t)(t / ELLM_TG) * xs); \
            const int n = nt - t < ELLM_TG ? (int)(nt - t) : ELLM_TG;                        \
            float *yt = y + (size_t)t * ys;                                                  \
            QGEMMK_ROWS(TYPE, 1, n, 0)                                                       \
        }                                                                                    \
    }

DEFINE_QGEMMK(qgemm_q2_k, ELLM_T_Q2_K)
DEFINE_QGEMMK(qgemm_q3_k, ELLM_T_Q3_K)
DEFINE_QGEMMK(qgemm_q4_k, ELLM_T_Q4_K)
DEFINE_QGEMMK(qgemm_q5_k, ELLM_T_Q5_K)
DEFINE_QGEMMK(qgemm_q6_k, ELLM_T_Q6_K)

#else /* !QX_VNNI */
/* ------------------------------------------------------------------------------------
 * Q4_K, Q5_K and Q6_K, many tokens, at the AVX2 level (maddubs into int16, madd into int32).
 * A panel of up to QXA_PANEL weight rows is unpacked QXA_CHUNK blocks at a time, once
 * for every token group of the call (up to QXA_GROUPS at once, their float sums waiting
 * in memory between chunks), and each chunk runs against the groups QXA_TG at a time,
 * with the panel's rows QXA_TR at a time. Per chunk and run of groups the activations
 * and the unpacked panel stay in L1, and the call's activations stream past once per
 * chunk, not once per row tile. (qgemmk_tile, the VNNI kernel, unpacks each block once
 * per token group or two instead, which at this level cost as much as the dot products.)
 *
 * Each output gets qgemmk_tile's integer sums (exact, so their order never shows) and
 * its float steps, block by block in block order from 0 -- Q4_K fma(isum, d d_x) then
 * fma(msum, -dmin d_x), Q6_K fma(isum, d d_x) -- so the bits are those of the decode
 * kernels (qdot_k_rows, qdot_k45, qdot_q6k_body) and of any batch or thread split.
 *
 * AMD EPYC Zen 3, one thread, thread CPU time, old and new alternated in one process
 * (the host under a load of ~8-10 from other work), items of 16 rows x 128 tokens as
 * matmul.c runs them, same bits: the per-group kernel -> panels with 2 x 2 tiles 1.5-1.8x;
 * then 1 row x 4 groups (one weight broadcast for 32 tokens, each activation load read
 * by its maddubs) against 2 x 2, with Q4_K's mins taken in pairs: Q4_K 1.13-1.26x, Q6_K
 * 1.03-1.10x; 4 x 1, 3 x 2 and 2 x 3 were between. GCC kept 1 x 4's 8 accumulators in
 * registers; 2 x 4 would not fit 16.
 * ------------------------------------------------------------------------------------ */
#define QXA_PANEL 16
#define QXA_CHUNK 2
#define QXA_GROUPS 16
#define QXA_TR 1
#define QXA_TG 4

/* One unpacked block of one row: the values as unsigned bytes, per run the scale in
 * both 16-bit halves of a dword (the madd factor, one broadcast load), the int16 pairs of
 * the bsums madd (Q4_K (mn, mn), Q6_K (sc, sc')), d and (Q4_K) -dmin */
typedef struct {
    uint8_t v[256] __attribute__((aligned(32)));
    int32_t sc[16];
    int32_t pk[8];
    float d, m;
} qxa_block;

INLINE void qxa_unpack(int type, const uint8_t *b, size_t ahead, qxa_block *o) {
    const int r32 = qk_runs_of_32(type);
    int32_t sc[16];
    qgemmk_unpack_block(type, b, ahead, o->v, sc, o->pk, &o->d, &o->m);
    for (int j = 0; j < (r32 ? 8 : 16); j += 8) { /* (sc, sc) */
        const __m256i s = _mm256_loadu_si256((const __m256i *)(sc + j));
        _mm256_storeu_si256((__m256i *)(o->sc + j), _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)),
                                                                     _mm256_slli_epi32(s, 16)));
    }
    if (r32) { /* the mins in pairs (mn[2k], mn[2k + 1]), against qxa_min_pairs' sums: the low halves of
                * the (mn, mn) dwords, packed (mn < 64) */
        const __m256i mm = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)o->pk), _mm256_set1_epi32(0xFFFF));
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(mm, mm), _MM_SHUFFLE(3, 1, 2, 0));
        _mm_storeu_si128((__m128i *)o->pk, _mm256_castsi256_si128(p));
    }
}

/* Q4_K's min term needs each token's sums of 32 (bsum[2j] + bsum[2j + 1], |.| <= 32 x 127):
 * for the group's block g, out[k] = those of j = 2k, 2k + 1 as int16 pairs, one madd with
 * a row's (mn[2k], mn[2k + 1]) each (4 a row and group, in place of 8) */
INLINE void qxa_min_pairs(const ellm_act256x8 *g, __m256i out[4]) {
    const __m256i one = _mm256_set1_epi16(1), lo = _mm256_set1_epi32(0xFFFF);
    for (int k = 0; k < 4; k++) {
        const __m256i s0 = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)g->bsums[2 * k]), one);
        const __m256i s1 = _mm256_madd_epi16(_mm256_load_si256((const __m256i *)g->bsums[2 * k + 1]), one);
        out[k] = _mm256_or_si256(_mm256_and_si256(s0, lo), _mm256_slli_epi32(s1, 16));
    }
}

/* acc[g][r] (g < NG groups, r < R rows; acc's rows QXA_PANEL vectors apart) += the nc
 * blocks of blk ([nc][QXA_PANEL], this tile's first row at [.][0]) against the groups at
 * xg (the first group's first block of the chunk; the next group xs bytes on) */
KINLINE void qxa_tile(const int type, const int R, const int NG, const int nc, const qxa_block *blk,
                      const ellm_act256x8 *xg, size_t xs, const __m256i *mp, __m256 *acc) {
    const int r32 = qk_runs_of_32(type);
    const int nrun = r32 ? 8 : 16, rdw = r32 ? 8 : 4;
    /* dwords summed in int16 per madd: Q4_K 8 (8 x 2 x 15 x 127), Q5_K 4 (4 x 2 x 31 x 127),
     * Q6_K 2 (2 x 2 x 63 x 127), Q2_K and Q3_K a run's 4 (4 x 2 x 7 x 127) */
    const int G = type == ELLM_T_Q4_K ? 8 : type == ELLM_T_Q6_K ? 2 : 4;
    __m256 a[QXA_TG][QXA_TR];
    _Pragma("GCC unroll 4")
    for (int gi = 0; gi < NG; gi++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) a[gi][r] = acc[gi * QXA_PANEL + r];
    for (int ii = 0; ii < nc; ii++) {
        const ellm_act256x8 *x[QXA_TG];
        const qxa_block *b[QXA_TR];
        _Pragma("GCC unroll 4")
        for (int gi = 0; gi < NG; gi++) x[gi] = (const ellm_act256x8 *)((const uint8_t *)xg + (size_t)gi * xs) + ii;
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) b[r] = blk + ii * QXA_PANEL + r;
        __m256i tot[QXA_TG][QXA_TR], s[QXA_TG][QXA_TR];
        _Pragma("GCC unroll 4")
        for (int gi = 0; gi < NG; gi++)
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) tot[gi][r] = _mm256_setzero_si256();
        for (int j = 0; j < nrun; j++) {
            _Pragma("GCC unroll 8")
            for (int m = 0; m < rdw; m++) {
                const int dw = rdw * j + m;
                __m256i xm[QXA_TG];
                _Pragma("GCC unroll 4")
                for (int gi = 0; gi < NG; gi++) xm[gi] = _mm256_load_si256((const __m256i *)(x[gi]->qs + 32 * dw));
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++) {
                    const __m256i wm = _mm256_set1_epi32((int)ellm_rd_u32(b[r]->v + 4 * dw));
                    _Pragma("GCC unroll 4")
                    for (int gi = 0; gi < NG; gi++) {
                        const __m256i p = _mm256_maddubs_epi16(wm, xm[gi]);
                        s[gi][r] = m % G == 0 ? p : _mm256_add_epi16(s[gi][r], p);
                        /* one running sum in a register: GCC would otherwise sum the
                         * products as a tree, keeping them all live (spilled) */
                        __asm__("" : "+x"(s[gi][r]));
                        if (m % G == G - 1)
                            tot[gi][r] = _mm256_add_epi32(tot[gi][r],
                                                          _mm256_madd_epi16(s[gi][r], _mm256_set1_epi32(b[r]->sc[j])));
                    }
                }
            }
        }
        _Pragma("GCC unroll 4")
        for (int gi = 0; gi < NG; gi++) {
            const __m256 dx = _mm256_load_ps(x[gi]->d);
            __m256i bsp[QXA_TR];
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) bsp[r] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8")
            for (int k = 0; k < 8; k++) {
                if (r32 && k == 4) break;
                const __m256i bs = r32 ? mp[(ii * QXA_GROUPS + gi) * 4 + k]
                                      : _mm256_load_si256((const __m256i *)x[gi]->bsums[k]);
                _Pragma("GCC unroll 4")
                for (int r = 0; r < R; r++)
                    bsp[r] = _mm256_add_epi32(bsp[r], _mm256_madd_epi16(bs, _mm256_set1_epi32(b[r]->pk[k])));
            }
            _Pragma("GCC unroll 4")
            for (int r = 0; r < R; r++) {
                if (qk_has_mins(type)) {
                    a[gi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[gi][r]),
                                               _mm256_mul_ps(_mm256_set1_ps(b[r]->d), dx), a[gi][r]);
                    a[gi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bsp[r]),
                                               _mm256_mul_ps(_mm256_set1_ps(b[r]->m), dx), a[gi][r]);
                } else {
                    const __m256i isum =
                        _mm256_sub_epi32(tot[gi][r], _mm256_slli_epi32(bsp[r], qk_offset_shift(type)));
                    a[gi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum),
                                               _mm256_mul_ps(_mm256_set1_ps(b[r]->d), dx), a[gi][r]);
                }
            }
        }
    }
    _Pragma("GCC unroll 4")
    for (int gi = 0; gi < NG; gi++)
        _Pragma("GCC unroll 4")
        for (int r = 0; r < R; r++) acc[gi * QXA_PANEL + r] = a[gi][r];
}

/* The whole (nr x nt) block: tokens QXA_GROUPS groups at a time, rows a panel at a time */
KINLINE void qgemmk_avx2(int type, int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,
                         size_t xs, int64_t nt, float *y, size_t ys) {
    const int r32 = qk_runs_of_32(type);
    const size_t bs = (size_t)qk_block_bytes(type);
    qxa_block blk[QXA_CHUNK][QXA_PANEL];
    __m256 acc[QXA_GROUPS][QXA_PANEL];
    __m256i mp[QXA_CHUNK][QXA_GROUPS][4]; /* Q4_K: qxa_min_pairs of the chunk's blocks */
    for (int64_t t0 = 0; t0 < nt; t0 += QXA_GROUPS * ELLM_TG) {
        const int64_t tn = nt - t0 < QXA_GROUPS * ELLM_TG ? nt - t0 : QXA_GROUPS * ELLM_TG;
        const int ng = (int)((tn + ELLM_TG - 1) / ELLM_TG);
        const uint8_t *xt = x + (size_t)(t0 / ELLM_TG) * xs;
        for (int64_t r0 = 0; r0 < nr; r0 += QXA_PANEL) {
            const int np = nr - r0 < QXA_PANEL ? (int)(nr - r0) : QXA_PANEL;
            const uint8_t *wp = w + (size_t)r0 * ws;
            for (int g = 0; g < ng; g++)
                for (int r = 0; r < np; r++) acc[g][r] = _mm256_setzero_ps();
            for (int64_t i0 = 0; i0 < nb; i0 += QXA_CHUNK) {
                const int nc = nb - i0 < QXA_CHUNK ? (int)(nb - i0) : QXA_CHUNK;
                for (int ii = 0; ii < nc; ii++)
                    for (int r = 0; r < np; r++)
                        qxa_unpack(type, wp + (size_t)r * ws + (size_t)(i0 + ii) * bs, (size_t)QXA_PANEL * ws,
                                   &blk[ii][r]);
                if (r32)
                    for (int ii = 0; ii < nc; ii++)
                        for (int g = 0; g < ng; g++)
                            qxa_min_pairs((const ellm_act256x8 *)(xt + (size_t)g * xs) + i0 + ii, mp[ii][g]);
                __asm__("" : "+m"(blk)); /* read back by broadcast loads (see qgemm32_tile) */
                for (int g = 0; g < ng; g += QXA_TG) {
                    const int whole = ng - g >= QXA_TG; /* else the last groups one at a time */
                    for (int gg = g; gg < (whole ? g + 1 : ng); gg++) {
                        const ellm_act256x8 *xg = (const ellm_act256x8 *)(xt + (size_t)gg * xs) + i0;
                        for (int r = 0; r < np; r += QXA_TR) {
                            _Static_assert(QXA_TR == 1, "a panel's rows need no remainder tile");
                            if (whole) qxa_tile(type, QXA_TR, QXA_TG, nc, &blk[0][r], xg, xs, mp[0][gg], &acc[gg][r]);
                            else qxa_tile(type, QXA_TR, 1, nc, &blk[0][r], xg, xs, mp[0][gg], &acc[gg][r]);
                        }
                    }
                }
            }
            for (int g = 0; g < ng; g++) {
                const int n = tn - (int64_t)g * ELLM_TG < ELLM_TG ? (int)(tn - (int64_t)g * ELLM_TG) : ELLM_TG;
                float *yg = y + (size_t)(t0 + (int64_t)g * ELLM_TG) * ys + (size_t)r0;
                for (int r = 0; r < np; r++) {
                    float out[ELLM_TG] __attribute__((aligned(32)));
                    _mm256_store_ps(out, acc[g][r]);
                    for (int t = 0; t < n; t++) yg[(size_t)t * ys + (size_t)r] = out[t];
                }
            }
        }
    }
}

#define DEFINE_QGEMMK_AVX2(name, TYPE)                                                       \
    KFUNC void name(int64_t nb, const uint8_t *w, size_t ws, int64_t nr, const uint8_t *x,    \
                    size_t xs, int64_t nt, float *y, size_t ys) {                             \
        qgemmk_avx2(TYPE, nb, w, ws, nr, x, xs, nt, y, ys);                                  \
    }
DEFINE_QGEMMK_AVX2(qgemm_q2_k, ELLM_T_Q2_K)
DEFINE_QGEMMK_AVX2(qgemm_q3_k, ELLM_T_Q3_K)
DEFINE_QGEMMK_AVX2(qgemm_q4_k, ELLM_T_Q4_K)
DEFINE_QGEMMK_AVX2(qgemm_q5_k, ELLM_T_Q5_K)
DEFINE_QGEMMK_AVX2(qgemm_q6_k, ELLM_T_Q6_K)
#endif /* QX_VNNI */

#endif
