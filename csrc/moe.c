/* Mixture-of-experts: routing, grouping tokens per expert, the per-expert SwiGLU
 * matmuls through the linear-layer driver, and the weighted sum per token (moe.h).
 *
 * Tokens go through in passes (pass_tokens), so the scratch stays bounded for
 * long prefills; a pass's tokens are laid out expert after expert (each expert's rows in
 * token order), and the experts with rows run as the groups of one ellm_linear_groups
 * call for gate and up (each group's X quantized once) and one for down, so a layer wakes
 * the thread pool a few times, not twice per expert. The outputs are gathered back per
 * token. None of this changes a token's bits: see moe.h. */
#include "moe.h"

#include <math.h>
#include <string.h>

#include "elementwise.h"
#include "matmul.h"
#include "quant.h"
#include "threadpool.h"

/* Tokens per pass. A pass reads, and the tile kernels unpack, every expert with rows once
 * for that expert's rows of the pass, which at 8 of 128 experts are a sixteenth of its
 * tokens: the more a pass takes, the fewer times each expert is unpacked. So a call is one
 * pass where its scratch (k rows of 2 H + 2 F floats a token) stays within PASS_BYTES, else
 * passes of equal size within it, never fewer than MIN_PASS_TOKENS.
 * Qwen3-30B-A3B's shape (Q4_K_M, 2 threads, AMX, tokens spread over the experts as a
 * trained router spreads them): its block took 512 tokens (the engine's default prefill
 * chunk, 92 MB of scratch) in 132 ms in one pass against 187 in passes of 256, and 1,024
 * in 262 ms in one pass against 396 in passes of 512 (each pair in one process, alternated). */
#define PASS_BYTES ((int64_t)256 << 20)
#define MIN_PASS_TOKENS 256

/* max_pass > 0: at most that many (the caller's choice, as the tests make passes small). */
static int64_t pass_tokens(int64_t T, int32_t k, int64_t H, int64_t F, int64_t max_pass) {
    const int64_t per_token = (int64_t)k * (2 * H + 2 * F) * (int64_t)sizeof(float);
    int64_t most = per_token > 0 ? PASS_BYTES / per_token : T;
    if (most < MIN_PASS_TOKENS) most = MIN_PASS_TOKENS;
    if (max_pass > 0) most = max_pass;
    if (T <= most) return T;
    const int64_t passes = (T + most - 1) / most;
    return (T + passes - 1) / passes;
}
#define MAX_TOPK ELLM_MOE_MAX_TOPK

/* ==================================== routing ==================================== */

int ellm_moe_route(const float *logits, int64_t T, int32_t E, int32_t k, int norm_topk, int32_t *ids,
                   float *weights) {
    if (T < 0 || E < 1 || k < 1 || k > E || k > MAX_TOPK) return ELLM_E_SHAPE;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        int32_t *id = ids + t * k;
        float *w = weights + t * k;
        float mx = l[0];
        for (int32_t e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
        float sum = 0.0f;
        for (int32_t e = 0; e < E; e++) sum += expf(l[e] - mx);
        /* k passes of arg-max over the probabilities not taken yet (lowest id on ties);
         * a NaN logit makes every probability NaN, and then expert order decides */
        for (int32_t j = 0; j < k; j++) {
            int32_t best = -1;
            float bp = 0.0f;
            for (int32_t e = 0; e < E; e++) {
                int taken = 0;
                for (int32_t i = 0; i < j; i++) taken |= id[i] == e;
                if (taken) continue;
                const float p = expf(l[e] - mx) / sum;
                if (best < 0 || p > bp) {
                    best = e;
                    bp = p;
                }
            }
            id[j] = best;
            w[j] = bp;
        }
        if (norm_topk) {
            float s = 0.0f;
            for (int32_t j = 0; j < k; j++) s += w[j];
            for (int32_t j = 0; j < k; j++) w[j] /= s;
        }
    }
    return ELLM_OK;
}

/* =================================== validation =================================== */

static int check_stack(const ellm_expert_stack *s, int32_t E, int64_t N, int64_t K) {
    if (s == NULL || s->w == NULL) return ELLM_E_SHAPE;
    if (ellm_qtype_block_elems(s->qtype) == 0) return ELLM_E_TYPE;
    if (s->N != N || s->K != K || ellm_row_bytes(s->qtype, K) < 0) return ELLM_E_SHAPE;
    for (int32_t e = 0; e < E; e++)
        if (s->w[e] == NULL) return ELLM_E_SHAPE;
    return ELLM_OK;
}

/* ==================================== scratch ==================================== */

