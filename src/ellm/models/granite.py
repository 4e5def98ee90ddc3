"""The Granite family (IBM Granite 3.x dense): Llama with four multipliers — on the
embeddings, on each block's output before the residual add, as the attention scale
(instead of 1/sqrt(head_dim)), and a divisor on the logits."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, GGUFMeta, ModelConfig
from ..weights import WeightSource
from .blocks import Decoder, embedding_and_head, load_norm, standard_layers

GGUF_TENSORS: list[tuple[str, str]] = []   # the common names


@dataclass
class Args(ModelConfig):
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0

    gguf_architectures = ("granite",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logits_scaling == 0:
            raise ConfigError("logits_scaling must not be 0")

    @property
    def attention_scale(self) -> float:
        return self.attention_multiplier

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "multipliers": {
            "embedding": self.embedding_multiplier, "residual": self.residual_multiplier,
            "attention": self.attention_multiplier, "logits_divisor": self.logits_scaling}}

    @classmethod
    def gguf_kwargs(cls, meta: GGUFMeta, kwargs: dict[str, Any]) -> None:
        kwargs["rope_interleaved"] = True   # llama.cpp permutes Q/K as for Llama
        for field, key in (("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
                           ("attention_multiplier", "attention.scale"), ("logits_scaling", "logit_scale")):
            if meta.has(key):
                kwargs[field] = meta.float(key)
        if not kwargs.get("attention_multiplier"):   # llama.cpp: absent or 0 means 1/sqrt(head_dim)
            kwargs["attention_multiplier"] = kwargs["head_dim"] ** -0.5
        for field in ("embedding_multiplier", "residual_multiplier"):   # absent or 0: not applied
            if not kwargs.get(field):
                kwargs[field] = 1.0


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        c = config
        embed, lm_head = embedding_and_head(weights, c)
        layers = standard_layers(weights, c)
        for layer in layers:
            layer.residual_multiplier = c.residual_multiplier
        super().__init__(c, ops, embed, lm_head, layers, load_norm(weights, "model.norm.weight", c.hidden_size),
                         embed_scale=c.embedding_multiplier, logits_scale=1.0 / c.logits_scaling)
