/* Vision-tower kernels: the scalar row functions, the SIMD dispatch, the split over the
 * thread pool, and attention over independent sequences (vision.h). The SIMD rows are in
 * vision_avx2.c and vision_avx512.c. */
#include "vision.h"

#include <math.h>
#include <stddef.h>

#include "elementwise.h"
#include "simd.h"
#include "threadpool.h"

/* ============================ scalar row functions ============================ */

/* 8 partial sums (as the SIMD rows keep 8 or 16 lanes): closer to numpy's pairwise sum */
static float sum8(const float *x, const float *sub, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    if (sub) {
        float m = *sub;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += (x[i + j] - m) * (x[i + j] - m);
        for (; i < n; i++) acc[0] += (x[i] - m) * (x[i] - m);
    } else {
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += x[i + j];
        for (; i < n; i++) acc[0] += x[i];
    }
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void ellm_layernorm_row_scalar(const float *x, const float *w, const float *b, float eps, float *out,
                               int64_t n) {
    float mean = sum8(x, NULL, n) / (float)n;
    float var = sum8(x, &mean, n) / (float)n;
    float inv = 1.0f / sqrtf(var + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] - mean) * inv * w[i] + b[i];
}

void ellm_gelu_tanh_row_scalar(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        float a = 0.7978845608f * (v + 0.044715f * v * v * v);
        /* 0.5 * v * (1 + tanh(a)) == v / (1 + exp(-2a)) */
        out[i] = v / (1.0f + expf(-2.0f * a));
    }
}

void ellm_scale_axpy_row_scalar(float *y, float s, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = y[i] * s + a * x[i];
}

void ellm_pv4_row_scalar(float *const y[4], const float *const p[4], const float *v, int64_t ldv,
                         int64_t nb, int64_t n) {
    for (int r = 0; r < 4; r++)
        for (int64_t j = 0; j < nb; j++)
            for (int64_t i = 0; i < n; i++) y[r][i] += p[r][j] * v[j * ldv + i];
}

void ellm_scores64_row_scalar(const float *q, const float *kt, int64_t hd, float out[64]) {
    for (int j = 0; j < 64; j++) out[j] = 0.0f;
    for (int64_t d = 0; d < hd; d++)
        for (int j = 0; j < 64; j++) out[j] += q[d] * kt[d * 64 + j];
}

/* ================================== dispatch ================================== */

typedef struct {
    void (*layernorm)(const float *, const float *, const float *, float, float *, int64_t);
    void (*gelu)(const float *, float *, int64_t);
    void (*scale_axpy)(float *, float, float, const float *, int64_t);
    float (*max)(const float *, int64_t);
    float (*exp_shift_sum)(float *, float, int64_t);
    void (*pv4)(float *const[4], const float *const[4], const float *, int64_t, int64_t, int64_t);
    void (*scores64)(const float *, const float *, int64_t, float[64]);
} vision_funcs;

