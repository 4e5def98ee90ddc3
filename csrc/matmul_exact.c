/* The exact-activation linear driver (matmul_exact.h): per work item, EXACT_ROWS weight
 * rows are dequantized into this thread's slice of the scratch and multiplied by the
 * item's tokens with the float-weight kernel of the level in force (ellm_fmm_fn on f32
 * rows). Float weight types go to that kernel directly. */
#include "matmul_exact.h"

#include <string.h>

#include "quant.h"
#include "quant_impl.h"
#include "simd.h"
#include "threadpool.h"

/* Rows dequantized per item (their f32 copy stays in L1 / L2 across the item's tokens),
 * and tokens per item (prefill: the rows are dequantized again per token tile, a small
 * cost next to the multiply) */
#define EXACT_ROWS 4
#define EXACT_TOKS 64

/* Few tokens through a fused kernel (no row buffer): an item is one long run of rows,
 * 1 / (EXACT_DECODE_ITEMS_PER_THREAD x threads) of the matrix within [MIN, MAX] bytes, a
 * multiple of EXACT_ROWS rows -- one sequential stream for the prefetchers and few claims
 * on the pool's counter (4-row items, claimed 8 at a time, took 8,192 claims per call of
 * the Gemma 3 head). Which rows an item holds never changes what is computed (each
 * output has its own sums in the fused kernel). */
#define EXACT_DECODE_ITEMS_PER_THREAD 2
#define EXACT_DECODE_MIN_BYTES ((size_t)16 << 10)
#define EXACT_DECODE_MAX_BYTES ((size_t)1 << 20)

/* One row of n elements -> f32, bit-identical to ellm_dequantize */
typedef void (*dq_row_fn)(const uint8_t *src, float *dst, int64_t n);

/* Below this many tokens, the level's fused kernel (where it has one) dequantizes in
 * registers, with the same results as the row buffer and the f32 kernel */
#define EXACT_FEW_TOKENS 16

#if defined(__x86_64__) || defined(__i386__)
dq_row_fn ellm_dq_row_avx512(int qtype);       /* matmul_exact_avx512.c; NULL where none */
ellm_fmm_fn ellm_exact_fused_avx512(int qtype); /* quantized rows in place of f32 ones */
#endif

typedef struct {
    int qtype;
    const uint8_t *w;
    size_t row_bytes;
    int64_t N;
    float *y;
    int64_t ldy;
    const float *bias; /* (N,) or NULL: added after each output's sum, as matmul.c does */
    int is_float;     /* F32 / F16 / BF16: no dequantization */
    dq_row_fn dq;     /* a fast row dequantizer, or NULL (then ellm_dequantize) */
    ellm_fmm_fn fused; /* few tokens: the quantized rows straight into the f32 kernel's sums */
    ellm_fmm_fn fmm;  /* F32 kernel (quantized types) or the type's own (float types) */
    int64_t item_rows; /* rows per item: EXACT_ROWS, or a decode-sized run with `fused` */
    int64_t row_items, first_item, end_item;
} exact_part;

typedef struct {
    const float *x;
    int64_t T, K, tok_items;
    int n_parts;
    exact_part p[ELLM_LINEAR_MAX_PARTS];
    uint8_t *scratch;
    size_t per_thread; /* bytes of scratch per thread */
} exact_ctx;

static size_t per_thread_bytes(int64_t K) {
    return ((size_t)K * EXACT_ROWS * sizeof(float) + 63) & ~(size_t)63;
}

size_t ellm_linear_exact_scratch_bytes(int64_t K, int max_threads) {
    if (K < 0 || max_threads < 1 || (uint64_t)K > SIZE_MAX / 64 / EXACT_ROWS / sizeof(float))
        return 0;
    const size_t per = per_thread_bytes(K);
    if (per && (size_t)max_threads > SIZE_MAX / per) return 0;
    return per * (size_t)max_threads;
}

/* y[t][i] += bias[i], one plain add per output after its sum (matmul.c's epilogue) */
static void add_bias(const float *bias, int64_t n, float *y, size_t ldy, int64_t nt) {
    for (int64_t t = 0; t < nt; t++)
        for (int64_t i = 0; i < n; i++) y[(size_t)t * ldy + (size_t)i] += bias[i];
}

/* Rows [n0, n1) of part p against nt tokens of x, into y: the sums, before any bias */
static void exact_block(const exact_ctx *c, const exact_part *p, float *buf, int64_t n0,
                        int64_t n1, const float *x, int64_t nt, float *y) {
    const uint8_t *w = p->w + (size_t)n0 * p->row_bytes;
    if (p->fused || p->is_float) { /* quantized rows straight in, or float weights as they lie */
        (p->fused ? p->fused : p->fmm)(c->K, w, p->row_bytes, n1 - n0, x, (size_t)c->K, nt, y,
                                       (size_t)p->ldy);
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *src = p->w + (size_t)n * p->row_bytes;
        float *dst = buf + (size_t)(n - n0) * (size_t)c->K;
        if (p->dq) p->dq(src, dst, c->K);
        else (void)ellm_dequantize(p->qtype, src, p->row_bytes, dst, c->K); /* sizes checked */
    }
    p->fmm(c->K, (const uint8_t *)buf, (size_t)c->K * sizeof(float), n1 - n0, x, (size_t)c->K, nt,
           y, (size_t)p->ldy);
}

