"""The architecture registry: Hugging Face `model_type` -> the module of its family.

Each family module (`models/<family>.py`) holds `Args` (a ModelConfig subclass in Hugging
Face field names, with its GGUF metadata mapping), `GGUF_TENSORS` (llama.cpp tensor names
that differ from the common ones in blocks.py), optionally `sanitize` (weight-name fixes),
`CHAT_TEMPLATE` (for files that carry none) and `GGUF_VOCAB_STYLE`, and `Model` (its
forward pass, composed of blocks). Adding a family is adding its file and a line here.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

from ..config import ConfigError, GGUFMeta, ModelConfig, config_in_file, read_config_json
from ..weights import GGUFWeights, WeightSource
from .blocks import gguf_tensor_table

# model_type -> module name under ellm.models
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",       # Llama with a sliding window on every layer
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3_text": "gemma",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "granite": "granite",
    "phi3": "phi3",
    "qwen3_moe": "qwen3_moe",
    "smolvlm": "smolvlm",     # SmolVLM / SmolVLM2: SigLIP + pixel-shuffle connector + Llama
    "idefics3": "smolvlm",
}
# Other names for a model_type (wrappers whose text model is one of the above).
ALIASES: dict[str, str] = {
    "gemma3": "gemma3_text",  # Gemma3ForConditionalGeneration: its text_config is read
}


def supported_model_types() -> list[str]:
    return sorted(set(FAMILIES) | set(ALIASES))


def family_for_model_type(model_type: Any) -> ModuleType:
    """The family module of a config.json model_type; a ConfigError listing the supported ones."""
    if model_type is None:
        raise ConfigError("config.json has no model_type")
    name = ALIASES.get(str(model_type), str(model_type))
    if name not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r} (supported: {', '.join(supported_model_types())})")
    return importlib.import_module(f"{__name__}.{FAMILIES[name]}")


def _families() -> list[ModuleType]:
    return [importlib.import_module(f"{__name__}.{m}") for m in dict.fromkeys(FAMILIES.values())]


def family_for_gguf(arch: str) -> ModuleType:
    """The family module reading GGUF files of `general.architecture` arch."""
    named = FAMILIES.get(ALIASES.get(arch, arch))
    if named is not None:   # most architectures are read by the family of their name:
        module = importlib.import_module(f"{__name__}.{named}")   # import that one alone
        if arch in module.Args.gguf_architectures:
            return module
    for module in _families():
        if arch in module.Args.gguf_architectures:
            return module
    names = sorted(a for m in _families() for a in m.Args.gguf_architectures)
    raise ConfigError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(names)})")


def config_from_dict(raw: Any, generation: dict[str, Any] | None = None) -> ModelConfig:
    """The config of config.json's contents, built by the family its model_type names."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    return family_for_model_type(raw.get("model_type")).Args.from_dict(raw, generation)


def config_from_folder(folder: str | Path) -> ModelConfig:
    """The config of a Hugging Face folder (config.json + generation_config.json)."""
    raw, generation = read_config_json(folder)
    return config_in_file(folder, lambda: config_from_dict(raw, generation))


def config_from_gguf(gguf: Any) -> ModelConfig:
    """The config of a GGUFFile, built by the family of its `general.architecture`."""
    meta = GGUFMeta(gguf)
    try:
        family = family_for_gguf(meta.arch)
    except ConfigError as e:
        raise ConfigError(f"{gguf.path}: {e}") from None
    return family.Args.from_gguf(gguf)


def gguf_weights(gguf: Any) -> GGUFWeights:
    """A GGUFFile's tensors under Hugging Face names, by its family's llama.cpp name table."""
    family = family_for_gguf(str(gguf.metadata.get("general.architecture", "")))
    return GGUFWeights(gguf, gguf_tensor_table(getattr(family, "GGUF_TENSORS", ())))


def family_of(config: ModelConfig) -> ModuleType:
    return family_for_model_type(config.model_type)


def builtin_chat_template(architecture: str | None) -> str | None:
    """A family's own chat template for files that carry none (a model_type or a GGUF
    architecture name), or None."""
    if not architecture:
        return None
    name = ALIASES.get(architecture, architecture)
    try:
        module = family_for_model_type(name) if name in FAMILIES else family_for_gguf(name)
    except ConfigError:
        return None
    return getattr(module, "CHAT_TEMPLATE", None)


def build_model(config: ModelConfig, weights: WeightSource, ops: Any) -> Any:
    family = family_of(config)
    sanitize = getattr(family, "sanitize", None)
    if sanitize is not None:
        weights = weights.renamed(sanitize)
    model = family.Model(config, weights, ops)
    model.upload_weights()   # the backend's copy of every weight (host backends: the same arrays)
    return model
