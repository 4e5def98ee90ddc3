"""/openapi.json: the error and streaming shapes the routes declare, and the document
with what only this server knows written in (served model names, vocabulary size,
embedding size)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from . import protocol as P
from . import responses as R
from .core import ServerConfig

ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": R.ErrorResponse, "description": "an OpenAI-shaped error naming the bad field"},
    "5XX": {"model": R.ErrorResponse, "description": "the engine failed or is stopped"},
}


# One server-sent event: `data:` holds a chunk as JSON, or [DONE] at the end.
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
             "required": ["data"]}


def streamed(model: type) -> dict[int | str, dict[str, Any]]:
    """The responses of a route that answers model, or a stream of its chunks."""
    return {200: {"model": model, "description": "the answer; with stream=true, server-sent events of chunks "
                                                 "ending with 'data: [DONE]'",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}}, **ERRORS}


def served_openapi(app: FastAPI, cfg: ServerConfig) -> dict[str, Any]:
    """FastAPI's document with what only this server knows written in: the served model
    names, the vocabulary's last token id, the embedding size (see P.SERVER_FACT)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    facts: dict[str, dict[str, Any]] = {
        "token_id": {"maximum": cfg.vocab_size - 1},
        "model": {"enum": [*cfg.model_names, None]},
        "model_path": {"enum": list(cfg.model_names)},
        "embedding_size": {"enum": [cfg.embedding_size, None]},
    }

    def patch(node: Any) -> None:
        if isinstance(node, dict):
            fact = node.pop(P.SERVER_FACT, None)
            if fact is not None:
                node.update(facts[fact])
            for v in node.values():
                patch(v)
        elif isinstance(node, list):
            for v in node:
                patch(v)

    patch(doc)
    app.openapi_schema = doc
    return doc
