"""GET /health (the engine thread's state; no API key needed) and GET /metrics
(Prometheus text, or OpenMetrics when asked)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import responses as R
from ..core import Server
from ..openapi import ERRORS


async def health_status(server: Server) -> Response:
    engine = server.engine
    if not engine.is_running:
        return JSONResponse({"status": "error", "message": "the engine thread is not running"}, status_code=503)
    return JSONResponse({"status": "ok", "model": server.cfg.model_name, "requests": engine.num_requests,
                         "running": engine.num_running, "waiting": engine.num_waiting})


async def render_metrics(server: Server, request: Request) -> Response:
    engine = server.engine
    snap = await engine.snapshot() if engine.is_running else engine.snapshot_now()
    body, content_type = server.metrics.render(snap, request.headers.get("accept"))
    return Response(body, media_type=content_type)


def register(app: FastAPI, server: Server) -> None:
    @app.get("/health", response_model=R.Health, responses={503: {"model": R.Health}})
    async def health() -> Response:
        return await health_status(server)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **ERRORS})
    async def metrics(request: Request) -> Response:
        return await render_metrics(server, request)
