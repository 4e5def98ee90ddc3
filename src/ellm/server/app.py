"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions,
/v1/chat/completions (both with SSE streaming), /v1/embeddings, /tokenize, /detokenize,
/health, /metrics and /openapi.json.

Request bodies are validated by the pydantic models of ellm.server.protocol (FastAPI
parses and checks them before a route runs; a bad field is a 400 naming it), tokenized
here, and run through an AsyncEngine (one engine thread, continuous batching). A request
with n choices (or several prompts) becomes one engine request per choice; their deltas
are merged as they come. Every way a client can go away (closing a stream, dropping a
connection while a non-streamed request runs) closes its engine requests, which frees
their KV blocks.

Nothing a request does can stop the server: every exception becomes an OpenAI-shaped
error response ({"error": {"message", "type", "param", "code"}}), or an error event on
a stream that has already started.

Nor can one client starve the others: tokenizing and chat-template rendering run in a
small thread pool (the event loop keeps answering; the tokenizer's batch call releases
the GIL), prompts are limited in characters before tokenizing, and every text is checked
to be valid Unicode first (a lone surrogate is a 400). A body that stops arriving is a
408 after read_timeout; a response the client stops reading is given up after
write_timeout, which aborts its generation. Header deadlines are the protocol's
(server/timeouts.py).
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from ..engine.engine import RequestError, SequenceError
from ..vision.chat import has_images
from ..engine.sequence import RequestOutput, TokenLogprob
from ..sampling_params import SamplingParams
from . import protocol as P
from . import responses as R
from .constraints import ConstraintError, constraint_fields
from .errors import APIError, error_body, from_validation
from .metrics import Metrics
from .streaming import SSEResponse, merge, sse, unless_disconnected
from .tools import StreamParser, ToolError, ToolPlan

log = logging.getLogger("ellm.server")

MAX_BODY_BYTES = 8 << 20     # a request body larger than this is refused (413)
PUBLIC_PATHS = ("/health", "/openapi.json")   # answered without the API key


@dataclass
class ServerConfig:
    model_names: Sequence[str]      # what clients may pass as "model"; the first is the one reported
    max_model_len: int              # prompt + output tokens per sequence
    vocab_size: int
    embedding_size: int = 0         # the hidden size: the length of an embedding
    api_key: str | None = None      # when set, every route but /health and /openapi.json needs it
    source: str = ""                # where the model came from (shown by /v1/models)
    allowed_origins: Sequence[str] = field(default_factory=tuple)   # CORS; empty: no CORS headers
    # Hostile clients: a prompt (or rendered chat) longer than this many characters is
    # refused before it is tokenized (tokenizing 1M characters takes seconds of CPU);
    # a request body that stops arriving, or a response the client stops reading, is
    # given up after these many seconds (the generation of an abandoned stream is aborted).
    max_prompt_chars: int = 1_000_000
    read_timeout: float = 30.0
    write_timeout: float = 30.0
    tokenizer_threads: int = 2      # tokenizing and template rendering run here, off the event loop
    # [vision] http(s) image URLs are fetched only when this is set (ellm serve --allow-image-urls)
    allow_image_urls: bool = False

    def __post_init__(self) -> None:
        self.model_names = tuple(dict.fromkeys(self.model_names))   # unique, in order
        if not self.model_names:
            raise ValueError("ServerConfig needs at least one model name")

    @property
    def model_name(self) -> str:
        return self.model_names[0]


