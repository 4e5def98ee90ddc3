/* The linear-layer driver (Y = X . W^T over the thread pool, for one weight matrix or
 * several sharing X) and the scalar float-weight kernels. The per-type inner kernels
 * live in quant_dot.c / quant_avx2.c / quant_avx512.c (quantized) and matmul_avx2.c /
 * matmul_avx512.c (float).
 *
 * How work is split never changes what is computed: every output is one kernel call's
 * fixed-order sum (quant_impl.h), so results are the same for any T, item size, part
 * grouping and thread count. */
#include "matmul.h"

#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "matmul_amx.h"
#include "matmul_bf16_amx.h" /* [bf16] */
#include "quant.h"
#include "quant_impl.h"
#include "simd.h"
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
 * Driver: one or several weight matrices against one X, as one list of work items
 * ==================================================================================== */

/* Prefill items: ROW_TILE weight rows x TOK_TILE tokens; the item's weight rows stay in
 * L1 / L2 across its tokens and its activations in L2 across its rows. The token-group
 * kernels unpack an item's weight rows once for all its token pairs, so longer items pay
 * that less often: 128 tokens against 32 (AMD EPYC Zen 5, 2 threads, alternated call by
 * call in one process) ran Q4_1 576 x 576 at T=512 1.21x, Q5_0 2048 x 640 1.24x, and
 * prefill@512 of SmolLM2 1.12x and of Gemma 3 1.07x; K-quants and float weights 1.00-1.07x.
 * (With 64 or fewer, staging still covered these items; see STAGE_TOKS.) */
#define ROW_TILE 16
#define TOK_TILE 128
/* [bf16] rows per item of the bf16 tiles: one pass (2 weight tiles) */
#define BF16_ROW_TILE 32
_Static_assert(TOK_TILE % ELLM_TG == 0, "token items start on a group of the group layouts");
/* [amx] Items of the AMX kernels. The 32-element types: 128 tokens (8 tile groups), which
 * share one unpacking of the item's weight rows. (64 was faster while each item loaded
 * and released the tile configuration and was claimed alone; with runs of items claimed
 * at once and the configuration kept, 128 gives SmolLM2's prefill@512 2,800 tok/s against
 * 2,720 at 64, 2 threads, and 256 no more.) The K-quants (only): up to 512 tokens, so that
 * one unpacking of a chunk of their big blocks serves them all, fewer where their
 * activations would pass AMX_ITEM_ACT_BYTES (L2 is 2 MiB a core here). */
#define AMX_TOK_TILE 128
#define AMX_K_TOK_TILE 512
#define AMX_ITEM_ACT_BYTES ((size_t)1 << 20)
_Static_assert(AMX_TOK_TILE % ELLM_AMX_TG == 0 && AMX_K_TOK_TILE % AMX_TOK_TILE == 0 &&
                   ELLM_AMX_TG % ELLM_TG == 0,
               "AMX items start on a 16-token group; padding to 16 covers groups of 8");
_Static_assert(sizeof(ellm_act32x8) == ELLM_TG * sizeof(ellm_act32) &&
                   sizeof(ellm_act256x8) == ELLM_TG * sizeof(ellm_act256),
               "a group layout takes the bytes of its tokens' rows (act_layout sizes it so)");
/* [amx] Output rows per item of a one-group call (batched decode of up to 16 sequences),
 * about N / (2 threads) within these bounds. SmolLM2, 16 sequences, 2 threads: a step
 * 15.0-15.8 ms with items of 32 rows, 14.8-14.9 at 64, 13.9-14.2 at 128. */
#define AMX_DECODE_ROWS_MIN 32
#define AMX_DECODE_ROWS_MAX 256
/* Below this many tokens (decode, batched decode of a few sequences) a linear call
 * reads its weights once, in the row layout, and takes the tokens QX_TILE at a time
 * against each weight tile in L1 (ellm_qdot_fn): unpacking a weight block for a group
 * of 8 token lanes (ellm_qgemm_fn) only pays off from about 16 tokens on. Measured on
 * the layers of both GGUF models here, 2 threads: 2 tokens 3.1-3.8 ms against 10-11 ms,
 * 8 tokens 9.2-9.5 against 10.9-11.0, 16 tokens 17.6-17.9 against 16.3-16.5. */
#define FEW_TOKENS 16
/* With 512-bit VNNI both kinds run at 512 bits (quant_x86.h: QX_ZMM), and the token
 * groups take over sooner. Layers of both GGUF models, 2 threads, one process switching
 * between the two (AMD EPYC Zen 5): T=8 rows 6.0 / 7.7 ms against groups 6.8 / 8.5 (SmolLM2
 * / Gemma 3), T=9 9.0 / 9.6 against 8.8 / 8.5, T=12 9.3 / 10.5 against 7.4 / 7.9. */
#define FEW_TOKENS_VNNI512 9
/* K-quant calls there take the groups from 12 tokens. Their row kernels (quant_x86.h:
 * qdot_kz_rows, 512 bits, 4 rows by up to 8 tokens a pass) beat the groups of 8 token
 * lanes, whose last one, part-filled, costs what a full one does, up to 11 (Zen 5, one
 * thread, 8192x2048, GMAC/s, rows / groups: Q4_K T=5 121 / 82, 8 124-133 / 127-135, 9
 * 117-122 / 101-111, 11 122-127 / 122-135, 12 124-128 / 133-147; Q6_K 5 140 / 78, 8
 * 138-145 / 122-126, 11 138 / 121, 12 143 / 132; Q2_K and Q3_K as Q6_K, Q5_K as Q4_K; the
 * 1B Q4_K_M file is two thirds Q4_K, a third Q6_K). Before the 512-bit row kernels the
 * K-quants took the groups from 5: their 256-bit rows summed ~70 GMAC/s at 2-8 tokens.
 * The 32-element types keep 9 (the 1B shape's Q8_0 file at 8 sequences: rows 157 tok/s,
 * groups 116). */
#define FEW_TOKENS_VNNI512_K 12
/* At the AVX2 level the groups take over from 13 tokens. One step's matmuls (layers and
 * head, q/k/v and gate/up fused as the engine calls them), 2 threads, one process switching
 * between the two, medians of 25 (AMD EPYC Zen 2): SmolLM2 rows / groups T=11 36.5 / 35.0 ms,
 * T=12 33.9 / 30.0, T=13 37.4 / 30.6, T=15 42.4 / 30.9; Gemma 3 T=11 63.1 / 70.5, T=12
 * 66.2 / 70.0, T=13 73.8 / 69.8, T=14 92.7 / 80.8, T=15 88.1 / 75.9. */
#define FEW_TOKENS_AVX2 13

/* Whether a call of T tokens uses the group layouts and the qgemm kernels; kquants_only:
 * it has K-quant parts (the 256-element activations) and no 32-element ones. */
