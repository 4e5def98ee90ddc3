"""`ellm inspect`: a local page that shows a prompt flowing through the model, and its JSON API.

    GET  /                 the page (static/index.html; app.js and style.css beside it)
    GET  /api/model        name, layers, heads, vocabulary size, longest prompt
    POST /api/trace        {"prompt": str, "chat": bool} or {"ids": [int]}, and "adapter":
                           a LoRA adapter's name or null (the base) -> tokens, per layer x
                           token the residual norm and logit-lens top tokens, the next
                           token's distribution, and a trace id
    GET  /api/attention    ?trace=ID&layer=L&head=H -> that head's weights (tokens x tokens)

Generation step by step is the page sending the ids again with one token more. Every
trace is one traced prefill (trace.capture.record); the last few are kept for the
attention requests. The model is used by one request at a time.

The page is for the local user only, so requests are checked before any route runs
(LocalOnly): the Host header must name loopback or the host the server was bound to (a
DNS-rebinding page, whose Host is its own name, gets a 421); a request carrying an Origin
must come from such a host too (a cross-site form or fetch gets a 403); /api/trace takes
only application/json (a "simple" cross-site POST of text/plain gets a 415), and a body
over MAX_BODY_BYTES is refused from its Content-Length before it is read, or once a
chunked body passes the limit (413).
"""
from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..capture import Recording, record
from ..lens import attention_map

STATIC = Path(__file__).with_name("static")
KEEP_TRACES = 8
LENS_TOP = 5
NEXT_TOP = 10
MAX_BODY_BYTES = 1 << 20


class BadRequest(ValueError):
    pass


