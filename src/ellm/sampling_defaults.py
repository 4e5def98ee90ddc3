"""The sampling settings a request gets when it does not choose them.

One rule for every entry point (the Python API, `ellm run`, `ellm chat`, the server): a
model's own recommendation wins, from its folder's generation_config.json or its GGUF
`general.sampling.*` metadata; a field the model does not set takes ellm's fallback
(FALLBACK below, the values the README's "Sampling defaults" table states). The fallback
leaves the model's distribution as it is (temperature 1, no truncation, no penalty), as
the OpenAI API, vLLM and transformers do when nothing is configured.

Like vLLM, a generation_config's `do_sample: false` is not read as "greedy": only the
numbers are taken. Values outside SamplingParams' ranges are dropped with a warning
naming the file and the field, and the fallback stands for them.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sampling_params import SamplingParams

log = logging.getLogger("ellm")

# The fields a model may recommend, and ellm's value for each when it does not.
FALLBACK: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,            # 0: off
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

# generation_config.json key -> SamplingParams field (the names already agree).
_HF_KEYS = {name: name for name in FALLBACK}
# GGUF metadata key (llama.cpp's names) -> SamplingParams field.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """The defaults one model's requests get; `sources` says where each came from
    ("generation_config.json", "gguf" or "ellm")."""
    temperature: float = float(FALLBACK["temperature"])
    top_p: float = float(FALLBACK["top_p"])
    top_k: int = int(FALLBACK["top_k"])
    min_p: float = float(FALLBACK["min_p"])
    repetition_penalty: float = float(FALLBACK["repetition_penalty"])
    sources: tuple[tuple[str, str], ...] = tuple((k, "ellm") for k in FALLBACK)

    def as_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in FALLBACK}

    def in_place_of_fallback(self, values: dict[str, float | int], source: str) -> SamplingDefaults:
        """These defaults with `values` for the fields that fell back to ellm's (the model's
        files left them unset); a model's own recommendation stays."""
        fell_back = {k for k, where in self.sources if where == "ellm"}
        chosen = {k: v for k, v in _checked(values, source).items() if k in fell_back}
        merged = {**self.as_dict(), **chosen}
        return SamplingDefaults(
            temperature=float(merged["temperature"]), top_p=float(merged["top_p"]), top_k=int(merged["top_k"]),
            min_p=float(merged["min_p"]), repetition_penalty=float(merged["repetition_penalty"]),
            sources=tuple((k, source if k in chosen else where) for k, where in self.sources))

    def params(self, base: SamplingParams | None = None, **overrides: Any) -> SamplingParams:
        """A SamplingParams with these defaults, then `overrides` (the caller's choices;
        None values are ignored, so an unset command-line option keeps the default).
        With base, base is used as it is and only overrides apply: a SamplingParams the
        caller built is their full choice."""
        chosen = {k: v for k, v in overrides.items() if v is not None}
        if base is not None:
            return SamplingParams.from_kwargs(base, **chosen)
        return SamplingParams.from_kwargs(None, **{**self.as_dict(), **chosen})


def _checked(values: dict[str, Any], where: str) -> dict[str, Any]:
    """The values SamplingParams accepts; the others are dropped with a warning."""
    good: dict[str, Any] = {}
    for field, value in values.items():
        if field == "top_k" and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            SamplingParams(**{field: value})
        except (ValueError, TypeError) as e:
            log.warning("%s: ignoring %s=%r (%s); using ellm's default %r", where, field, value, e,
                        FALLBACK[field])
            continue
        good[field] = value
    return good


def _build(values: dict[str, Any], source: str) -> SamplingDefaults:
    merged = {**FALLBACK, **values}
    return SamplingDefaults(
        temperature=float(merged["temperature"]), top_p=float(merged["top_p"]), top_k=int(merged["top_k"]),
        min_p=float(merged["min_p"]), repetition_penalty=float(merged["repetition_penalty"]),
        sources=tuple((k, source if k in values else "ellm") for k in FALLBACK))


def from_generation_config(config: dict[str, Any], where: str = "generation_config.json") -> SamplingDefaults:
    """Defaults from a parsed generation_config.json."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    found = {field: config[key] for key, field in _HF_KEYS.items() if config.get(key) is not None}
    return _build(_checked(found, where), "generation_config.json")


def from_folder(folder: str | Path) -> SamplingDefaults:
    """Defaults from a model folder (its generation_config.json; none: the fallback)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return SamplingDefaults()
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    return from_generation_config(config, str(path))


def from_gguf_metadata(metadata: dict[str, Any], where: str = "GGUF") -> SamplingDefaults:
    """Defaults from a GGUF file's metadata (`general.sampling.*`, as llama.cpp writes them)."""
    found = {field: metadata[key] for key, field in _GGUF_KEYS.items() if key in metadata}
    found = {k: (v.item() if hasattr(v, "item") else v) for k, v in found.items()}
    return _build(_checked(found, where), "gguf")
