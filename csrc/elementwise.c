/* Elementwise kernels: the scalar row functions, the SIMD dispatch, and the split of
 * large inputs over rows on the thread pool. The SIMD rows are in elementwise_avx2.c and
 * elementwise_avx512.c. */
#include "elementwise.h"

#include <math.h>

#include "simd.h"
#include "threadpool.h"

/* ============================ scalar row functions ============================ */
/* The portable baseline (and the reference the SIMD levels are tested against): libm
 * exp/tanh, same formulas as the SIMD rows. */

void ellm_exp_row_scalar(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = expf(x[i]);
}

void ellm_tanh_row_scalar(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = tanhf(x[i]);
}

float ellm_max_row_scalar(const float *x, int64_t n) {
    float m = -INFINITY;
    for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

float ellm_exp_shift_sum_row_scalar(float *x, float shift, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - shift);
        s += x[i];
    }
    return s;
}

void ellm_rmsnorm_row_scalar(const float *x, const float *w, float eps, float *out, int64_t n) {
    float acc[8] = {0};  /* 8 partial sums: closer to numpy's pairwise sum than one */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    for (; i < n; i++) acc[0] += x[i] * x[i];
    float ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

void ellm_add_rmsnorm_row_scalar(float *res, const float *x, const float *w, float eps, float *out,
                                 int64_t n) {
    for (int64_t i = 0; i < n; i++) res[i] += x[i];
    ellm_rmsnorm_row_scalar(res, w, eps, out, n);
}

void ellm_swiglu_row_scalar(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

void ellm_geglu_row_scalar(const float *g, const float *u, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float x = g[i];
        float a = 0.7978845608f * (x + 0.044715f * x * x * x);
        /* 0.5 * x * (1 + tanh(a)) == x / (1 + exp(-2a)) */
        out[i] = x / (1.0f + expf(-2.0f * a)) * u[i];
    }
}

void ellm_add_row_scalar(float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++) a[i] += b[i];
}