def _error(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def _api_error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@dataclass
class _Choice:
    """Running totals of one choice while its deltas arrive."""
    text: str = ""
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    text_offset: int = 0
    cached_tokens: int = 0


class Server:
    """Routes over one AsyncEngine. build_app() wires it into a FastAPI app.

    make_params turns a request's sampling fields into SamplingParams; pass the model's
    defaults (LLM.defaults.params) so that fields a client leaves out get them."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, config: ServerConfig,
                 make_params: Callable[..., SamplingParams] = SamplingParams, processing: Any = None) -> None:
        self.engine = engine
        self.processing = processing   # [vision] the model's image processor, None for a text-only model
        self.tokenizer = tokenizer
        self.cfg = config
        self.make_params = make_params
        self.metrics = Metrics(config.model_name)
        self.token_text = R.TokenText(tokenizer)
        self.created = int(time.time())
        self._cpu = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="ellm-tokenize")

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) in the tokenizer threads: tokenizing and template rendering are CPU
        work that would otherwise stall every other client (and /health) for its length."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, functools.partial(fn, *args))

    def encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Token ids of text, after the checks every text gets before the tokenizer:
        its length (max_prompt_chars) and that it is valid Unicode (a lone UTF-16
        surrogate, which JSON can carry as "\\ud800", is not and cannot be tokenized)."""
        limit = self.cfg.max_prompt_chars
        if len(text) > limit:
            raise APIError(400, f"the {param} has {len(text)} characters; this server takes at most {limit}",
                           param=param, code="prompt_too_long")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"the {param} holds a lone UTF-16 surrogate ({text[e.start]!a} at character "
                                f"{e.start}), which is not valid Unicode", param=param) from None
        batch = getattr(self.tokenizer, "encode_batch", None)
        if batch is not None:  # (the batch call releases the GIL while Rust works; encode does not)
            return list(batch([text], add_special_tokens=add_special_tokens)[0])
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # -- checks -----------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """A request may leave out model (the served model) or name any served alias."""
        if model is not None and model not in self.cfg.model_names:
            names = ", ".join(f"'{n}'" for n in self.cfg.model_names)
            raise APIError(404, f"the model '{model}' does not exist; this server serves {names}",
                           param="model", code="model_not_found")

    def _check_ids(self, ids: Sequence[int], param: str, what: str = "prompt token id") -> None:
        vocab = self.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{what} {bad} is outside the vocabulary (size {vocab})", param=param)

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt, param, add_special_tokens=True)
        else:
            self._check_ids(prompt, param)
            ids = list(prompt)
        if not ids:
            raise APIError(400, f"the {param} encodes to no tokens", param=param)
        return ids

    def chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                  template_kwargs: dict[str, Any]) -> str:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", True):
            raise APIError(400, f"the model '{self.cfg.model_name}' has no chat template; "
                                "use /v1/completions", param="messages", code="no_chat_template")
        try:
            return str(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                               **template_kwargs))
        except TypeError as e:
            raise APIError(400, f"the chat template could not be applied: {e}", param="messages") from None
        except ValueError as e:   # the template raised (e.g. roles that do not alternate)
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None

    def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                 template_kwargs: dict[str, Any] | None = None, plan: ToolPlan | None = None) -> list[int]:
        return self.chat_prompt(messages, add_generation_prompt, template_kwargs, plan)[0]

    def prepare_images(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
        """[vision] Decodes and preprocesses the messages' image parts (fetching http(s)
        URLs only when allowed): -> (messages for the template, ImageInputs in order)."""
        from ..vision.chat import prepare_messages
        from ..vision.images import ImageError
        fetch = None
        if self.cfg.allow_image_urls:
            from ..vision.fetch import fetch_image
            fetch = fetch_image
        try:
            return prepare_messages(messages, self.processing, fetch=fetch, model_name=f"the model '{self.cfg.model_name}'")
        except ImageError as e:
            raise APIError(400, str(e), param=e.param or "messages", code="invalid_image") from None

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    plan: ToolPlan | None = None) -> tuple[list[int], list[Any] | None]:
        """The ids of a chat, and the ImageInputs its image tokens stand for (None without images)."""
        from ..vision.chat import has_images
        images = None
        if has_images(messages):   # [vision]
            if plan is not None:
                raise APIError(400, "images together with tools are not supported yet", param="tools")
            messages, images = self.prepare_images(messages)
        tok = self.tokenizer
        kwargs = dict(template_kwargs or {})
        if plan is not None:  # [tools] the plan renders tools, calls and results for the template
            messages, tools = plan.render(messages)
            if tools:
                kwargs["tools"] = tools
        text = self.chat_text(messages, add_generation_prompt, kwargs)
        if images:   # [vision] each placeholder the template wrote gets its image's tokens
            from ..vision.images import ImageError
            from ..vision.preprocess import expand_prompt
            try:
                text = expand_prompt(text, self.processing, images)
            except ImageError as e:   # the template wrote more or fewer placeholders than images
                raise APIError(400, f"the chat template and the images disagree: {e}", param="messages") from None
        ids = self.encode(text, "messages", add_special_tokens=False)
        # As LLM.chat: the template may or may not write BOS; a model that wants one gets one.
        bos = getattr(tok, "bos_token_id", None)
        if getattr(tok, "add_bos", False) and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids, images

    def check_length(self, ids: list[int], what: str, max_tokens: int | None = None,
                     max_tokens_param: str | None = None) -> None:
        limit, n = self.cfg.max_model_len, len(ids)
        if n >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens, but the {what} "
                                f"has {n} tokens (prompt and completion together must fit, so at most "
                                f"{limit - 1} prompt tokens). The prompt was not truncated; shorten it.",
                           param=what, code="context_length_exceeded")
        if max_tokens_param and max_tokens is not None and n + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                f"requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} for the "
                                f"completion). Reduce the {what} or the completion length (at most "
                                f"{limit - n}).", param=max_tokens_param, code="context_length_exceeded")

    def sampling_params(self, req: P.GenerationRequest) -> SamplingParams:
        """SamplingParams (n=1; per-choice seeds are derived from it) for a request."""
        try:  # [structured] response_format, json_schema, grammar, guided_*, structured_outputs
            constraint = constraint_fields(req.constraint_fields())
        except ConstraintError as e:
            raise APIError(400, str(e), param=e.param) from None
        try:
            params = self.make_params(**req.sampling_fields())
            # Set apart: None is meaningful here (no limit, no logprobs), not "the default".
            return dataclasses.replace(params, max_tokens=P.output_limit(req), logprobs=P.logprob_count(req),
                                       **constraint)
        except ValueError as e:   # the models bound every field, so this is a rare combination
            msg = str(e)
            name = msg.split(" ", 1)[0]   # SamplingParams' messages start with the field name
            raise APIError(400, msg, param=name if name in type(req).model_fields else None) from None

    # -- routes -------------------------------------------------------------------------

    async def health(self) -> Response:
        if not self.engine.is_running:
            return JSONResponse({"status": "error", "message": "the engine thread is not running"},
                                status_code=503)
        return JSONResponse({"status": "ok", "model": self.cfg.model_name,
                             "requests": self.engine.num_requests, "running": self.engine.num_running,
                             "waiting": self.engine.num_waiting})

    def model_card(self, name: str) -> R.ModelCard:
        return R.ModelCard(id=name, created=self.created, root=self.cfg.source or self.cfg.model_name,
                           max_model_len=self.cfg.max_model_len)

    async def models(self) -> Response:
        return JSONResponse(R.ModelList(data=[self.model_card(n) for n in self.cfg.model_names]).model_dump())

    async def model(self, name: str) -> Response:
        if name not in self.cfg.model_names:
            self.check_model(name)
        return JSONResponse(self.model_card(name).model_dump())

    async def metrics_route(self, request: Request) -> Response:
        snap = await self.engine.snapshot() if self.engine.is_running else self.engine.snapshot_now()
        body, content_type = self.metrics.render(snap, request.headers.get("accept"))
        return Response(body, media_type=content_type)

    async def completions(self, request: Request, req: P.CompletionRequest) -> Response:
        self.check_model(req.model)
        prompts = [await self.off_loop(self.prompt_ids, p) for p in req.prompts()]
        return await self._generate(request, req, prompts)

    def tool_plan(self, req: P.ChatCompletionRequest) -> ToolPlan | None:
        """[tools] The plan for a chat request with tools, tool_choice, or tool turns in its
        history; None for a plain chat."""
        history = any(m.tool_calls or m.role == "tool" for m in req.messages)
        if req.tools is None and req.tool_choice is None and not history:
            return None
        try:
            return ToolPlan.make(self.tokenizer, req.tools or [], req.tool_choice, req.parallel_tool_calls)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None

    async def chat_completions(self, request: Request, req: P.ChatCompletionRequest) -> Response:
        self.check_model(req.model)
        plan = self.tool_plan(req)
        try:
            ids, images = await self.off_loop(self.chat_prompt, req.template_messages(), True,
                                              req.chat_template_kwargs, plan)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param) from None
        return await self._generate(request, req, [ids], plan, [images])

    async def embeddings(self, request: Request, req: P.EmbeddingRequest) -> Response:
        self.check_model(req.model)
        size = self.cfg.embedding_size
        if req.dimensions is not None and req.dimensions != size:
            raise APIError(400, f"this model's embeddings have {size} dimensions; other sizes ('dimensions': "
                                f"{req.dimensions}) are not supported", param="dimensions")
        prompts = [await self.off_loop(self.prompt_ids, p, "input") for p in req.inputs()]
        for ids in prompts:
            self.check_length(ids, "input")
        finished, result = await unless_disconnected(
            request, self._embed(prompts, req.pooling, req.normalize))
        if not finished:
            return Response(status_code=499)
        if isinstance(result, APIError):
            return _api_error(result)
        vectors = np.asarray(result, dtype=np.float32)
        data = []
        for i, v in enumerate(vectors):
            if req.encoding_format == "base64":
                value: list[float] | str = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
            else:
                value = v.tolist()
            data.append(R.Embedding(index=i, embedding=value))
        n = sum(len(ids) for ids in prompts)
        body = R.EmbeddingList(data=data, model=self.cfg.model_name,
                               usage=R.EmbeddingUsage(prompt_tokens=n, total_tokens=n))
        self.metrics.prompt_tokens.inc(n)
        return JSONResponse(body.model_dump())

    async def _embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> Any:
        try:
            return await self.engine.embed(prompts, pooling, normalize)
        except Exception as e:  # noqa: BLE001 - any engine failure becomes an error answer
            return self._engine_error(e)

    async def tokenize(self, req: P.TokenizeRequest) -> Response:
        self.check_model(req.model)
        return await self.off_loop(self._tokenize, req)

    def _tokenize(self, req: P.TokenizeRequest) -> Response:
        if req.messages is not None:
            messages = [m.for_template() for m in req.messages]
            kwargs = req.chat_template_kwargs or {}
            if (req.add_special_tokens is None and req.add_special is None) or has_images(messages):  # [vision]
                ids = self.chat_ids(messages, req.add_generation_prompt, kwargs)
            else:
                text = self.chat_text(messages, req.add_generation_prompt, kwargs)
                ids = self.encode(text, "messages", add_special_tokens=req.special_tokens())
        else:
            ids = self.encode(req.text or "", "prompt", add_special_tokens=req.special_tokens())
        tokens: list[int] | list[R.TokenPiece] = ids
        if req.with_pieces:
            tokens = [R.TokenPiece(id=t, piece=self.tokenizer.decode([t])) for t in ids]
        body = R.TokenizeResponse(tokens=tokens, count=len(ids), max_model_len=self.cfg.max_model_len)
        return JSONResponse(body.model_dump())

    async def detokenize(self, req: P.DetokenizeRequest) -> Response:
        self.check_model(req.model)
        self._check_ids(req.tokens, "tokens", "token id")
        text = self.tokenizer.decode(req.tokens)
        return JSONResponse(R.DetokenizeResponse(prompt=text, content=text).model_dump())

    # -- generation ---------------------------------------------------------------------

    async def _generate(self, request: Request, req: P.GenerationRequest, prompts: list[list[int]],
                        plan: ToolPlan | None = None, images: list[Any] | None = None) -> Response:
        chat = isinstance(req, P.ChatCompletionRequest)
        params = self.sampling_params(req)
        if plan is not None:  # [tools] required / named: the call grammar
            try:
                params = plan.sampling(params)
            except ToolError as e:
                raise APIError(400, str(e), param=e.param) from None
        for ids in prompts:
            self.check_length(ids, "messages" if chat else "prompt", params.max_tokens, req.max_tokens_param)
        bias = params.logit_bias or {}
        bad = next((t for t in bias if t >= self.cfg.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"logit_bias names token {bad}, outside the vocabulary "
                                f"(size {self.cfg.vocab_size})", param="logit_bias")
        if params.stop_token_ids:
            self._check_ids(params.stop_token_ids, "stop_token_ids", "stop token id")
        if params.constraint is not None:  # [structured] llguidance's tokenizer, off the engine thread
            await asyncio.get_running_loop().run_in_executor(None, self.engine.engine.prepare_constraints)
        total = len(prompts) * req.n
        if total > self.engine.max_queue:
            raise APIError(400, f"this request asks for {total} sequences ({len(prompts)} prompts x n={req.n}); "
                                f"the server runs at most {self.engine.max_queue} at once", param="n")
        try:
            self.engine.check_capacity(total)
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        t0 = time.perf_counter()
        rid = R.new_id("chatcmpl" if chat else "cmpl")
        streams: list[RequestStream] = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(req.n):
                    streams.append(self.engine.submit(ids, _choice_params(params, j), f"{rid}-{p * req.n + j}",
                                                      images=images[p] if images else None))  # [vision]
        except (QueueFullError, EngineDeadError) as e:
            for s in streams:
                s.close()
            status = 429 if isinstance(e, QueueFullError) else 503
            raise APIError(status, str(e), type="rate_limit_error" if status == 429 else "server_error",
                           code="queue_full" if status == 429 else "engine_stopped") from None
        prompt_lens = [len(ids) for ids in prompts for _ in range(req.n)]
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
        outputs = self._outputs(streams, t0)
        if req.stream:
            return SSEResponse(self._events(req, rid, outputs, prompt_lens, plan))
        finished, result = await unless_disconnected(request, self._collect(req, outputs, len(streams)))
        if not finished:
            return Response(status_code=499)   # nobody is listening; the requests were aborted
        if isinstance(result, APIError):
            return _api_error(result)
        return JSONResponse(self._final_body(req, rid, result, prompts, plan))

    async def _outputs(self, streams: list[RequestStream], t0: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) as they arrive from all streams; records the timing metrics;
        closes (aborts) every unfinished stream when the consumer stops early."""
        m = self.metrics
        last: dict[int, float] = {}
        try:
            async for i, out in merge(streams):
                k = len(out.new_token_ids)
                if k:
                    now = time.perf_counter()
                    if i in last:
                        for _ in range(k):   # one decode step usually brings one token
                            m.itl.observe((now - last[i]) / k)
                    else:
                        m.ttft.observe(now - t0)
                    last[i] = now
                    m.generation_tokens.inc(k)
                if out.finished:
                    m.e2e.observe(time.perf_counter() - t0)
                    m.count_finished(out.finish_reason)
                yield i, out
        finally:
            for s in streams:
                if not s.done:
                    m.count_finished("abort")
                s.close()

    async def _collect(self, req: P.GenerationRequest, outputs: AsyncIterator[tuple[int, RequestOutput]],
                       n: int) -> list[_Choice] | APIError:
        want_logprobs = P.logprob_count(req) is not None
        choices = [_Choice(logprobs=[] if want_logprobs else None) for _ in range(n)]
        try:
            async for i, out in outputs:
                c = choices[i]
                c.text += out.new_text
                c.num_tokens += len(out.new_token_ids)
                if c.logprobs is not None:
                    c.logprobs.extend(out.new_logprobs)
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.cached_tokens = out.num_cached_tokens
        except Exception as e:  # noqa: BLE001 - any engine failure becomes an error answer
            return self._engine_error(e)
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        return choices

    def _engine_error(self, e: BaseException) -> APIError:
        if isinstance(e, RequestError):
            return APIError(400, str(e))
        if isinstance(e, EngineDeadError):
            return APIError(503, str(e), type="server_error", code="engine_stopped")
        if isinstance(e, SequenceError):   # this request alone failed while it ran; the others went on
            log.error("request failed while it ran: %s", e)
            return APIError(500, f"the engine failed on this request: {e}", type="server_error", code="engine_error")
        log.error("request failed in the engine", exc_info=e)
        return APIError(500, f"the engine failed on this request: {type(e).__name__}: {e}",
                        type="server_error", code="engine_error")

    def _final_body(self, req: P.GenerationRequest, rid: str, choices: list[_Choice],
                    prompts: list[list[int]], plan: ToolPlan | None = None) -> dict[str, Any]:
        prompt_tokens = sum(len(ids) for ids in prompts)
        cached = sum(c.cached_tokens for c in choices[::req.n])   # one per prompt, as prompt_tokens
        use = R.usage(prompt_tokens, sum(c.num_tokens for c in choices), cached)
        head = {"id": rid, "created": R.now(), "model": self.cfg.model_name}
        if isinstance(req, P.ChatCompletionRequest):
            chat = []
            for i, c in enumerate(choices):
                content, calls = plan.parse(c.text) if plan is not None else (c.text, [])  # [tools]
                chat.append(R.ChatChoice(
                    index=i, message=R.AssistantMessage(content=content, tool_calls=[t.to_openai() for t in calls]),
                    finish_reason="tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
                    logprobs=R.chat_logprobs(c.logprobs, self.token_text) if c.logprobs is not None else None))
            return R.ChatCompletion(**head, choices=chat, usage=use).model_dump()
        text = [R.CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                   logprobs=R.completion_logprobs(c.logprobs, self.token_text, 0)[0]
                                   if c.logprobs is not None else None)
                for i, c in enumerate(choices)]
        return R.Completion(**head, choices=text, usage=use).model_dump()

    async def _events(self, req: P.GenerationRequest, rid: str,
                      outputs: AsyncIterator[tuple[int, RequestOutput]], prompt_lens: list[int],
                      plan: ToolPlan | None = None) -> AsyncIterator[str]:
        """The SSE body: OpenAI chunks, then (include_usage) a usage chunk, then [DONE]."""
        chat = isinstance(req, P.ChatCompletionRequest)
        want_logprobs = P.logprob_count(req) is not None
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": R.now(), "model": self.cfg.model_name, "system_fingerprint": None}
        n = len(prompt_lens)
        choices = [_Choice() for _ in range(n)]
        # [tools] per choice: its stream parser and how many calls it has sent
        parsers = [plan.stream_parser() if plan is not None else None for _ in range(n)]
        calls_sent = [0] * n

        def deltas(i: int, events: list[tuple[str, Any]]) -> list[dict[str, Any]]:
            out = []
            for kind, v in events:
                if kind == "content":
                    out.append({"content": v})
                else:
                    out.append({"tool_calls": [{"index": calls_sent[i], **v.to_openai()}]})
                    calls_sent[i] += 1
            return out

        def chunk(choice_list: list[dict[str, Any]]) -> str:
            body = dict(head, choices=choice_list)
            if req.include_usage:
                body["usage"] = None
            return sse(body)

        try:
            if chat:   # the role comes first, before any token (and before prefill ends)
                for i in range(n):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
            async for i, out in outputs:
                c = choices[i]
                c.num_tokens += len(out.new_token_ids)
                lp: dict[str, Any] | None = None
                if want_logprobs and out.new_logprobs:
                    if chat:
                        lp = R.chat_logprobs(out.new_logprobs, self.token_text)
                    else:
                        lp, c.text_offset = R.completion_logprobs(out.new_logprobs, self.token_text, c.text_offset)
                if chat:
                    parser = parsers[i]
                    if parser is None:
                        pieces = [{"content": out.new_text}] if out.new_text else []
                    else:  # [tools] content and calls as the parser finds them
                        pieces = deltas(i, parser.feed(out.new_text) + (parser.finish() if out.finished else []))
                    if lp is not None and not pieces:
                        pieces = [{"content": ""}]
                    for k, delta in enumerate(pieces):
                        yield chunk([{"index": i, "delta": delta, "logprobs": lp if k == 0 else None,
                                      "finish_reason": None}])
                    if out.finished:
                        reason = "tool_calls" if calls_sent[i] and out.finish_reason == "stop" else out.finish_reason
                        yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}])
                elif out.new_text or lp is not None or out.finished:
                    yield chunk([{"index": i, "text": out.new_text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None}])
                if out.finished:
                    c.cached_tokens = out.num_cached_tokens
            if req.include_usage:
                prompt_tokens = sum(prompt_lens[::req.n])
                use = R.usage(prompt_tokens, sum(c.num_tokens for c in choices),
                              sum(c.cached_tokens for c in choices[::req.n]))
                yield sse(dict(head, choices=[], usage=use.model_dump()))
        except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(self._engine_error(e).body())
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"


def _choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """Params of the i-th completion of a prompt: seed + i when seeded."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + i)


# ---------------------------------------------------------------------------------------
# middleware and app
# ---------------------------------------------------------------------------------------

class _Guard:
    """The API key check, the body size limit, the request counter, and a last net that
    turns any escaped exception into a 500 JSON error (never a dead server)."""

    def __init__(self, app: ASGIApp, server: Server, routes: Sequence[BaseRoute]) -> None:
        self.app, self.server, self.routes = app, server, routes
        key = server.cfg.api_key
        self._expected = f"Bearer {key}".encode() if key else None

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None or scope["path"] in PUBLIC_PATHS:
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                return hmac.compare_digest(value.strip(), self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"status": 500, "started": False}
        cfg = self.server.cfg

        async def send_status(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                state["status"], state["started"] = msg["status"], True
            # Bounded write: a client that stops reading fills the socket, and send() then
            # waits for it forever; past write_timeout it counts as gone (a stream's
            # generation is then aborted, as on a disconnect).
            try:
                await asyncio.wait_for(send(msg), cfg.write_timeout)
            except asyncio.TimeoutError:
                raise ConnectionAbortedError(f"the client read nothing for {cfg.write_timeout:g} s") from None

        received = 0
        body_done = False

        async def receive_limited() -> Message:
            nonlocal received, body_done
            if body_done:   # afterwards receive() only waits for the disconnect: no deadline
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), cfg.read_timeout)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {cfg.read_timeout:g} s") from None
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > MAX_BODY_BYTES:
                    raise HTTPException(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
                body_done = not msg.get("more_body", False)
            else:
                body_done = True
            return msg

        try:
            if not self._authorized(scope):
                resp = _error(401, "Incorrect API key provided. Pass it as 'Authorization: Bearer <key>'.",
                              code="invalid_api_key", headers={"www-authenticate": "Bearer"})
                await resp(scope, receive, send_status)
            elif _declared_length(scope) > MAX_BODY_BYTES:
                await _error(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")(
                    scope, receive, send_status)
            else:
                await self.app(scope, receive_limited, send_status)
        except ConnectionAbortedError as e:   # the bounded write gave up on this client
            log.warning("%s: %s; connection dropped", scope["path"], e)
        except Exception as e:
            log.exception("unhandled error on %s", scope["path"])
            if not state["started"]:
                await _error(500, f"internal server error: {type(e).__name__}", type="server_error")(
                    scope, receive, send_status)
        finally:
            self.server.metrics.count_request(self._route_label(scope), int(state["status"]))

    def _route_label(self, scope: Scope) -> str:
        """The route's path template (bounded label values), also for requests refused before
        routing (401, 413); 'other' for paths no route serves."""
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return str(getattr(route, "path", "other"))
        return "other"


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _api_error(exc)


async def _on_invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return _api_error(from_validation(exc.errors()))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
        # FastAPI's answer to a body that is not UTF-8, or JSON that Python cannot hold.
        message = "the request body could not be read as JSON (is it UTF-8, with numbers of sane size?)"
        return _error(400, message, code="invalid_json")
    return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind,
                  headers=dict(exc.headers or {}))


