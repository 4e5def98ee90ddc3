"""One process-wide cache of loaded models for the integrations: every integration given a
model name (not a loaded LLM) gets it from here, so two of them in one process never load
the same model twice. Thread-safe: two threads asking for one model wait for one load."""
from __future__ import annotations

import threading
from typing import Any

from ..llm import LLM, load

_lock = threading.Lock()                                # guards the two dicts below
_models: dict[tuple[str, str], LLM] = {}
_loading: dict[tuple[str, str], threading.Lock] = {}    # one lock per model being loaded


def _key(model: str, load_kwargs: dict[str, Any]) -> tuple[str, str]:
    # load()'s arguments are plain values; their sorted repr tells two loads apart
    return str(model), repr(sorted(load_kwargs.items()))


def get_llm(model: str | None = None, llm: LLM | None = None, **load_kwargs: Any) -> LLM:
    """llm when given; else the model loaded from `model` (a known name, a folder or a
    .gguf file) with ellm.load(model, **load_kwargs), once per process for each
    (model, load_kwargs)."""
    if llm is not None:
        if not isinstance(llm, LLM):
            raise TypeError(f"llm= must be an ellm.LLM (from ellm.load), got {type(llm).__name__}")
        if load_kwargs:
            raise ValueError(f"load options ({', '.join(sorted(load_kwargs))}) go with model=, "
                             "not with an LLM that is already loaded")
        return llm
    if model is None:
        raise ValueError("give model= (a model name, folder or .gguf path) or llm= (a loaded ellm.LLM)")
    if not isinstance(model, str) or not model:
        raise TypeError(f"model= must be a non-empty string, got {model!r}")
    key = _key(model, load_kwargs)
    with _lock:
        if key in _models:
            return _models[key]
        loading = _loading.setdefault(key, threading.Lock())
    with loading:
        with _lock:
            if key in _models:       # another thread loaded it while this one waited
                return _models[key]
        loaded = load(model, **load_kwargs)
        with _lock:
            _models[key] = loaded
            _loading.pop(key, None)
        return loaded


def share(llm: LLM, name: str | None = None) -> None:
    """Puts an LLM loaded elsewhere into the cache under name (default: llm.source), so
    integrations that only know the name (the `llm` CLI plugin, litellm's "ellm/<name>")
    use it instead of loading it again."""
    if not isinstance(llm, LLM):
        raise TypeError(f"share() takes an ellm.LLM, got {type(llm).__name__}")
    with _lock:
        _models[_key(name or llm.source, {})] = llm


def release(model: str | None = None, close: bool = True) -> None:
    """Drops model from the cache (every load of it), or everything when model is None;
    closes what it drops unless close=False (when the LLM is still used elsewhere)."""
    with _lock:
        keys = [k for k in _models if model is None or k[0] == model]
        dropped = [_models.pop(k) for k in keys]
    if close:
        for llm in dropped:
            llm.close()


def loaded() -> list[str]:
    """The names in the cache."""
    with _lock:
        return sorted({k[0] for k in _models})
