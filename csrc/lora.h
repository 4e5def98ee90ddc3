/* LoRA adapters over a shared base: y[t] += scale_s * B_s (A_s x[t]) for each row t of a
 * batch whose adapter slot is s (row_slot[t] = -1: the base alone, y left as it is).
 *
 * One call serves every adapter of the batch and several projections of one input (q,
 * k and v, or gate and up): rows are grouped by slot here (a counting sort, stable in row
 * order), each adapter's A and B are read once for all of its rows, and the pool is woken
 * twice (the A products, then the B products). No Python anywhere in it.
 *
 * Batch invariance: an output element is touched by exactly one adapter, the one of its
 * row, and every dot product is summed in one fixed order (8 lanes, then a fixed tree),
 * whatever the other rows, their adapters, the thread count or the SIMD level. The
 * kernel needs no FMA, so it is the same code at every level. */
#ifndef ELLM_LORA_H
#define ELLM_LORA_H
#include <stddef.h>
#include <stdint.h>

/* One adapter's factors for one projection (N outputs, K inputs). */
typedef struct {
    int32_t rank;     /* 0: this adapter leaves the projection alone */
    float scale;      /* lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA */
    const float *a;   /* (rank, K) row-major */
    const float *b;   /* (N, rank) row-major */
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

/* Bytes of scratch ellm_lora_apply needs (8-byte aligned); 0 on invalid arguments. */
size_t ellm_lora_scratch_bytes(const ellm_lora_part *parts, int n_parts, int64_t T);

/* x (T, K) rows ldx floats apart; row_slot (T,) in [-1, n_slots). Every part takes the
 * same K. Checks every shape, rank and slot before anything is written; returns ELLM_OK
 * or an ellm_status code (quant.h): ELLM_E_INDEX for a slot out of range. y must not
 * overlap x. Safe without the GIL. */
int ellm_lora_apply(const float *x, int64_t ldx, int64_t T, const int32_t *row_slot,
                    const ellm_lora_part *parts, int n_parts, void *scratch, size_t scratch_bytes);

/* The largest n_parts one call takes. */
#define ELLM_LORA_MAX_PARTS 8

#endif
