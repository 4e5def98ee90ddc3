/* The linear-layer driver (Y = X . W^T over the thread pool) and the scalar float-weight
 * kernels. The per-type inner kernels live in quant_dot.c / quant_avx2.c /
 * quant_avx512.c (quantized) and matmul_avx2.c / matmul_avx512.c (float). */
#include "matmul.h"

#include <stdint.h>
#include <string.h>

#include "quant.h"
#include "quant_impl.h"
#include "threadpool.h"

/* ====================================================================================
 * Scalar float-weight kernels: a tile of nr weight rows x nt activation rows
 * ==================================================================================== */

static float wf32(const uint8_t *w, int64_t i) {
    float f;
    memcpy(&f, w + 4 * i, 4);
    return f;
}
static float wf16(const uint8_t *w, int64_t i) { return ellm_rd_f16(w + 2 * i); }
static float wbf16(const uint8_t *w, int64_t i) { return ellm_bf16_to_f32(ellm_rd_u16(w + 2 * i)); }

#define DEFINE_FMM_SCALAR(name, load)                                                        \
    static void name(int64_t k, const uint8_t *w, size_t w_stride, int64_t nr, const float *x, \
                     size_t x_stride, int64_t nt, float *y, size_t y_stride) {                 \
        for (int64_t r = 0; r < nr; r++) {                                                   \
            const uint8_t *wr = w + (size_t)r * w_stride;                                    \
            for (int64_t t = 0; t < nt; t++) {                                               \
                const float *xt = x + (size_t)t * x_stride;                                  \
                float acc = 0.0f;                                                            \
                for (int64_t i = 0; i < k; i++) acc += load(wr, i) * xt[i];                  \
                y[(size_t)t * y_stride + r] = acc;                                           \
            }                                                                                \
        }                                                                                    \
    }

DEFINE_FMM_SCALAR(fmm_f32, wf32)
DEFINE_FMM_SCALAR(fmm_f16, wf16)
DEFINE_FMM_SCALAR(fmm_bf16, wbf16)

ellm_fmm_fn ellm_fmm_scalar(int qtype) {
    switch (qtype) {
    case ELLM_T_F32: return fmm_f32;
    case ELLM_T_F16: return fmm_f16;
    case ELLM_T_BF16: return fmm_bf16;
    default: return NULL;
    }
}

/* ====================================================================================
 * Driver
 * ==================================================================================== */

/* Prefill tiles: a tile is ROW_TILE weight rows x TOK_TILE tokens; the tile's weight
 * rows stay in L1 / L2 across its tokens and its activations in L2 across its rows. */
#define ROW_TILE 16
#define TOK_TILE 32
/* Decode: a thread claims about this many weight bytes at a time. */
#define DECODE_CHUNK_BYTES 24576

typedef struct {
    const float *x;     /* (T, K) */
    const uint8_t *xq;  /* (T, act_stride bytes) quantized activations */
    size_t act_stride;
    const uint8_t *w;   /* (N, row_bytes) */
    size_t row_bytes;
    int64_t T, K, N, nb; /* nb: blocks per row (quantized) */
    float *y;           /* (T, N) */
    ellm_qdot_fn qdot;  /* exactly one of qdot / fmm is set */
    ellm_fmm_fn fmm;
    ellm_act_fn act;
    int64_t row_tiles;  /* prefill: tiles along N */
} lin_ctx;

/* Output rows [n0, n1) for tokens [t0, t1). */
static void run_block(const lin_ctx *c, int64_t n0, int64_t n1, int64_t t0, int64_t t1) {
    if (c->fmm) {
        c->fmm(c->K, c->w + (size_t)n0 * c->row_bytes, c->row_bytes, n1 - n0,
               c->x + (size_t)t0 * c->K, (size_t)c->K, t1 - t0, c->y + (size_t)t0 * c->N + n0,
               (size_t)c->N);
        return;
    }
    /* quantized: each weight row is loaded once per kernel call and reused for up to
     * ELLM_QDOT_MAX_NT tokens while it sits in L1 */
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *wr = c->w + (size_t)n * c->row_bytes;
        for (int64_t t = t0; t < t1; t += ELLM_QDOT_MAX_NT) {
            int nt = (int)(t1 - t < ELLM_QDOT_MAX_NT ? t1 - t : ELLM_QDOT_MAX_NT);
            c->qdot(c->nb, wr, c->xq + (size_t)t * c->act_stride, c->act_stride, nt,
                    c->y + (size_t)t * c->N + n, (size_t)c->N);
        }
    }
}

