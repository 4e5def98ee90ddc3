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
from ..ops.workspace import Workspace
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
        self.ws = Workspace()
        self.recorder = None   # a trace.Recorder while `ellm trace` / inspect runs this model
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
        """-> logits (len(batch.logits_rows), vocab) float32, a workspace view that stays
        valid until the next forward."""
        c, ops, ws = self.config, self.ops, self.ws
        t, r = len(batch.token_ids), len(batch.logits_rows)
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        H, F, eps = c.hidden_size, c.intermediate_size, c.rms_norm_eps
        q, k, v = ws.get("q", t, nh * hd), ws.get("k", t, nkv * hd), ws.get("v", t, nkv * hd)
        gate, up, act = ws.get("gate", t, F), ws.get("up", t, F), ws.get("act", t, F)
        attn, proj = ws.get("attn", t, nh, hd), ws.get("proj", t, H)
        residual = ops.embed(self.embed, batch.token_ids, out=ws.get("residual", t, H))   # (T, H)
        ops.scale(residual, self.embed_scale)
        rec = self.recorder
        if rec is not None:
            rec(None, "embed", residual)
        h = ops.rmsnorm(residual, self.layers[0].input_norm, eps, out=ws.get("h", t, H))
        for i, layer in enumerate(self.layers):
            ops.linear_multi(h, [(layer.q, q), (layer.k, k), (layer.v, v)])
            if rec is not None:
                rec(i, "attn_norm", h), rec(i, "q", q), rec(i, "k", k), rec(i, "v", v)
            q3, k3, v3 = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
            if layer.q_norm is not None:   # per-head norms, in place
                ops.rmsnorm(q3, layer.q_norm, eps, out=q3)
                ops.rmsnorm(k3, layer.k_norm, eps, out=k3)
                if rec is not None:
                    rec(i, "q_norm", q3), rec(i, "k_norm", k3)
            k_cache, v_cache = kv.layer(i)
            ops.rope_attention(q3, k3, v3, batch.positions, batch.seq_ids,
                               batch.block_tables[layer.window], k_cache, v_cache,
                               layer.inv_freq, c.rope_interleaved, c.attention_scale,
                               layer.window, c.attn_logit_softcapping or 0.0, out=attn)
            if rec is not None:
                rec.attention(i, q3, k_cache, v_cache, batch.block_tables[layer.window], layer.inv_freq,
                              c.rope_interleaved, c.attention_scale, layer.window,
                              c.attn_logit_softcapping or 0.0)
                rec(i, "attn", attn)
            ops.linear(attn.reshape(t, nh * hd), layer.o, out=proj)
            if rec is not None:
                rec(i, "o_proj", proj)
            if layer.post_attn_norm is not None:
                ops.rmsnorm(proj, layer.post_attn_norm, eps, out=proj)
                if rec is not None:
                    rec(i, "post_attn_norm", proj)
            ops.add_rmsnorm(residual, proj, layer.pre_ffn_norm, eps, out=h)
            ops.linear_multi(h, [(layer.gate, gate), (layer.up, up)])
            ops.geglu(gate, up, out=act)
            if rec is not None:
                rec(i, "resid_attn", residual), rec(i, "mlp_norm", h)
                rec(i, "gate", gate), rec(i, "up", up), rec(i, "act", act)
            ops.linear(act, layer.down, out=proj)
            if rec is not None:
                rec(i, "down", proj)
            if layer.post_ffn_norm is not None:
                ops.rmsnorm(proj, layer.post_ffn_norm, eps, out=proj)
                if rec is not None:
                    rec(i, "post_mlp_norm", proj)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            ops.add_rmsnorm(residual, proj, next_norm, eps, out=h)
            if rec is not None:
                rec(i, "resid_mlp", residual)
        if rec is not None:
            rec(None, "final_norm", h)
        if r != t:
            h = np.take(h, batch.logits_rows, axis=0, out=ws.get("rows", r, H))
        logits = ops.linear(h, self.lm_head, out=ws.get("logits", r, c.vocab_size))
        return ops.softcap(logits, c.final_logit_softcapping or 0.0)