static int takes_token_groups(int64_t T, int kquants_only) {
    const int level = ellm_simd_level();
    if (ellm_simd_is_avx512(level) && ellm_cpu_has_vnni())
        return T >= (kquants_only ? FEW_TOKENS_VNNI512_K : FEW_TOKENS_VNNI512);
    return T >= (level == ELLM_SIMD_AVX2 ? FEW_TOKENS_AVX2 : FEW_TOKENS);
}
/* The AMX tiles take a 16-token group in the time the row-layout kernels take about 8
 * tokens (Q4_1 1536x576, one thread: T=8 0.17 ms on VNNI rows, T=16 0.12-0.15 ms on
 * tiles), so at the AMX level calls from this many tokens on use them, padded to 16 */
#define AMX_FEW_TOKENS 8
_Static_assert(AMX_FEW_TOKENS <= FEW_TOKENS && AMX_FEW_TOKENS <= FEW_TOKENS_VNNI512 &&
                   AMX_FEW_TOKENS <= FEW_TOKENS_VNNI512_K && AMX_FEW_TOKENS <= FEW_TOKENS_AVX2,
               "tiles start no later than the token groups, and the scratch (rows padded to 16 "
               "from AMX_FEW_TOKENS on) has room for the groups");
/* Decode (T < FEW_TOKENS) is a read of the weights from DRAM, which the row kernels fetch
 * ahead in software (quant_x86.h); each thread should stream all the time. The call's
 * parts, one after the other, are cut into items of about the same bytes (1 /
 * (DECODE_ITEMS_PER_REGION x threads) of the call within [MIN, MAX], at least
 * DECODE_MIN_ROWS rows), and the items into one contiguous region per thread, balanced by
 * bytes (run_decode_regions below): each thread reads its region front to back -- one stream,
 * through the parts back to back -- and then takes items from the back of the others'
 * regions, so a thread that loses its core holds up only the item it is in. */
#define DECODE_ITEMS_PER_REGION 4
#define DECODE_ITEM_MIN_BYTES ((size_t)16 << 10)
#define DECODE_ITEM_MAX_BYTES ((size_t)256 << 10)
#define DECODE_MIN_ROWS 4
/* A one-token call on a matrix larger than this (a model's head) reads it from DRAM; on
 * AMD CPUs before Zen 5 the kernel variant that reads one row at a time (same results)
 * streams it faster than the 8-row tiles with their software prefetch, on Intel's and on
 * Zen 5 the tiles do. AMD EPYC, 2 threads: Gemma 3's 178 MB head 7.4-7.7 -> 6.1-6.8 ms,
 * SmolLM2's 30 MB one 1.24-1.33 -> 1.00-1.10 ms; the layers' matrices (under 1 MB) were
 * slower that way. Zen 5 (2 threads, the decode of whole models with one choice and the
 * other alternated in one process): one row at a time took SmolLM2 from 443 to 413 tok/s,
 * Gemma 3 270M from 222 to 193, the 1B shape's Q8_0 file (its head and FFN matrices past
 * this size) from 46 to 36. A type whose stream variant is NULL at the level keeps its
 * tiles: Q8_0 at AVX2, whose 4-row one-token kernel was faster than the one-row stream at
 * every size tried. */
#define DECODE_ROW_STREAM_BYTES ((size_t)16 << 20)

/* AMD's CPU family from Zen 5 on (CPUID family 26) */
#define AMD_FAMILY_ZEN5 26

/* The row kernel of a part at T tokens: at one token, the one-row variant where it streams
 * from DRAM faster than the tiles -- the 32-element types' on AMD CPUs before Zen 5 past
 * DECODE_ROW_STREAM_BYTES; the K-quants' (512-bit levels) on CPUs other than AMD's, at
 * every size: on the Xeon (AMX level, one thread) a 4-row K-quant tile read DRAM a quarter
 * slower than one row (8.7 against 11.8 GB/s), its four row streams defeating the hardware
 * prefetcher, while on Zen 5 the 512-bit 4-row tile reads it faster (Q4_K 8192 x 2048 from
 * 400 MB of copies, one thread: 56-57 against 46-47 GMAC/s one row at a time). Same bits
 * either way. */
static ellm_qdot_fn decode_kernel(const ellm_linear_part *q, int64_t T) {
    const ellm_qdot_fn tiles = ellm_qdot_select(q->qtype);
    if (T != 1) return tiles;
    const ellm_qdot_fn one_row = ellm_qdot_stream_select(q->qtype);
    if (!one_row) return tiles;
    const int family = ellm_cpu_amd_family();
    const int streams = ellm_act_block(q->qtype) == QK256
                            ? family == 0
                            : q->w_bytes > DECODE_ROW_STREAM_BYTES && family > 0 && family < AMD_FAMILY_ZEN5;
    return streams ? one_row : tiles;
}

static int64_t decode_item_bytes(size_t call_bytes) {
    size_t b = call_bytes / ((size_t)ellm_num_threads() * DECODE_ITEMS_PER_REGION);
    b = b < DECODE_ITEM_MIN_BYTES ? DECODE_ITEM_MIN_BYTES : b;
    return (int64_t)(b > DECODE_ITEM_MAX_BYTES ? DECODE_ITEM_MAX_BYTES : b);
}

/* Activation formats: index 0 = act32, 1 = act256. */
#define N_ACT 2

typedef struct {
    const uint8_t *w;      /* (N, row_bytes) */
    size_t row_bytes;
    int64_t N, nb;         /* nb: blocks per row (quantized) */
    float *y;              /* (T, ldy) */
    int64_t ldy;
    const float *bias;     /* (N,) or NULL */
    const uint8_t *xq;     /* quantized activations (quantized types): (T, act_stride bytes)
                            * rows, or with qgemm set (ceil(T / ELLM_TG), act_stride bytes)
                            * token groups (ellm_act32x8 / ellm_act256x8) */
    size_t act_stride;
    ellm_qdot_fn qdot;     /* exactly one of qdot / qgemm / fmm is set */
    ellm_qgemm_fn qgemm;
    ellm_fmm_fn fmm;
    int64_t tg;            /* with qgemm: tokens per group of xq (ELLM_TG, or ELLM_AMX_TG) */
    int64_t item_rows;     /* output rows per work item */
    int64_t lead_rows;     /* > 0: rows of a shorter first item, so that the others start on
                            * a 64-byte line of y (AMX tiles) */
    int64_t row_items;     /* work items along N */
    int64_t first_item;    /* this part's items in the call's item list: [first, end) */
    int64_t end_item;
    int index;             /* its index in the caller's parts (the epilogue's `part`) */
} lin_part;

typedef struct {
    const float *x;        /* (T, K) */
    int64_t T, K;
    int64_t item_toks;     /* tokens per work item */
    int n_parts;
    lin_part p[ELLM_LINEAR_MAX_PARTS];
    uint8_t *xq[N_ACT];    /* (T, act_stride[f]) per format in use, else NULL */
    size_t act_stride[N_ACT];
    int grouped[N_ACT];    /* format f is in its group layout (takes_token_groups(T),
                            * every part of that format has a qgemm kernel) */
    int amx[N_ACT];        /* format f is in 16-token groups for the AMX kernels (every part
                            * of it has one; then grouped[f] is 0) */
    ellm_act_fn act[N_ACT]; /* set for the formats a non-empty part needs */
    int has_act;           /* some part has quantized weights (or BF16 ones on bf16 tiles) */
    int few;               /* decode-sized items, all tokens in each (T < FEW_TOKENS) */
    int act_kparts;        /* [amx] parts each run's blocks are quantized in (act_items) */
    /* [bf16] BF16 parts on the AMX bf16 tiles: x split into 16-token groups of xb_stride
     * bytes (matmul_bf16_amx.h), else xb is NULL */
    uint8_t *xb;
    size_t xb_stride;
    const ellm_linear_epilogue *epi; /* run after each block (NULL: none) */
} lin_ctx;

