"""The SmolLM3 family: Llama with NoPE layers (no rotary embedding on every
`no_rope_layer_interval`-th layer, or where `no_rope_layers` says 0).

transformers' rule: no_rope_layers[i] = int((i + 1) % interval != 0), so with interval 4
layers 3, 7, 11, ... skip RoPE; when `use_sliding_window`, the NoPE layers slide. llama.cpp's
converter writes no interval, and llama.cpp always uses 4: a GGUF means interval 4.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ConfigError, GGUFMeta, ModelConfig, check_layer_types, check_window, layer_types_window
from ..weights import WeightSource
from .blocks import Decoder, embedding_and_head, load_norm, standard_layers

GGUF_TENSORS: list[tuple[str, str]] = []   # the common names


@dataclass
class Args(ModelConfig):
    use_sliding_window: bool = False
    sliding_window: int | None = None
    no_rope_layers: list[int] | None = None   # per layer: 1 uses RoPE, 0 does not
    no_rope_layer_interval: int = 4
    layer_types: list[str] | None = None

    gguf_architectures = ("smollm3",)

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.num_hidden_layers
        if self.no_rope_layer_interval <= 0:
            raise ConfigError(f"no_rope_layer_interval must be positive, got {self.no_rope_layer_interval}")
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(n)]
        if len(self.no_rope_layers) != n or any(v not in (0, 1) for v in self.no_rope_layers):
            raise ConfigError(f"no_rope_layers must be {n} entries of 0 or 1, got {self.no_rope_layers}")
        check_window(self.sliding_window)
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if self.use_sliding_window and self.sliding_window
                                and not self.no_rope_layers[i] else "full_attention" for i in range(n)]
        check_layer_types(self.layer_types, n)

    def layer_window(self, layer: int) -> int:
        return layer_types_window(layer, self.layer_types,
                                  self.sliding_window if self.use_sliding_window else None)

    def inv_freq(self, layer: int) -> np.ndarray:
        inv = super().inv_freq(layer)
        assert self.no_rope_layers is not None   # __post_init__ fills it in
        return inv if self.no_rope_layers[layer] else np.zeros_like(inv)   # zeros: RoPE is the identity

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "nope_layers": [i for i, r in enumerate(self.no_rope_layers or []) if not r]}

    @classmethod
    def gguf_kwargs(cls, meta: GGUFMeta, kwargs: dict[str, Any]) -> None:
        kwargs["rope_interleaved"] = True      # llama.cpp permutes Q/K as for Llama
        kwargs["no_rope_layer_interval"] = 4   # what llama.cpp assumes; the file does not say


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        embed, lm_head = embedding_and_head(weights, config)
        super().__init__(config, ops, embed, lm_head, standard_layers(weights, config),
                         load_norm(weights, "model.norm.weight", config.hidden_size))
