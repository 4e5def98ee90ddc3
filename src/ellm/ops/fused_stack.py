"""A decoder's layers run through the op set's fused ops (reference.FusedByComposition).

`FusedLayerStack` is what a backend's `layer_stack` may return (models/blocks.py
Decoder._layer_stack: every layer of a forward in one `run`, leaving `residual` and
`h_buf` as the one-op-at-a-time loop leaves them). Per standard layer it calls

    norm_qkv_rope_write   the input RMSNorm, q/k/v, RoPE, the paged KV write
    paged_attention       attention over the cache
    linear_add            o_proj, added into the residual
    norm_linear_glu       the pre-MLP RMSNorm, gate/up and the activation
    linear_add            down_proj, added into the residual

and once at the end the final RMSNorm into h_buf: the norm each layer's residual goes
through next is folded into the next product instead of a separate add + RMSNorm (the
first layer's input norm too: the decoder leaves the embeddings unnormed for it). A
decode forward whose every row gives logits passes the head instead (`run(..., head=)`):
the final norm is then folded into the vocabulary product too (one launch less a step). On
the cuda backend each of these is one kernel for decode batches (five launches a layer
in place of ten). Layers that need more take other ops for those pieces: with q/k norms
(Qwen3, Gemma 3, OLMo 2) q/k/v are norm_linear_multi, then qk_norm_rope_write (the norms,
RoPE and the KV write) and paged_attention; q/k/v of different weight types take
norm_linear_multi and rope_attention; a post-block norm or residual multiplier (Gemma 2/3,
OLMo 2, Granite) makes the block's product a plain one, then norm_add (the norm, the scale
and the add). A mixture-of-experts block (Qwen3-MoE) is norm_moe_add: its input norm, the
experts and the residual add (six kernels on cuda for decode, where the loop takes eight).

Only op-set calls: it runs on any backend, so tests/test_backends.py checks it on the
reference backend against the plain loop.
"""
from __future__ import annotations

from typing import Any