/* The kernel call for output rows [n0, n1) of part p, tokens [t0, t1), into y (the
 * block's first output). */
static void run_kernel(const lin_ctx *c, const lin_part *p, int64_t n0, int64_t n1, int64_t t0,
                       int64_t t1, float *y, size_t ys) {
    if (p->qgemm) /* t0 is a multiple of item_toks, so of p->tg */
        p->qgemm(p->nb, p->w + (size_t)n0 * p->row_bytes, p->row_bytes, n1 - n0,
                 p->xq + (size_t)(t0 / p->tg) * p->act_stride, p->act_stride, t1 - t0, y,
                 ys);
    else if (p->fmm)
        p->fmm(c->K, p->w + (size_t)n0 * p->row_bytes, p->row_bytes, n1 - n0,
               c->x + (size_t)t0 * (size_t)c->K, (size_t)c->K, t1 - t0, y, ys);
    else
        p->qdot(p->nb, p->w + (size_t)n0 * p->row_bytes, p->row_bytes, n1 - n0,
                p->xq + (size_t)t0 * p->act_stride, p->act_stride, t1 - t0, y, ys);
}

/* The bias epilogue: y[t][i] += bias[i] over a block just summed. One rounding per
 * output, after its fixed-order sum, so the result still depends only on (w_n, x_t,
 * bias_n): the same plain add at every SIMD level. */
static void add_bias(const float *bias, int64_t n, float *y, size_t ldy, int64_t nt) {
    for (int64_t t = 0; t < nt; t++) {
        float *yt = y + (size_t)t * ldy;
        for (int64_t i = 0; i < n; i++) yt[i] += bias[i];
    }
}

/* A block of several tokens is summed into a local buffer STAGE_ROWS rows at a time and
 * copied out row by row. The kernels store a few consecutive outputs of each token per
 * row tile; straight into y, whose token rows are ldy floats apart, those stores all fall
 * in one L1 set when ldy is a multiple of 1024 (a model's head, 2048-wide FFNs) and
 * evict each other tile after tile. Q8_0 576-wide rows at T=16, one thread, in cache:
 * 4096 rows 151 GFLOP/s against 230 for 4000 or 4104 rows, before staging.
 * The token-group kernels (qgemm, ELLM_TG) stage only those widths, since at the others the
 * copy is pure cost; the other kernels stage at every width, as before. Q4_1, K = 576,
 * T = 512, one thread (AMD EPYC, VNNI), staged -> straight: N = 576 1,450 -> 1,411 us,
 * 1536 4,042 -> 3,816, 2304 6,330 -> 5,548; but 1024 2,671 -> 3,543, 3072 8,051 -> 10,710.
 * A block is up to a whole item: with 128-token items and staging only to 64, Gemma 3's
 * 2048-wide FFN outputs went straight into y, and its prefill@512 ran 0.88x. */
#define STAGE_ROWS 32
#define STAGE_TOKS TOK_TILE
static inline int rows_share_l1_sets(size_t ldy) { return ldy % 1024 == 0; }

/* Output rows [n0, n1) of part p for tokens [t0, t1). */
static void run_block(const lin_ctx *c, const lin_part *p, int64_t n0, int64_t n1, int64_t t0,
                      int64_t t1) {
    const size_t ldy = (size_t)p->ldy;
    float *y = p->y + (size_t)t0 * ldy + (size_t)n0;
    const int64_t nt = t1 - t0;
    if (c->epi && c->epi->pre) c->epi->pre(c->epi->ctx, p->index, n0, n1, t0, t1);
    /* [amx] the AMX and bf16 tile kernels (16-token groups) store 16 outputs of a token at
     * once, whole 64-byte lines where lead_rows aligns them: staging them gave nothing
     * (SmolLM2's head at 16 rows 1.46-1.48 ms either way, Xeon with AMX, 2 threads) */
    const int tiles = p->qgemm != NULL && p->tg != ELLM_TG;
    const int straight = p->qgemm != NULL && p->tg == ELLM_TG && !rows_share_l1_sets(ldy);
    if (nt > 1 && nt <= STAGE_TOKS && !tiles && !straight) {
        float stage[STAGE_ROWS * STAGE_TOKS] __attribute__((aligned(64)));
        for (int64_t r0 = n0; r0 < n1; r0 += STAGE_ROWS) {
            const int64_t r1 = r0 + STAGE_ROWS < n1 ? r0 + STAGE_ROWS : n1, nr = r1 - r0;
            run_kernel(c, p, r0, r1, t0, t1, stage, (size_t)nr);
            for (int64_t t = 0; t < nt; t++)
                memcpy(y + (size_t)t * ldy + (size_t)(r0 - n0), stage + t * nr, sizeof(float) * (size_t)nr);
        }
    } else {
        run_kernel(c, p, n0, n1, t0, t1, y, ldy);
    }
    if (p->bias) add_bias(p->bias + n0, n1 - n0, y, ldy, nt);
    if (c->epi) c->epi->fn(c->epi->ctx, p->index, n0, n1, t0, t1);
}

/* [amx] Asks for the first tile (16 rows) of the item after the one starting now into L2.
 * A batched decode step (one token group) reads every weight once, from memory; the tile
 * kernels prefetch their call's next tile themselves, so each item's first tile is the one
 * left waiting. Items of one thread are neighbouring rows (item_grain). */
static void prefetch_rows(const lin_part *p, int64_t n0) {
    const int64_t n1 = n0 + 16 < p->N ? n0 + 16 : p->N;
    const char *b = (const char *)(p->w + (size_t)n0 * p->row_bytes);
    const size_t bytes = (size_t)(n1 - n0) * p->row_bytes;
    for (size_t l = 0; l < bytes; l += 64) __builtin_prefetch(b + l, 0, 2);
}

/* Items [begin, end) of one call (numbered from 0). */
static void run_items(const lin_ctx *c, int64_t begin, int64_t end) {
    int pi = 0;
    for (int64_t item = begin; item < end; item++) {
        while (item >= c->p[pi].end_item) pi++; /* items are numbered part after part */
        const lin_part *p = &c->p[pi];
        int64_t j = item - p->first_item;
        int64_t r = j % p->row_items, tt = j / p->row_items;
        int64_t n0 = r * p->item_rows, n1 = n0 + p->item_rows;
        if (p->lead_rows) { /* [amx] */
            n0 = r ? p->lead_rows + (r - 1) * p->item_rows : 0;
            n1 = r ? n0 + p->item_rows : p->lead_rows;
        }
        n1 = n1 < p->N ? n1 : p->N;
        int64_t t0 = tt * c->item_toks, t1 = t0 + c->item_toks < c->T ? t0 + c->item_toks : c->T;
        if (p->tg == ELLM_AMX_TG && c->T <= ELLM_AMX_TG && n1 < p->N) prefetch_rows(p, n1);
        run_block(c, p, n0, n1, t0, t1);
    }
}