static void task_decode(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const lin_ctx *c = (const lin_ctx *)ctx;
    run_block(c, begin, end, 0, c->T);
}

static void task_tiles(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const lin_ctx *c = (const lin_ctx *)ctx;
    for (int64_t tile = begin; tile < end; tile++) {
        int64_t r = tile % c->row_tiles, tt = tile / c->row_tiles;
        int64_t n0 = r * ROW_TILE, n1 = n0 + ROW_TILE < c->N ? n0 + ROW_TILE : c->N;
        int64_t t0 = tt * TOK_TILE, t1 = t0 + TOK_TILE < c->T ? t0 + TOK_TILE : c->T;
        run_block(c, n0, n1, t0, t1);
    }
}

static void task_quantize_act(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const lin_ctx *c = (const lin_ctx *)ctx;
    for (int64_t t = begin; t < end; t++)
        c->act(c->x + t * c->K, c->K, (void *)(c->xq + (size_t)t * c->act_stride));
}

size_t ellm_linear_scratch_bytes(int qtype, int64_t T, int64_t K) {
    if (T < 0 || ellm_row_bytes(qtype, K) < 0) return 0;
    size_t per_row = ellm_act_row_bytes(qtype, K);
    if (per_row && (uint64_t)T > SIZE_MAX / per_row) return 0;
    return per_row * (size_t)T;
}

int ellm_linear(int qtype, const float *x, int64_t T, int64_t K, const uint8_t *w, size_t w_bytes,
                int64_t N, float *y, void *scratch, size_t scratch_bytes) {
    if (ellm_qtype_block_elems(qtype) == 0) return ELLM_E_TYPE;
    int64_t rb = ellm_row_bytes(qtype, K);
    if (rb < 0 || T < 0 || N < 0) return ELLM_E_SHAPE;
    if (N > 0 && (uint64_t)rb > (uint64_t)w_bytes / (uint64_t)N) return ELLM_E_SIZE;
    if ((uint64_t)rb * (uint64_t)N != (uint64_t)w_bytes) return ELLM_E_SIZE;
    if (T == 0 || N == 0) return ELLM_OK;
    if (K == 0) {
        memset(y, 0, (size_t)T * (size_t)N * sizeof(float));
        return ELLM_OK;
    }

    lin_ctx c;
    memset(&c, 0, sizeof c);
    c.x = x;
    c.w = w;
    c.row_bytes = (size_t)rb;
    c.T = T;
    c.K = K;
    c.N = N;
    c.y = y;
    if (ellm_act_block(qtype)) {
        size_t need = ellm_linear_scratch_bytes(qtype, T, K);
        if (need == 0 || scratch == NULL || scratch_bytes < need || ((uintptr_t)scratch & 63u))
            return ELLM_E_SCRATCH;
        c.xq = (const uint8_t *)scratch;
        c.act_stride = ellm_act_row_bytes(qtype, K);
        c.nb = K / ellm_act_block(qtype);
        c.qdot = ellm_qdot_select(qtype);
        c.act = ellm_act_select(qtype);
        /* Activation quantization is cheap next to the matmul; only spread it when
         * there are enough rows to pay for waking the pool. */
        if (T >= 16) ellm_parallel_for(T, 4, task_quantize_act, &c);
        else task_quantize_act(&c, 0, T, 0);
    } else {
        c.fmm = ellm_fmm_select(qtype);
    }

    if (T == 1) {
        int64_t grain = DECODE_CHUNK_BYTES / rb;
        if (grain < 4) grain = 4;
        ellm_parallel_for(N, grain, task_decode, &c);
    } else {
        c.row_tiles = (N + ROW_TILE - 1) / ROW_TILE;
        int64_t tiles = c.row_tiles * ((T + TOK_TILE - 1) / TOK_TILE);
        ellm_parallel_for(tiles, 1, task_tiles, &c);
    }
    return ELLM_OK;
}