class FusedLayerStack:
    takes_adapters = False   # [lora] a batch naming adapters runs the layers one op at a time

    def __init__(self, ops: Any, specs: list[dict], t: int, hidden: int, residual: Any, proj: Any,
                 h_buf: Any, eps: float) -> None:
        self.ops, self.specs, self.t, self.eps = ops, specs, t, eps
        self.residual, self.proj, self.h_buf = residual, proj, h_buf
        self.final_norm = specs[-1]["next_norm"] if specs else None

    # the first layer's input norm goes into its products (it reads the embeddings unnormed),
    # the final norm into the vocabulary head's when run is given one (run(..., head=))
    folds_norms = True

    def run(self, positions: Any, seq_ids: Any, block_tables: dict, key_limit: Any = None,
            adapter_slots: Any = None, head: tuple | None = None) -> None:
        """adapter_slots: [lora] always None here (takes_adapters: the decoder runs a batch
        naming adapters layer by layer, ops.lora in between). head: (lm_head, logits (T, V))
        or (lm_head, logits, ids (T,)) for a forward whose every row gives logits: the final
        norm goes into the head's product (norm_linear_multi; with ids, norm_linear_greedy:
        each row's greedy token too), and h_buf is left as the last layer left it."""
        if adapter_slots is not None:
            raise ValueError("the fused layer stack runs no LoRA adapters: run such a batch layer by layer")
        ops, eps, residual, h_buf = self.ops, self.eps, self.residual, self.h_buf
        for s in self.specs:
            # the layer's input: the residual, its input norm folded into the products
            x, norm = residual, s["input_norm"]
            self._attention(s, x, norm, eps, positions, seq_ids, block_tables[s["window"]], key_limit)
            self._into_residual(s["attn_out"].reshape(self.t, -1), s["o"], s["post_attn_norm"],
                                s["residual_multiplier"])
            if s["moe"] is not None:
                self._moe(s)
                continue
            ops.norm_linear_glu(residual, s["pre_mlp_norm"], eps, s["gate"], s["up"], s["act"], out=s["act_out"])
            self._into_residual(s["act_out"], s["down"], s["post_mlp_norm"], s["residual_multiplier"])
        if head is not None:
            lm_head, logits, *ids = head
            if ids and ids[0] is not None:
                ops.norm_linear_greedy(residual, self.final_norm, eps, lm_head, logits, ids[0])
            elif self.final_norm is not None:
                ops.norm_linear_multi(residual, self.final_norm, eps, ((lm_head, logits),))
            else:
                ops.linear(residual, lm_head, out=logits)
        elif self.final_norm is not None:
            ops.rmsnorm(residual, self.final_norm, eps, out=h_buf)

    def _attention(self, s: dict, x: Any, norm: Any, eps: float, positions: Any, seq_ids: Any,
                   table: Any, key_limit: Any) -> None:
        ops, t = self.ops, self.t
        nh, nkv, hd = s["n_heads"], s["n_kv_heads"], s["head_dim"]
        q3 = s["q_out"].reshape(t, nh, hd)
        attn = s["attn_out"]
        one_type = s["q"].qtype == s["k"].qtype == s["v"].qtype
        if s["q_norm"] is None and one_type:
            ops.norm_qkv_rope_write(x, norm, eps, s["q"], s["k"], s["v"], hd, positions, seq_ids, table,
                                    s["k_cache"], s["v_cache"], s["inv_freq"], s["interleaved"],
                                    s["rope_mscale"], q_out=q3)
            ops.paged_attention(q3, positions, seq_ids, table, s["k_cache"], s["v_cache"], s["scale"],
                                s["window"], s["softcap"], key_limit, out=attn)
            return
        # q/k/v as models/blocks.py Attention makes them (h_buf free to hold the normed input)
        q, k, v = s["q_out"], s["k_out"], s["v_out"]
        ops.norm_linear_multi(x, norm, eps, ((s["q"], q), (s["k"], k), (s["v"], v)),
                              normed=None if norm is None else self.h_buf)
        k3, v3 = k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
        if s["q_norm"] is not None:   # the q/k norms with RoPE and the KV write: one op
            q_rot = ops.qk_norm_rope_write(q3, k3, v3, s["q_norm"], s["k_norm"], s["attn_eps"],
                                           s["qk_norm_whole"], positions, seq_ids, table, s["k_cache"],
                                           s["v_cache"], s["inv_freq"], s["interleaved"], s["rope_mscale"],
                                           q_out=s["q_rot"])
            ops.paged_attention(q_rot, positions, seq_ids, table, s["k_cache"], s["v_cache"], s["scale"],
                                s["window"], s["softcap"], key_limit, out=attn)
            return
        ops.rope_attention(q3, k3, v3, positions, seq_ids, table, s["k_cache"], s["v_cache"], s["inv_freq"],
                           s["interleaved"], s["scale"], s["window"], s["softcap"], out=attn,
                           rope_mscale=s["rope_mscale"], key_limit=key_limit)

    def _moe(self, s: dict) -> None:
        """The layer's mixture-of-experts block (s["moe"]: router, experts, top_k,
        norm_topk_prob) from the residual's pre-MLP norm into the residual."""
        ops, eps = self.ops, self.eps
        if s["post_mlp_norm"] is None and s["residual_multiplier"] == 1.0:
            ops.norm_moe_add(self.residual, s["pre_mlp_norm"], eps, *s["moe"], normed=self.h_buf, out=self.proj)
            return
        norm = s["pre_mlp_norm"]
        h = self.residual if norm is None else ops.rmsnorm(self.residual, norm, eps, out=self.h_buf)
        ops.moe(h, *s["moe"], out=self.proj)
        ops.norm_add(self.residual, self.proj, s["post_mlp_norm"], eps, s["residual_multiplier"])

    def _into_residual(self, x: Any, w: Any, post_norm: Any, multiplier: float) -> None:
        """residual += the block's output x @ W^T, through its post norm and multiplier."""
        ops = self.ops
        if post_norm is None and multiplier == 1.0:
            ops.linear_add(x, w, self.residual)
            return
        ops.linear(x, w, out=self.proj)
        ops.norm_add(self.residual, self.proj, post_norm, self.eps, multiplier)   # norm, scale and add: one op


def fused_layer_stack(ops: Any, specs: list[dict], t: int, hidden: int, residual: Any, proj: Any,
                      h_buf: Any, eps: float) -> FusedLayerStack | None:
    """A FusedLayerStack for these layers, or None (the decoder then runs them one by one)
    when a layer is not the pre-norm attention + gated MLP pair it knows."""
    if not specs or any(s["moe"] is None and s["act"] not in ("silu", "gelu_tanh") for s in specs):
        return None
    return FusedLayerStack(ops, specs, t, hidden, residual, proj, h_buf, eps)

