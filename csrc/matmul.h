/* Linear layers on weights as they lie in the file: Y = X . W^T.
 *
 *   x: (T, K) f32, rows contiguous
 *   w: (N, row_bytes) weight rows, each K elements of qtype (GGML blocks, or f32 /
 *      f16 / bf16 elements) -- typically a view into the mmapped model file
 *   y: (T, N) f32
 *
 * Quantized weights are never dequantized as a whole: X is quantized once per call to
 * 8-bit blocks (into the caller's scratch buffer) and multiplied with the weight blocks
 * by integer dot products. Float weights are converted in registers. Work is split
 * over the thread pool: by output rows for a few tokens (decode), by (rows x tokens)
 * tiles for many (prefill). */
#ifndef ELLM_MATMUL_H
#define ELLM_MATMUL_H
#include <stddef.h>
#include <stdint.h>

/* Batch invariance: row t of Y depends only on row t of X, W and the SIMD level -- it is
 * bit-identical whatever T is, wherever the row sits in X, and whatever the thread
 * count (each output is summed in one fixed order, see quant_impl.h). */

/* Scratch bytes ellm_linear needs for this (qtype, T, K); 0 for float types. The
 * scratch must be 64-byte aligned. Returns 0 also for invalid shapes (ellm_linear then
 * reports the error). */
size_t ellm_linear_scratch_bytes(int qtype, int64_t T, int64_t K);

/* Y = X . W^T (+ bias: (N,) f32, or NULL). Returns ELLM_OK or an ellm_status code
 * (quant.h); checks that w_bytes equals N * ellm_row_bytes(qtype, K) and that the scratch
 * is large enough and aligned. Safe to call without the GIL; uses ellm_parallel_for. */
int ellm_linear(int qtype, const float *x, int64_t T, int64_t K, const uint8_t *w, size_t w_bytes,
                int64_t N, const float *bias, float *y, void *scratch, size_t scratch_bytes);

/* ------------------------------------------------------------------------------------
 * Several weight matrices against the same X (q, k, v; gate, up): X is quantized once
 * per activation format, and all matrices run in one ellm_parallel_for over their
 * concatenated output rows. Each Y_p is bit-identical to ellm_linear(W_p) alone.
 * ------------------------------------------------------------------------------------ */

/* At most this many matrices per call. */
#define ELLM_LINEAR_MAX_PARTS 16

typedef struct {
    int qtype;
    const uint8_t *w;  /* (N, ellm_row_bytes(qtype, K)) */
    size_t w_bytes;    /* must equal N * ellm_row_bytes(qtype, K) */
    int64_t N;
    float *y;          /* (T, ldy) f32; columns [0, N) of each row are written */
    int64_t ldy;       /* row stride of y in floats, >= N (a column slice of a wider Y) */
    const float *bias; /* (N,) f32 or NULL: y[t][n] = dot(w_n, x_t) + bias[n], the add made
                        * after the fixed-order sum, so batch invariance is unchanged */
} ellm_linear_part;

/* Scratch bytes ellm_linear_multi needs (64-byte aligned); 0 when every part has float
 * weights, or for an invalid argument (ellm_linear_multi then reports it). */
size_t ellm_linear_multi_scratch_bytes(const ellm_linear_part *parts, int n_parts, int64_t T,
                                       int64_t K);

/* Y_p = X . W_p^T for p < n_parts (1 <= n_parts <= ELLM_LINEAR_MAX_PARTS); x: (T, K) f32.
 * Every part is checked (type, shape, byte length, ldy) before anything runs; the
 * outputs must not overlap X or one another. Safe to call without the GIL. */
int ellm_linear_multi(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                      int n_parts, void *scratch, size_t scratch_bytes);

/* A hook run right after each block of outputs is final (bias included): rows [n0, n1)
 * of part `part` (its index in the call's parts) for tokens [t0, t1), on the thread that
 * summed them, while the block is still in its cache. It may add to exactly that block of
 * y and must write nothing else shared. [lora] The LoRA expand rides on the base product's
 * pass over the pool this way (lora.c), with no pass of its own. */
typedef struct {
    void (*fn)(void *ctx, int part, int64_t n0, int64_t n1, int64_t t0, int64_t t1);
    void *ctx;
    /* NULL, or run as the block starts, with the same arguments: to ask for what fn will
     * read (a prefetch), which then arrives while the base product is summed */
    void (*pre)(void *ctx, int part, int64_t n0, int64_t n1, int64_t t0, int64_t t1);
} ellm_linear_epilogue;

/* ellm_linear_multi with an epilogue (NULL: none). */
int ellm_linear_multi_epi(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                          int n_parts, void *scratch, size_t scratch_bytes,
                          const ellm_linear_epilogue *epi);

/* ------------------------------------------------------------------------------------
 * Groups: several ellm_linear_multi calls, each with its own X (of one width K), run as
 * one pass over the thread pool -- the experts of an MoE layer, each on the tokens routed
 * to it. Every output is bit-identical to its group's ellm_linear_multi call alone.
 * ------------------------------------------------------------------------------------ */

#define ELLM_LINEAR_MAX_GROUPS 4096

typedef struct {
    const float *x;                /* (T, K) */
    int64_t T;
    const ellm_linear_part *parts; /* (n_parts,), as for ellm_linear_multi */
    int n_parts;
} ellm_linear_group;

/* Scratch bytes ellm_linear_groups needs (64-byte aligned; never 0 for valid input, as
 * it holds each group's layout); 0 for invalid arguments. */
size_t ellm_linear_groups_scratch_bytes(const ellm_linear_group *groups, int n_groups, int64_t K);

/* At least ellm_linear_groups_scratch_bytes for any n_groups groups of these parts' types
 * (only the qtypes are read) whose T add up to total_rows; 0 for invalid arguments. */
size_t ellm_linear_groups_scratch_bound(const ellm_linear_part *parts, int n_parts, int n_groups,
                                        int64_t total_rows, int64_t K);

/* Runs every group (1 <= n_groups <= ELLM_LINEAR_MAX_GROUPS); each is checked as
 * ellm_linear_multi checks its arguments, all before anything runs on the pool (a group
 * with K = 0 has its outputs written during the checks). Outputs must not overlap any
 * group's X or one another. Safe to call without the GIL. */
int ellm_linear_groups(const ellm_linear_group *groups, int n_groups, int64_t K, void *scratch,
                       size_t scratch_bytes);

#endif
