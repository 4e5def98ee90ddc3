/* LoRA adapters over a shared base: y[t] += scale_s * B_s (A_s x[t]) for each row t of a
 * batch whose adapter slot is s (row_slot[t] = -1: the base alone, y left as it is).
 *
 * One call serves every adapter of the batch and several projections of one input (q,
 * k and v, or gate and up): rows are grouped by slot here (a counting sort, stable in row
 * order), each adapter's factors are read once for all of its rows. The A products (the
 * shrink) run first: on one thread when they are small (a decode step's few rows), else
 * on the pool; then the B products. ellm_linear_multi_lora runs both inside the base
 * product's own pass over the pool: a small shrink by the threads as they start blocks,
 * and the B products of each block of outputs as soon as the base wrote it (their
 * factors prefetched as it starts), so a decode step wakes the pool for adapters no more
 * often than without them. No Python anywhere in it.
 *
 * The factors are stored transposed, A^T (K, r) and B^T (r, N; in blocks of 8 outputs),
 * in float32, float16 or bfloat16 (an adapter's own type: half the bytes a step reads for
 * a 16-bit adapter), and widened exactly to float32. Every sum runs in one order: u[j] =
 * (sum over even k ascending of A[j][k] x[k]) + (the same over odd k), then y[n] +=
 * scale * (sum over j ascending of u[j] B[n][j]), each term a plain multiply and add
 * (never fused), so an output's bits do not depend on the other rows, their adapters,
 * the thread count or the SIMD level (batch invariance). */
#ifndef ELLM_LORA_H
#define ELLM_LORA_H
#include <stddef.h>
#include <stdint.h>

#include "matmul.h"

enum { ELLM_LORA_F32 = 0, ELLM_LORA_F16 = 1, ELLM_LORA_BF16 = 2 };

/* One adapter's factors for one projection (N outputs, K inputs). */
typedef struct {
    int32_t rank;     /* 0: this adapter leaves the projection alone */
    int32_t dtype;    /* ELLM_LORA_F32 / F16 / BF16: the element type of at and bt */
    float scale;      /* lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA */
    const void *at;   /* A^T (K, rank) row-major; [bf16] at and bt in units of 16 (lora_impl.h) */
    const void *bt;   /* B^T in blocks of 8 outputs: (ceil(N / 8), rank, 8) row-major, the
                       * last block's outputs past N zeros -- the factors of an output
                       * block lie together, one read (_lora.pyx LoraTable lays them so) */
} ellm_lora_slot;

/* Every adapter's factors for one projection: slot s is adapter s. */
typedef struct {
    int64_t N, K;
    int32_t n_slots;
    const ellm_lora_slot *slots; /* (n_slots,) */
} ellm_lora_proj;

/* One projection of a call and where its product goes: columns [0, N) of y's T rows,
 * ldy floats apart (the base product already there). */
typedef struct {
    const ellm_lora_proj *proj;
    float *y;
    int64_t ldy;
} ellm_lora_part;

/* The largest n_parts one call takes. */
#define ELLM_LORA_MAX_PARTS 8

/* Bytes of scratch ellm_lora_apply needs (8-byte aligned); 0 on invalid arguments. */
size_t ellm_lora_scratch_bytes(const ellm_lora_part *parts, int n_parts, int64_t T);

/* x (T, K) rows ldx floats apart; row_slot (T,) in [-1, n_slots). Every part takes the
 * same K and has the same n_slots. Checks every shape, rank, type and slot before anything
 * is written; returns ELLM_OK or an ellm_status code (quant.h): ELLM_E_INDEX for a slot
 * out of range. y must not overlap x. Safe without the GIL. */
int ellm_lora_apply(const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                    const ellm_lora_part *parts, int n_parts, void *scratch, size_t scratch_bytes);

/* [lora] A base product and its adapters' in one pass over the pool: Y_p = X W_p^T for
 * the linear parts (ellm_linear_multi, matmul.h), and for each lora part i, which adds to
 * linear part lin_index[i] (same y, ldy and N; K its width), the adapters' products of its
 * rows, each block of outputs as soon as the base product has written it (an epilogue of
 * the matmul's items), the shrink A x before. Bits equal to ellm_linear_multi followed by
 * ellm_lora_apply. row_slot NULL or n_parts 0: ellm_linear_multi alone. */
int ellm_linear_multi_lora(const float *x, int64_t T, int64_t K, const ellm_linear_part *lin, int n_lin,
                           void *lin_scratch, size_t lin_bytes, const int32_t *row_slot,
                           const ellm_lora_part *parts, const int *lin_index, int n_parts, void *scratch,
                           size_t scratch_bytes);

/* [internal] the SIMD variants' entry points (lora_impl.h) */
typedef struct {
    void (*shrink)(const void *at, int32_t dtype, int64_t K, int32_t r, int32_t j0, int32_t jn,
                   const float *x0, const float *x1, float *u0, float *u1);
    void (*expand)(const void *bt, int32_t dtype, int64_t N, int32_t r, int64_t n0, int64_t nc,
                   const float *u, float scale, float *y);
    void (*expand4)(const void *bt, int32_t dtype, int32_t r, int64_t n0, int64_t nc,
                    const float *const u[4], float scale, float *const y[4], int rows);
} ellm_lora_funcs;
const ellm_lora_funcs *ellm_lora_funcs_scalar(void);
const ellm_lora_funcs *ellm_lora_funcs_avx2(void);

#endif