/* Items a thread claims at once. [amx] The tile kernels' items are short (32 rows x 16
 * tokens of Q4_1 is ~1.3 us): one claim each, two contended atomics, cost a fifth of that,
 * so they are claimed GRAIN_CHUNKS_PER_THREAD runs per thread, of neighbouring rows. */
#define GRAIN_CHUNKS_PER_THREAD 8
static int64_t item_grain(const lin_ctx *c, int64_t items) {
    if (!c->amx[0] && !c->amx[1]) return 1;
    const int64_t g = items / ((int64_t)ellm_num_threads() * GRAIN_CHUNKS_PER_THREAD);
    return g > 1 ? g : 1;
}

/* [amx] Whether a call's items may run tile kernels (which leave their configuration
 * loaded, for the task's end to release). */
static inline int uses_tiles(const lin_ctx *c) { return c->amx[0] || c->amx[1] || c->xb != NULL; }

static void task_matmul(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const lin_ctx *c = (const lin_ctx *)ctx;
    run_items(c, begin, end);
    if (uses_tiles(c)) ellm_amx_release_tiles(); /* [amx] */
}

/* The regions schedule numbers items token-major: token tile k / R, then the R row items
 * of the parts in order; this is item k's part-major number, as run_items takes it. */
static void task_matmul_tokens(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const lin_ctx *c = (const lin_ctx *)ctx;
    int64_t R = 0;
    for (int i = 0; i < c->n_parts; i++) R += c->p[i].row_items;
    for (int64_t k = begin; k < end; k++) {
        int64_t tt = k / R, r = k % R;
        int i = 0;
        while (r >= c->p[i].row_items) r -= c->p[i++].row_items;
        const int64_t item = c->p[i].first_item + tt * c->p[i].row_items + r;
        run_items(c, item, item + 1);
    }
    if (uses_tiles(c)) ellm_amx_release_tiles(); /* [amx] */
}

/* Token t of format f into its activation layout: part `part` of `parts` of its blocks in
 * the AMX groups (whole blocks of a group are whole cache lines, matmul_amx.h); the other
 * layouts, and the bf16 split, whole, in part 0. */
static void quantize_token(const lin_ctx *c, int f, int64_t t, int part, int parts) {
    const float *xt = c->x + (size_t)t * (size_t)c->K;
    if (part == 0 && f == 0 && c->xb && t % ELLM_BF16_TG == 0) /* [bf16] a group's split, at its first token */
        ellm_bf16x3_put_group(xt, (size_t)c->K, c->T - t < ELLM_BF16_TG ? (int)(c->T - t) : ELLM_BF16_TG,
                              c->K, c->xb + (size_t)(t / ELLM_BF16_TG) * c->xb_stride);
    if (!c->act[f]) return; /* formats of non-empty parts only */
    if (c->amx[f]) {
        const int blk = f == 0 ? QK32 : QK256;
        const int64_t n = c->K / blk, b0 = n * part / parts, b1 = n * (part + 1) / parts;
        const size_t block_bytes = f == 0 ? sizeof(ellm_act32x16) : sizeof(ellm_act256x16);
        ellm_amx_put_token(blk, c->act[f], xt + (size_t)(b0 * blk), b1 - b0,
                           c->xq[f] + (size_t)(t / ELLM_AMX_TG) * c->act_stride[f] + (size_t)b0 * block_bytes,
                           (int)(t % ELLM_AMX_TG));
        return;
    }
    if (part != 0) return;
    /* grouped: each block quantized as in the row layout (the same bytes), then
     * spread into this token's lane of its group */
    const int64_t lane = t % ELLM_TG;
    if (f == 0 && c->grouped[0]) {
        ellm_act32x8 *g = (ellm_act32x8 *)(c->xq[0] + (size_t)(t / ELLM_TG) * c->act_stride[0]);
        for (int64_t i = 0; i < c->K / QK32; i++) {
            ellm_act32 a;
            c->act[0](xt + QK32 * i, QK32, &a);
            g[i].d[lane] = a.d;
            g[i].s[lane] = a.s;
            for (int m = 0; m < QK32 / 4; m++)
                memcpy(g[i].qs + 4 * (ELLM_TG * m + lane), a.qs + 4 * m, 4);
        }
    } else if (f == 1 && c->grouped[1]) {
        ellm_act256x8 *g = (ellm_act256x8 *)(c->xq[1] + (size_t)(t / ELLM_TG) * c->act_stride[1]);
        for (int64_t i = 0; i < c->K / QK256; i++) {
            ellm_act256 a;
            c->act[1](xt + QK256 * i, QK256, &a);
            g[i].d[lane] = a.d;
            for (int k = 0; k < 8; k++) {
                g[i].bsums[k][lane][0] = a.bsums[2 * k];
                g[i].bsums[k][lane][1] = a.bsums[2 * k + 1];
            }
            for (int m = 0; m < QK256 / 4; m++)
                memcpy(g[i].qs + 4 * (ELLM_TG * m + lane), a.qs + 4 * m, 4);
        }
    } else {
        c->act[f](xt, c->K, c->xq[f] + (size_t)t * c->act_stride[f]);
    }
}

/* Tokens per item of the activation quantization: a whole group of every group layout
 * (ELLM_TG, ELLM_AMX_TG, ELLM_BF16_TG), so no two threads write into one group's cache
 * lines. Items of single tokens (grain 4) had the two threads' lanes of a group share
 * lines: 16 prompts x 35 tokens of SmolLM2 spent 5.4% of the prefill here. */
#define ACT_RUN 16
_Static_assert(ACT_RUN % ELLM_TG == 0 && ACT_RUN % ELLM_AMX_TG == 0 && ACT_RUN % ELLM_BF16_TG == 0,
               "an item of the activation quantization holds whole groups");
static inline int64_t act_runs(int64_t T) { return (T + ACT_RUN - 1) / ACT_RUN; }

static inline int64_t act_items(const lin_ctx *c) { return N_ACT * act_runs(c->T) * c->act_kparts; }

/* Items [begin, end) are (run of ACT_RUN tokens, format, part of the blocks) triples,
 * token-major so that regions of items are runs of tokens:
 * item = (run * N_ACT + f) * act_kparts + part. */
static void task_quantize_act(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const lin_ctx *c = (const lin_ctx *)ctx;
    const int64_t parts = c->act_kparts;
    for (int64_t k = begin; k < end; k++) {
        const int part = (int)(k % parts), f = (int)(k / parts % N_ACT);
        const int64_t t0 = k / parts / N_ACT * ACT_RUN, t1 = t0 + ACT_RUN < c->T ? t0 + ACT_RUN : c->T;
        for (int64_t t = t0; t < t1; t++) quantize_token(c, f, t, part, (int)parts);
    }
}

