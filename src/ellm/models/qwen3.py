"""The Qwen3 family (dense): Qwen2's layout without the q/k/v bias, with RMSNorm on q and
k per head before RoPE, and a head_dim of its own (not hidden_size / heads)."""
from __future__ import annotations

from typing import Any

from ..weights import WeightSource
from . import qwen2
from .blocks import Decoder, embedding_and_head, load_norm, standard_layers

GGUF_TENSORS: list[tuple[str, str]] = []   # the common names (attn_q_norm / attn_k_norm)


class Args(qwen2.Args):
    gguf_architectures = ("qwen3",)


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        c, layers = config, []
        embed, lm_head = embedding_and_head(weights, c)
        layers = standard_layers(weights, c)
        for i, layer in enumerate(layers):
            p = f"model.layers.{i}.self_attn."
            layer.attn.q_norm = load_norm(weights, p + "q_norm.weight", c.head_dim)
            layer.attn.k_norm = load_norm(weights, p + "k_norm.weight", c.head_dim)
        super().__init__(c, ops, embed, lm_head, layers, load_norm(weights, "model.norm.weight", c.hidden_size))
