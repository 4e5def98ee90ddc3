"""The OpenAI wire format: request validation and response / chunk shapes.

Requests arrive as parsed JSON (anything). parse_completion / parse_chat check every
field the server understands for its type and range and raise APIError (an OpenAI-shaped
error with a status code) naming the field; unknown fields are ignored, as OpenAI-style
servers commonly do, except fields whose meaning the server cannot honour (tools, a
non-text response_format, echo, suffix), which are refused rather than silently dropped.

Nothing here imports Starlette: the shapes are plain dicts, serialised by the app.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.sequence import TokenLogprob
from ..sampling_params import MAX_LOGPROBS, SamplingParams

# Bounds that keep one request from swamping the server; over them is a 400.
MAX_N = 64                  # completions per prompt
MAX_PROMPTS = 64            # prompts in one /v1/completions request
MAX_STOP = 16               # stop strings
MAX_STOP_LEN = 256          # characters per stop string
# vLLM clamps -inf logprobs to this so that the JSON stays standard (no -Infinity).
MIN_LOGPROB = -9999.0

Prompt = str | list[int]


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---------------------------------------------------------------------------------------
# field checks
# ---------------------------------------------------------------------------------------

_MISSING = object()


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _type_name(v: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _opt_int(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)   # 16.0 from a loosely typed client is still 16
    if not isinstance(v, int) or isinstance(v, bool):
        raise _bad(name, f"'{name}' must be an integer, got {_type_name(v)} {v!r}")
    return v


def _opt_number(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a number, got {_type_name(v)} {v!r}")
    if not math.isfinite(v):
        raise _bad(name, f"'{name}' must be finite, got {v!r}")
    return float(v)


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_type_name(v)} {v!r}")
    return v


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _bad(name, f"'{name}' must be a string, got {_type_name(v)}")
    return v


def _stop(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "'stop' must be a string or an array of strings")
    if len(v) > MAX_STOP:
        raise _bad("stop", f"'stop' may hold at most {MAX_STOP} strings, got {len(v)}")
    if any(s == "" for s in v):
        raise _bad("stop", "'stop' strings must not be empty")
    if any(len(s) > MAX_STOP_LEN for s in v):
        raise _bad("stop", f"'stop' strings may be at most {MAX_STOP_LEN} characters long")
    return list(v)


def _int_list(v: Any, name: str) -> list[int] | None:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return None
    return list(v)


# ---------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------

@dataclass
class GenerationRequest:
    """What both endpoints boil down to. prompts (completions) or messages (chat) is set."""
    kind: str                                  # "completion" | "chat"
    model: str
    params: SamplingParams                     # n=1; per-choice seeds are derived from it
    n: int
    stream: bool
    include_usage: bool
    max_tokens_param: str | None               # the field that set max_tokens; None: the default
    prompts: list[Prompt] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    logprobs: int | None = None                # top logprobs per token, None: none asked
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def choice_params(self, i: int) -> SamplingParams:
        """Params of the i-th completion of a prompt: seed + i when seeded."""
        if self.params.seed is None or i == 0:
            return self.params
        import dataclasses
        return dataclasses.replace(self.params, seed=self.params.seed + i)


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_type_name(body)}")
    return body


def _model(body: dict[str, Any]) -> str:
    v = body.get("model", _MISSING)
    if v is _MISSING or v is None:
        raise _bad("model", "you must provide a model parameter", code="missing_required_parameter")
    if not isinstance(v, str):
        raise _bad("model", f"'model' must be a string, got {_type_name(v)}")
    return v


def _sampling(body: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Builds SamplingParams (n=1) from the fields both endpoints share."""
    for name in ("frequency_penalty", "presence_penalty"):
        v = _opt_number(body, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise _bad(name, f"'{name}' must be in [-2, 2], got {v:g}")
    temperature = _opt_number(body, "temperature")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise _bad("temperature", f"'temperature' must be in [0, 2], got {temperature:g}")
    bias = body.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object mapping token ids to biases")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and _int_list(stop_ids, "stop_token_ids") is None:
        raise _bad("stop_token_ids", "'stop_token_ids' must be an array of integers")
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": _opt_number(body, "top_p"),
        "top_k": _opt_int(body, "top_k"),
        "min_p": _opt_number(body, "min_p"),
        "repetition_penalty": _opt_number(body, "repetition_penalty"),
        "frequency_penalty": _opt_number(body, "frequency_penalty"),
        "presence_penalty": _opt_number(body, "presence_penalty"),
        "seed": _opt_int(body, "seed"),
        "stop": _stop(body),
        "stop_token_ids": stop_ids,
        "ignore_eos": _opt_bool(body, "ignore_eos"),
        "logit_bias": bias,
        "logprobs": logprobs,
        "skip_special_tokens": _opt_bool(body, "skip_special_tokens"),
        "include_stop_str_in_output": _opt_bool(body, "include_stop_str_in_output"),
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k in ("max_tokens", "logprobs")}
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        msg = str(e)
        name = msg.split(" ", 1)[0]   # SamplingParams' messages start with the field name
        raise _bad(name if name in kwargs else None, msg) from None