/* A short last group's padding tokens (format f in its group layout): 0, never stale
 * bits (their outputs are never stored, but a NaN or denormal lane would cost time). */
static void zero_group_padding(const lin_ctx *c, int f) {
    const int64_t used = c->T % ELLM_TG, pad = ELLM_TG - used;
    if (used == 0) return;
    uint8_t *grp = c->xq[f] + (size_t)(c->T / ELLM_TG) * c->act_stride[f];
    if (f == 0) {
        ellm_act32x8 *g = (ellm_act32x8 *)grp;
        for (int64_t i = 0; i < c->K / QK32; i++) {
            for (int m = 0; m < QK32 / 4; m++)
                memset(g[i].qs + 4 * (ELLM_TG * m + used), 0, (size_t)(4 * pad));
            memset(g[i].d + used, 0, (size_t)pad * sizeof(float));
            memset(g[i].s + used, 0, (size_t)pad * sizeof(float));
        }
    } else {
        ellm_act256x8 *g = (ellm_act256x8 *)grp;
        for (int64_t i = 0; i < c->K / QK256; i++) {
            for (int m = 0; m < QK256 / 4; m++)
                memset(g[i].qs + 4 * (ELLM_TG * m + used), 0, (size_t)(4 * pad));
            for (int k = 0; k < 8; k++)
                memset(g[i].bsums[k][used], 0, (size_t)pad * 2 * sizeof(int16_t));
            memset(g[i].d + used, 0, (size_t)pad * sizeof(float));
        }
    }
}

static int act_index(int qtype) {
    switch (ellm_act_block(qtype)) {
    case QK32: return 0;
    case QK256: return 1;
    default: return -1;
    }
}

/* The scratch layout: offset[f] = byte offset of format f's (T, stride[f]) rows (64-byte
 * aligned; SIZE_MAX when no part uses f), *total = bytes in all. Where T takes token groups,
 * each format gets room for its group layout as well, whichever the level in force will use.
 * Returns 1, or 0 with *total = 0 on overflow or invalid input. */
static int act_layout(const ellm_linear_part *parts, int n_parts, int64_t T, int64_t K,
                         size_t offset[N_ACT], size_t stride[N_ACT], size_t *total,
                         size_t *bf16_offset) {
    int used[N_ACT] = {0, 0};
    *total = 0;
    *bf16_offset = SIZE_MAX; /* [bf16] */
    if (T < 0 || K < 0 || n_parts < 1 || n_parts > ELLM_LINEAR_MAX_PARTS || parts == NULL)
        return 0;
    for (int i = 0; i < n_parts; i++) {
        if (ellm_row_bytes(parts[i].qtype, K) < 0) return 0;
        int f = act_index(parts[i].qtype);
        if (f >= 0) {
            used[f] = 1;
            stride[f] = ellm_act_row_bytes(parts[i].qtype, K);
        }
    }
    size_t at = 0;
    for (int f = 0; f < N_ACT; f++) {
        offset[f] = SIZE_MAX; /* not in use */
        if (!used[f]) continue;
        /* room for the group layout too, which is the rows padded to whole groups
         * (ellm_act32x8 / ellm_act256x8 hold ELLM_TG blocks' bytes, rearranged) */
        const int64_t rows = T >= AMX_FEW_TOKENS ? (T + ELLM_AMX_TG - 1) / ELLM_AMX_TG * ELLM_AMX_TG : T;
        if (stride[f] && (uint64_t)rows > (SIZE_MAX - 64 - at) / stride[f]) return 0;
        at = (at + 63) & ~(size_t)63;
        offset[f] = at;
        at += stride[f] * (size_t)rows;
    }
    /* [bf16] where the CPU has bf16 tiles (whatever the level now), room for the split
     * activations of BF16 parts: ceil(T / 16) groups */
    int bf16 = 0;
    for (int i = 0; i < n_parts; i++) bf16 |= parts[i].qtype == ELLM_T_BF16;
    if (bf16 && ellm_cpu_has_amx_bf16()) {
        const size_t gb = ellm_bf16x3_group_bytes(K);
        const uint64_t groups = ((uint64_t)T + ELLM_BF16_TG - 1) / ELLM_BF16_TG;
        if (groups > (SIZE_MAX - 64 - at) / gb) return 0;
        at = (at + 63) & ~(size_t)63;
        *bf16_offset = at;
        at += gb * (size_t)groups;
    }
    *total = at;
    return 1;
}

size_t ellm_linear_multi_scratch_bytes(const ellm_linear_part *parts, int n_parts, int64_t T,
                                       int64_t K) {
    size_t offset[N_ACT], stride[N_ACT], total, bf16_offset;
    act_layout(parts, n_parts, T, K, offset, stride, &total, &bf16_offset);
    return total;
}

size_t ellm_linear_scratch_bytes(int qtype, int64_t T, int64_t K) {
    ellm_linear_part part = {qtype, NULL, 0, 0, NULL, 0, NULL};
    return ellm_linear_multi_scratch_bytes(&part, 1, T, K);
}

/* Checks one call and lays it out in *c (activation formats, kernels, work items); *items
 * gets its item count (0: nothing left to run, e.g. T = 0, or K = 0, whose outputs are
 * written here). Nothing runs on the pool. */
