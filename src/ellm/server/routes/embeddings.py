"""POST /v1/embeddings: one pooled hidden-state vector per input (floats or base64)."""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import protocol as P
from .. import responses as R
from ..core import Server
from ..errors import APIError
from ..openapi import ERRORS
from ..streaming import unless_disconnected


async def create_embeddings(server: Server, request: Request, req: P.EmbeddingRequest) -> Response:
    if server.check_model(req.model) is not None:   # [lora]
        raise APIError(400, f"embeddings come from the base model; '{req.model}' is a LoRA adapter "
                            f"(ask for '{server.cfg.model_name}')", param="model")
    size = server.cfg.embedding_size
    if req.dimensions is not None and req.dimensions != size:
        raise APIError(400, f"this model's embeddings have {size} dimensions; other sizes ('dimensions': "
                            f"{req.dimensions}) are not supported", param="dimensions")
    prompts = [await server.off_loop(server.prompt_ids, p, "input") for p in req.inputs()]
    for ids in prompts:
        server.check_length(ids, "input")
    finished, result = await unless_disconnected(request, _embed(server, prompts, req.pooling, req.normalize))
    if not finished:
        return Response(status_code=499)
    if isinstance(result, APIError):
        return JSONResponse(result.body(), status_code=result.status)
    vectors = np.asarray(result, dtype=np.float32)
    data = []
    for i, v in enumerate(vectors):
        if req.encoding_format == "base64":
            value: list[float] | str = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        else:
            value = v.tolist()
        data.append(R.Embedding(index=i, embedding=value))
    n = sum(len(ids) for ids in prompts)
    body = R.EmbeddingList(data=data, model=server.cfg.model_name,
                           usage=R.EmbeddingUsage(prompt_tokens=n, total_tokens=n))
    server.metrics.prompt_tokens.inc(n)
    return JSONResponse(body.model_dump())


async def _embed(server: Server, prompts: list[list[int]], pooling: str, normalize: bool) -> Any:
    try:
        return await server.engine.embed(prompts, pooling, normalize)
    except Exception as e:  # noqa: BLE001 - any engine failure becomes an error answer
        return server.engine_error(e)


def register(app: FastAPI, server: Server) -> None:
    @app.post("/v1/embeddings", response_model=R.EmbeddingList, responses=ERRORS)
    async def embeddings(body: P.EmbeddingRequest, request: Request) -> Response:
        return await create_embeddings(server, request, body)
