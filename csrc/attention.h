/* Fused RoPE + paged-KV-cache attention (the contract of reference.rope_attention).
 * No Python here.
 *
 * One call handles a whole batch: T new tokens from any number of sequences, each with
 * its position and its row in the block tables. Phase 1 (parallel over tokens) rotates
 * q into scratch and k straight into its cache slot, and copies v into its slot; phase 2
 * (parallel over (token, kv head) pairs, optionally split along the keys for small
 * batches) runs all query heads of a GQA group in one pass over that token's visible
 * keys with an online softmax, reading K/V through the block table. */
#ifndef ELLM_ATTENTION_H
#define ELLM_ATTENTION_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const float *q;               /* (T, nh, hd), token stride q_stride floats */
    const float *k;               /* (T, nkv, hd), token stride k_stride */
    const float *v;               /* (T, nkv, hd), token stride v_stride */
    int64_t q_stride, k_stride, v_stride;
    const int32_t *positions;     /* (T,) position of each token in its sequence */
    const int32_t *seq_ids;       /* (T,) each token's row in block_tables */
    const int32_t *block_tables;  /* (B, max_blocks), -1 where unused */
    float *k_cache;               /* (num_blocks, block_size, nkv, hd), written in place */
    float *v_cache;               /* (num_blocks, block_size, nkv, hd), written in place */
    const float *inv_freq;        /* (hd/2,) */
    float *out;                   /* (T, nh, hd) contiguous; must not overlap the caches */
    int64_t T, B, max_blocks, num_blocks;
    int32_t nh, nkv, hd, block_size;
    int32_t interleaved;          /* 1: pairs (2i, 2i+1); 0: pairs (i, i + hd/2) */
    int32_t window;               /* > 0: a token at p sees positions > p - window */
    float scale;                  /* on q.k before the softcap */
    float softcap;                /* > 0: scores = softcap * tanh(scores / softcap) */
} ellm_attn_args;

/* Floats of scratch ellm_rope_attention wants for these shapes on `threads` threads:
 * the rotated q (T, nh, hd) plus room for key-split partial results in small batches.
 * Less (down to T*nh*hd) also works: the kernel then splits less. */
int64_t ellm_rope_attention_scratch_floats(int64_t T, int32_t nh, int32_t nkv, int32_t hd, int threads);

/* Checks shapes and every index the kernel will follow (sequence ids, positions, the
 * block-table entries of every visible position). Returns 0, or -1 with a message. */
int ellm_rope_attention_check(const ellm_attn_args *a, char *err, size_t err_len);

/* Validates (as above), then runs. scratch (scratch_floats,), at least T*nh*hd.
 * Returns 0, or -1 with a message in err and nothing written. Each (sequence,
 * position) may appear at most once in a call (two tokens may not share a cache slot). */
int ellm_rope_attention(const ellm_attn_args *a, float *scratch, int64_t scratch_floats, char *err,
                        size_t err_len);

/* ---- internal: the per-ISA inner loops of phase 2 ----
 * s (g, ELLM_ATTN_TILE): s[h][j] = q[h] . k[j] for n <= ELLM_ATTN_TILE keys at kp[j].
 * acc (g, hd) += p (g, ELLM_ATTN_TILE) @ the value rows at vp[j]. */
#define ELLM_ATTN_TILE 64
#define ELLM_ATTN_MAX_GROUP 16
#define ELLM_ATTN_KERNELS(sfx)                                                                \
    void ellm_attn_qk_##sfx(const float *q, int g, int hd, const float *const *kp, int n,     \
                            float *s);                                                         \
    void ellm_attn_pv_##sfx(const float *p, int g, int hd, const float *const *vp, int n,     \
                            float *acc);
ELLM_ATTN_KERNELS(scalar)
#if defined(__x86_64__) || defined(__i386__)
#define ELLM_HAVE_X86_ATTN 1
ELLM_ATTN_KERNELS(avx2)
ELLM_ATTN_KERNELS(avx512)
#endif

#endif