typedef struct {
    size_t slot, offs, groups, parts, xg, g, u, y, act, total, act_bytes; /* byte offsets, 64-aligned */
    int64_t pass;                                                          /* tokens a pass (pass_tokens) */
} moe_layout;

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Returns 0 on overflow or invalid shapes. */
static int layout(const ellm_expert_stack *gate, const ellm_expert_stack *up, const ellm_expert_stack *down,
                  int64_t T, int32_t k, int32_t E, int64_t max_pass, moe_layout *L) {
    memset(L, 0, sizeof *L);
    if (gate == NULL || up == NULL || down == NULL || T < 0 || k < 1 || E < 1 || E > ELLM_LINEAR_MAX_GROUPS)
        return 0;
    const int64_t H = gate->K, F = gate->N;
    if (H < 0 || F < 0) return 0;
    const int64_t tc = pass_tokens(T, k, H, F, max_pass), R = tc * k;
    L->pass = tc;
    if (R > ((int64_t)1 << 40) / (2 * H + 2 * F + 1)) return 0; /* far beyond any real call */
    ellm_linear_part gu[2] = {{gate->qtype, NULL, 0, F, NULL, F, NULL}, {up->qtype, NULL, 0, F, NULL, F, NULL}};
    ellm_linear_part dn[1] = {{down->qtype, NULL, 0, H, NULL, H, NULL}};
    const int groups = E < R ? E : (int)R; /* experts with rows in a pass */
    const size_t a1 = ellm_linear_groups_scratch_bound(gu, 2, groups, R, H);
    const size_t a2 = ellm_linear_groups_scratch_bound(dn, 1, groups, R, F);
    if (a1 == 0 || a2 == 0) return 0;
    size_t at = 0;
    L->slot = at;
    at = align64(at + sizeof(int32_t) * (size_t)R);
    L->offs = at;
    at = align64(at + sizeof(int64_t) * (size_t)(2 * E + 1));
    L->groups = at;
    at = align64(at + sizeof(ellm_linear_group) * (size_t)groups);
    L->parts = at;
    at = align64(at + sizeof(ellm_linear_part) * 2 * (size_t)groups);
    L->xg = at;
    at = align64(at + sizeof(float) * (size_t)(R * H));
    L->g = at;
    at = align64(at + sizeof(float) * (size_t)(R * F));
    L->u = at;
    at = align64(at + sizeof(float) * (size_t)(R * F));
    L->y = at;
    at = align64(at + sizeof(float) * (size_t)(R * H));
    L->act = at;
    L->act_bytes = a1 > a2 ? a1 : a2;
    L->total = at + L->act_bytes;
    return 1;
}

size_t ellm_moe_scratch_bytes(const ellm_expert_stack *gate, const ellm_expert_stack *up,
                              const ellm_expert_stack *down, int64_t T, int32_t k, int32_t E, int64_t max_pass) {
    moe_layout L;
    return max_pass >= 0 && layout(gate, up, down, T, k, E, max_pass, &L) ? L.total : 0;
}

/* ==================================== combine ==================================== */

typedef struct {
    const int32_t *ids;   /* (tc, k) */
    const float *weights; /* (tc, k) */
    const int32_t *slot;  /* (tc, k): each choice's row in y */
    const float *y;       /* (R, H) expert outputs, grouped by expert */
    float *out;           /* (tc, H) */
    int32_t k;
    int64_t H;
} combine_ctx;

/* out[t] = sum of the token's k weighted expert rows, in ascending expert id. */
static void task_combine(void *p, int64_t t0, int64_t t1, int tid) {
    const combine_ctx *c = p;
    const int32_t k = c->k;
    const int64_t H = c->H;
    for (int64_t t = t0; t < t1; t++) {
        int32_t order[MAX_TOPK];
        for (int32_t j = 0; j < k; j++) {
            int32_t i = j;
            while (i > 0 && c->ids[t * k + order[i - 1]] > c->ids[t * k + j]) {
                order[i] = order[i - 1];
                i--;
            }
            order[i] = j;
        }
        float *o = c->out + t * H;
        memset(o, 0, sizeof(float) * (size_t)H);
        for (int32_t i = 0; i < k; i++) {
            const int32_t j = order[i];
            const float w = c->weights[t * k + j];
            const float *yr = c->y + (int64_t)c->slot[t * k + j] * H;
            for (int64_t h = 0; h < H; h++) o[h] += w * yr[h];
        }
    }
}

/* ================================== entry point ================================== */

