"""The OLMo 2 family: norms after attention and after the MLP (none before them), and
RMSNorm on q and k over the whole projection (all heads at once) before RoPE."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..weights import WeightSource
from .blocks import Decoder, DecoderLayer, embedding_and_head, load_attention, load_mlp, load_norm

GGUF_TENSORS: list[tuple[str, str]] = []   # the common names (post_attention_norm, post_ffw_norm)


class Args(ModelConfig):
    gguf_architectures = ("olmo2",)


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        c, H, layers = config, config.hidden_size, []
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        embed, lm_head = embedding_and_head(weights, c)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layers.append(DecoderLayer(
                attn=load_attention(weights, c, i, qk_norm_whole=True,
                                    q_norm=load_norm(weights, p + "self_attn.q_norm.weight", q_size),
                                    k_norm=load_norm(weights, p + "self_attn.k_norm.weight", kv_size)),
                mlp=load_mlp(weights, c, p + "mlp."),
                input_norm=None, pre_mlp_norm=None,
                post_attn_norm=load_norm(weights, p + "post_attention_layernorm.weight", H),
                post_mlp_norm=load_norm(weights, p + "post_feedforward_layernorm.weight", H)))
        super().__init__(c, ops, embed, lm_head, layers, load_norm(weights, "model.norm.weight", H))
