"""The Llama family (Llama 2/3, TinyLlama, SmolLM2) and Mistral: pre-norm decoder, RoPE,
GQA, SwiGLU.

Mistral is Llama with `sliding_window` applied on every layer (transformers' Mistral has
no per-layer kinds). llama.cpp writes Mistral files as plain `llama` without the window,
so a GGUF of either is read as Llama, with its Q/K rows permuted for interleaved RoPE.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..config import GGUFMeta, ModelConfig, check_window
from ..weights import WeightSource
from .blocks import Decoder, embedding_and_head, load_norm, standard_layers

GGUF_TENSORS: list[tuple[str, str]] = []   # the common names


@dataclass
class Args(ModelConfig):
    sliding_window: int | None = None      # Mistral only

    gguf_architectures: ClassVar[tuple[str, ...]] = ("llama",)   # any number: SmolVLM, a subclass, has none

    def __post_init__(self) -> None:
        super().__post_init__()
        check_window(self.sliding_window)

    def layer_window(self, layer: int) -> int:
        return (self.sliding_window or 0) if self.model_type == "mistral" else 0

    @classmethod
    def gguf_kwargs(cls, meta: GGUFMeta, kwargs: dict[str, Any]) -> None:
        kwargs["rope_interleaved"] = True
        if meta.raw("rope.scaling.type") == "linear":
            kwargs["rope_scaling"] = {"rope_type": "linear", "factor": meta.float("rope.scaling.factor", 1.0)}
        if "rope_freqs.weight" in meta.tensors:  # llama-3 scaling baked into per-frequency divisors
            kwargs["rope_scaling"] = {"rope_type": "gguf_freq_factors"}


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        embed, lm_head = embedding_and_head(weights, config)
        layers = standard_layers(weights, config)
        if "rope_freqs.weight" in weights:
            factors = weights.vector("rope_freqs.weight")
            for layer in layers:
                layer.attn.inv_freq = (layer.attn.inv_freq / factors).astype(np.float32)
        super().__init__(config, ops, embed, lm_head, layers,
                         load_norm(weights, "model.norm.weight", config.hidden_size))
