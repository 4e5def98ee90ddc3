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

float ellm_dot_row_scalar(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[0] += a[i] * b[i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

void ellm_scale_axpy_row_scalar(float *y, float s, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = y[i] * s + a * x[i];
}

/* ================================== dispatch ================================== */

typedef struct {
    void (*layernorm)(const float *, const float *, const float *, float, float *, int64_t);
    void (*gelu)(const float *, float *, int64_t);
    float (*dot)(const float *, const float *, int64_t);
    void (*scale_axpy)(float *, float, float, const float *, int64_t);
    float (*max)(const float *, int64_t);
    float (*exp_shift_sum)(float *, float, int64_t);
} vision_funcs;

#define VISION_TABLE(sfx)                                                                  \
    {ellm_layernorm_row_##sfx, ellm_gelu_tanh_row_##sfx, ellm_dot_row_##sfx,               \
     ellm_scale_axpy_row_##sfx, ellm_max_row_##sfx, ellm_exp_shift_sum_row_##sfx}

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

/* Keys are taken KEY_BLOCK at a time: their scores sit on the stack, softmax runs
 * online across blocks (the running max and sum rescale what is accumulated), so any
 * sequence length works without a scratch buffer. With seq_len <= KEY_BLOCK this is the
 * plain two-pass softmax. */
enum { KEY_BLOCK = 128 };

typedef struct {
    const vision_funcs *f;
    const float *q, *k, *v;   /* (T, nh, hd) */
    float *out;               /* (T, nh, hd) */
    int64_t nh, hd, seq_len;
    float scale;
} attn_ctx;

static void attend_row(const attn_ctx *c, int64_t t, int64_t h) {
    const vision_funcs *f = c->f;
    int64_t row = c->nh * c->hd, first = t - t % c->seq_len;
    const float *q = c->q + t * row + h * c->hd;
    float *acc = c->out + t * row + h * c->hd;    /* (hd,) accumulated in place */
    float s[KEY_BLOCK];
    float m = -INFINITY, l = 0.0f;
    for (int64_t i = 0; i < c->hd; i++) acc[i] = 0.0f;
    for (int64_t j0 = 0; j0 < c->seq_len; j0 += KEY_BLOCK) {
        int64_t nb = c->seq_len - j0 < KEY_BLOCK ? c->seq_len - j0 : KEY_BLOCK;
        const float *kb = c->k + (first + j0) * row + h * c->hd;
        const float *vb = c->v + (first + j0) * row + h * c->hd;
        for (int64_t j = 0; j < nb; j++) s[j] = f->dot(q, kb + j * row, c->hd) * c->scale;
        float bm = f->max(s, nb);
        float m_new = bm > m ? bm : m;
        float corr = m == -INFINITY ? 0.0f : expf(m - m_new);
        l = l * corr + f->exp_shift_sum(s, m_new, nb);
        f->scale_axpy(acc, corr, s[0], vb, c->hd);
        for (int64_t j = 1; j < nb; j++) f->scale_axpy(acc, 1.0f, s[j], vb + j * row, c->hd);
        m = m_new;
    }
    float inv = 1.0f / l;
    for (int64_t i = 0; i < c->hd; i++) acc[i] *= inv;
}

static void task_attention(void *p, int64_t i0, int64_t i1, int tid) {
    const attn_ctx *c = p;
    for (int64_t i = i0; i < i1; i++) attend_row(c, i / c->nh, i % c->nh);
}

void ellm_full_attention(const float *q, const float *k, const float *v, float *out, int64_t T,
                         int64_t nh, int64_t hd, int64_t seq_len, float scale) {
    if (T <= 0 || nh <= 0 || hd <= 0 || seq_len <= 0 || T % seq_len) return;
    attn_ctx c = {.f = funcs_now(), .q = q, .k = k, .v = v, .out = out, .nh = nh, .hd = hd,
                  .seq_len = seq_len, .scale = scale};
    int64_t items = T * nh, work = seq_len * hd;
    if (items * work < PAR_MIN) {
        task_attention(&c, 0, items, 0);
        return;
    }
    int64_t grain = PAR_GRAIN / work;
    ellm_parallel_for(items, grain < 1 ? 1 : grain, task_attention, &c);
}
