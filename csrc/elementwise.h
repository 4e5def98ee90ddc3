/* Row-wise and pointwise kernels of a transformer layer: RMSNorm (plain and fused with
 * the residual add), the gated MLP activations, in-place add / scale / softcap, and the
 * fast exp / tanh they are built on. No Python here.
 *
 * Every matrix is (rows, n) float32 with its own row stride (in floats, >= n), so
 * column slices of a wider buffer (e.g. the gate and up halves of a fused projection)
 * are passed without copying. Large inputs are split over rows on the thread pool;
 * the SIMD level comes from ellm_simd_level() at each call. */
#ifndef ELLM_ELEMENTWISE_H
#define ELLM_ELEMENTWISE_H
#include <stdint.h>

/* out = x / sqrt(mean(x^2) + eps) * w per row. x (rows, n) stride ldx, w (n,),
 * out (rows, n) stride ldo; out may be x itself. */
void ellm_rmsnorm(const float *x, int64_t ldx, const float *w, float eps, float *out, int64_t ldo,
                  int64_t rows, int64_t n);

/* residual += x; out = rmsnorm(residual) per row. residual (rows, n) in/out stride ldr,
 * x (rows, n) stride ldx, out (rows, n) stride ldo; out may be x, never residual. */
void ellm_add_rmsnorm(float *residual, int64_t ldr, const float *x, int64_t ldx, const float *w,
                      float eps, float *out, int64_t ldo, int64_t rows, int64_t n);

/* out = silu(gate) * up (SwiGLU) / gelu_tanh(gate) * up (GeGLU). gate, up, out
 * (rows, n) with their strides; out may be gate or up. */
void ellm_swiglu(const float *gate, int64_t ldg, const float *up, int64_t ldu, float *out,
                 int64_t ldo, int64_t rows, int64_t n);
void ellm_geglu(const float *gate, int64_t ldg, const float *up, int64_t ldu, float *out,
                int64_t ldo, int64_t rows, int64_t n);

/* In place: a += b; x *= s; x = cap * tanh(x / cap) (cap > 0). */
void ellm_add(float *a, int64_t lda, const float *b, int64_t ldb, int64_t rows, int64_t n);
void ellm_scale(float *x, int64_t ldx, float s, int64_t rows, int64_t n);
void ellm_softcap(float *x, int64_t ldx, float cap, int64_t rows, int64_t n);

/* (n,) -> (n,), out may be x; single-threaded. Relative error within a few ulp. */
void ellm_exp_row(const float *x, float *out, int64_t n);
void ellm_tanh_row(const float *x, float *out, int64_t n);

/* ---- per-ISA row functions (internal: the dispatchers above and attention use them) ----
 * The same set exists as _scalar (elementwise.c), _avx2 and _avx512 variants. */
#define ELLM_ROW_FUNCS(sfx)                                                                    \
    void ellm_rmsnorm_row_##sfx(const float *x, const float *w, float eps, float *out,         \
                                int64_t n);                                                    \
    void ellm_add_rmsnorm_row_##sfx(float *res, const float *x, const float *w, float eps,     \
                                    float *out, int64_t n);                                    \
    void ellm_swiglu_row_##sfx(const float *g, const float *u, float *out, int64_t n);         \
    void ellm_geglu_row_##sfx(const float *g, const float *u, float *out, int64_t n);          \
    void ellm_add_row_##sfx(float *a, const float *b, int64_t n);                              \
    void ellm_scale_row_##sfx(float *x, float s, int64_t n);                                   \
    void ellm_softcap_row_##sfx(float *x, float cap, int64_t n);                               \
    void ellm_exp_row_##sfx(const float *x, float *out, int64_t n);                            \
    void ellm_tanh_row_##sfx(const float *x, float *out, int64_t n);                           \
    /* max over x (n >= 1) */                                                                  \
    float ellm_max_row_##sfx(const float *x, int64_t n);                                       \
    /* x = exp(x - shift) in place; returns the sum of the new x */                            \
    float ellm_exp_shift_sum_row_##sfx(float *x, float shift, int64_t n);

ELLM_ROW_FUNCS(scalar)
#if defined(__x86_64__) || defined(__i386__)
#define ELLM_HAVE_X86_ROWS 1
ELLM_ROW_FUNCS(avx2)
ELLM_ROW_FUNCS(avx512)
#endif

#endif