static int lin_setup(lin_ctx *c, const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                     int n_parts, void *scratch, size_t scratch_bytes, int64_t *items_out) {
    *items_out = 0;
    memset(c, 0, sizeof *c);
    if (parts == NULL || n_parts < 1 || n_parts > ELLM_LINEAR_MAX_PARTS) return ELLM_E_SHAPE;
    if (T < 0 || K < 0) return ELLM_E_SHAPE;
    for (int i = 0; i < n_parts; i++) {
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

    c->x = x;
    c->T = T;
    c->K = K;
    size_t offset[N_ACT], stride[N_ACT], need, bf16_offset;
    if (!act_layout(parts, n_parts, T, K, offset, stride, &need, &bf16_offset)) return ELLM_E_SHAPE;
    if (need && (scratch == NULL || scratch_bytes < need || ((uintptr_t)scratch & 63u)))
        return ELLM_E_SCRATCH;
    for (int f = 0; f < N_ACT; f++) {
        if (offset[f] == SIZE_MAX) continue;
        c->xq[f] = (uint8_t *)scratch + offset[f];
        c->act_stride[f] = stride[f];
    }

    /* Many tokens: a format takes its group layout when every part of it has a qgemm kernel
     * at the level in force (the 32-element types, Q4_K, Q5_K and Q6_K on x86). The kernels
     * are chosen here once, so a level changed meanwhile cannot split the decision. */
    ellm_qgemm_fn qgemm[ELLM_LINEAR_MAX_PARTS], qamx[ELLM_LINEAR_MAX_PARTS];
    int uses_act[N_ACT] = {0, 0}; /* formats of the non-empty parts (float parts have none) */
    for (int i = 0; i < n_parts; i++)
        if (parts[i].N > 0 && act_index(parts[i].qtype) >= 0) uses_act[act_index(parts[i].qtype)] = 1;
    const int groups = takes_token_groups(T, uses_act[1] && !uses_act[0]);
    const int amx_level = T >= AMX_FEW_TOKENS && ellm_simd_level() == ELLM_SIMD_AMX;
    for (int i = 0; i < n_parts; i++) {
        qgemm[i] = groups ? ellm_qgemm_select(parts[i].qtype) : NULL;
        qamx[i] = amx_level ? ellm_qgemm_amx(parts[i].qtype) : NULL;
    }
    for (int f = 0; f < N_ACT; f++) { /* AMX where every part of the format has a kernel */
        if (!amx_level || !c->xq[f]) continue;
        c->amx[f] = 1;
        for (int i = 0; i < n_parts; i++)
            if (parts[i].N > 0 && act_index(parts[i].qtype) == f && !qamx[i]) c->amx[f] = 0;
        if (c->amx[f]) {
            const int blk = f == 0 ? QK32 : QK256;
            c->act_stride[f] = (size_t)(K / blk) * (f == 0 ? sizeof(ellm_act32x16) : sizeof(ellm_act256x16));
            if (T % ELLM_AMX_TG)
                ellm_amx_zero_lanes(blk, K / blk, c->xq[f] + (size_t)(T / ELLM_AMX_TG) * c->act_stride[f],
                                    (int)(T % ELLM_AMX_TG));
        }
    }
    /* [bf16] BF16 parts take the bf16 tiles at the AMX level, at every T (one order of
     * sums per output whatever the batch, matmul_bf16_amx.h) */
    if (bf16_offset != SIZE_MAX && ellm_simd_level() == ELLM_SIMD_AMX) {
        c->xb = (uint8_t *)scratch + bf16_offset;
        c->xb_stride = ellm_bf16x3_group_bytes(K);
    }
    /* few: every part reads its weights once in the row layout (decode-sized items) */
    const int any_amx = c->amx[0] || c->amx[1];
    const int few = !groups && !any_amx;
    c->few = few;
    c->act_kparts = 1;
    c->item_toks = few ? T : any_amx || c->xb ? AMX_TOK_TILE : TOK_TILE; /* [bf16] || c->xb */
    if (any_amx && !c->amx[0]) { /* [amx] K-quants only: more tokens, within L2 */
        c->item_toks = AMX_K_TOK_TILE;
        const size_t tok_bytes = c->act_stride[1] / ELLM_AMX_TG;
        while (c->item_toks > AMX_TOK_TILE && (size_t)c->item_toks * tok_bytes > AMX_ITEM_ACT_BYTES)
            c->item_toks /= 2;
    }
    size_t call_bytes = 0; /* the weights this call reads */
    for (int i = 0; i < n_parts; i++) call_bytes += parts[i].N > 0 ? parts[i].w_bytes : 0;
    for (int f = 0; f < N_ACT; f++) {
        if (!groups || !c->xq[f] || c->amx[f]) continue;
        c->grouped[f] = 1;
        for (int i = 0; i < n_parts; i++)
            if (parts[i].N > 0 && act_index(parts[i].qtype) == f && !qgemm[i]) c->grouped[f] = 0;
        if (c->grouped[f]) {
            c->act_stride[f] = f == 0 ? (size_t)(K / QK32) * sizeof(ellm_act32x8)
                                     : (size_t)(K / QK256) * sizeof(ellm_act256x8);
            zero_group_padding(c, f);
        }
    }

    const int64_t tok_items = (T + c->item_toks - 1) / c->item_toks;
    int64_t items = 0;
    for (int i = 0; i < n_parts; i++) {
        const ellm_linear_part *q = &parts[i];
        lin_part *p = &c->p[c->n_parts];
        if (q->N == 0) continue;
        p->w = q->w;
        p->index = i;
        p->row_bytes = (size_t)ellm_row_bytes(q->qtype, K);
        p->N = q->N;
        p->y = q->y;
        p->ldy = q->ldy;
        p->bias = q->bias;
        int f = act_index(q->qtype);
        if (f >= 0) {
            p->xq = c->xq[f];
            p->act_stride = c->act_stride[f];
            p->nb = K / ellm_act_block(q->qtype);
            if (c->amx[f]) {
                p->qgemm = qamx[i];
                p->tg = ELLM_AMX_TG;
            } else if (c->grouped[f]) {
                p->qgemm = qgemm[i];
                p->tg = ELLM_TG;
            } else {
                p->qdot = decode_kernel(q, T);
            }
            c->act[f] = ellm_act_select(q->qtype);
        } else if (c->xb && q->qtype == ELLM_T_BF16) { /* [bf16] */
            p->qgemm = ellm_fmm_bf16_amx(q->qtype);
            p->xq = c->xb;
            p->act_stride = c->xb_stride;
            p->nb = K;
            p->tg = ELLM_BF16_TG;
        } else {
            p->fmm = ellm_fmm_select(q->qtype);
        }
        /* [bf16] the bf16 tiles' items are whole passes of 32 rows */
        const int64_t row_unit = p->fmm == NULL && q->qtype == ELLM_T_BF16 ? BF16_ROW_TILE : 8;
        if (few) {
            int64_t rows = decode_item_bytes(call_bytes) / (int64_t)p->row_bytes;
            rows = rows > DECODE_MIN_ROWS ? rows : DECODE_MIN_ROWS;
            p->item_rows = (rows + row_unit - 1) / row_unit * row_unit; /* whole 8-row tiles (qdot32_rows8) */
        } else if (p->tg == ELLM_AMX_TG && T <= ELLM_AMX_TG) {
            /* [amx] one token group (batched decode) reads each weight once, from memory:
             * long items, in which the kernel asks for each next tile while it sums the
             * one before, and about two per thread (AMX_DECODE_ROWS_*) */
            int64_t rows = p->N / (2 * (int64_t)ellm_num_threads());
            rows = rows < AMX_DECODE_ROWS_MIN ? AMX_DECODE_ROWS_MIN : rows > AMX_DECODE_ROWS_MAX ? AMX_DECODE_ROWS_MAX : rows;
            p->item_rows = (rows + ROW_TILE - 1) / ROW_TILE * ROW_TILE;
        } else {
            p->item_rows = row_unit == BF16_ROW_TILE ? BF16_ROW_TILE : ROW_TILE;
        }
        /* A tile stores 16 outputs of a token (64 bytes) at once. Where y's rows are not
         * on a 64-byte line, every store straddles two lines, and the lines at an item's
         * ends are shared with the items beside it, which the other threads are writing:
         * [amx] Q4_1 1536x576 at T=16 scaled 1.12x from one thread to two, against 1.62x on
         * aligned rows. A short first item puts the other items' rows on whole lines. The
         * 16-row items of the several-token VNNI kernels take it too: SmolLM2 prefill@512
         * on 2 threads +4% (AMD EPYC, with the straight stores above, 60 alternations). */
        p->lead_rows = 0;
        const int line_items = p->tg == ELLM_AMX_TG || (!few && p->qgemm != NULL && p->tg == ELLM_TG);
        if (line_items && p->ldy % 16 == 0 && (uintptr_t)p->y % sizeof(float) == 0) {
            const int64_t off = (int64_t)(((uintptr_t)p->y / sizeof(float)) % 16);
            if (off && p->N > 16 - off) p->lead_rows = 16 - off;
        }
        p->row_items = p->lead_rows ? 1 + (p->N - p->lead_rows + p->item_rows - 1) / p->item_rows
                                    : (p->N + p->item_rows - 1) / p->item_rows;
        p->first_item = items;
        items += p->row_items * tok_items;
        p->end_item = items;
        c->n_parts++;
    }
    if (c->n_parts == 0) return ELLM_OK;
    c->has_act = c->act[0] || c->act[1] || c->xb; /* [bf16] not the scratch size: BF16 room is kept at every level */
    *items_out = items;
    return ELLM_OK;
}

/* ------------------------------------------------------------------------------------
 * Decode regions: one contiguous run of items per thread, balanced by bytes
 * ------------------------------------------------------------------------------------ */

/* Item index at which the bytes before it first reach `target` (bytes counted through
 * the parts in order, each item of a part item_rows x row_bytes, its last one less). */
static int64_t item_at_bytes(const lin_ctx *c, uint64_t target) {
    uint64_t base = 0;
    for (int i = 0; i < c->n_parts; i++) {
        const lin_part *p = &c->p[i];
        const uint64_t bytes = (uint64_t)p->N * p->row_bytes, item = (uint64_t)p->item_rows * p->row_bytes;
        if (target < base + bytes) {
            const int64_t j = (int64_t)((target - base + item / 2) / item);
            return p->first_item + (j < p->row_items ? j : p->row_items);
        }
        base += bytes;
    }
    return c->p[c->n_parts - 1].end_item;
}

/* The weight bytes a call's parts hold. */
static uint64_t call_weight_bytes(const lin_ctx *c) {
    uint64_t total = 0;
    for (int i = 0; i < c->n_parts; i++) total += (uint64_t)c->p[i].N * c->p[i].row_bytes;
    return total;
}

/* Runs a decode-sized call's items in regions; 0 (nothing run) where it does not fit. */
static int run_decode_regions(const lin_ctx *c, int64_t items) {
    const int n = ellm_num_threads();
    if (n < 2 || n > ELLM_MAX_REGIONS || items < n || items > (int64_t)UINT32_MAX) return 0;
    int64_t cuts[ELLM_MAX_REGIONS + 1] = {0};
    const uint64_t total = call_weight_bytes(c);
    for (int g = 1; g <= n; g++) {
        const int64_t end = g == n ? items : item_at_bytes(c, total / (uint64_t)n * (uint64_t)g);
        cuts[g] = end < cuts[g - 1] ? cuts[g - 1] : end;
    }
    ellm_parallel_for_cut(items, cuts, n, task_matmul, (void *)c);
    return 1;
}

int ellm_linear_multi(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                      int n_parts, void *scratch, size_t scratch_bytes) {
    return ellm_linear_multi_epi(x, T, K, parts, n_parts, scratch, scratch_bytes, NULL);
}

int ellm_linear_multi_epi(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                          int n_parts, void *scratch, size_t scratch_bytes,
                          const ellm_linear_epilogue *epi) {
    lin_ctx c;
    int64_t items;
    int st = lin_setup(&c, x, T, K, parts, n_parts, scratch, scratch_bytes, &items);
    if (st != ELLM_OK || items == 0) return st;
    if (epi && !epi->fn) return ELLM_E_SHAPE;
    c.epi = epi;
    /* Activation quantization is cheap next to the matmul; only spread it when there are
     * enough rows to pay for waking the pool. */
    if (c.has_act) {
        /* [amx] fewer runs than threads (a batched decode step is one): each run's blocks in
         * parts, one a thread. SmolLM2 at 16 sequences: ~10 us a call for K = 1536 alone. */
        const int threads = ellm_num_threads();
        if ((c.amx[0] || c.amx[1]) && act_runs(T) < threads && K / QK256 >= threads) c.act_kparts = threads;
        /* runs of tokens as the matmul below cuts them (threadpool.h); [amx] the parts of
         * one run's blocks are handed out one by one, as measured there */
        if (T >= 16 && c.act_kparts > 1) ellm_parallel_for(act_items(&c), 1, task_quantize_act, &c);
        else if (T >= 16) ellm_parallel_for_regions(act_items(&c), 1, task_quantize_act, &c);
        else task_quantize_act(&c, 0, act_items(&c), 0);
    }
    /* a batched decode step (one token item, not on the tiles) streams its weights like a
     * decode: one region per thread, so each thread's rows run on ahead of its prefetches */
    const int streams = c.few || (!c.amx[0] && !c.amx[1] && !c.xb && T <= c.item_toks);
    if (streams && run_decode_regions(&c, items)) return ELLM_OK;
    /* Each thread takes the tokens it quantized, and its outputs go to the next op's same
     * thread (elementwise.c): SmolLM2 prefill@512 on 2 threads 1.10x, Gemma 3 1.06x (AMD
     * EPYC). [amx] The tile path keeps its runs of row items (not measured there). */
    if (!c.amx[0] && !c.amx[1] && !c.xb)
        ellm_parallel_for_regions(items, item_grain(&c, items), task_matmul_tokens, &c);
    else
        ellm_parallel_for(items, item_grain(&c, items), task_matmul, &c);
    return ELLM_OK;
}

/* ------------------------------------------------------------------------------------
 * Groups: several calls (each its own X) in one pass over the pool
 * ------------------------------------------------------------------------------------ */

typedef struct {
    lin_ctx *c;            /* (n,) the groups' layouts */
    const int64_t *first;  /* (n + 1,) first[g] = global index of group g's item 0 */
    int n;
} groups_ctx;

static void task_groups_act(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const groups_ctx *G = ctx;
    for (int64_t g = begin; g < end; g++)
        if (G->first[g + 1] > G->first[g] && G->c[g].has_act) task_quantize_act(&G->c[g], 0, act_items(&G->c[g]), 0);
}

static void task_groups(void *ctx, int64_t begin, int64_t end, int thread_id) {
    const groups_ctx *G = ctx;
    int lo = 0, hi = G->n - 1; /* the group holding item `begin`: first[g] <= begin < first[g + 1] */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (G->first[mid] <= begin) lo = mid;
        else hi = mid - 1;
    }
    for (int g = lo; g < G->n && begin < end; g++) {
        const int64_t b = begin > G->first[g] ? begin : G->first[g];
        const int64_t e = end < G->first[g + 1] ? end : G->first[g + 1];
        if (b < e) {
            run_items(&G->c[g], b - G->first[g], e - G->first[g]);
            if (uses_tiles(&G->c[g])) ellm_amx_release_tiles(); /* [amx] */
        }
        begin = e > begin ? e : begin;
    }
}

