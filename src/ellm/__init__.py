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

from ._native_check import check_startup as _check_startup

_check_startup()

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


def generate(prompts: Any, params: SamplingParams | None = None, **kwargs: Any) -> Any:
    """LLM.generate() on the default model (pulled and loaded on first use): the same
    arguments and the same results (a CompletionOutput, or lists of them)."""
    return _default().generate(prompts, params, **kwargs)


def chat(messages: Any, params: SamplingParams | None = None, **kwargs: Any) -> Any:
    """LLM.chat() on the default model (pulled and loaded on first use): the same arguments
    (a list of messages, or a string for one user message) and the same results."""
    return _default().chat(messages, params, **kwargs)
