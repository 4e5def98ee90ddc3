"""ellm's OpenAI-compatible HTTP server (`ellm serve`, extra `ellm[server]`).

Importing this package needs nothing beyond ellm itself; Starlette and uvicorn are
imported only when an app is built (`ellm.server.app`) or served (`ellm.server.cli`).

    from ellm.server import create_app
    app = create_app(ellm.load("model.gguf"), api_key="secret")   # any ASGI server runs it
"""
from __future__ import annotations

from typing import Any


def create_app(llm: Any, *, served_model_name: str | None = None, api_key: str | None = None,
               max_queue: int = 256) -> Any:
    """An ASGI app serving llm (an ellm.LLM). Its lifespan starts and stops the engine thread."""
    from ..engine.async_engine import AsyncEngine
    from .app import Server, ServerConfig, build_app
    cfg = ServerConfig(model_name=served_model_name or llm.source, max_model_len=llm.engine.cfg.max_model_len,
                       vocab_size=llm.config.vocab_size, api_key=api_key, source=llm.source)
    return build_app(Server(AsyncEngine(llm.engine, max_queue), llm.tokenizer, cfg))


__all__ = ["create_app"]
