"""ellm's OpenAI-compatible HTTP server (`ellm serve`, extra `ellm[server]`).

Importing this package needs nothing beyond ellm itself; FastAPI, pydantic, uvicorn and
prometheus_client are imported only when an app is built (`ellm.server.app`) or served
(`ellm.server.cli`).

    from ellm.server import create_app
    app = create_app(ellm.load("model.gguf"), api_key="secret")   # any ASGI server runs it
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

DEFAULT_MAX_QUEUE = 256


def create_app(llm: Any, *, served_model_name: str | Sequence[str] | None = None, api_key: str | None = None,
               max_queue: int = DEFAULT_MAX_QUEUE, allowed_origins: Sequence[str] = ()) -> Any:
    """An ASGI app (FastAPI) serving llm (an ellm.LLM). Its lifespan starts and stops the
    engine thread. served_model_name: the name clients send as "model" (several: aliases,
    the first is the one reported); default: llm.source. allowed_origins: browser origins
    allowed by CORS ("*" for any)."""
    from .app import Server, ServerConfig, build_app
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    cfg = ServerConfig(model_names=names or [llm.source], max_model_len=llm.engine.cfg.max_model_len,
                       vocab_size=llm.config.vocab_size, embedding_size=llm.config.hidden_size,
                       api_key=api_key, source=llm.source, allowed_origins=tuple(allowed_origins))
    return build_app(Server(engine_loop(llm, max_queue), llm.tokenizer, cfg, sampling_defaults(llm)))


def engine_loop(llm: Any, max_queue: int) -> Any:
    """The AsyncEngine the server submits to, bounded to max_queue requests: the LLM's own
    loop where it has one (so Python callers and the server batch together)."""
    loop = getattr(llm, "async_engine", None)
    if loop is None:
        from ..engine.async_engine import AsyncEngine
        return AsyncEngine(llm.engine, max_queue)
    loop.max_queue = max_queue
    return loop


def sampling_defaults(llm: Any) -> Any:
    """The function that fills in the sampling fields a request leaves out: the model's
    defaults (generation_config.json, GGUF general.sampling.*) where the LLM has them."""
    defaults = getattr(llm, "defaults", None)
    if defaults is not None:
        return defaults.params
    from ..sampling_params import SamplingParams
    return SamplingParams


__all__ = ["create_app"]
