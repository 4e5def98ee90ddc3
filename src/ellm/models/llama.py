"""The Llama family (Llama 2/3, TinyLlama, SmolLM2): pre-norm decoder, RoPE, GQA, SwiGLU.

forward(batch, kv) runs every token of the batch through the layers, writes their K/V
into the paged cache and returns logits for batch.logits_rows. Prefill and decode are the
same call; decode is just a batch of one token per sequence.
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
class LlamaLayer:
    input_norm: np.ndarray   # (H,)
    q: Linear                # (nh*hd, H)
    k: Linear                # (nkv*hd, H)
    v: Linear                # (nkv*hd, H)
    o: Linear                # (H, nh*hd)
    post_attn_norm: np.ndarray  # (H,)
    gate: Linear             # (F, H)
    up: Linear               # (F, H)
    down: Linear             # (H, F)
    inv_freq: np.ndarray     # (hd/2,)
    window: int


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: WeightSource, ops: Any) -> None:
        self.config, self.ops = config, ops
        self.ws = Workspace()
        self.recorder = None   # a trace.Recorder while `ellm trace` / inspect runs this model
        c = config
        self.embed = weights.linear("model.embed_tokens.weight")
        self.norm = weights.vector("model.norm.weight")
        if "lm_head.weight" in weights and not c.tie_word_embeddings:
            self.lm_head = weights.linear("lm_head.weight")
        else:
            self.lm_head = self.embed
        freq_factors = weights.vector("rope_freqs.weight") if "rope_freqs.weight" in weights else None
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            inv_freq = c.inv_freq(i)
            if freq_factors is not None:
                inv_freq = (inv_freq / freq_factors).astype(np.float32)
            self.layers.append(LlamaLayer(
                input_norm=weights.vector(p + "input_layernorm.weight"),
                q=weights.linear(p + "self_attn.q_proj.weight"),
                k=weights.linear(p + "self_attn.k_proj.weight"),
                v=weights.linear(p + "self_attn.v_proj.weight"),
                o=weights.linear(p + "self_attn.o_proj.weight"),
                post_attn_norm=weights.vector(p + "post_attention_layernorm.weight"),
                gate=weights.linear(p + "mlp.gate_proj.weight"),
                up=weights.linear(p + "mlp.up_proj.weight"),
                down=weights.linear(p + "mlp.down_proj.weight"),
                inv_freq=inv_freq,
                window=c.layer_window(i),
            ))
        self._check_shapes()

    def _check_shapes(self) -> None:
        c = self.config
        want = {"q": (c.num_attention_heads * c.head_dim, c.hidden_size),
                "k": (c.num_key_value_heads * c.head_dim, c.hidden_size),
                "v": (c.num_key_value_heads * c.head_dim, c.hidden_size),
                "o": (c.hidden_size, c.num_attention_heads * c.head_dim),
                "gate": (c.intermediate_size, c.hidden_size),
                "up": (c.intermediate_size, c.hidden_size),
                "down": (c.hidden_size, c.intermediate_size)}
        for i, layer in enumerate(self.layers):
            for attr, shape in want.items():
                w: Linear = getattr(layer, attr)
                if (w.out_features, w.in_features) != shape:
                    raise ValueError(f"layer {i} {attr}: weight is {(w.out_features, w.in_features)}, "
                                     f"config says {shape}")
        if (self.embed.out_features, self.embed.in_features) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embedding is {(self.embed.out_features, self.embed.in_features)}, "
                             f"config says {(c.vocab_size, c.hidden_size)}")

    def forward(self, batch: Batch, kv: Any) -> np.ndarray:
        """-> logits (len(batch.logits_rows), vocab) float32, a workspace view that stays
        valid until the next forward."""
        c, ops, ws = self.config, self.ops, self.ws
        t, r = len(batch.token_ids), len(batch.logits_rows)
        nh, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        H, F = c.hidden_size, c.intermediate_size
        q, k, v = ws.get("q", t, nh * hd), ws.get("k", t, nkv * hd), ws.get("v", t, nkv * hd)
        gate, up, act = ws.get("gate", t, F), ws.get("up", t, F), ws.get("act", t, F)
        attn, proj = ws.get("attn", t, nh, hd), ws.get("proj", t, H)
        rec = self.recorder
        residual = ops.embed(self.embed, batch.token_ids, out=ws.get("residual", t, H))   # (T, H)
        if rec is not None:
            rec(None, "embed", residual)
        h = ops.rmsnorm(residual, self.layers[0].input_norm, c.rms_norm_eps, out=ws.get("h", t, H))
        for i, layer in enumerate(self.layers):
            ops.linear_multi(h, [(layer.q, q), (layer.k, k), (layer.v, v)])
            k_cache, v_cache = kv.layer(i)
            if rec is not None:
                rec(i, "attn_norm", h), rec(i, "q", q), rec(i, "k", k), rec(i, "v", v)
            ops.rope_attention(q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd),
                               batch.positions, batch.seq_ids, batch.block_tables[layer.window],
                               k_cache, v_cache, layer.inv_freq, c.rope_interleaved, c.attention_scale,
                               layer.window, 0.0, out=attn)                         # (T, nh, hd)
            if rec is not None:
                rec.attention(i, q.reshape(t, nh, hd), k_cache, v_cache, batch.block_tables[layer.window],
                              layer.inv_freq, c.rope_interleaved, c.attention_scale, layer.window, 0.0)
                rec(i, "attn", attn)
            ops.linear(attn.reshape(t, nh * hd), layer.o, out=proj)
            if rec is not None:
                rec(i, "o_proj", proj)
            ops.add_rmsnorm(residual, proj, layer.post_attn_norm, c.rms_norm_eps, out=h)
            ops.linear_multi(h, [(layer.gate, gate), (layer.up, up)])
            ops.swiglu(gate, up, out=act)
            if rec is not None:
                rec(i, "resid_attn", residual), rec(i, "mlp_norm", h)
                rec(i, "gate", gate), rec(i, "up", up), rec(i, "act", act)
            ops.linear(act, layer.down, out=proj)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            ops.add_rmsnorm(residual, proj, next_norm, c.rms_norm_eps, out=h)
            if rec is not None:
                rec(i, "down", proj), rec(i, "resid_mlp", residual)
        if rec is not None:
            rec(None, "final_norm", h)
        if r != t:
            h = np.take(h, batch.logits_rows, axis=0, out=ws.get("rows", r, H))
        return ops.linear(h, self.lm_head, out=ws.get("logits", r, c.vocab_size))
