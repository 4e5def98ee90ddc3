/* AMX bf16 tile kernels for BF16 weights (matmul_bf16_amx.c), used at the AMX SIMD level
 * where the CPU also has AMX-BF16. Internal, like quant_impl.h.
 *
 * The weights are exact bf16 and are loaded into tiles straight from the file (16 rows x
 * 32 elements a tile, rows w_stride apart). The f32 activations are not rounded to bf16:
 * each is split exactly into three bf16 parts, x = hi + mid + lo (hi: x's top 8
 * significand bits, mid: the next 8, lo: the last 8; the differences are exact in f32), so
 * x . w = hi . w + mid . w + lo . w with every product exact, summed in f32 by the tile
 * unit (TDPBF16PS). Every call at this level, whatever T (1 too), runs the same tile
 * multiplies for an output in the same order -- per 32-element block of k, in block
 * order: += hi . w, += mid . w, += lo . w, from 0 -- so a row of Y depends only on its row
 * of X and on W (batch invariance, matmul.h). The sums differ from the AVX-512 FMA
 * kernels' (another order of f32 roundings): the AMX level has its own bits.
 *
 * Activations go in groups of ELLM_BF16_TG = 16 tokens laid out as the tile unit's B
 * operand: per block b of 32 elements and part p (hi, mid, lo), one 1 KiB tile whose row
 * j holds the 16 tokens' element pairs (2j, 2j + 1) of the block, 4 bytes a token. */
#ifndef ELLM_MATMUL_BF16_AMX_H
#define ELLM_MATMUL_BF16_AMX_H
#include <stddef.h>
#include <stdint.h>

#include "quant_impl.h"

#define ELLM_BF16_TG 16
#define ELLM_BF16_KB 32 /* elements of k per tile multiply */

/* Bytes of one 16-token group of split activations for rows of k elements. */
static inline size_t ellm_bf16x3_group_bytes(int64_t k) {
    return (size_t)((k + ELLM_BF16_KB - 1) / ELLM_BF16_KB) * 3u * 1024u;
}

/* 1 when the CPU has AMX-TILE and AMX-BF16 with the tile state saved by the OS
 * (dispatch.c); the kernels run only where ellm_simd_level() is also ELLM_SIMD_AMX,
 * whose detection asked the kernel for the tile permission. 0 off x86. */
int ellm_cpu_has_amx_bf16(void);

#ifdef __x86_64__
/* The tile kernel for qtype (only ELLM_T_BF16 has one, else NULL), as ellm_qgemm_fn with
 * nb = k (elements per row) and x = (ceil(nt / 16), x_stride bytes) groups. */
ellm_qgemm_fn ellm_fmm_bf16_amx(int qtype);

/* Splits tokens x[0..n) (rows x_stride floats apart, 1 <= n <= 16) into a group; lanes
 * past n, and k past the last whole block, are 0. group: 64-byte aligned. */
void ellm_bf16x3_put_group(const float *x, size_t x_stride, int n, int64_t k, uint8_t *group);

#else /* no AMX off x86-64: ellm_cpu_has_amx_bf16() is 0 there */
static inline ellm_qgemm_fn ellm_fmm_bf16_amx(int qtype) {
    (void)qtype;
    return NULL;
}
static inline void ellm_bf16x3_put_group(const float *x, size_t x_stride, int n, int64_t k,
                                         uint8_t *group) {}
#endif

#endif
