/* Fused RoPE + paged-KV-cache attention (the contract of reference.rope_attention).
 * No Python here.
 *
 * One call handles a whole batch: T new tokens from any number of sequences, each with
 * its position and its row in the block tables. Phase 1 (parallel over tokens) rotates
 * q into scratch and k straight into its cache slot, and copies v into its slot; phase 2
 * runs all query heads of a GQA group over that token's visible keys, reading K/V
 * through the block table.
 *
 * Batch invariance: the output of a token is bit-identical whatever else is in the call
 * (other sequences, other tokens of its own sequence), whatever T and the thread count,
 * and whether its K/V were written in this call or an earlier one. Its keys are cut into
 * chunks at absolute positions multiple of ELLM_ATTN_CHUNK and tiles at multiples of
 * ELLM_ATTN_TILE; each chunk's (max, sum, acc) is an online softmax over its tiles in
 * order, and the chunks are folded in order -- whoever computes them. Several query
 * tokens of one sequence share each K/V tile (prefill), and small batches spread the
 * chunks of one token over threads (decode); neither changes a single bit. */
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
    const int32_t *key_limit;     /* (T,) last position each token sees, >= its own (the
                                     later ones must be written in this call or before:
                                     an image's tokens seeing the whole image); NULL:
                                     causal, each token sees up to its own position */
    const int32_t *block_tables;  /* (B, max_blocks), -1 where unused */
    float *k_cache;               /* (num_blocks, block_size, nkv, hd), written in place */
    float *v_cache;               /* (num_blocks, block_size, nkv, hd), written in place */
    const float *inv_freq;        /* (n_rot,): the rotated pairs' frequencies */
    float *out;                   /* (T, nh, hd) contiguous; must not overlap the caches */
    int64_t T, B, max_blocks, num_blocks;
    int32_t nh, nkv, hd, block_size;
    int32_t n_rot;                /* rotated pairs, 0..hd/2: dims [0, 2 n_rot) of each head
                                     rotate, the rest pass through (partial rotary) */
    int32_t interleaved;          /* 1: pairs (2i, 2i+1); 0: pairs (i, i + n_rot) */
    int32_t window;               /* > 0: a token at p sees positions > p - window (and
                                     still up to its key_limit) */
    float scale;                  /* on q.k before the softcap */
    float softcap;                /* > 0: scores = softcap * tanh(scores / softcap) */
    float rope_mscale;            /* multiplies cos and sin (1: plain RoPE; longrope's
                                     attention factor otherwise) */
    uint16_t *k_cache16;          /* IEEE half caches, in place of k_cache / v_cache (then */
    uint16_t *v_cache16;          /* NULL): K and V are stored rounded to f16 (nearest even)
                                     and read back exactly; the arithmetic is the f32 path's
                                     on those values. nkv * hd <= ELLM_ATTN_F16_MAX_ROW and
                                     hd <= ELLM_ATTN_F16_MAX_HD. */
} ellm_attn_args;

/* Limits of the f16 caches: one token's K row (nkv * hd) and one head's dims, staged as
 * f32 on the stack (a key tile of f16 rows is converted before the f32 kernels read it). */
#define ELLM_ATTN_F16_MAX_HD 256
#define ELLM_ATTN_F16_MAX_ROW 8192

/* Floats of scratch that always suffice for T tokens on `threads` threads: the rotated q
 * (T, nh, hd) plus one (ELLM_ATTN_MAX_ROWS, hd) chunk accumulator per thread. Down to
 * T*nh*hd + ELLM_ATTN_MAX_ROWS*hd also works (fewer threads then). */
int64_t ellm_rope_attention_scratch_floats(int64_t T, int32_t nh, int32_t nkv, int32_t hd, int threads);

/* Floats of scratch this call wants on `threads` threads: the above, or more for a small
 * batch whose keys are worth spreading over threads (room for every chunk's partial
 * result). May be called before validation (bad positions are skipped). The result of
 * the call never depends on how much scratch it gets. */
int64_t ellm_rope_attention_scratch_wanted(const ellm_attn_args *a, int threads);

/* Checks shapes and every index the kernel will follow (sequence ids, positions, the
 * block-table entries of every visible position). Returns 0, or -1 with a message. */
int ellm_rope_attention_check(const ellm_attn_args *a, char *err, size_t err_len);

/* Validates (as above), then runs. scratch (scratch_floats,), at least
 * ellm_rope_attention_scratch_floats(T, nh, nkv, hd, 1).
 * Returns 0, or -1 with a message in err and nothing written. Each (sequence,
 * position) may appear at most once in a call (two tokens may not share a cache slot). */
int ellm_rope_attention(const ellm_attn_args *a, float *scratch, int64_t scratch_floats, char *err,
                        size_t err_len);

/* ---- internal: the per-ISA inner loops of phase 2 ----
 * q (g, hd): g query rows (several heads, possibly of several tokens), g <= ELLM_ATTN_MAX_ROWS.
 * s (g, ELLM_ATTN_TILE): s[h][j] = q[h] . k[j] for n <= ELLM_ATTN_TILE keys at kp[j].
 * acc (g, hd) += p (g, ELLM_ATTN_TILE) @ the value rows at vp[j].
 * Invariance contract: s[h][j] depends only on the bits of q[h] and k[j] (not on g, n,
 * j or the other rows), and row h of acc only on its own p row, n and the values, each
 * key added in order j = 0, 1, ... */
#define ELLM_ATTN_TILE 64
#define ELLM_ATTN_CHUNK 256
#define ELLM_ATTN_MAX_ROWS 32
/* widen: the n f16 rows at src[j] (hd each) -> f32 rows dst + j * hd, exactly. */
#define ELLM_ATTN_KERNELS(sfx)                                                                \
    void ellm_attn_qk_##sfx(const float *q, int g, int hd, const float *const *kp, int n,     \
                            float *s);                                                         \
    void ellm_attn_pv_##sfx(const float *p, int g, int hd, const float *const *vp, int n,     \
                            float *acc);                                                       \
    void ellm_attn_widen_##sfx(const uint16_t *const *src, int n, int hd, float *dst);
ELLM_ATTN_KERNELS(scalar)
#if defined(__x86_64__) || defined(__i386__)
#define ELLM_HAVE_X86_ATTN 1
ELLM_ATTN_KERNELS(avx2)
ELLM_ATTN_KERNELS(avx512)
/* One row of a tile's scores x[0..n) (n <= ELLM_ATTN_TILE) in one pass: x *= scale, the
 * soft-cap (cap > 0), *m_new = max(m_old, max x), x = e^(x - *m_new); returns sum x. The
 * same operations in the same order as ellm_scale_row, ellm_softcap_row, ellm_max_row and
 * ellm_exp_shift_sum_row one after another (the same bits), without three passes and
 * three calls per row. */
float ellm_attn_softmax_row_avx512(float *x, int n, float scale, float cap, float m_old, float *m_new);
#endif

#endif