class Inspector:
    """The state behind the page: the model and the last few recordings."""

    def __init__(self, llm: Any, name: str, max_tokens: int = 256) -> None:
        self.llm, self.name, self.max_tokens = llm, name, max_tokens
        self.lock = threading.Lock()
        self.traces: OrderedDict[str, Recording] = OrderedDict()

    def piece(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([int(token_id)])

    def model_info(self) -> dict[str, Any]:
        c = self.llm.config
        lora = getattr(self.llm.model, "lora", None)
        return {"name": self.name, "model_type": c.model_type, "layers": c.num_hidden_layers,
                "heads": c.num_attention_heads, "vocab_size": c.vocab_size, "max_tokens": self.max_tokens,
                "chat_template": bool(self.llm.tokenizer.chat_template),
                "adapters": list(lora.names) if lora is not None else []}

    def adapter_of(self, body: Any) -> str | None:
        """[lora] The body's "adapter": a loaded adapter's name, or null / absent (the base)."""
        name = body.get("adapter") if isinstance(body, dict) else None
        if name is None:
            return None
        have = self.model_info()["adapters"]
        if not isinstance(name, str) or name not in have:
            raise BadRequest(f"unknown adapter {name!r} (loaded: {', '.join(have) if have else 'none'})")
        return name

    def ids_of(self, body: Any) -> list[int]:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object with 'prompt' or 'ids'")
        if "ids" in body:
            ids = body["ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRequest("'ids' must be a list of integers")
            return ids
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:   # JSON can carry "\ud800"; text cannot hold it
            raise BadRequest(f"'prompt' holds a lone surrogate (U+{ord(prompt[e.start]):04X} at "
                             f"character {e.start}), which is not text") from None
        tok = self.llm.tokenizer
        if body.get("chat"):
            if not tok.chat_template:
                raise BadRequest("this model has no chat template")
            return tok.encode_chat([{"role": "user", "content": prompt}])
        return self.llm.encode_prompt(prompt)

    def trace(self, ids: list[int], adapter: str | None = None) -> dict[str, Any]:
        with self.lock:
            try:
                rec = record(self.llm, ids, max_tokens=self.max_tokens, lens_top_k=LENS_TOP, adapter=adapter)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            lens = rec.lens
        assert lens is not None   # asked for (lens_top_k)
        trace_id = secrets.token_hex(8)
        self.traces[trace_id] = rec
        while len(self.traces) > KEEP_TRACES:
            self.traces.popitem(last=False)
        last = rec.logits[-1].astype(np.float64)
        p = np.exp(last - last.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:NEXT_TOP]
        lens_ids = lens["ids"]                                    # (L, T, k)
        return {
            "trace": trace_id,
            "adapter": adapter,
            "ids": rec.ids,
            "tokens": [self.piece(t) for t in rec.ids],
            "layers": int(lens_ids.shape[0]),
            "heads": self.llm.config.num_attention_heads,
            "norms": lens["norms"].round(3).tolist(),              # (L, T)
            "lens": [[[{"id": int(i), "token": self.piece(int(i)), "p": round(float(q), 4)}
                       for i, q in zip(lens_ids[layer, t], lens["probs"][layer, t])]
                      for t in range(lens_ids.shape[1])] for layer in range(lens_ids.shape[0])],
            "next": [{"id": int(i), "token": self.piece(int(i)), "p": round(float(p[i]), 5)} for i in top],
        }

    def attention(self, trace_id: str, layer: int, head: int) -> dict[str, Any]:
        rec = self.traces.get(trace_id)
        if rec is None:
            raise BadRequest(f"unknown or expired trace {trace_id!r}; run the prompt again")
        c = self.llm.config
        if not 0 <= layer < c.num_hidden_layers:
            raise BadRequest(f"layer must be in 0..{c.num_hidden_layers - 1}, got {layer}")
        if not 0 <= head < c.num_attention_heads:
            raise BadRequest(f"head must be in 0..{c.num_attention_heads - 1}, got {head}")
        m = attention_map(self.llm.model, rec.arrays, layer)[head]     # (T, T)
        return {"layer": layer, "head": head, "tokens": [self.piece(t) for t in rec.ids],
                "matrix": m.round(4).tolist()}


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class LocalOnly:
    """ASGI guard: Host and Origin must name an allowed host (see the module docstring)."""

    def __init__(self, app: Any, hosts: tuple[str, ...]) -> None:
        self.app = app
        self.hosts = {h.lower().strip("[]") for h in hosts}

    def allowed(self, host_port: str) -> bool:
        host = host_port.strip().lower()
        if host.startswith("["):                       # [::1]:8765
            host = host[1:host.find("]")] if "]" in host else host
        elif host.count(":") == 1:                     # name:port
            host = host.split(":")[0]
        return host in self.hosts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = None
        if not self.allowed(headers.get("host", "")):
            problem = (421, "the Host header must name this machine (localhost or the address ellm inspect "
                            "was started on); other names are refused")
        elif "origin" in headers:
            origin = headers["origin"]
            scheme, _, rest = origin.partition("://")
            if scheme not in ("http", "https") or not self.allowed(rest.split("/")[0]):
                problem = (403, "requests from another site are refused (the Origin is not this machine)")
        if problem is not None:
            await _bad(problem[1], problem[0])(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _read_bounded(request: Request) -> bytes | Response:
    """The body, or the 413/415 answer: JSON only, at most MAX_BODY_BYTES, refused from
    Content-Length before reading and while reading a chunked body."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        return _bad(f"the body must be application/json, not {ctype or 'untyped'!r}", 415)
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            return _bad("the Content-Length header is not a number")
        if int(declared) > MAX_BODY_BYTES:
            return _bad(f"the body is over {MAX_BODY_BYTES} bytes", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return _bad(f"the body is over {MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(inspector: Inspector, hosts: tuple[str, ...] = ()) -> Any:
    """The app, behind LocalOnly: hosts are the names allowed beside loopback (the bound
    host, when it is not a wildcard)."""
    async def index(_: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def model(_: Request) -> Response:
        return JSONResponse(inspector.model_info())

    async def trace(request: Request) -> Response:
        raw = await _read_bounded(request)
        if isinstance(raw, Response):
            return raw
        try:
            body = json.loads(raw or b"null")
        except ValueError as e:
            return _bad(f"the body is not JSON: {e}")
        except RecursionError:
            return _bad("the body is nested too deeply")
        try:
            ids = inspector.ids_of(body)
            adapter = inspector.adapter_of(body)
            from starlette.concurrency import run_in_threadpool
            return JSONResponse(await run_in_threadpool(inspector.trace, ids, adapter))
        except BadRequest as e:
            return _bad(str(e))

    async def attention(request: Request) -> Response:
        q = request.query_params
        try:
            layer, head = int(q.get("layer", "")), int(q.get("head", ""))
        except ValueError:
            return _bad("layer and head must be integers")
        try:
            return JSONResponse(inspector.attention(q.get("trace", ""), layer, head))
        except BadRequest as e:
            return _bad(str(e))

    app = Starlette(routes=[
        Route("/", index),
        Route("/api/model", model),
        Route("/api/trace", trace, methods=["POST"]),
        Route("/api/attention", attention),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ])
    wildcard = ("", "0.0.0.0", "::")
    return LocalOnly(app, LOOPBACK_NAMES + tuple(h for h in hosts if h not in wildcard))


def _bad(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def serve(model: str | None, host: str = "127.0.0.1", port: int = 8765, device: str = "cpu",
          max_tokens: int = 256, lora_adapters: dict[str, str] | None = None) -> None:
    import uvicorn

    import ellm
    from ... import hub
    resolved = hub.resolve(model)
    llm = ellm.load(resolved.path, device=device, max_num_seqs=1, lora_adapters=lora_adapters or None)
    app = create_app(Inspector(llm, resolved.name, max_tokens), hosts=(host,))
    print(f"ellm inspect: {resolved.name} on http://{host}:{port}/  (Ctrl-C stops)")
    uvicorn.run(app, host=host, port=port, log_level="warning")
