"""The Qwen2 family (Qwen2, Qwen2.5): Llama with a bias on the q/k/v projections.

Its sliding window is off unless `use_sliding_window`; then it applies to the layers from
`max_window_layers` on (transformers' rule, unless config.json lists `layer_types`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import ModelConfig, check_layer_types, check_window, layer_types_window
from ..weights import WeightSource
from .blocks import Decoder, embedding_and_head, load_norm, standard_layers

GGUF_TENSORS: list[tuple[str, str]] = []   # the common names, biases included


@dataclass
class Args(ModelConfig):
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    gguf_architectures = ("qwen2",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.use_sliding_window:
            self.sliding_window = None
        check_window(self.sliding_window)
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if self.sliding_window and i >= self.max_window_layers
                                else "full_attention" for i in range(self.num_hidden_layers)]
        check_layer_types(self.layer_types, self.num_hidden_layers)

    def layer_window(self, layer: int) -> int:
        return layer_types_window(self, layer, self.layer_types, self.sliding_window)


class Model(Decoder):
    def __init__(self, config: Args, weights: WeightSource, ops: Any) -> None:
        embed, lm_head = embedding_and_head(weights, config)
        super().__init__(config, ops, embed, lm_head, standard_layers(weights, config),
                         load_norm(weights, "model.norm.weight", config.hidden_size))