def _common(body: dict[str, Any], default_max_tokens: int | None, max_tokens_names: tuple[str, ...],
            logprobs: int | None) -> tuple[SamplingParams, int, bool, bool, str | None]:
    """-> (params, n, stream, include_usage, the max-tokens field the client set or None)."""
    max_tokens, given = default_max_tokens, None
    for name in max_tokens_names:   # the first one set wins (max_completion_tokens over max_tokens)
        v = _opt_int(body, name)
        if v is not None:
            if v < 1:
                raise _bad(name, f"'{name}' must be at least 1, got {v}")
            max_tokens, given = v, name
            break
    n = _opt_int(body, "n")
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise _bad("n", f"'n' must be between 1 and {MAX_N}, got {n}")
    best_of = _opt_int(body, "best_of")
    if best_of is not None and best_of != n:
        raise _bad("best_of", "'best_of' is not supported (it may only equal n)")
    stream = bool(_opt_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        iu = _opt_bool(opts, "include_usage")
        include_usage = bool(iu)
    params = _sampling(body, max_tokens, logprobs)
    return params, n, stream, include_usage, given


def parse_completion(body: Any) -> GenerationRequest:
    """Validates a POST /v1/completions body."""
    body = _require_object(body)
    model = _model(body)
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "you must provide a prompt parameter", code="missing_required_parameter")
    prompts = _prompts(body["prompt"])
    if _opt_bool(body, "echo"):
        raise _bad("echo", "'echo' is not supported by this server")
    suffix = _opt_str(body, "suffix")
    if suffix:
        raise _bad("suffix", "'suffix' is not supported by this server")
    logprobs = _opt_int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise _bad("logprobs", f"'logprobs' must be between 0 and {MAX_LOGPROBS}, got {logprobs}")
    # OpenAI's legacy completions default to 16 tokens.
    params, n, stream, include_usage, given = _common(body, 16, ("max_tokens",), logprobs)
    if len(prompts) * n > MAX_PROMPTS * 4:
        raise _bad("n", f"{len(prompts)} prompts x n={n} is more completions than one request may ask for")
    return GenerationRequest("completion", model, params, n, stream, include_usage, given,
                             prompts=prompts, logprobs=logprobs)


