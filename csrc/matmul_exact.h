/* Linear layers with exact (f32) activations: Y = X . W^T where quantized weights are
 * dequantized a few rows at a time into a per-thread buffer and multiplied by X as it
 * is, in f32 -- no 8-bit rounding of X (ellm.load(..., activations="f32")). Slower than
 * the integer kernels at many tokens; at one token both are bound by reading W.
 *
 * Batch invariance holds as in matmul.h: each output is the float kernel's fixed-order
 * sum over the dequantized row (quant_impl.h), whatever T, position or thread count. */
#ifndef ELLM_MATMUL_EXACT_H
#define ELLM_MATMUL_EXACT_H
#include <stddef.h>
#include <stdint.h>

#include "matmul.h"

/* Scratch bytes for K-element rows on up to max_threads threads (64-byte aligned); 0 on
 * overflow or a bad argument. */
size_t ellm_linear_exact_scratch_bytes(int64_t K, int max_threads);

/* As ellm_linear_multi (same parts and checks), with f32 activations. Runs on as many
 * threads as the scratch was sized for (at most ellm_num_threads()). */
int ellm_linear_multi_exact(const float *x, int64_t T, int64_t K, const ellm_linear_part *parts,
                            int n_parts, void *scratch, size_t scratch_bytes);

#endif
