/* Mixture-of-experts feed-forward (Qwen3-MoE): top-k routing of each token over the
 * router's logits, then each expert's SwiGLU MLP down(silu(gate x) * up x) on the tokens
 * routed to it, summed per token with the routing weights. No Python here.
 *
 * The experts' matrices are passed as one pointer per expert (ellm_expert_stack), so
 * GGUF's stacked 3-D tensors, Hugging Face's per-expert tensors and row slices of a
 * fused gate_up tensor all work without copying. Tokens are grouped per expert here (a
 * counting sort, stable in token order) and each expert's group runs through the
 * linear-layer driver (matmul.h) on the weights as they lie in the file.
 *
 * Batch invariance: a token's output depends only on its own row of X and of the router
 * logits. Its top-k choice is a per-row computation; each expert's matmuls give a row
 * the same bits whatever the group holds (matmul.h); and the token's k expert outputs
 * are summed in one fixed order (ascending expert id), each scaled by its weight. */
#ifndef ELLM_MOE_H
#define ELLM_MOE_H
#include <stddef.h>
#include <stdint.h>

/* k (experts per token) at most this: a token's k choices are sorted on the stack. */
#define ELLM_MOE_MAX_TOPK 64

/* Routing: logits (T, E) f32 -> ids (T, k) int32, weights (T, k) f32 for each token's k
 * most probable experts, highest first (ties: the lower id first). Probabilities are
 * softmax(logits) in f32; with norm_topk they are divided by the sum of the k chosen.
 * Returns ELLM_OK, or ELLM_E_SHAPE when 1 <= k <= min(E, ELLM_MOE_MAX_TOPK) fails. */
int ellm_moe_route(const float *logits, int64_t T, int32_t E, int32_t k, int norm_topk, int32_t *ids,
                   float *weights);

/* E weight matrices of one GGML type and shape, one pointer each:
 * w[e] -> (N, ellm_row_bytes(qtype, K)) rows of expert e. */
typedef struct {
    int qtype;
    int64_t N, K;
    const uint8_t *const *w; /* (E,) */
} ellm_expert_stack;

/* Scratch bytes ellm_moe_experts needs for T tokens with k of E experts each (64-byte
 * aligned), given the same max_pass; 0 for invalid arguments (ellm_moe_experts then
 * reports them). */
size_t ellm_moe_scratch_bytes(const ellm_expert_stack *gate, const ellm_expert_stack *up,
                              const ellm_expert_stack *down, int64_t T, int32_t k, int32_t E, int64_t max_pass);

/* out (T, H) = sum over j < k, in ascending ids[t][j], of
 *     weights[t][j] * down[e] . (silu(gate[e] . x_t) * (up[e] . x_t)),  e = ids[t][j].
 * x (T, H) f32; ids (T, k) in [0, E), distinct within a row; gate, up: (E) x (F, H);
 * down: (E) x (H, F). out must not overlap x. The tokens go through in passes of at most
 * max_pass tokens (0: as many as a bound on the scratch allows, moe.c pass_tokens), which
 * changes no bit of out. Checks every shape and id before anything runs; returns ELLM_OK
 * or an ellm_status code (quant.h). Safe without the GIL. */
int ellm_moe_experts(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *weights,
                     int32_t k, int32_t E, const ellm_expert_stack *gate, const ellm_expert_stack *up,
                     const ellm_expert_stack *down, float *out, void *scratch, size_t scratch_bytes,
                     int64_t max_pass);

#endif