#define VISION_TABLE(sfx)                                                                  \
    {ellm_layernorm_row_##sfx, ellm_gelu_tanh_row_##sfx,               \
     ellm_scale_axpy_row_##sfx, ellm_max_row_##sfx, ellm_exp_shift_sum_row_##sfx,            \
     ellm_pv4_row_##sfx, ellm_scores64_row_##sfx}

static const vision_funcs funcs_scalar = VISION_TABLE(scalar);
#ifdef ELLM_HAVE_X86_VISION_ROWS
static const vision_funcs funcs_avx2 = VISION_TABLE(avx2);
static const vision_funcs funcs_avx512 = VISION_TABLE(avx512);
#endif

static const vision_funcs *funcs_now(void) {
#ifdef ELLM_HAVE_X86_VISION_ROWS
    int level = ellm_simd_level();
    if (ellm_simd_is_avx512(level)) return &funcs_avx512;
    if (level == ELLM_SIMD_AVX2) return &funcs_avx2;
#endif
    return &funcs_scalar;
}

/* ============================== row-wise ops ============================== */

/* Below this many elements a call stays on the calling thread. */
enum { PAR_MIN = 1 << 15, PAR_GRAIN = 1 << 13 };

typedef struct {
    const vision_funcs *f;
    const float *x;  /* (rows, n) stride ldx */
    int64_t ldx;
    const float *w, *b;  /* (n,) */
    float eps;
    float *out;      /* (rows, n) stride ldo */
    int64_t ldo, n;
} rows_ctx;

static void task_layernorm(void *p, int64_t r0, int64_t r1, int tid) {
    const rows_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->layernorm(c->x + r * c->ldx, c->w, c->b, c->eps, c->out + r * c->ldo, c->n);
}

static void task_gelu(void *p, int64_t r0, int64_t r1, int tid) {
    const rows_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->gelu(c->x + r * c->ldx, c->out + r * c->ldo, c->n);
}

static void run_rows(ellm_task_fn fn, rows_ctx *c, int64_t rows) {
    if (rows <= 0 || c->n <= 0) return;
    if (rows == 1 || rows * c->n < PAR_MIN) {
        fn(c, 0, rows, 0);
        return;
    }
    int64_t grain = PAR_GRAIN / c->n;
    ellm_parallel_for(rows, grain < 1 ? 1 : grain, fn, c);
}

void ellm_layernorm(const float *x, int64_t ldx, const float *w, const float *b, float eps,
                    float *out, int64_t ldo, int64_t rows, int64_t n) {
    rows_ctx c = {.f = funcs_now(), .x = x, .ldx = ldx, .w = w, .b = b, .eps = eps, .out = out, .ldo = ldo, .n = n};
    run_rows(task_layernorm, &c, rows);
}

void ellm_gelu_tanh(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t n) {
    rows_ctx c = {.f = funcs_now(), .x = x, .ldx = ldx, .out = out, .ldo = ldo, .n = n};
    run_rows(task_gelu, &c, rows);
}

/* ============================ full attention ============================ */

/* Query rows go QROWS at a time (same sequence, same head) and keys KEY_BLOCK at a time:
 * the block's keys are copied transposed onto the stack (head_dim x 64), so each query's
 * 64 scores come out of vector FMAs with no horizontal sums, and each value row is read
 * once for four queries, their sums held in registers. Softmax runs online across key blocks (the running max and sum
 * rescale what is accumulated), so any sequence length works without a heap buffer; with
 * seq_len <= KEY_BLOCK it is the plain two-pass softmax. A row's arithmetic does not
 * depend on the rows grouped with it (a short last group repeats its last row, with
 * weight 0, its sums written to a scratch row). */
enum { KEY_BLOCK = 64, QROWS = 32 };

typedef struct {
    const vision_funcs *f;
    const float *q, *k, *v;   /* (T, nh, hd) */
    float *out;               /* (T, nh, hd) */
    int64_t nh, hd, seq_len, groups;   /* groups: query groups per sequence */
    float scale;
} attn_ctx;

static void attend_group(const attn_ctx *c, int64_t seq, int64_t g, int64_t h) {
    const vision_funcs *f = c->f;
    int64_t row = c->nh * c->hd, first = seq * c->seq_len, hd = c->hd;
    int64_t t0 = first + g * QROWS, nq = c->seq_len - g * QROWS < QROWS ? c->seq_len - g * QROWS : QROWS;
    const float *q[QROWS];
    float *acc[QROWS];
    float s[QROWS][KEY_BLOCK], m[QROWS], l[QROWS];
    float kt[ELLM_FULL_ATTENTION_MAX_HD * KEY_BLOCK];   /* (hd, 64): the block's keys, transposed */
    float scratch[ELLM_FULL_ATTENTION_MAX_HD];           /* where the copies' sums go */
    for (int r = 0; r < QROWS; r++) {
        int64_t t = t0 + (r < nq ? r : nq - 1);
        q[r] = c->q + t * row + h * hd;
        acc[r] = r < nq ? c->out + t * row + h * hd : scratch;   /* (hd,) accumulated in place */
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int r = 0; r < nq; r++)
        for (int64_t i = 0; i < hd; i++) acc[r][i] = 0.0f;
    for (int64_t i = 0; i < hd; i++) scratch[i] = 0.0f;
    for (int64_t j0 = 0; j0 < c->seq_len; j0 += KEY_BLOCK) {
        int64_t nb = c->seq_len - j0 < KEY_BLOCK ? c->seq_len - j0 : KEY_BLOCK;
        const float *kb = c->k + (first + j0) * row + h * hd;
        const float *vb = c->v + (first + j0) * row + h * hd;
        for (int64_t d = 0; d < hd; d++) {
            for (int64_t j = 0; j < nb; j++) kt[d * KEY_BLOCK + j] = kb[j * row + d];
            for (int64_t j = nb; j < KEY_BLOCK; j++) kt[d * KEY_BLOCK + j] = 0.0f;
        }
        for (int r = 0; r < nq; r++) f->scores64(q[r], kt, hd, s[r]);
        for (int r = 0; r < nq; r++) {
            for (int64_t j = 0; j < nb; j++) s[r][j] *= c->scale;
            float bm = f->max(s[r], nb);
            float m_new = bm > m[r] ? bm : m[r];
            float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
            l[r] = l[r] * corr + f->exp_shift_sum(s[r], m_new, nb);
            if (corr != 1.0f) f->scale_axpy(acc[r], corr, 0.0f, vb, hd);
            m[r] = m_new;
        }
        for (int r = (int)nq; r < QROWS; r++)   /* the copies: weight 0, so the shared rows stay right */
            for (int64_t j = 0; j < nb; j++) s[r][j] = 0.0f;
        for (int half = 0; half < nq; half += 4) {   /* rows past nq in the last four: copies */
            const float *p[4] = {s[half], s[half + 1], s[half + 2], s[half + 3]};
            f->pv4(acc + half, p, vb, row, nb, hd);
        }
    }
    for (int r = 0; r < nq; r++) {
        float inv = 1.0f / l[r];
        for (int64_t i = 0; i < hd; i++) acc[r][i] *= inv;
    }
}

static void task_attention(void *p, int64_t i0, int64_t i1, int tid) {
    const attn_ctx *c = p;
    for (int64_t i = i0; i < i1; i++) {   /* item = (sequence, query group, head) */
        int64_t h = i % c->nh, rest = i / c->nh;
        attend_group(c, rest / c->groups, rest % c->groups, h);
    }
}

void ellm_full_attention(const float *q, const float *k, const float *v, float *out, int64_t T,
                         int64_t nh, int64_t hd, int64_t seq_len, float scale) {
    if (T <= 0 || nh <= 0 || hd <= 0 || hd > ELLM_FULL_ATTENTION_MAX_HD || seq_len <= 0 || T % seq_len) return;
    int64_t groups = (seq_len + QROWS - 1) / QROWS;
    attn_ctx c = {.f = funcs_now(), .q = q, .k = k, .v = v, .out = out, .nh = nh, .hd = hd,
                  .seq_len = seq_len, .groups = groups, .scale = scale};
    int64_t items = T / seq_len * groups * nh, work = seq_len * hd * QROWS;
    if (items * work < PAR_MIN) {
        task_attention(&c, 0, items, 0);
        return;
    }
    int64_t grain = PAR_GRAIN / work;
    ellm_parallel_for(items, grain < 1 ? 1 : grain, task_attention, &c);
}
