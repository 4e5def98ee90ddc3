"""POST /tokenize and POST /detokenize (vLLM's and llama.cpp's extensions): a text or a
rendered chat to token ids, and ids back to text."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from ...vision.chat import has_images
from .. import protocol as P
from .. import responses as R
from ..core import Server
from ..openapi import ERRORS


async def tokenize_request(server: Server, req: P.TokenizeRequest) -> Response:
    server.check_model(req.model)
    fetched = None
    if req.messages is not None:   # [vision] image URLs, in the fetcher's threads
        fetched = await server.fetch_images([m.for_template() for m in req.messages])
    return await server.off_loop(_tokenize, server, req, fetched)


def _tokenize(server: Server, req: P.TokenizeRequest, fetched: dict[str, Any] | None = None) -> Response:
    if req.messages is not None:
        messages = [m.for_template() for m in req.messages]
        kwargs = req.chat_template_kwargs or {}
        if (req.add_special_tokens is None and req.add_special is None) or has_images(messages):  # [vision]
            ids = server.chat_ids(messages, req.add_generation_prompt, kwargs, None, fetched)
        else:
            text = server.chat_text(messages, req.add_generation_prompt, kwargs)
            ids = server.encode(text, "messages", add_special_tokens=req.special_tokens())
    else:
        ids = server.encode(req.text or "", "prompt", add_special_tokens=req.special_tokens())
    tokens: list[int] | list[R.TokenPiece] = ids
    if req.with_pieces:
        tokens = [R.TokenPiece(id=t, piece=server.tokenizer.decode([t])) for t in ids]
    strs = [server.tokenizer.id_to_token(t) or "" for t in ids] if req.return_token_strs else None
    body = R.TokenizeResponse(tokens=tokens, count=len(ids), max_model_len=server.cfg.max_model_len, token_strs=strs)
    return JSONResponse(body.model_dump())


async def detokenize_request(server: Server, req: P.DetokenizeRequest) -> Response:
    server.check_model(req.model)
    # (millions of ids take seconds to check and decode: the tokenizer threads do it)
    return await server.off_loop(_detokenize, server, req)


def _detokenize(server: Server, req: P.DetokenizeRequest) -> Response:
    server.check_ids(req.tokens, "tokens", "token id")
    text = server.tokenizer.decode(req.tokens)
    return JSONResponse(R.DetokenizeResponse(prompt=text, content=text).model_dump())


def register(app: FastAPI, server: Server) -> None:
    @app.post("/tokenize", response_model=R.TokenizeResponse, responses=ERRORS)
    async def tokenize(body: P.TokenizeRequest) -> Response:
        return await tokenize_request(server, body)

    @app.post("/detokenize", response_model=R.DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: P.DetokenizeRequest) -> Response:
        return await detokenize_request(server, body)
