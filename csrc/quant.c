/* GGML block formats: sizes, dequantization to f32, quantization to Q8_0 / Q4_0, and
 * the row gather used for embedding lookups. Plain C: dequantization runs at load time
 * or one row per token, never in a hot loop, so it has no SIMD variants. */
#include <math.h>

#include "quant.h"
#include "quant_impl.h"
#include "threadpool.h"

/* ====================================================================================
 * Type table
 * ==================================================================================== */

int64_t ellm_qtype_block_elems(int qtype) {
    switch (qtype) {
    case ELLM_T_F32: case ELLM_T_F16: case ELLM_T_BF16: return 1;
    case ELLM_T_Q4_0: case ELLM_T_Q4_1: case ELLM_T_Q5_0: case ELLM_T_Q5_1: case ELLM_T_Q8_0:
        return QK32;
    case ELLM_T_Q2_K: case ELLM_T_Q3_K: case ELLM_T_Q4_K: case ELLM_T_Q5_K: case ELLM_T_Q6_K:
        return QK256;
    default: return 0;
    }
}

int64_t ellm_qtype_block_bytes(int qtype) {
    switch (qtype) {
    case ELLM_T_F32: return 4;
    case ELLM_T_F16: case ELLM_T_BF16: return 2;
    case ELLM_T_Q4_0: return Q4_0_BYTES;
    case ELLM_T_Q4_1: return Q4_1_BYTES;
    case ELLM_T_Q5_0: return Q5_0_BYTES;
    case ELLM_T_Q5_1: return Q5_1_BYTES;
    case ELLM_T_Q8_0: return Q8_0_BYTES;
    case ELLM_T_Q2_K: return Q2_K_BYTES;
    case ELLM_T_Q3_K: return Q3_K_BYTES;
    case ELLM_T_Q4_K: return Q4_K_BYTES;
    case ELLM_T_Q5_K: return Q5_K_BYTES;
    case ELLM_T_Q6_K: return Q6_K_BYTES;
    default: return 0;
    }
}

int64_t ellm_row_bytes(int qtype, int64_t n) {
    int64_t be = ellm_qtype_block_elems(qtype);
    if (be == 0 || n < 0 || n % be) return -1;
    int64_t nb = n / be;
    int64_t bb = ellm_qtype_block_bytes(qtype);
    if (nb > INT64_MAX / bb) return -1;
    return nb * bb;
}

const char *ellm_status_str(int status) {
    switch (status) {
    case ELLM_OK: return "ok";
    case ELLM_E_TYPE: return "unsupported tensor type";
    case ELLM_E_SHAPE: return "element count is not a whole number of blocks";
    case ELLM_E_SIZE: return "byte length does not match the element count";
    case ELLM_E_SCRATCH: return "scratch buffer too small or misaligned";
    case ELLM_E_INDEX: return "row index out of range";
    default: return "unknown error";
    }
}

/* ====================================================================================
 * Dequantization, one block at a time: (block bytes) -> (block elements,) f32
 * ==================================================================================== */

static void dq_q4_0(const uint8_t *b, float *y) {
    float d = ellm_rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 0x0F) - 8);
        y[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static void dq_q4_1(const uint8_t *b, float *y) {
    float d = ellm_rd_f16(b), m = ellm_rd_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 0x0F) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

static void dq_q5_0(const uint8_t *b, float *y) {
    float d = ellm_rd_f16(b);
    uint32_t qh = ellm_rd_u32(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * (float)(lo - 16);
        y[j + 16] = d * (float)(hi - 16);
    }
}

static void dq_q5_1(const uint8_t *b, float *y) {
    float d = ellm_rd_f16(b), m = ellm_rd_f16(b + 2);
    uint32_t qh = ellm_rd_u32(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0x0F) | (int)(((qh >> j) & 1u) << 4);
        int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * (float)lo + m;
        y[j + 16] = d * (float)hi + m;
    }
}

