"""The OpenAI wire format of requests, as pydantic models (they also make /openapi.json).

Every field the server understands is typed and bounded here, so one bad field is a 400
naming it (see ellm.server.errors for the wording). The models are strict, as JSON is:
a string is not a number and `true` is not 1; an integral float (16.0) is still an
integer, as JSON Schema says. Unknown fields are ignored, as OpenAI-style servers
commonly do, except those whose meaning the server cannot honour (suffix, vLLM's
prompt_logprobs and use_beam_search, best_of other than n): their schema admits only the
value that means "off" (llama.cpp's n_probs too), and anything else is refused rather than
silently dropped.

What the schema cannot know (the context length, the vocabulary, the served model's
names, how many sequences the server runs at once) is checked by the app and answered
with a 4xx of the same shape.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError,
                      ValidatorFunctionWrapHandler, WithJsonSchema, WrapValidator, field_validator,
                      model_validator)

from ..sampling_params import LOGIT_BIAS_RANGE, MAX_LOGPROBS, PENALTY_RANGE
from .errors import phrase, refused

# Bounds that keep one request from swamping the server; over them is a 400.
MAX_N = 64                  # completions per prompt
MAX_PROMPTS = 64            # prompts in one /v1/completions request
MAX_EMBED_INPUTS = 256      # inputs in one /v1/embeddings request
MAX_STOP = 16               # stop strings
MAX_STOP_LEN = 256          # characters per stop string


# ---------------------------------------------------------------------------------------
# field types
# ---------------------------------------------------------------------------------------

def _integral(v: Any) -> Any:
    # 16.0 from a loosely typed client is still 16 (JSON Schema counts it as an integer).
    return int(v) if isinstance(v, float) and v.is_integer() else v


# Integers, with JSON Schema bounds. (The bounds come before the validator so that
# pydantic writes them into the schema as minimum / maximum.)
Int = Annotated[int, BeforeValidator(_integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=-1), BeforeValidator(_integral)]
# Facts only the running server knows (its vocabulary, model names, embedding size) are
# marked here and written into /openapi.json by ellm.server.app (served_openapi).
SERVER_FACT = "x-ellm-fact"
TokenId = Annotated[int, Field(ge=0, json_schema_extra={SERVER_FACT: "token_id"}), BeforeValidator(_integral)]
ModelName = Annotated[str | None, Field(json_schema_extra={SERVER_FACT: "model"},
                                        description="a served model name; omitted: the served model")]


def _bounded(kind: type, lo: float, hi: float, *, lo_open: bool = False) -> Any:
    """kind in [lo, hi] (or (lo, hi]); out of range is one message that gives both ends."""
    shown = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    text = f"must be between {lo:g} and {hi:g}" if kind is int else f"must be in {shown}"

    def wrap(v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(v)
        except ValidationError as e:
            if e.errors()[0]["type"] in ("greater_than", "greater_than_equal", "less_than_equal"):
                raise phrase(f"{text}, got {v!r}") from None
            raise

    low = Field(gt=lo) if lo_open else Field(ge=lo)
    if kind is int:
        return Annotated[int, low, Field(le=hi), BeforeValidator(_integral), WrapValidator(wrap)]
    return Annotated[float, low, Field(le=hi), WrapValidator(wrap)]


def _shape(v: Any) -> str | None:
    """Which JSON shape a prompt-like value has (the union members below are tagged by it)."""
    if isinstance(v, str):
        return "string"
    if not isinstance(v, list):
        return None
    if v and all(isinstance(x, list) for x in v):
        return "token_arrays"
    if v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return "tokens"
    return "strings"


def _prompt_list(p: Any) -> list[str | list[int]]:
    """A validated prompt-like value -> a list of prompts (texts or token-id lists)."""
    if isinstance(p, str):
        return [p]
    if isinstance(p[0], list):
        return [list(x) for x in p]
    if isinstance(p[0], int):
        return [list(p)]
    return list(p)


NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _prompt_union(what: str, most: int) -> Any:
    return Annotated[
        Union[Annotated[NonEmptyStr, Tag("string")],
              Annotated[list[NonEmptyStr], Field(min_length=1, max_length=most), Tag("strings")],
              Annotated[TokenIds, Tag("tokens")],
              Annotated[list[TokenIds], Field(min_length=1, max_length=most), Tag("token_arrays")]],
        Discriminator(_shape, custom_error_type="phrase",
                      custom_error_message=f"must be a string, an array of strings, an array of token ids "
                                           f"or an array of arrays of token ids ({what})")]


if TYPE_CHECKING:   # what mypy checks the fields as (it cannot read a call as a type)
    Prompt = Union[str, list[str], list[int], list[list[int]]]
    EmbeddingInput = Prompt
else:
    Prompt = _prompt_union("none empty", MAX_PROMPTS)
    EmbeddingInput = _prompt_union("none empty", MAX_EMBED_INPUTS)

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]
Stop = Annotated[
    Union[Annotated[StopString, Tag("string")],
          Annotated[list[StopString], Field(max_length=MAX_STOP), Tag("strings")]],
    Discriminator(lambda v: "string" if isinstance(v, str) else "strings" if isinstance(v, list) else None,
                  custom_error_type="phrase", custom_error_message="must be a string or an array of strings")]

# logit_bias: JSON object keys are strings, so token ids arrive as decimal strings.
if TYPE_CHECKING:
    LogitBias = dict[str, float]
else:
    LogitBias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                     _bounded(float, LOGIT_BIAS_RANGE[0], LOGIT_BIAS_RANGE[1])]


def _off_only(value: Any, message: str, param: str, schema: dict[str, Any]) -> Any:
    """A field whose only accepted value means "off"; anything else is refused by name."""
    def check(v: Any) -> Any:
        # Compared with its type too: 0 == False in Python, but not in JSON.
        if v is not None and (type(v) is not type(value) or v != value):
            raise refused(message, param)
        return v
    return Annotated[Any, BeforeValidator(check), WithJsonSchema({"anyOf": [schema, {"type": "null"}]})]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


# ---------------------------------------------------------------------------------------
# what completions and chat share
# ---------------------------------------------------------------------------------------

class StreamOptions(_Strict):
    include_usage: bool = False


def _when_set(field: str, other: str, value: Any) -> dict[str, Any]:
    """JSON Schema for "when `field` is given (not null), `other` must be `value`"."""
    return {"if": {"properties": {field: {"not": {"type": "null"}}}, "required": [field]},
            "then": {"properties": {other: {"const": value}}, "required": [other]}}


class SamplingFields(_Strict):
    """The fields /v1/completions and /v1/chat/completions share. None: the default
    (the model's generation_config, else ellm's), see Server.sampling_params."""
    model_config = ConfigDict(json_schema_extra={"allOf": [_when_set("stream_options", "stream", True)]})
    model: ModelName = None
    n: _bounded(int, 1, MAX_N) = Field(1, description="completions per prompt")  # type: ignore[valid-type]
    best_of: Int | None = Field(None, description="accepted only when equal to n")
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: _bounded(float, 0.0, 2.0) | None = None  # type: ignore[valid-type]
    top_p: _bounded(float, 0.0, 1.0, lo_open=True) | None = None  # type: ignore[valid-type]
    top_k: TopK | None = Field(None, description="0 or -1: off")
    min_p: _bounded(float, 0.0, 1.0) | None = None  # type: ignore[valid-type]
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    frequency_penalty: _bounded(float, *PENALTY_RANGE) | None = None  # type: ignore[valid-type]
    presence_penalty: _bounded(float, *PENALTY_RANGE) | None = None  # type: ignore[valid-type]
    seed: Int | None = None
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    logit_bias: LogitBias | None = Field(None, description="token id (a decimal string) -> bias in [-100, 100]")
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    user: str | None = Field(None, description="accepted and not used")
    # [structured] constrained output; checked (and named when wrong) by ellm.server.constraints
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp: a JSON schema the output follows")
    grammar: str | None = Field(None, description="llama.cpp: a GBNF (or Lark) grammar the output follows")
    guided_json: Any = Field(None, description="vLLM: a JSON schema (object or JSON text)")
    guided_regex: str | None = Field(None, description="vLLM: a regular expression the output matches")
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = Field(
        None, description="vLLM: the output is one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM: a Lark or GBNF grammar")
    guided_decoding_backend: str | None = Field(None, description="vLLM: accepted; ellm always uses llguidance")
    guided_whitespace_pattern: str | None = Field(None, description="vLLM: not supported (a 400)")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM: {json | regex | choice | grammar | json_object}")
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}')
    # vLLM's fields that would change what comes back: refused by name rather than dropped
    # (type: ignore: a call as a type, which pydantic reads and mypy cannot, as _bounded's)
    prompt_logprobs: _off_only(  # type: ignore[valid-type]
        None, "'prompt_logprobs' is not supported by this server (the prompt's logprobs are not computed)",
        "prompt_logprobs", {"type": "null"}) = None
    use_beam_search: _off_only(  # type: ignore[valid-type]
        False, "'use_beam_search' is not supported by this server (it samples)", "use_beam_search",
        {"type": "boolean", "enum": [False]}) = None
    n_probs: _off_only(  # type: ignore[valid-type]
        0, "llama.cpp's 'n_probs' is not supported; use 'logprobs' (and chat's 'top_logprobs')", "n_probs",
        {"type": "integer", "enum": [0]}) = None

    @model_validator(mode="after")
    def _shared_checks(self) -> SamplingFields:
        if self.best_of is not None and self.best_of != self.n:
            raise refused("'best_of' is not supported (it may only equal n)", "best_of")
        if self.stream_options is not None and not self.stream:
            raise refused("'stream_options' is only allowed when 'stream' is true", "stream_options")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def constraint_fields(self) -> dict[str, Any]:
        """[structured] The structured-output fields this request sets."""
        from .constraints import FIELDS
        return {k: getattr(self, k) for k in FIELDS if getattr(self, k, None) is not None}

    def sampling_fields(self) -> dict[str, Any]:
        """The SamplingParams fields this request sets (None: left to the defaults)."""
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias",
                 "skip_special_tokens", "include_stop_str_in_output")
        out = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if "logit_bias" in out:
            out["logit_bias"] = {int(k): v for k, v in out["logit_bias"].items()}
        if isinstance(out.get("stop"), str):
            out["stop"] = [out["stop"]]
        return out


# ---------------------------------------------------------------------------------------
# POST /v1/completions
# ---------------------------------------------------------------------------------------

# echo with logprobs would mean the prompt's logprobs, which are not computed
_ECHO_WITHOUT_LOGPROBS: dict[str, Any] = {"if": {"properties": {"echo": {"const": True}}, "required": ["echo"]},
                                          "then": {"properties": {"logprobs": {"type": "null"}}}}


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [_when_set("stream_options", "stream", True),
                                                           _ECHO_WITHOUT_LOGPROBS]})
    prompt: Prompt = Field(description="text, texts, token ids, or arrays of token ids")
    max_tokens: PositiveInt | None = Field(None, description="default 16, as OpenAI's")
    logprobs: _bounded(int, 0, MAX_LOGPROBS) | None = Field(  # type: ignore[valid-type]
        None, description="top logprobs per generated token")
    echo: bool | None = Field(None, description="the prompt's text before each completion's")
    suffix: _off_only("", "'suffix' is not supported by this server", "suffix",  # type: ignore[valid-type]
                      {"type": "string", "maxLength": 0}) = None

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise refused("'echo' with 'logprobs' asks for the prompt's logprobs, which this server does not "
                          "compute; leave out one of them", "echo")
        return self

    @property
    def default_max_tokens(self) -> int | None:
        return 16

    @property
    def max_tokens_param(self) -> str | None:
        """The field that set the output length, or None for the default."""
        return "max_tokens" if self.max_tokens is not None else None

    def prompts(self) -> list[str | list[int]]:
        return _prompt_list(self.prompt)


# ---------------------------------------------------------------------------------------
# POST /v1/chat/completions
# ---------------------------------------------------------------------------------------

class TextPart(_Strict):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, v: Any) -> Any:
        if not (isinstance(v, dict) and v.get("type") == "text" and isinstance(v.get("text"), str)):
            raise phrase('must be a text part: {"type": "text", "text": ...}')
        return v


class ImageURL(_Strict):
    """[vision] OpenAI's image_url object. detail is accepted for compatibility; ellm's
    processors have one resolution per model, so it changes nothing (docs/vision.md)."""
    url: str = Field(description="data:image/<type>;base64,... (http(s) only with --allow-image-urls)",
                     json_schema_extra={"pattern": "^(data:|https?://)"})
    detail: Literal["auto", "low", "high"] | None = None

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("data:", "http://", "https://")):
            raise phrase("must be a data: URL (data:image/png;base64,...) or an http(s) URL")
        return v


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


def _part_tag(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else None
    return {"text": "text_part", "image_url": "image_part"}.get(kind) if isinstance(kind, str) else None


Part = Annotated[Union[Annotated[TextPart, Tag("text_part")], Annotated[ImagePart, Tag("image_part")]],
                 Discriminator(_part_tag, custom_error_type="phrase",
                               custom_error_message='must be a text part {"type": "text", "text": ...} or an '
                                                    'image part {"type": "image_url", "image_url": {"url": ...}}')]

Content = Annotated[
    Union[Annotated[str, Tag("string")], Annotated[list[Part], Tag("parts")]],
    Discriminator(lambda v: "string" if isinstance(v, str) else "parts" if isinstance(v, list) else None,
                  custom_error_type="phrase", custom_error_message="must be a string or an array of content parts")]

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_Strict):
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"role": {"not": {"const": "assistant"}}}},
        "then": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}})
    role: Role
    content: Content | None = Field(None, description="required except for assistant messages")
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(None, description="tool: the call this message answers")

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise phrase("needs 'content' (only an assistant message may leave it out)")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it ({"role", "content"[, "name"]})."""
        content: str | list[dict[str, Any]]
        if self.content is None:
            content = ""
        elif isinstance(self.content, str):
            content = self.content
        elif any(isinstance(part, ImagePart) for part in self.content):   # [vision] the template sees the parts
            content = [{"type": "text", "text": part.text} if isinstance(part, TextPart)
                       else {"type": "image_url", "image_url": {"url": part.image_url.url}} for part in self.content]
        else:
            content = "\n".join(part.text for part in self.content if isinstance(part, TextPart))
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:   # [tools] rendered by ellm.server.tools
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


_RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "chat_template", "messages", "tools")


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [_when_set("stream_options", "stream", True),
                                                           _when_set("top_logprobs", "logprobs", True)]})
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = Field(None, description="deprecated name of max_completion_tokens")
    max_completion_tokens: PositiveInt | None = Field(
        None, description="default: until EOS or the end of the context")
    logprobs: bool | None = None
    top_logprobs: _bounded(int, 0, MAX_LOGPROBS) | None = None  # type: ignore[valid-type]
    # [tools] checked by ellm.server.tools (a bad entry is a 400 naming it)
    tools: list[dict[str, Any]] | None = Field(None, description="function tools")
    tool_choice: Any = Field(None, description='"none" | "auto" | "required" | {"type": "function", ...}')
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="variables for the chat template (not " + ", ".join(_RESERVED_TEMPLATE_KWARGS) + ")",
        json_schema_extra={"propertyNames": {"not": {"enum": list(_RESERVED_TEMPLATE_KWARGS)}}})

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        bad = sorted(set(_RESERVED_TEMPLATE_KWARGS) & set(v or {}))
        if bad:
            # A client-supplied template would be arbitrary code for the Jinja sandbox to run.
            raise refused(f"'chat_template_kwargs' may not set {', '.join(bad)}", "chat_template_kwargs")
        return v

    @model_validator(mode="after")
    def _logprobs_pair(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise refused("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        return self

    @property
    def default_max_tokens(self) -> int | None:
        return None   # until EOS or the end of the context, as vLLM does

    @property
    def max_tokens_param(self) -> str | None:
        if self.max_completion_tokens is not None:   # it wins over the older max_tokens
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens is not None else None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def top_logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


GenerationRequest = Union[CompletionRequest, ChatCompletionRequest]


def output_limit(req: GenerationRequest) -> int | None:
    """max_tokens for the engine: what the client set, else the endpoint's default."""
    limit = req.output_limit if isinstance(req, ChatCompletionRequest) else req.max_tokens
    return req.default_max_tokens if limit is None else limit


def logprob_count(req: GenerationRequest) -> int | None:
    """Top logprobs per token to return, None for no logprobs."""
    return req.top_logprob_count if isinstance(req, ChatCompletionRequest) else req.logprobs


# ---------------------------------------------------------------------------------------
# POST /v1/embeddings
# ---------------------------------------------------------------------------------------

class EmbeddingRequest(_Strict):
    input: EmbeddingInput = Field(description="text, texts, token ids, or arrays of token ids")
    model: ModelName = None
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each vector")
    dimensions: PositiveInt | None = Field(
        None, description="only the model's own embedding size is accepted",
        json_schema_extra={SERVER_FACT: "embedding_size"})
    pooling: Literal["mean", "last", "cls"] = Field("mean", description="ellm: how token states become one vector")
    normalize: bool = Field(True, description="ellm: scale each vector to unit length")
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        return _prompt_list(self.input)


# ---------------------------------------------------------------------------------------
# POST /tokenize, POST /detokenize (vLLM's and llama.cpp's)
# ---------------------------------------------------------------------------------------

class TokenizeRequest(_Strict):
    """Exactly one of prompt (vLLM), content (llama.cpp) or messages (a chat, rendered with
    the model's template)."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"properties": {"prompt": {"type": "string"}}, "required": ["prompt"]},
        {"properties": {"content": {"type": "string"}}, "required": ["content"]},
        {"properties": {"messages": {"type": "array"}}, "required": ["messages"]}]})
    model: ModelName = None
    prompt: str | None = None
    content: str | None = Field(None, description="llama.cpp's name for prompt")
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(None, description="add BOS as the model does (default true for "
                                                              "text, false for messages)")
    add_special: bool | None = Field(None, description="llama.cpp's name for add_special_tokens")
    add_generation_prompt: bool = Field(True, description="messages only")
    with_pieces: bool = Field(False, description="llama.cpp: tokens as {id, piece} objects")
    return_token_strs: bool | None = Field(None, description="vLLM: also each token's vocabulary string "
                                                             "(token_strs)")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, json_schema_extra={"propertyNames": {"not": {"enum": list(_RESERVED_TEMPLATE_KWARGS)}}})

    @model_validator(mode="after")
    def _one_source(self) -> TokenizeRequest:
        given = [k for k in ("prompt", "content", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            what = "none" if not given else " and ".join(given)
            raise refused(f"give exactly one of 'prompt', 'content' or 'messages' (got {what})",
                          given[1] if len(given) > 1 else "prompt",
                          code=None if given else "missing_required_parameter")
        bad = sorted(set(_RESERVED_TEMPLATE_KWARGS) & set(self.chat_template_kwargs or {}))
        if bad:
            raise refused(f"'chat_template_kwargs' may not set {', '.join(bad)}", "chat_template_kwargs")
        return self

    @property
    def text(self) -> str | None:
        return self.prompt if self.prompt is not None else self.content

    def special_tokens(self) -> bool:
        for v in (self.add_special_tokens, self.add_special):
            if v is not None:
                return v
        return self.messages is None


class DetokenizeRequest(_Strict):
    model: ModelName = None
    tokens: list[TokenId]