/* Groups of decode-sized calls (a mixture of experts' step: a token or a few per expert)
 * stream their weights as one decode call does (run_decode_regions): the groups' items,
 * group after group, cut into one contiguous region of about equal bytes per thread.
 * Claimed one item at a time from a shared counter instead, the two threads' items
 * interleave and each thread's software prefetches run past the end of its item into rows
 * the other thread takes. Qwen3-30B-A3B's Q4_K experts, 2 threads, alternated in one
 * process, medians of 240 calls: one token 1.19 -> 1.14 ms, four 4.44 -> 4.14 ms.
 * Returns 0 (nothing run) where a group is not decode-sized. */
static int run_group_regions(const groups_ctx *G, int64_t items) {
    const int n = ellm_num_threads();
    if (n < 2 || n > ELLM_MAX_REGIONS || items < n || items > (int64_t)UINT32_MAX) return 0;
    uint64_t total = 0;
    for (int g = 0; g < G->n; g++) {
        if (G->first[g + 1] == G->first[g]) continue;
        if (!G->c[g].few) return 0;
        total += call_weight_bytes(&G->c[g]);
    }
    int64_t cuts[ELLM_MAX_REGIONS + 1] = {0};
    uint64_t base = 0;
    int g = 0;
    for (int k = 1; k <= n; k++) {
        const uint64_t target = total / (uint64_t)n * (uint64_t)k;
        int64_t end = items;
        if (k < n) {
            /* the group holding the target byte, then the item within it */
            for (;;) {
                const lin_ctx *c = &G->c[g];
                const uint64_t bytes = G->first[g + 1] > G->first[g] ? call_weight_bytes(c) : 0;
                if (target < base + bytes || g == G->n - 1) {
                    end = bytes ? G->first[g] + item_at_bytes(c, target - base) : items;
                    break;
                }
                base += bytes;
                g++;
            }
        }
        cuts[k] = end < cuts[k - 1] ? cuts[k - 1] : end > items ? items : end;
    }
    ellm_parallel_for_cut(items, cuts, n, task_groups, (void *)G);
    return 1;
}

