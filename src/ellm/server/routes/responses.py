"""POST /v1/responses: OpenAI's Responses API, stateless (ellm.server.responses_api
turns its items into a chat and the chat's output into its events and objects)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..core import Server
from ..errors import APIError
from ..openapi import ERRORS
from ..responses_api import create_response


def register(app: FastAPI, server: Server) -> None:
    @app.post("/v1/responses", responses=ERRORS)
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless (see ellm.server.responses_api)."""
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body could not be read as JSON", code="invalid_json") from None
        return await create_response(server, request, body)
