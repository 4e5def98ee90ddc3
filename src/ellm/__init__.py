"""ellm: a PyTorch-free LLM inference engine.

    import ellm
    llm = ellm.load("smollm2-135m-instruct")
    print(llm.chat([{"role": "user", "content": "What is the capital of France?"}]).text)

One LLM serves any number of threads and asyncio tasks (`await llm.agenerate(...)`);
see ellm.llm.
"""
from __future__ import annotations

import threading
from typing import Any

__version__ = "0.1.0"

from ._native_check import check_native as _check_native

_check_native()

from .engine.async_engine import EngineDeadError  # noqa: E402
from .engine.engine import RequestError  # noqa: E402
from .llm import LLM, CompletionOutput, load  # noqa: E402
from .sampling_defaults import SamplingDefaults  # noqa: E402
from .sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "SamplingParams", "SamplingDefaults", "RequestError", "EngineDeadError",
           "load", "generate", "chat", "__version__"]

_default_llm: LLM | None = None
_default_lock = threading.Lock()   # two threads' first calls must not load it twice


def _default() -> LLM:
    global _default_llm
    with _default_lock:
        if _default_llm is None:
            _default_llm = load()
        return _default_llm


def generate(prompt: Any, params: SamplingParams | None = None, **kwargs: Any) -> Any:
    """Generates with the default model (pulled on first use). Returns the text for a
    single prompt, a list of texts for a list of prompts."""
    out = _default().generate(prompt, params, **kwargs)
    return [o.text for o in out] if isinstance(out, list) else out.text


def chat(messages: list[dict[str, Any]], params: SamplingParams | None = None, **kwargs: Any) -> str:
    """Chats with the default model; returns the reply text."""
    return _default().chat(messages, params, **kwargs).text
