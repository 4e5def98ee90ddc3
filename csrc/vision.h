/* Kernels of the vision towers (SigLIP): layernorm with bias, GELU (tanh form) and
 * attention without a mask or cache over independent sequences of equal length (the
 * patches of an image tile). No Python here; nothing is allocated.
 *
 * Matrices are (rows, n) float32 with a row stride in floats (>= n). Large inputs are
 * split over rows (or over query rows and heads) on the thread pool; each output element
 * is computed by one thread in a fixed order, so results do not depend on the thread
 * count. The SIMD level comes from ellm_simd_level() at each call. */
#ifndef ELLM_VISION_H
#define ELLM_VISION_H
#include <stdint.h>

/* out = (x - mean) / sqrt(var + eps) * w + b per row (biased variance, as
 * torch.nn.LayerNorm). x (rows, n) stride ldx, w, b (n,), out (rows, n) stride ldo;
 * out may be x itself. */
void ellm_layernorm(const float *x, int64_t ldx, const float *w, const float *b, float eps,
                    float *out, int64_t ldo, int64_t rows, int64_t n);

/* out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). x, out (rows, n) with their
 * strides; out may be x. */
void ellm_gelu_tanh(const float *x, int64_t ldx, float *out, int64_t ldo, int64_t rows, int64_t n);

/* q, k, v, out (T, nh, hd) contiguous, T = n_seqs * seq_len: each block of seq_len rows
 * is one sequence, every query row attends to all seq_len rows of its own block:
 * out = softmax(q k^T * scale) v per head. out must not overlap q, k or v;
 * hd <= ELLM_FULL_ATTENTION_MAX_HD (nothing is done otherwise). */
#define ELLM_FULL_ATTENTION_MAX_HD 256
void ellm_full_attention(const float *q, const float *k, const float *v, float *out, int64_t T,
                         int64_t nh, int64_t hd, int64_t seq_len, float scale);

/* ---- per-ISA row functions (internal), as _scalar (vision.c), _avx2, _avx512 ---- */
#define ELLM_VISION_ROW_FUNCS(sfx)                                                            \
    void ellm_layernorm_row_##sfx(const float *x, const float *w, const float *b, float eps, \
                                  float *out, int64_t n);                                     \
    void ellm_gelu_tanh_row_##sfx(const float *x, float *out, int64_t n);                     \
    /* y = y * s + a * x */                                                                   \
    void ellm_scale_axpy_row_##sfx(float *y, float s, float a, const float *x, int64_t n);    \
    /* y[r] += sum_j p[r][j] * v[j * ldv + :n] for r < 4, j < nb: four queries' weighted    \
     * sums of nb value rows, each value row read once for the four */                       \
    void ellm_pv4_row_##sfx(float *const y[4], const float *const p[4], const float *v,       \
                            int64_t ldv, int64_t nb, int64_t n);                               \
    /* out[j] = sum_d q[d] * kt[d * 64 + j] for j < 64: one query against 64 keys stored     \
     * transposed (hd, 64) */                                                                  \
    void ellm_scores64_row_##sfx(const float *q, const float *kt, int64_t hd, float out[64]);

ELLM_VISION_ROW_FUNCS(scalar)
#if defined(__x86_64__) || defined(__i386__)
#define ELLM_HAVE_X86_VISION_ROWS 1
ELLM_VISION_ROW_FUNCS(avx2)
ELLM_VISION_ROW_FUNCS(avx512)
#endif

#endif