_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": R.ErrorResponse, "description": "an OpenAI-shaped error naming the bad field"},
    "5XX": {"model": R.ErrorResponse, "description": "the engine failed or is stopped"},
}


# One server-sent event: `data:` holds a chunk as JSON, or [DONE] at the end.
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
              "required": ["data"]}


def _streamed(model: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "the answer; with stream=true, server-sent events of chunks "
                                                 "ending with 'data: [DONE]'",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}, **_ERRORS}


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


def build_app(server: Server, manage_engine: bool = True) -> FastAPI:
    """The ASGI app. With manage_engine, the app's lifespan starts and stops the engine thread."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            server.engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.get_running_loop().run_in_executor(None, server.engine.shutdown)

    from .. import __version__
    app = FastAPI(title="ellm", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json",
                  description="OpenAI-compatible API of ellm. Errors are {\"error\": {message, type, param, code}}.",
                  exception_handlers={APIError: _on_api_error, RequestValidationError: _on_invalid_request,
                                      HTTPException: _on_http_error})

    @app.get("/health", response_model=R.Health, responses={503: {"model": R.Health}})
    async def health() -> Response:
        return await server.health()

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **_ERRORS})
    async def metrics(request: Request) -> Response:
        return await server.metrics_route(request)

    @app.get("/v1/models", response_model=R.ModelList, responses=_ERRORS)
    async def models() -> Response:
        return await server.models()

    @app.get("/v1/models/{model:path}", response_model=R.ModelCard, responses=_ERRORS)
    async def model(model: Annotated[str, Path(json_schema_extra={P.SERVER_FACT: "model_path"})]) -> Response:
        return await server.model(model)

    @app.post("/v1/completions", responses=_streamed(R.Completion))
    async def completions(body: P.CompletionRequest, request: Request) -> Response:
        return await server.completions(request, body)

    @app.post("/v1/chat/completions", responses=_streamed(R.ChatCompletion))
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Response:
        return await server.chat_completions(request, body)

    @app.post("/v1/embeddings", response_model=R.EmbeddingList, responses=_ERRORS)
    async def embeddings(body: P.EmbeddingRequest, request: Request) -> Response:
        return await server.embeddings(request, body)

    @app.post("/v1/responses", responses=_ERRORS)
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless (see ellm.server.responses_api)."""
        from .responses_api import create_response
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the request body could not be read as JSON", code="invalid_json") from None
        return await create_response(server, request, body)

    @app.post("/tokenize", response_model=R.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: P.TokenizeRequest) -> Response:
        return await server.tokenize(body)

    @app.post("/detokenize", response_model=R.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: P.DetokenizeRequest) -> Response:
        return await server.detokenize(body)

    app.openapi = lambda: served_openapi(app, server.cfg)  # type: ignore[method-assign]
    app.add_middleware(_Guard, server=server, routes=app.router.routes)
    if server.cfg.allowed_origins:   # added last: outermost, so preflights need no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(server.cfg.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    app.state.server = server
    return app
