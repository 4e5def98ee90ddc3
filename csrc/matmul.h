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
 * over the thread pool: by output rows for T == 1, by (rows x tokens) tiles otherwise. */
#ifndef ELLM_MATMUL_H
#define ELLM_MATMUL_H
#include <stddef.h>
#include <stdint.h>

/* Scratch bytes ellm_linear needs for this (qtype, T, K); 0 for float types. The
 * scratch must be 64-byte aligned. Returns 0 also for invalid shapes (ellm_linear then
 * reports the error). */
size_t ellm_linear_scratch_bytes(int qtype, int64_t T, int64_t K);

/* Y = X . W^T. Returns ELLM_OK or an ellm_status code (quant.h); checks that w_bytes
 * equals N * ellm_row_bytes(qtype, K) and that the scratch is large enough and
 * aligned. Safe to call without the GIL; uses ellm_parallel_for. */
int ellm_linear(int qtype, const float *x, int64_t T, int64_t K, const uint8_t *w, size_t w_bytes,
                int64_t N, float *y, void *scratch, size_t scratch_bytes);

#endif