static void task_exact(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const exact_ctx *c = (const exact_ctx *)ctx;
    float *buf = (float *)(c->scratch + (size_t)thread_id * c->per_thread);
    int pi = 0;
    for (int64_t item = begin; item < end; item++) {
        while (item >= c->p[pi].end_item) pi++;
        const exact_part *p = &c->p[pi];
        const int64_t j = item - p->first_item;
        const int64_t r = j % p->row_items, tt = j / p->row_items;
        const int64_t n0 = r * p->item_rows, n1 = n0 + p->item_rows < p->N ? n0 + p->item_rows : p->N;
        const int64_t t0 = tt * EXACT_TOKS, t1 = t0 + EXACT_TOKS < c->T ? t0 + EXACT_TOKS : c->T;
        float *y = p->y + (size_t)t0 * (size_t)p->ldy + (size_t)n0;
        exact_block(c, p, buf, n0, n1, c->x + (size_t)t0 * (size_t)c->K, t1 - t0, y);
        if (p->bias) add_bias(p->bias + n0, n1 - n0, y, (size_t)p->ldy, t1 - t0);
    }
}

int ellm_linear_multi_exact(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                            int n_parts, void *scratch, size_t scratch_bytes) {
    if (parts == NULL || n_parts < 1 || n_parts > ELLM_LINEAR_MAX_PARTS) return ELLM_E_SHAPE;
    if (T < 0 || K < 0) return ELLM_E_SHAPE;
    for (int i = 0; i < n_parts; i++) { /* the checks of ellm_linear_multi */
        const ellm_linear_part *q = &parts[i];
        if (ellm_qtype_block_elems(q->qtype) == 0) return ELLM_E_TYPE;
        int64_t rb = ellm_row_bytes(q->qtype, K);
        if (rb < 0 || q->N < 0) return ELLM_E_SHAPE;
        if (q->N > 0 && (uint64_t)rb > (uint64_t)q->w_bytes / (uint64_t)q->N) return ELLM_E_SIZE;
        if ((uint64_t)rb * (uint64_t)q->N != (uint64_t)q->w_bytes) return ELLM_E_SIZE;
        if (T > 0 && q->N > 0) {
            if (q->ldy < q->N || q->y == NULL || (q->w == NULL && q->w_bytes)) return ELLM_E_SHAPE;
            if ((uint64_t)q->ldy > SIZE_MAX / sizeof(float) / (uint64_t)T) return ELLM_E_SIZE;
        }
    }
    if (T == 0) return ELLM_OK;
    if (K == 0) { /* empty sums: y = 0 (+ bias) */
        for (int i = 0; i < n_parts; i++)
            for (int64_t t = 0; parts[i].N > 0 && t < T; t++) {
                float *yt = parts[i].y + (size_t)t * (size_t)parts[i].ldy;
                memset(yt, 0, (size_t)parts[i].N * sizeof(float));
                if (parts[i].bias) add_bias(parts[i].bias, parts[i].N, yt, 0, 1);
            }
        return ELLM_OK;
    }
    if (x == NULL) return ELLM_E_SHAPE;
    const size_t per = per_thread_bytes(K);
    if (scratch == NULL || ((uintptr_t)scratch & 63u) || scratch_bytes < per) return ELLM_E_SCRATCH;
    int threads = ellm_num_threads();
    if ((size_t)threads > scratch_bytes / per) threads = (int)(scratch_bytes / per);

    exact_ctx c;
    memset(&c, 0, sizeof c);
    c.x = x;
    c.T = T;
    c.K = K;
    c.tok_items = (T + EXACT_TOKS - 1) / EXACT_TOKS;
    c.scratch = (uint8_t *)scratch;
    c.per_thread = per;
    const ellm_fmm_fn fmm_f32 = ellm_fmm_select(ELLM_T_F32);
    int64_t items = 0;
    for (int i = 0; i < n_parts; i++) {
        const ellm_linear_part *q = &parts[i];
        if (q->N == 0) continue;
        exact_part *p = &c.p[c.n_parts++];
        p->qtype = q->qtype;
        p->w = q->w;
        p->row_bytes = (size_t)ellm_row_bytes(q->qtype, K);
        p->N = q->N;
        p->y = q->y;
        p->ldy = q->ldy;
        p->bias = q->bias;
        p->is_float = q->qtype == ELLM_T_F32 || q->qtype == ELLM_T_F16 || q->qtype == ELLM_T_BF16;
        if (p->is_float) {
            p->fmm = ellm_fmm_select(q->qtype);
        } else {
            p->fmm = fmm_f32;
#if defined(__x86_64__) || defined(__i386__)
            if (ellm_simd_is_avx512(ellm_simd_level())) {
                p->dq = ellm_dq_row_avx512(q->qtype);
                if (T < EXACT_FEW_TOKENS) p->fused = ellm_exact_fused_avx512(q->qtype);
            }
#endif
        }
        p->item_rows = EXACT_ROWS;
        if (p->fused) {
            size_t b = (size_t)q->w_bytes / ((size_t)threads * EXACT_DECODE_ITEMS_PER_THREAD);
            b = b < EXACT_DECODE_MIN_BYTES ? EXACT_DECODE_MIN_BYTES : b > EXACT_DECODE_MAX_BYTES ? EXACT_DECODE_MAX_BYTES : b;
            const int64_t rows = (int64_t)(b / p->row_bytes);
            p->item_rows = rows > EXACT_ROWS ? rows / EXACT_ROWS * EXACT_ROWS : EXACT_ROWS;
        }
        p->row_items = (p->N + p->item_rows - 1) / p->item_rows;
        p->first_item = items;
        items += p->row_items * c.tok_items;
        p->end_item = items;
    }
    if (c.n_parts == 0) return ELLM_OK;
    /* only 4-row items (the row buffer's): claim several at a time at one token (cheap
     * items); a decode-sized item is claimed alone */
    int all_small = 1;
    for (int i = 0; i < c.n_parts; i++) all_small &= c.p[i].item_rows == EXACT_ROWS;
    ellm_parallel_for_threads(items, T == 1 && all_small ? 8 : 1, threads, task_exact, &c);
    return ELLM_OK;
}
