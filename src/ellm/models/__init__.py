"""One module per architecture family; `build_model` picks the family from the config."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..weights import WeightSource


def build_model(config: ModelConfig, weights: WeightSource, ops: Any) -> Any:
    if config.model_type == "llama":
        from .llama import LlamaModel
        return LlamaModel(config, weights, ops)
    if config.is_gemma:
        from .gemma import GemmaModel
        return GemmaModel(config, weights, ops)
    raise ValueError(f"no model for model_type {config.model_type!r}")
