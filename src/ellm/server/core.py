"""The Server: what every route shares -- the engine, the tokenizer, the checks a request
gets before it reaches the engine (model name, lengths, vocabulary, Unicode), chat
rendering (templates, tools, images) and the translation of engine failures into
OpenAI-shaped errors. The routes (ellm.server.routes) are functions over a Server;
ellm.server.app assembles them into the FastAPI app.

Tokenizing and chat-template rendering run in a small thread pool (off_loop), so the
event loop keeps answering other clients (and /health) while a long prompt is encoded;
prompts are limited in characters before tokenizing, and every text is checked to be
valid Unicode first (a lone surrogate is a 400).
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..engine.async_engine import AsyncEngine, EngineDeadError
from ..engine.engine import ModelFileChanged, RequestError, SequenceError
from ..sampling_params import SamplingParams
from . import protocol as P
from . import responses as R
from .compile_pool import ConstraintCompiler
from .constraints import ConstraintError, constraint_fields
from .errors import APIError
from .metrics import Metrics
from .tools import ToolError, ToolPlan

log = logging.getLogger("ellm.server")


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
    # [vision] http(s) image URLs are fetched only when this is set (ellm serve --allow-image-urls),
    # from public internet addresses only, and from these hosts (by name) whatever their address
    allow_image_urls: bool = False
    allowed_image_hosts: Sequence[str] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        self.model_names = tuple(dict.fromkeys(self.model_names))   # unique, in order
        if not self.model_names:
            raise ValueError("ServerConfig needs at least one model name")

    @property
    def model_name(self) -> str:
        return self.model_names[0]


class Server:
    """What the routes share over one AsyncEngine (or anything with its interface, such as
    the Ray Serve ingress's ReplicaPool). ellm.server.app.build_app wires it into an app.

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
        # [structured] constraints compile in threads of their own, with a deadline
        self.compiler = ConstraintCompiler(observe=self.metrics.constraint_compile.observe)
        self.fetcher: Any = None   # [vision] image URLs are fetched in threads of their own
        if config.allow_image_urls:
            from ..vision.fetch import FetchLimits, ImageFetcher
            self.fetcher = ImageFetcher(FetchLimits(allowed_hosts=tuple(config.allowed_image_hosts)))

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

    @property
    def adapters(self) -> list[str]:
        """[lora] The LoRA adapters' names (ellm serve --lora-modules), in order."""
        lora = getattr(getattr(getattr(self.engine, "engine", None), "model", None), "lora", None)
        return list(lora.names) if lora is not None else []

    def check_model(self, model: str | None) -> str | None:
        """A request may leave out model (the served model) or name any served alias, or
        [lora] a LoRA adapter. -> the adapter's name, or None for the base."""
        if model is None or model in self.cfg.model_names:
            return None
        if model in self.adapters:
            return model
        names = ", ".join(f"'{n}'" for n in [*self.cfg.model_names, *self.adapters])
        raise APIError(404, f"the model '{model}' does not exist; this server serves {names}",
                       param="model", code="model_not_found")

    def reported_model(self, model: str | None) -> str:
        """The "model" of a response: [lora] the adapter asked for, else the served model."""
        return model if model is not None and model in self.adapters else self.cfg.model_name

    def check_ids(self, ids: Sequence[int], param: str, what: str = "prompt token id") -> None:
        vocab = self.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"{what} {bad} is outside the vocabulary (size {vocab})", param=param)

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            ids = self.encode(prompt, param, add_special_tokens=True)
        else:
            self.check_ids(prompt, param)
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
                 template_kwargs: dict[str, Any] | None = None, plan: ToolPlan | None = None,
                 fetched: dict[str, Any] | None = None) -> list[int]:
        return self.chat_prompt(messages, add_generation_prompt, template_kwargs, plan, fetched)[0]

    async def fetch_images(self, messages: list[dict[str, Any]]) -> dict[str, Any] | None:
        """[vision] The http(s) image URLs of the messages fetched (in the fetcher's own
        threads, never the tokenizer's: a slow URL holds up only its own request), for
        chat_prompt's `fetched`; None when URLs are not fetched or there are none."""
        if self.fetcher is None or self.processing is None:
            return None
        from ..vision.chat import has_images
        if not has_images(messages):
            return None
        return await self.fetcher.fetch_all(messages)

    def prepare_images(self, messages: list[dict[str, Any]],
                       fetched: dict[str, Any] | None = None) -> tuple[list[dict[str, Any]], list[Any]]:
        """[vision] Decodes and preprocesses the messages' image parts (http(s) URLs only
        when allowed, from fetch_images' results): -> (messages for the template,
        ImageInputs in order)."""
        from ..vision.chat import prepare_messages
        from ..vision.images import ImageError
        fetch = None
        if self.fetcher is not None:
            fetch = self.fetcher.lookup(fetched or {})
        try:
            return prepare_messages(messages, self.processing, fetch=fetch,
                                    model_name=f"the model '{self.cfg.model_name}'")
        except ImageError as e:
            raise APIError(400, str(e), param=e.param or "messages", code="invalid_image") from None

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    plan: ToolPlan | None = None,
                    fetched: dict[str, Any] | None = None) -> tuple[list[int], list[Any] | None]:
        """The ids of a chat, and the ImageInputs its image tokens stand for (None without
        images). fetched: [vision] the image URLs' bytes, from fetch_images."""
        from ..vision.chat import has_images
        images = None
        if has_images(messages):   # [vision]
            if plan is not None:
                raise APIError(400, "images together with tools are not supported yet", param="tools")
            messages, images = self.prepare_images(messages, fetched)
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

    async def compile_params(self, req: P.GenerationRequest, plan: ToolPlan | None = None) -> SamplingParams:
        """sampling_params (then the tool plan's call grammar), with the constraint checked,
        compiled once and its llguidance matcher built in the compile threads, off the event
        loop and within a deadline (server/compile_pool.py); a request without a
        constraint is made here at once."""
        constrained = plan is not None or any(v is not None for v in req.constraint_fields().values())
        if not constrained:
            return self.sampling_params(req)
        return await self.compiler.run(self._compiled_params, req, plan)

    def _compiled_params(self, req: P.GenerationRequest, plan: ToolPlan | None) -> SamplingParams:
        params = self.sampling_params(req)
        if plan is not None:  # [tools] required / named: the call grammar
            try:
                params = plan.sampling(params)
            except ToolError as e:
                raise APIError(400, str(e), param=e.param) from None
        if params.constraint is not None:   # the tokenizer's view and the matcher, built once
            try:
                self.engine.engine.prepare_constraints(params)
            except RequestError as e:
                raise APIError(400, str(e)) from None
        return params

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

    def engine_error(self, e: BaseException) -> APIError:
        """The error answer for an engine failure (raised by a stream or by embed)."""
        if isinstance(e, ModelFileChanged):   # the weights changed under the mapping: nothing can run
            log.error("%s", e)
            return APIError(503, str(e), type="server_error", code="model_file_changed")
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

