"""The OpenAI wire format of answers: pydantic models of the JSON bodies (they document
/openapi.json, and the non-streamed bodies are built from them, so the two agree), and
the logprobs shapes of both endpoints.

Streamed chunks are plain dicts: they are built once per token, and SSE bodies are not
part of what an OpenAPI document can describe beyond their media type.
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from ..engine.sequence import TokenLogprob

# vLLM clamps -inf logprobs to this so that the JSON stays standard (no -Infinity).
MIN_LOGPROB = -9999.0


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV came from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


FinishReason = Literal["stop", "length", "abort", "tool_calls", "error"]


# -- /v1/completions -------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[CompletionChoice]
    usage: Usage


# -- /v1/chat/completions ----------------------------------------------------------------

class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    # left out when no tool was called (as OpenAI does), never []
    tool_calls: list[dict[str, Any]] | None = Field(None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: None = None
    choices: list[ChatChoice]
    usage: Usage


# -- /v1/embeddings ----------------------------------------------------------------------

class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# -- tokenize, models, health ------------------------------------------------------------

class TokenPiece(BaseModel):
    id: int
    piece: str


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]
    count: int
    max_model_len: int
    token_strs: list[str] | None = Field(None, description="with return_token_strs: each token's vocabulary string",
                                         exclude_if=lambda v: v is None)


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the text (vLLM's name)")
    content: str = Field(description="the same text (llama.cpp's name)")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ellm"
    root: str
    parent: str | None = None   # [lora] a LoRA adapter's base model
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "error"]
    model: str | None = None
    requests: int | None = None
    running: int | None = None
    waiting: int | None = None
    message: str | None = None


# ---------------------------------------------------------------------------------------
# ids, times, logprobs
# ---------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


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