static void dq_q8_0(const uint8_t *b, float *y) {
    float d = ellm_rd_f16(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = d * (float)qs[j];
}

/* Q2_K: 16 groups of 16; 2-bit values, four per byte, spread over two 128-halves. */
static void dq_q2_k(const uint8_t *b, float *y) {
    const uint8_t *sc = b, *qs = b + 16;
    float d = ellm_rd_f16(b + 80), dmin = ellm_rd_f16(b + 82);
    for (int e = 0; e < 256; e++) {
        int half = e >> 7, s = (e >> 5) & 3, l = e & 31, g = e >> 4;
        int q = (qs[half * 32 + l] >> (2 * s)) & 3;
        y[e] = d * (float)(sc[g] & 0x0F) * (float)q - dmin * (float)(sc[g] >> 4);
    }
}

/* Q3_K: 2 low bits as in Q2_K, the third bit in hmask; a clear bit means "minus 4". */
static void dq_q3_k(const uint8_t *b, float *y) {
    const uint8_t *hm = b, *qs = b + 32;
    int8_t sc[16];
    ellm_unpack_q3k_scales(b + 96, sc);
    float d = ellm_rd_f16(b + 108);
    for (int e = 0; e < 256; e++) {
        int half = e >> 7, s = (e >> 5) & 3, l = e & 31;
        int q = (qs[half * 32 + l] >> (2 * s)) & 3;
        if (!((hm[l] >> (e >> 5)) & 1)) q -= 4;
        y[e] = d * (float)sc[e >> 4] * (float)q;
    }
}

/* Q4_K: 8 sub-blocks of 32, each 64-chunk holding two sub-blocks in low/high nibbles. */
static void dq_q4_k(const uint8_t *b, float *y) {
    float d = ellm_rd_f16(b), dmin = ellm_rd_f16(b + 2);
    uint8_t sc[8], mn[8];
    ellm_unpack_k4_scales(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int c = 0; c < 4; c++) {
        float d0 = d * sc[2 * c], m0 = dmin * mn[2 * c];
        float d1 = d * sc[2 * c + 1], m1 = dmin * mn[2 * c + 1];
        for (int l = 0; l < 32; l++) {
            y[64 * c + l] = d0 * (float)(qs[32 * c + l] & 0x0F) - m0;
            y[64 * c + 32 + l] = d1 * (float)(qs[32 * c + l] >> 4) - m1;
        }
    }
}

/* Q5_K: Q4_K plus a fifth bit: bit j of qh[l] belongs to element 32 j + l. */
static void dq_q5_k(const uint8_t *b, float *y) {
    float d = ellm_rd_f16(b), dmin = ellm_rd_f16(b + 2);
    uint8_t sc[8], mn[8];
    ellm_unpack_k4_scales(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int c = 0; c < 4; c++) {
        float d0 = d * sc[2 * c], m0 = dmin * mn[2 * c];
        float d1 = d * sc[2 * c + 1], m1 = dmin * mn[2 * c + 1];
        for (int l = 0; l < 32; l++) {
            int lo = (qs[32 * c + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4);
            int hi = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
            y[64 * c + l] = d0 * (float)lo - m0;
            y[64 * c + 32 + l] = d1 * (float)hi - m1;
        }
    }
}

/* Q6_K: two 128-halves; low nibbles in ql (64 bytes a half), 2 high bits in qh
 * (32 bytes a half, four values a byte); signed scale per 16, values stored +32. */
static void dq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = ellm_rd_f16(b + 208);
    for (int e = 0; e < 256; e++) {
        int half = e >> 7, r = e & 127;
        int lo = (ql[half * 64 + (r & 63)] >> (4 * (r >> 6))) & 0x0F;
        int hi = (qh[half * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
        y[e] = d * (float)sc[e >> 4] * (float)((lo | (hi << 4)) - 32);
    }
}

typedef void (*dq_block_fn)(const uint8_t *b, float *y);

static dq_block_fn dq_block(int qtype) {
    switch (qtype) {
    case ELLM_T_Q4_0: return dq_q4_0;
    case ELLM_T_Q4_1: return dq_q4_1;
    case ELLM_T_Q5_0: return dq_q5_0;
    case ELLM_T_Q5_1: return dq_q5_1;
    case ELLM_T_Q8_0: return dq_q8_0;
    case ELLM_T_Q2_K: return dq_q2_k;
    case ELLM_T_Q3_K: return dq_q3_k;
    case ELLM_T_Q4_K: return dq_q4_k;
    case ELLM_T_Q5_K: return dq_q5_k;
    case ELLM_T_Q6_K: return dq_q6_k;
    default: return NULL;
    }
}

/* Unchecked: src holds exactly ellm_row_bytes(qtype, n) bytes, n whole blocks. */
static void dequantize_unchecked(int qtype, const uint8_t *src, float *dst, int64_t n) {
    switch (qtype) {
    case ELLM_T_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case ELLM_T_F16: {
        /* src may be odd-aligned; convert through a small aligned bounce buffer */
        uint16_t tmp[256];
        for (int64_t i = 0; i < n; i += 256) {
            int64_t m = n - i < 256 ? n - i : 256;
            memcpy(tmp, src + 2 * i, (size_t)m * 2);
            ellm_f16_to_f32_row(tmp, dst + i, (size_t)m);
        }
        return;
    }
    case ELLM_T_BF16: {
        uint16_t tmp[256];
        for (int64_t i = 0; i < n; i += 256) {
            int64_t m = n - i < 256 ? n - i : 256;
            memcpy(tmp, src + 2 * i, (size_t)m * 2);
            ellm_bf16_to_f32_row(tmp, dst + i, (size_t)m);
        }
        return;
    }
    default: break;
    }
    dq_block_fn f = dq_block(qtype);
    int64_t be = ellm_qtype_block_elems(qtype), bb = ellm_qtype_block_bytes(qtype);
    for (int64_t i = 0; i < n / be; i++) f(src + i * bb, dst + i * be);
}

int ellm_dequantize(int qtype, const uint8_t *src, size_t src_bytes, float *dst, int64_t n) {
    if (ellm_qtype_block_elems(qtype) == 0) return ELLM_E_TYPE;
    int64_t rb = ellm_row_bytes(qtype, n);
    if (rb < 0) return ELLM_E_SHAPE;
    if ((uint64_t)rb != (uint64_t)src_bytes) return ELLM_E_SIZE;
    if (n == 0) return ELLM_OK;
    dequantize_unchecked(qtype, src, dst, n);
    return ELLM_OK;
}

int ellm_get_rows(int qtype, const uint8_t *w, size_t w_bytes, int64_t n_rows, int64_t k,
                  const int32_t *ids, int64_t n_ids, float *out) {
    if (ellm_qtype_block_elems(qtype) == 0) return ELLM_E_TYPE;
    int64_t rb = ellm_row_bytes(qtype, k);
    if (rb < 0 || n_rows < 0 || n_ids < 0) return ELLM_E_SHAPE;
    if (n_rows > 0 && (uint64_t)rb > (uint64_t)w_bytes / (uint64_t)n_rows) return ELLM_E_SIZE;
    if ((uint64_t)rb * (uint64_t)n_rows != (uint64_t)w_bytes) return ELLM_E_SIZE;
    for (int64_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return ELLM_E_INDEX;
    for (int64_t i = 0; i < n_ids; i++)
        dequantize_unchecked(qtype, w + (size_t)ids[i] * (size_t)rb, out + i * k, k);
    return ELLM_OK;
}

/* ====================================================================================
 * Q4_K, Q5_K and Q6_K rows rearranged for the GPU
 * ==================================================================================== */

/* The nibbles (low ones if !high, else high) of 32 source bytes -> a step's 16 bytes as
 * Q4_0 keeps them: byte i = weight i (low nibble), weight 16 + i (high); weight j is the
 * chosen nibble of source byte j. 8 bytes at a time (masks keep it within each byte). */
static void nibble_step(const uint8_t *src, int high, uint8_t *dst) {
    const uint64_t m4 = 0x0F0F0F0F0F0F0F0FULL;
    for (int i = 0; i < 16; i += 8) {
        uint64_t lo, hi, v;
        memcpy(&lo, src + i, 8);
        memcpy(&hi, src + 16 + i, 8);
        v = high ? ((lo >> 4) & m4) | (hi & ~m4) : (lo & m4) | ((hi & m4) << 4);
        memcpy(dst + i, &v, 8);
    }
}

/* A step's high bits: the `bits`-wide field (1 or 2) at `shift` of 32 source bytes, weight
 * j's from byte j -> 4 units (a byte for 1 bit, a little-endian u16 for 2) at dst, unit q
 * holding weights 4q + i at bits i * bits and 16 + 4q + i at bits (4 + i) * bits. Four
 * weights at a time: the 4 bytes src[4c ..] (little-endian, as every target) shifted and
 * masked, byte m's field moved to bits m * bits. */
static void high_bits(const uint8_t *src, int shift, int bits, uint8_t *dst) {
    uint32_t mask = bits == 1 ? 0x01010101u : 0x03030303u, gap = (uint32_t)(8 - bits);
    uint32_t packed[8];   /* weights 4c .. 4c + 3 */
    for (int c = 0; c < 8; c++) {
        uint32_t x;
        memcpy(&x, src + 4 * c, 4);
        x = (x >> shift) & mask;
        packed[c] = (x | (x >> gap) | (x >> (2 * gap)) | (x >> (3 * gap))) & ((1u << (4 * bits)) - 1u);
    }
    for (int q = 0; q < 4; q++) {
        uint32_t unit = packed[q] | (packed[4 + q] << (4 * bits));
        for (int i = 0; i < bits; i++) dst[bits * q + i] = (uint8_t)(unit >> (8 * i));
    }
}

/* One Q6_K block (ql[128], qh[64], int8 scales[16], f16 d) -> its 8 steps' records at rec
 * (24 bytes a step). GGML's weight e of a block: h = e / 128, r = e % 128, low 4 bits the
 * nibble r / 64 of ql[64 h + r % 64], high 2 bits the pair r / 32 of qh[32 h + r % 32].
 * So step t (h = t / 4, u = t % 4) takes its nibbles from ql[64 h + 32 (u % 2) ..] (the
 * high ones if u >= 2) and its pairs from qh[32 h ..] (shift 2 u). A record: 16 bytes of
 * nibbles (nibble_step), then 4 u16 words of pairs (high_bits). */
static void q6_k_records(const uint8_t *blk, uint8_t *rec) {
    for (int t = 0; t < 8; t++, rec += 24) {
        int h = t >> 2, u = t & 3;
        nibble_step(blk + 64 * h + 32 * (u & 1), u >= 2, rec);
        high_bits(blk + 128 + 32 * h, 2 * u, 2, rec + 16);
    }
}

/* A Q4_K / Q5_K block's head (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins packed as
 * GGML packs them) -> 16 bytes: d, dmin, a word of sub-block s's top 2 bits of scale and of min
 * at bits 4 s and 4 s + 2, then a byte a sub-block: the scale's low 4 bits, the min's
 * above them. A sub-block's two numbers are then in the first 8 bytes and one word. */
static void k_quant_head(const uint8_t *blk, uint8_t *head) {
    uint8_t sc[8], mn[8];
    ellm_unpack_k4_scales(blk + 4, sc, mn);
    uint32_t top = 0;
    for (int s = 0; s < 8; s++) {
        top |= (uint32_t)((sc[s] >> 4) | ((mn[s] >> 4) << 2)) << (4 * s);
        head[8 + s] = (uint8_t)((sc[s] & 15) | ((mn[s] & 15) << 4));
    }
    memcpy(head, blk, 4);
    for (int i = 0; i < 4; i++) head[4 + i] = (uint8_t)(top >> (8 * i));
}

/* One row: Q4_K (f16 d, f16 dmin, 12 bytes of scales, qs[128]: 64-chunk c holds sub-block
 * 2c in the low nibbles of qs[32c ..], 2c + 1 in the high ones) -> 16 bytes of nibbles a
 * step (nibble_step), then the blocks' heads (k_quant_head). Q5_K (Q4_K's head, qh[32],
 * qs[128]) -> 20 bytes a step (nibbles, then the fifth bits: high_bits), then the heads. Q6_K -> 24-byte step
 * records, then the blocks' 16 scales, then their d. */
static void split_row(int qtype, const uint8_t *row, int64_t nb, uint8_t *out) {
    for (int64_t b = 0; b < nb; b++) {
        if (qtype == ELLM_T_Q4_K) {
            const uint8_t *blk = row + b * 144;
            for (int t = 0; t < 8; t++) nibble_step(blk + 16 + 32 * (t >> 1), t & 1, out + (b * 8 + t) * 16);
            k_quant_head(blk, out + nb * 128 + b * 16);
        } else if (qtype == ELLM_T_Q5_K) {
            const uint8_t *blk = row + b * 176;
            for (int t = 0; t < 8; t++) {
                uint8_t *rec = out + (b * 8 + t) * 20;
                nibble_step(blk + 48 + 32 * (t >> 1), t & 1, rec);
                high_bits(blk + 16, t, 1, rec + 16);   /* bit t of qh[j]: weight j's fifth */
            }
            k_quant_head(blk, out + nb * 160 + b * 16);
        } else {
            const uint8_t *blk = row + b * 210;
            q6_k_records(blk, out + b * 192);
            memcpy(out + nb * 192 + b * 16, blk + 192, 16);
            memcpy(out + nb * 208 + b * 2, blk + 208, 2);
        }
    }
}

typedef struct {
    int qtype;
    const uint8_t *src;
    uint8_t *dst;
    int64_t k, row_bytes, dst_stride;
} split_ctx;

static void split_task(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const split_ctx *c = (const split_ctx *)ctx;
    (void)thread_id;
    for (int64_t r = begin; r < end; r++) {
        uint8_t *out = c->dst + (size_t)r * (size_t)c->dst_stride;
        split_row(c->qtype, c->src + (size_t)r * (size_t)c->row_bytes, c->k / 256, out);
        memset(out + c->row_bytes, 0, (size_t)(c->dst_stride - c->row_bytes));
    }
}

int ellm_split_rows(int qtype, const uint8_t *src, size_t src_bytes, int64_t n_rows, int64_t k,
                    uint8_t *dst, size_t dst_bytes, int64_t dst_stride) {
    if (qtype != ELLM_T_Q4_K && qtype != ELLM_T_Q5_K && qtype != ELLM_T_Q6_K) return ELLM_E_TYPE;
    int64_t rb = ellm_row_bytes(qtype, k);
    if (rb < 0 || n_rows < 0 || dst_stride < rb) return ELLM_E_SHAPE;
    if ((uint64_t)rb * (uint64_t)n_rows != (uint64_t)src_bytes) return ELLM_E_SIZE;
    if ((uint64_t)dst_stride * (uint64_t)n_rows != (uint64_t)dst_bytes) return ELLM_E_SIZE;
    if (n_rows == 0 || rb == 0) {   /* no weights: only padding */
        if (dst_bytes) memset(dst, 0, dst_bytes);
        return ELLM_OK;
    }
    split_ctx c = {qtype, src, dst, k, rb, dst_stride};
    /* a whole model's K-quant rows are rearranged as it is uploaded: spread them over the
     * pool in ~64 KiB chunks of input */
    int64_t grain = 65536 / rb;
    ellm_parallel_for(n_rows, grain < 1 ? 1 : grain, split_task, &c);
    return ELLM_OK;
}

/* ====================================================================================
 * Quantization of f32 rows (GGML's reference rounding, so the bytes match llama.cpp)
 * ==================================================================================== */

/* (32,) -> one Q8_0 block: d = amax / 127, q = round-half-away(x / d). */
static void q_q8_0(const float *x, uint8_t *b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t dh = ellm_f32_to_f16(d);
    memcpy(b, &dh, 2);
    for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* (32,) -> one Q4_0 block: d = (the value of largest magnitude) / -8, q in [0, 15]. */
static void q_q4_0(const float *x, uint8_t *b) {
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < 32; j++) {
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            vmax = x[j];
        }
    }
    float d = vmax / -8.0f;
    float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint16_t dh = ellm_f32_to_f16(d);
    memcpy(b, &dh, 2);
    for (int j = 0; j < 16; j++) {
        /* x * id lies in [-8, 8], so the sum is >= 0.5 and the truncation is a floor */
        float v0 = x[j] * id + 8.5f, v1 = x[j + 16] * id + 8.5f;
        int q0 = (int)v0 > 15 ? 15 : (int)v0;
        int q1 = (int)v1 > 15 ? 15 : (int)v1;
        b[2 + j] = (uint8_t)(q0 | (q1 << 4));
    }
}

typedef struct {
    void (*block)(const float *, uint8_t *);
    const float *src; /* (n_rows, k) */
    uint8_t *dst;     /* (n_rows, row_bytes) */
    int64_t k, row_bytes, block_bytes;
} quantize_ctx;

static void quantize_task(void *ctx, int64_t begin, int64_t end, int thread_id) {
    (void)thread_id;
    const quantize_ctx *c = (const quantize_ctx *)ctx;
    for (int64_t r = begin; r < end; r++)
        for (int64_t i = 0; i < c->k / QK32; i++)
            c->block(c->src + r * c->k + i * QK32, c->dst + r * c->row_bytes + i * c->block_bytes);
}

int ellm_quantize_rows(int qtype, const float *src, int64_t n_rows, int64_t k, uint8_t *dst,
                       size_t dst_bytes) {
    quantize_ctx c;
    if (qtype == ELLM_T_Q8_0) c.block = q_q8_0;
    else if (qtype == ELLM_T_Q4_0) c.block = q_q4_0;
    else return ELLM_E_TYPE;
    int64_t rb = ellm_row_bytes(qtype, k);
    if (rb < 0 || n_rows < 0) return ELLM_E_SHAPE;
    if (n_rows > 0 && (uint64_t)rb > (uint64_t)dst_bytes / (uint64_t)n_rows) return ELLM_E_SIZE;
    if ((uint64_t)rb * (uint64_t)n_rows != (uint64_t)dst_bytes) return ELLM_E_SIZE;
    if (n_rows == 0 || k == 0) return ELLM_OK;
    c.src = src;
    c.dst = dst;
    c.k = k;
    c.row_bytes = rb;
    c.block_bytes = ellm_qtype_block_bytes(qtype);
    /* a whole model is quantized at load time: spread rows over the pool in ~64 KiB
     * chunks of input */
    int64_t grain = (65536 / 4) / k;
    ellm_parallel_for(n_rows, grain < 1 ? 1 : grain, quantize_task, &c);
    return ELLM_OK;
}