void ellm_scale_row_scalar(float *x, float s, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

void ellm_softcap_row_scalar(float *x, float cap, int64_t n) {
    float inv = 1.0f / cap;
    for (int64_t i = 0; i < n; i++) x[i] = cap * tanhf(x[i] * inv);
}

/* ================================== dispatch ================================== */

typedef struct {
    void (*rmsnorm)(const float *, const float *, float, float *, int64_t);
    void (*add_rmsnorm)(float *, const float *, const float *, float, float *, int64_t);
    void (*swiglu)(const float *, const float *, float *, int64_t);
    void (*geglu)(const float *, const float *, float *, int64_t);
    void (*add)(float *, const float *, int64_t);
    void (*scale)(float *, float, int64_t);
    void (*softcap)(float *, float, int64_t);
    void (*exp)(const float *, float *, int64_t);
    void (*tanh)(const float *, float *, int64_t);
} row_funcs;

#define ROW_TABLE(sfx)                                                                        \
    {ellm_rmsnorm_row_##sfx, ellm_add_rmsnorm_row_##sfx, ellm_swiglu_row_##sfx,               \
     ellm_geglu_row_##sfx,   ellm_add_row_##sfx,         ellm_scale_row_##sfx,                \
     ellm_softcap_row_##sfx, ellm_exp_row_##sfx,         ellm_tanh_row_##sfx}

static const row_funcs rows_scalar = ROW_TABLE(scalar);
#ifdef ELLM_HAVE_X86_ROWS
static const row_funcs rows_avx2 = ROW_TABLE(avx2);
static const row_funcs rows_avx512 = ROW_TABLE(avx512);
#endif

static const row_funcs *rows_now(void) {
#ifdef ELLM_HAVE_X86_ROWS
    int level = ellm_simd_level();
    if (ellm_simd_is_avx512(level)) return &rows_avx512;
    if (level == ELLM_SIMD_AVX2) return &rows_avx2;
#endif
    return &rows_scalar;
}

/* ============================== splitting rows ============================== */

/* Below this many elements a call stays on the calling thread (pool dispatch costs a
 * few microseconds); above it, chunks of about PAR_GRAIN elements are handed out. */
enum { PAR_MIN = 1 << 15, PAR_GRAIN = 1 << 13 };

typedef struct {
    const row_funcs *f;
    float *a;        /* (rows, n) stride lda: in/out operand */
    int64_t lda;
    const float *b;  /* (rows, n) stride ldb: second input */
    int64_t ldb;
    const float *w;  /* (n,) norm weight */
    float *out;      /* (rows, n) stride ldo */
    int64_t ldo;
    float s;         /* eps, scale or cap */
    int64_t n;
} ew_ctx;

static void run_rows(ellm_task_fn fn, ew_ctx *c, int64_t rows) {
    if (rows <= 0 || c->n <= 0) return;
    if (rows == 1 || rows * c->n < PAR_MIN) {
        fn(c, 0, rows, 0);
        return;
    }
    int64_t grain = PAR_GRAIN / c->n;
    /* rows are tokens: cut the same way as the matmuls' tokens (threadpool.h) */
    ellm_parallel_for_regions(rows, grain < 1 ? 1 : grain, fn, c);
}

static void task_rmsnorm(void *p, int64_t r0, int64_t r1, int tid) {
    const ew_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->rmsnorm(c->b + r * c->ldb, c->w, c->s, c->out + r * c->ldo, c->n);
}

static void task_add_rmsnorm(void *p, int64_t r0, int64_t r1, int tid) {
    const ew_ctx *c = p;
    for (int64_t r = r0; r < r1; r++)
        c->f->add_rmsnorm(c->a + r * c->lda, c->b + r * c->ldb, c->w, c->s, c->out + r * c->ldo, c->n);
}

static void task_swiglu(void *p, int64_t r0, int64_t r1, int tid) {
    const ew_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->swiglu(c->a + r * c->lda, c->b + r * c->ldb, c->out + r * c->ldo, c->n);
}

static void task_geglu(void *p, int64_t r0, int64_t r1, int tid) {
    const ew_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->geglu(c->a + r * c->lda, c->b + r * c->ldb, c->out + r * c->ldo, c->n);
}

static void task_add(void *p, int64_t r0, int64_t r1, int tid) {
    const ew_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->add(c->a + r * c->lda, c->b + r * c->ldb, c->n);
}

static void task_scale(void *p, int64_t r0, int64_t r1, int tid) {
    const ew_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->scale(c->a + r * c->lda, c->s, c->n);
}

static void task_softcap(void *p, int64_t r0, int64_t r1, int tid) {
    const ew_ctx *c = p;
    for (int64_t r = r0; r < r1; r++) c->f->softcap(c->a + r * c->lda, c->s, c->n);
}

/* ================================= public API ================================= */

void ellm_rmsnorm(const float *x, int64_t ldx, const float *w, float eps, float *out, int64_t ldo,
                  int64_t rows, int64_t n) {
    ew_ctx c = {.f = rows_now(), .b = x, .ldb = ldx, .w = w, .out = out, .ldo = ldo, .s = eps, .n = n};
    run_rows(task_rmsnorm, &c, rows);
}

void ellm_add_rmsnorm(float *residual, int64_t ldr, const float *x, int64_t ldx, const float *w,
                      float eps, float *out, int64_t ldo, int64_t rows, int64_t n) {
    ew_ctx c = {.f = rows_now(), .a = residual, .lda = ldr, .b = x, .ldb = ldx, .w = w,
                .out = out, .ldo = ldo, .s = eps, .n = n};
    run_rows(task_add_rmsnorm, &c, rows);
}

void ellm_swiglu(const float *gate, int64_t ldg, const float *up, int64_t ldu, float *out,
                 int64_t ldo, int64_t rows, int64_t n) {
    /* a is only read by the task; the cast keeps one context layout for every op */
    ew_ctx c = {.f = rows_now(), .a = (float *)gate, .lda = ldg, .b = up, .ldb = ldu,
                .out = out, .ldo = ldo, .n = n};
    run_rows(task_swiglu, &c, rows);
}

void ellm_geglu(const float *gate, int64_t ldg, const float *up, int64_t ldu, float *out,
                int64_t ldo, int64_t rows, int64_t n) {
    ew_ctx c = {.f = rows_now(), .a = (float *)gate, .lda = ldg, .b = up, .ldb = ldu,
                .out = out, .ldo = ldo, .n = n};
    run_rows(task_geglu, &c, rows);
}

void ellm_add(float *a, int64_t lda, const float *b, int64_t ldb, int64_t rows, int64_t n) {
    ew_ctx c = {.f = rows_now(), .a = a, .lda = lda, .b = b, .ldb = ldb, .n = n};
    run_rows(task_add, &c, rows);
}

void ellm_scale(float *x, int64_t ldx, float s, int64_t rows, int64_t n) {
    ew_ctx c = {.f = rows_now(), .a = x, .lda = ldx, .s = s, .n = n};
    run_rows(task_scale, &c, rows);
}

void ellm_softcap(float *x, int64_t ldx, float cap, int64_t rows, int64_t n) {
    if (!(cap > 0.0f)) return;  /* cap <= 0 means no capping */
    ew_ctx c = {.f = rows_now(), .a = x, .lda = ldx, .s = cap, .n = n};
    run_rows(task_softcap, &c, rows);
}

void ellm_exp_row(const float *x, float *out, int64_t n) {
    if (n > 0) rows_now()->exp(x, out, n);
}

void ellm_tanh_row(const float *x, float *out, int64_t n) {
    if (n > 0) rows_now()->tanh(x, out, n);
}
