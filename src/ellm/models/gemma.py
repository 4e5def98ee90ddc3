"""The Gemma family (Gemma 1, 2 and 3 text models).

What sets it apart from Llama: embeddings scaled by sqrt(hidden_size); RMSNorm weights
used as (1 + w); GeGLU (tanh GELU) MLP; attention scaled by query_pre_attn_scalar;
Gemma 2/3 add a norm after attention and after the MLP, interleave sliding-window and
global layers with their own RoPE bases, and soft-cap logits (Gemma 2); Gemma 3 normalises
q and k per head. The switches come from the config and from which weights exist.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..weights import Linear, WeightSource
from .batch import Batch


@dataclass
class GemmaLayer:
    input_norm: np.ndarray             # (H,), the +1 already added
    q: Linear                          # (nh*hd, H)
    k: Linear                          # (nkv*hd, H)
    v: Linear                          # (nkv*hd, H)
    o: Linear                          # (H, nh*hd)
    q_norm: np.ndarray | None          # (hd,)  Gemma 3
    k_norm: np.ndarray | None          # (hd,)  Gemma 3
    post_attn_norm: np.ndarray | None  # (H,)   Gemma 2/3
    pre_ffn_norm: np.ndarray           # (H,)
    post_ffn_norm: np.ndarray | None   # (H,)   Gemma 2/3
    gate: Linear                       # (F, H)
    up: Linear                         # (F, H)
    down: Linear                       # (H, F)
    inv_freq: np.ndarray               # (hd/2,)
    window: int


class GemmaModel:
    def __init__(self, config: ModelConfig, weights: WeightSource, ops: Any) -> None:
        self.config, self.ops = config, ops
        c = config
        offset = np.float32(0.0 if weights.norm_weights_include_one else 1.0)

        def norm(name: str) -> np.ndarray:
            return (weights.vector(name) + offset).astype(np.float32)

        def maybe_norm(name: str) -> np.ndarray | None:
            return norm(name) if name in weights else None

        self.embed = weights.linear("model.embed_tokens.weight")
        self.lm_head = weights.linear("lm_head.weight") if (
            "lm_head.weight" in weights and not c.tie_word_embeddings) else self.embed
        self.norm = norm("model.norm.weight")
        self.embed_scale = float(np.float32(c.hidden_size ** 0.5))
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            has_pre_ffn = p + "pre_feedforward_layernorm.weight" in weights
            self.layers.append(GemmaLayer(
                input_norm=norm(p + "input_layernorm.weight"),
                q=weights.linear(p + "self_attn.q_proj.weight"),
                k=weights.linear(p + "self_attn.k_proj.weight"),
                v=weights.linear(p + "self_attn.v_proj.weight"),
                o=weights.linear(p + "self_attn.o_proj.weight"),
                q_norm=maybe_norm(p + "self_attn.q_norm.weight"),
                k_norm=maybe_norm(p + "self_attn.k_norm.weight"),
                # Gemma 1 has one norm before the MLP, named post_attention_layernorm.
                post_attn_norm=maybe_norm(p + "post_attention_layernorm.weight") if has_pre_ffn else None,
                pre_ffn_norm=norm(p + ("pre_feedforward_layernorm.weight" if has_pre_ffn
                                       else "post_attention_layernorm.weight")),
                post_ffn_norm=maybe_norm(p + "post_feedforward_layernorm.weight"),
                gate=weights.linear(p + "mlp.gate_proj.weight"),
                up=weights.linear(p + "mlp.up_proj.weight"),
                down=weights.linear(p + "mlp.down_proj.weight"),
                inv_freq=c.inv_freq(i),
                window=c.layer_window(i),
            ))

    def forward(self, batch: Batch, kv: Any) -> np.ndarray:
        """-> logits (len(batch.logits_rows), vocab) float32."""
        c, ops = self.config, self.ops
        t = len(batch.token_ids)
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps = c.rms_norm_eps
        residual = ops.scale(ops.embed(self.embed, batch.token_ids), self.embed_scale)   # (T, H)
        h = ops.rmsnorm(residual, self.layers[0].input_norm, eps)
        for i, layer in enumerate(self.layers):
            q = ops.linear(h, layer.q).reshape(t, nh, hd)
            k = ops.linear(h, layer.k).reshape(t, nkv, hd)
            v = ops.linear(h, layer.v).reshape(t, nkv, hd)
            if layer.q_norm is not None:
                q = ops.rmsnorm(q, layer.q_norm, eps)
                k = ops.rmsnorm(k, layer.k_norm, eps)
            k_cache, v_cache = kv.layer(i)
            attn = ops.rope_attention(q, k, v, batch.positions, batch.seq_ids,
                                      batch.block_tables[layer.window], k_cache, v_cache,
                                      layer.inv_freq, c.rope_interleaved, c.attention_scale,
                                      layer.window, c.attn_logit_softcapping or 0.0)
            o = ops.linear(attn.reshape(t, nh * hd), layer.o)
            if layer.post_attn_norm is not None:
                o = ops.rmsnorm(o, layer.post_attn_norm, eps)
            h = ops.add_rmsnorm(residual, o, layer.pre_ffn_norm, eps)
            m = ops.geglu(ops.linear(h, layer.gate), ops.linear(h, layer.up))
            d = ops.linear(m, layer.down)
            if layer.post_ffn_norm is not None:
                d = ops.rmsnorm(d, layer.post_ffn_norm, eps)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            h = ops.add_rmsnorm(residual, d, next_norm, eps)
        rows = h if len(batch.logits_rows) == t else np.ascontiguousarray(h[batch.logits_rows])
        logits = ops.linear(rows, self.lm_head)
        return ops.softcap(logits, c.final_logit_softcapping or 0.0)
