/* AMX int8 tile kernels for the many-token matmuls (matmul_amx.c), used at the AMX SIMD
 * level (simd.h). Internal, like quant_impl.h.
 *
 * The kernels take the activations in groups of ELLM_AMX_TG = 16 tokens laid out for the
 * tile unit: one block's dword m of all 16 tokens is one 64-byte tile row, so a block of
 * 16 tokens is the B operand of one tile multiply (weights, one row per tile row, are A).
 * Each token's bytes, scale and sums are exactly its row-layout block's (act32 / act256),
 * so the integer dot of every (row, token, block) is the same exact integer the other
 * levels form, and the float steps after it are theirs, in their order: results are bit
 * for bit the AVX-512 VNNI level's. Only call these where ellm_simd_level() is
 * ELLM_SIMD_AMX (the file is built with AMX and AVX-512 code generation). */
#ifndef ELLM_MATMUL_AMX_H
#define ELLM_MATMUL_AMX_H
#include <stdint.h>

#include "quant_impl.h"

#define ELLM_AMX_TG 16

/* qs[4 (16 m + t) + j] = token t's qs[4 m + j]; padding tokens of a short last group 0 */
typedef struct {
    int8_t qs[32 * ELLM_AMX_TG];
    float d[ELLM_AMX_TG];
    float s[ELLM_AMX_TG];
} ellm_act32x16;
_Static_assert(sizeof(ellm_act32x16) == ELLM_AMX_TG * sizeof(ellm_act32), "act32x16 layout");

/* the K-quants' blocks: the same qs layout; the per-16 sums in pairs, so that one madd
 * applies two per-16 factors to 16 tokens: bsums[k][t] = token t's bsums[2 k], [2 k + 1] */
typedef struct {
    int8_t qs[256 * ELLM_AMX_TG];
    int16_t bsums[8][ELLM_AMX_TG][2];
    float d[ELLM_AMX_TG];
} ellm_act256x16;
_Static_assert(sizeof(ellm_act256x16) == ELLM_AMX_TG * sizeof(ellm_act256), "act256x16 layout");

#ifdef __x86_64__
/* The AMX kernel for qtype (as ellm_qgemm_fn, x in 16-token groups), or NULL where the
 * type has none (the caller then keeps the AVX-512 path for that call). */
ellm_qgemm_fn ellm_qgemm_amx(int qtype);

/* Token `lane` of a group of nblk blocks (act_block 32 or 256 elements each): x's
 * blocks quantized one by one with act (so their bytes are the row layout's) and
 * spread into that lane. */
void ellm_amx_put_token(int act_block, ellm_act_fn act, const float *x, int64_t nblk,
                        uint8_t *group, int lane);

/* Zeroes lanes [used, ELLM_AMX_TG) of a group of nblk blocks. */
void ellm_amx_zero_lanes(int act_block, int64_t nblk, uint8_t *group, int used);

/* Releases the tiles if this thread holds a configuration (the matmul driver, at the end
 * of each task that may have run a tile kernel). */
void ellm_amx_release_tiles(void);

#else /* no AMX off x86-64: the level is never offered there */
static inline void ellm_amx_release_tiles(void) {}
static inline ellm_qgemm_fn ellm_qgemm_amx(int qtype) {
    (void)qtype;
    return NULL;
}
static inline void ellm_amx_put_token(int act_block, ellm_act_fn act, const float *x,
                                      int64_t nblk, uint8_t *group, int lane) {}
static inline void ellm_amx_zero_lanes(int act_block, int64_t nblk, uint8_t *group, int used) {}
#endif

#endif