/* Bytes of lin_ctx + item offsets at the front of the groups scratch. */
static size_t groups_header_bytes(int n_groups) {
    const size_t b = (size_t)n_groups * sizeof(lin_ctx) + (size_t)(n_groups + 1) * sizeof(int64_t);
    return (b + 63) & ~(size_t)63;
}

size_t ellm_linear_groups_scratch_bytes(const ellm_linear_group *groups, int n_groups, int64_t K) {
    if (groups == NULL || n_groups < 1 || n_groups > ELLM_LINEAR_MAX_GROUPS) return 0;
    size_t total = groups_header_bytes(n_groups);
    for (int g = 0; g < n_groups; g++) {
        const size_t b = ellm_linear_multi_scratch_bytes(groups[g].parts, groups[g].n_parts, groups[g].T, K);
        if (b > SIZE_MAX - 64 - total) return 0;
        total = (total + b + 63) & ~(size_t)63;
    }
    return total;
}

size_t ellm_linear_groups_scratch_bound(const ellm_linear_part *parts, int n_parts, int n_groups,
                                        int64_t total_rows, int64_t K) {
    if (parts == NULL || n_parts < 1 || n_parts > ELLM_LINEAR_MAX_PARTS || n_groups < 1 ||
        n_groups > ELLM_LINEAR_MAX_GROUPS || total_rows < 0 || K < 0)
        return 0;
    /* per group: each format's rows padded to a whole token group (< ELLM_AMX_TG more) and
     * aligned to 64 bytes, then the group's block aligned again */
    int used[N_ACT] = {0, 0};
    size_t row_bytes = 0;
    for (int i = 0; i < n_parts; i++) {
        const int f = act_index(parts[i].qtype);
        if (ellm_row_bytes(parts[i].qtype, K) < 0) return 0;
        if (f >= 0 && !used[f]) {
            used[f] = 1;
            row_bytes += ellm_act_row_bytes(parts[i].qtype, K);
        }
    }
    const uint64_t rows = (uint64_t)total_rows + (uint64_t)(ELLM_AMX_TG - 1) * (uint64_t)n_groups;
    if (row_bytes && rows > (SIZE_MAX / 2) / row_bytes) return 0;
    /* [bf16] BF16 parts' split activations: each group's tokens in whole groups of 16 */
    size_t bf16_bytes = 0;
    for (int i = 0; i < n_parts; i++)
        if (parts[i].qtype == ELLM_T_BF16 && ellm_cpu_has_amx_bf16()) {
            const uint64_t g16 = ((uint64_t)total_rows + (uint64_t)(ELLM_BF16_TG - 1) * (uint64_t)n_groups) / ELLM_BF16_TG;
            const size_t gb = ellm_bf16x3_group_bytes(K);
            if (g16 > (SIZE_MAX / 4) / gb) return 0;
            bf16_bytes = gb * (size_t)g16 + 64 * (size_t)n_groups;
            break;
        }
    if (row_bytes * (size_t)rows > SIZE_MAX / 2 - bf16_bytes) return 0;
    return groups_header_bytes(n_groups) + (size_t)n_groups * 64 * (N_ACT + 1) + row_bytes * (size_t)rows + bf16_bytes;
}

int ellm_linear_groups(const ellm_linear_group *groups, int n_groups, int64_t K, void *scratch,
                       size_t scratch_bytes) {
    if (groups == NULL || n_groups < 1 || n_groups > ELLM_LINEAR_MAX_GROUPS || K < 0) return ELLM_E_SHAPE;
    const size_t need = ellm_linear_groups_scratch_bytes(groups, n_groups, K);
    if (need == 0 || scratch == NULL || scratch_bytes < need || ((uintptr_t)scratch & 63u)) return ELLM_E_SCRATCH;
    lin_ctx *ctxs = (lin_ctx *)scratch;
    int64_t *first = (int64_t *)((uint8_t *)scratch + (size_t)n_groups * sizeof(lin_ctx));
    size_t at = groups_header_bytes(n_groups);
    int64_t items = 0, rows = 0;
    int any_act = 0;
    for (int g = 0; g < n_groups; g++) {
        const ellm_linear_group *q = &groups[g];
        const size_t b = ellm_linear_multi_scratch_bytes(q->parts, q->n_parts, q->T, K);
        int64_t n;
        int st = lin_setup(&ctxs[g], q->x, q->T, K, q->parts, q->n_parts, (uint8_t *)scratch + at, b, &n);
        if (st != ELLM_OK) return st;
        at = (at + b + 63) & ~(size_t)63;
        first[g] = items;
        items += n;
        if (n > 0) {
            rows += q->T;
            any_act |= ctxs[g].has_act;
        }
    }
    first[n_groups] = items;
    if (items == 0) return ELLM_OK;
    groups_ctx G = {ctxs, first, n_groups};
    if (any_act) {
        if (rows >= 16) ellm_parallel_for(n_groups, 1, task_groups_act, &G);
        else task_groups_act(&G, 0, n_groups, 0);
    }
    if (!run_group_regions(&G, items)) ellm_parallel_for(items, 1, task_groups, &G);
    return ELLM_OK;
}



int ellm_linear(int qtype, const float *x, int64_t T, int64_t K, const uint8_t *w, size_t w_bytes,
                int64_t N, const float *bias, float *y, void *scratch, size_t scratch_bytes) {
    ellm_linear_part part = {qtype, w, w_bytes, N, y, N, bias};
    return ellm_linear_multi(x, T, K, &part, 1, scratch, scratch_bytes);
}
