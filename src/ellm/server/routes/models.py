"""GET /v1/models and GET /v1/models/{model}: the served model, its aliases and [lora] its
LoRA adapters (each with "parent": the served model)."""
from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Path
from fastapi.responses import JSONResponse, Response

from .. import protocol as P
from .. import responses as R
from ..core import Server
from ..openapi import ERRORS


def model_card(server: Server, name: str) -> R.ModelCard:
    cfg = server.cfg
    if name not in cfg.model_names and name in server.adapters:   # [lora] vLLM's card of an adapter
        return R.ModelCard(id=name, created=server.created, root=name, parent=cfg.model_name,
                           max_model_len=cfg.max_model_len)
    return R.ModelCard(id=name, created=server.created, root=cfg.source or cfg.model_name,
                       max_model_len=cfg.max_model_len)


async def list_models(server: Server) -> Response:
    names = list(dict.fromkeys([*server.cfg.model_names, *server.adapters]))   # [lora] adapters after
    return JSONResponse(R.ModelList(data=[model_card(server, n) for n in names]).model_dump())


async def describe_model(server: Server, name: str) -> Response:
    if name not in server.cfg.model_names:
        server.check_model(name)
    return JSONResponse(model_card(server, name).model_dump())


def register(app: FastAPI, server: Server) -> None:
    @app.get("/v1/models", response_model=R.ModelList, responses=ERRORS)
    async def models() -> Response:
        return await list_models(server)

    @app.get("/v1/models/{model:path}", response_model=R.ModelCard, responses=ERRORS)
    async def model(model: Annotated[str, Path(json_schema_extra={P.SERVER_FACT: "model_path"})]) -> Response:
        return await describe_model(server, model)
