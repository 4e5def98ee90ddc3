"""ellm's OpenAI-compatible HTTP server (`ellm serve`, extra `ellm-engine[server]`).

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
               max_queue: int = DEFAULT_MAX_QUEUE, allowed_origins: Sequence[str] = (),
               allow_image_urls: bool = False, allowed_image_hosts: Sequence[str] = ()) -> Any:
    """An ASGI app (FastAPI) serving llm (an ellm.LLM). Its lifespan starts and stops the
    engine thread. served_model_name: the name clients send as "model" (several: aliases,
    the first is the one reported); default: llm.source. allowed_origins: browser origins
    allowed by CORS ("*" for any). allow_image_urls: fetch http(s) image URLs of chat
    messages (bounded in size and time, public internet addresses only; off by default:
    data: URLs only); allowed_image_hosts: host names fetched whatever their address."""
    from .app import build_app
    from .core import Server, ServerConfig
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    cfg = ServerConfig(model_names=names or [llm.source], max_model_len=llm.engine.cfg.max_model_len,
                       vocab_size=llm.config.vocab_size, embedding_size=llm.config.hidden_size,
                       api_key=api_key, source=llm.source, allowed_origins=tuple(allowed_origins),
                       allow_image_urls=allow_image_urls, allowed_image_hosts=tuple(allowed_image_hosts))
    return build_app(Server(engine_loop(llm, max_queue), llm.tokenizer, cfg, llm.defaults.params,
                            processing=getattr(llm, "processing", None)))


def engine_loop(llm: Any, max_queue: int) -> Any:
    """The LLM's own AsyncEngine (so that Python callers and the server batch together),
    bounded to max_queue requests queued or running."""
    loop = llm.async_engine
    loop.max_queue = max_queue
    return loop


__all__ = ["create_app"]