int ellm_moe_experts(const float *x, int64_t T, int64_t H, const int32_t *ids, const float *weights,
                     int32_t k, int32_t E, const ellm_expert_stack *gate, const ellm_expert_stack *up,
                     const ellm_expert_stack *down, float *out, void *scratch, size_t scratch_bytes,
                     int64_t max_pass) {
    if (T < 0 || H < 0 || k < 1 || k > MAX_TOPK || E < 1 || k > E || max_pass < 0) return ELLM_E_SHAPE;
    if (gate == NULL || up == NULL || down == NULL) return ELLM_E_SHAPE;
    const int64_t F = gate->N;
    int st;
    if ((st = check_stack(gate, E, F, H)) != ELLM_OK) return st;
    if ((st = check_stack(up, E, F, H)) != ELLM_OK) return st;
    if ((st = check_stack(down, E, H, F)) != ELLM_OK) return st;
    if (T == 0) return ELLM_OK;
    if (x == NULL || ids == NULL || weights == NULL || out == NULL) return ELLM_E_SHAPE;
    for (int64_t t = 0; t < T; t++)
        for (int32_t j = 0; j < k; j++) {
            const int32_t e = ids[t * k + j];
            if (e < 0 || e >= E) return ELLM_E_INDEX;
            for (int32_t i = 0; i < j; i++)
                if (ids[t * k + i] == e) return ELLM_E_INDEX; /* an expert twice for one token */
        }
    moe_layout L;
    if (!layout(gate, up, down, T, k, E, max_pass, &L)) return ELLM_E_SHAPE;
    if (scratch == NULL || scratch_bytes < L.total || ((uintptr_t)scratch & 63u)) return ELLM_E_SCRATCH;
    uint8_t *base = scratch;
    int32_t *slot = (int32_t *)(base + L.slot);
    int64_t *offs = (int64_t *)(base + L.offs), *cursor = offs + E + 1;
    float *xg = (float *)(base + L.xg), *g = (float *)(base + L.g), *u = (float *)(base + L.u);
    float *y = (float *)(base + L.y);
    void *act = base + L.act;
    ellm_linear_group *groups = (ellm_linear_group *)(base + L.groups);
    ellm_linear_part *parts = (ellm_linear_part *)(base + L.parts);
    const size_t gu_rb = (size_t)ellm_row_bytes(gate->qtype, H), up_rb = (size_t)ellm_row_bytes(up->qtype, H);
    const size_t dn_rb = (size_t)ellm_row_bytes(down->qtype, F);

    const int64_t pass = L.pass;
    for (int64_t c0 = 0; c0 < T; c0 += pass) {
        const int64_t tc = T - c0 < pass ? T - c0 : pass;
        const int32_t *cid = ids + c0 * k;
        /* counting sort of the chunk's (token, choice) pairs by expert, stable in token order */
        memset(offs, 0, sizeof(int64_t) * (size_t)(E + 1));
        for (int64_t i = 0; i < tc * k; i++) offs[cid[i] + 1]++;
        for (int32_t e = 0; e < E; e++) offs[e + 1] += offs[e];
        memcpy(cursor, offs, sizeof(int64_t) * (size_t)E);
        for (int64_t i = 0; i < tc * k; i++) {
            const int64_t r = cursor[cid[i]]++;
            slot[i] = (int32_t)r;
            memcpy(xg + r * H, x + (c0 + i / k) * H, sizeof(float) * (size_t)H);
        }
        /* gate and up of every expert with rows: one pass */
        int ng = 0;
        for (int32_t e = 0; e < E; e++) {
            const int64_t r0 = offs[e], n = offs[e + 1] - r0;
            if (n == 0) continue;
            parts[2 * ng] = (ellm_linear_part){gate->qtype, gate->w[e], gu_rb * (size_t)F, F, g + r0 * F, F, NULL};
            parts[2 * ng + 1] = (ellm_linear_part){up->qtype, up->w[e], up_rb * (size_t)F, F, u + r0 * F, F, NULL};
            groups[ng] = (ellm_linear_group){xg + r0 * H, n, parts + 2 * ng, 2};
            ng++;
        }
        if ((st = ellm_linear_groups(groups, ng, H, act, L.act_bytes)) != ELLM_OK) return st;
        const int64_t R = tc * k;
        ellm_swiglu(g, F, u, F, g, F, R, F);
        /* down of the same experts: one pass */
        ng = 0;
        for (int32_t e = 0; e < E; e++) {
            const int64_t r0 = offs[e], n = offs[e + 1] - r0;
            if (n == 0) continue;
            parts[ng] = (ellm_linear_part){down->qtype, down->w[e], dn_rb * (size_t)H, H, y + r0 * H, H, NULL};
            groups[ng] = (ellm_linear_group){g + r0 * F, n, parts + ng, 1};
            ng++;
        }
        if ((st = ellm_linear_groups(groups, ng, F, act, L.act_bytes)) != ELLM_OK) return st;
        combine_ctx cc = {cid, weights + c0 * k, slot, y, out + c0 * H, k, H};
        ellm_parallel_for(tc, 8, task_combine, &cc);
    }
    return ELLM_OK;
}