def _prompts(v: Any) -> list[Prompt]:
    """str | [str] | [int] | [[int]] -> a list of prompts (strings or token-id lists)."""
    if isinstance(v, str):
        out: list[Prompt] = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) for p in v):
        out = list(v)
    elif isinstance(v, list) and v and _int_list(v, "prompt") is not None:
        out = [list(v)]
    elif isinstance(v, list) and v and all(isinstance(p, list) and _int_list(p, "prompt") is not None for p in v):
        out = [list(p) for p in v]
    else:
        raise _bad("prompt", "'prompt' must be a string, an array of strings, an array of token ids "
                             "or an array of arrays of token ids (none empty)")
    if len(out) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(out)}")
    for p in out:
        if len(p) == 0:
            raise _bad("prompt", "a prompt is empty")
    return out


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_chat(body: Any) -> GenerationRequest:
    """Validates a POST /v1/chat/completions body."""
    body = _require_object(body)
    model = _model(body)
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "you must provide a messages parameter", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "'messages' must be a non-empty array of message objects")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools:
        raise _bad("tools", "'tools' (function calling) is not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _bad("response_format", "only response_format {\"type\": \"text\"} is supported")
    want = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs")
    if top is not None:
        if not want:
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs' set to true")
        if not 0 <= top <= MAX_LOGPROBS:
            raise _bad("top_logprobs", f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}, got {top}")
    logprobs = (top or 0) if want else None
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    reserved = sorted({"chat_template", "messages", "add_generation_prompt", "tools"} & set(kwargs or {}))
    if reserved:
        # A client-supplied template would be arbitrary code for the Jinja sandbox to run.
        raise _bad("chat_template_kwargs", f"'chat_template_kwargs' may not set {', '.join(reserved)}")
    # No max_tokens: generate until EOS or the end of the context, as vLLM does.
    params, n, stream, include_usage, given = _common(
        body, None, ("max_completion_tokens", "max_tokens"), logprobs)
    return GenerationRequest("chat", model, params, n, stream, include_usage, given,
                             messages=clean, logprobs=logprobs, chat_template_kwargs=dict(kwargs or {}))


def _message(m: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(param, f"'{param}' must be an object with 'role' and 'content'")
    role = m.get("role")
    if role not in _ROLES:
        raise _bad(f"{param}.role", f"'{param}.role' must be one of {', '.join(_ROLES)}, got {role!r}")
    content = m.get("content")
    if content is None:
        if role != "assistant":
            raise _bad(f"{param}.content", f"'{param}.content' is required")
        content = ""
    elif isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}.content[{j}]", "only text content parts ({\"type\": \"text\", "
                                                    "\"text\": ...}) are supported")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise _bad(f"{param}.content", f"'{param}.content' must be a string or an array of text parts")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


# ---------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _lp(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


class TokenText:
    """Token id -> its text and bytes, for logprobs. Cached: the same ids recur."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = _token_bytes(self.tokenizer, token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                # Part of a multi-byte character: OpenAI spells such tokens "bytes:\xNN".
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = (text, raw)
            if len(self._cache) < 1 << 17:
                self._cache[token_id] = hit
        return hit


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    fn = getattr(tokenizer, "token_bytes", None)
    if callable(fn):
        return bytes(fn(token_id))
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text.encode("utf-8")


def completion_logprobs(lps: list[TokenLogprob], texts: TokenText, offset: int) -> tuple[dict[str, Any], int]:
    """The legacy completions shape for these tokens; offset = characters before them.
    -> (logprobs object, offset after them)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        s, _ = texts.get(lp.token_id)
        tokens.append(s)
        token_lps.append(_lp(lp.logprob))
        tops.append({texts.get(t)[0]: _lp(v) for t, v in (lp.top or [])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(lps: list[TokenLogprob], texts: TokenText) -> dict[str, Any]:
    """The chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    content = []
    for lp in lps:
        s, raw = texts.get(lp.token_id)
        top = []
        for t, v in lp.top or []:
            ts, traw = texts.get(t)
            top.append({"token": ts, "logprob": _lp(v), "bytes": list(traw)})
        content.append({"token": s, "logprob": _lp(lp.logprob), "bytes": list(raw), "top_logprobs": top})
    return {"content": content, "refusal": None}
