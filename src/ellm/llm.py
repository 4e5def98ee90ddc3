"""LLM: a loaded model behind generate / stream / chat / embed / logits, sync and async.

Every call goes through one engine loop: an AsyncEngine whose thread alone steps the
Engine (continuous batching). Blocking calls post their requests and wait on a
per-request queue, async calls on a per-request asyncio.Queue; so any number of threads,
interleaved stream() generators and asyncio tasks share one LLM, their requests batch
together and each gets only its own tokens. The loop starts on first use and stops on
close(), at the end of a `with` block, when the LLM is collected, or at interpreter exit.
"""
from __future__ import annotations

import asyncio
import logging
import sys
import warnings
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

import numpy as np

from .config import ModelConfig
from .engine.async_engine import AsyncEngine, BlockingRequestStream, EngineDeadError, FinalOutput, RequestStream
from .engine.engine import POOLINGS, Engine, EngineConfig
from .engine.sequence import FinishReason, TokenLogprob
from .sampling_defaults import SamplingDefaults
from .sampling_params import SamplingParams
from .vision.images import DEFAULT_LIMITS, ImageError, ImageLimits, ImageSource

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]
# One request: prompt ids, its params, and the ImageInputs for its image tokens (or None)
_Request = tuple[list[int], SamplingParams, Union[list[Any], None]]


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None         # why, when finish_reason is "error" (a constraint failed)
    # chat with tools: the parsed calls (ellm.server.tools.ToolCall) and the text beside them
    tool_calls: list[Any] | None = None
    content: str | None = None

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class _Encoded:
    """A prompt already turned into ids with its images (chat() with image parts)."""
    ids: list[int]
    images: list[Any]


# What generate() says to chat-shaped input: messages are for chat(), which applies the template.
CHAT_INPUT_HINT = ("generate() and stream() take text prompts (a string, a list of token ids, or a list of "
                   "those); chat messages ({'role': ..., 'content': ...} dicts) go to chat(messages) or "
                   "chat_stream(messages), which apply the model's chat template")


def _is_messages(value: Any) -> bool:
    """A message dict, or a non-empty list of them: the input of chat(), not generate()."""
    return isinstance(value, dict) or (isinstance(value, (list, tuple)) and len(value) > 0
                                       and all(isinstance(m, dict) for m in value))


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """chat()'s conversation: a list of message dicts; a string is taken as one user message
    (the only thing a string can mean there). A lone dict is a TypeError, not guessed at."""
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    if isinstance(messages, dict):
        raise TypeError("chat() takes a list of messages (or a string, one user message); wrap the one "
                        "message in a list: chat([message])")
    return messages


def _is_single(prompt: Any) -> bool:
    if isinstance(prompt, (str, _Encoded)):
        return True
    return isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0 and \
        all(isinstance(t, (int, np.integer)) for t in prompt)


def _choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n completions: n=1, seed + i when seeded (as the server does)."""
    seed = params.seed if params.seed is None else params.seed + i
    return SamplingParams.from_kwargs(params, n=1, seed=seed)


def _completion(final: FinalOutput, params: SamplingParams) -> CompletionOutput:
    return CompletionOutput(final.text, final.token_ids, final.finish_reason, final.prompt_token_ids,
                            final.logprobs if params.logprobs is not None else None, final.error)


def _shape(outs: list[CompletionOutput], n: int, single: bool) -> Any:
    """One output per prompt (n=1) or a list of n per prompt; unwrapped for one prompt."""
    per_prompt: list[Any] = outs if n == 1 else [outs[i:i + n] for i in range(0, len(outs), n)]
    return per_prompt[0] if single else per_prompt


class LLM:
    """A loaded model. Build with `ellm.load(source)`.

    Thread-safe and asyncio-friendly: see the module docstring. `llm.engine` is the
    Engine the loop thread owns (read its config; do not call its methods while the loop
    runs); `llm.async_engine` is the loop itself, which the server shares."""

    def __init__(self, model: Any, tokenizer: Any, config: ModelConfig, source: str,
                 engine_config: EngineConfig | None = None,
                 sampling_defaults: SamplingDefaults | None = None, processing: Any = None,
                 draft_model: Any = None) -> None:
        self.model, self.tokenizer, self.config, self.source = model, tokenizer, config, source
        # [vision] the image processor (ellm.vision.preprocess) of a model that takes images,
        # else None; image_limits bound every image given to this LLM
        self.processing = processing
        self.image_limits: ImageLimits = DEFAULT_LIMITS
        self.engine = Engine(model, tokenizer, engine_config, draft_model)  # [spec] draft_model
        self.async_engine = AsyncEngine(self.engine, max_queue=None)
        self.defaults = sampling_defaults or SamplingDefaults()
        self._closed = False
        # Stops the loop thread when this object is collected or the interpreter exits;
        # the callback holds the AsyncEngine, never the LLM.
        self._finalizer = weakref.finalize(self, self.async_engine.shutdown)

    def __repr__(self) -> str:
        return f"LLM({self.source!r}, {self.config.model_type}, {self.config.num_hidden_layers} layers)"

    # -- life cycle -----------------------------------------------------------------

    def close(self) -> None:
        """Stops the engine loop; requests still running fail with EngineDeadError, later
        calls raise it. Safe more than once."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _loop(self) -> AsyncEngine:
        if self._closed:
            raise EngineDeadError(f"{self!r} is closed")
        if not self.async_engine.is_running:
            self.async_engine.start()
        return self.async_engine

    # -- prompts ------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """A string is encoded with the tokenizer's special tokens (BOS); no chat template."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if _is_messages(prompt):
            raise TypeError(CHAT_INPUT_HINT)
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise TypeError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
        if bad is not None:
            raise TypeError(f"a token-id prompt holds ints, not {type(bad).__name__} ({bad!r}); {CHAT_INPUT_HINT}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation under the chat template, ending with the assistant's
        turn opened; BOS added when the tokenizer wants one and the template did not write it."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def encode_chat_with_images(self, messages: list[dict[str, Any]], fetch: Any = None
                                ) -> tuple[list[int], list[Any] | None]:
        """encode_chat() for messages that may hold image parts: -> (ids with every image's
        tokens in place, the ImageInputs in order, or None when there are none). An image
        for a model without a vision tower is an ImageError."""
        from .vision.chat import has_images, prepare_messages
        from .vision.preprocess import expand_prompt
        if not has_images(messages):
            return self.encode_chat(messages), None
        template_messages, images = prepare_messages(messages, self.processing, self.image_limits, fetch,
                                                     model_name=self.source)
        prompt = self.tokenizer.apply_chat_template(template_messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(expand_prompt(prompt, self.processing, images), add_special_tokens=False)
        bos = self.tokenizer.bos_token_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids, images

    def encode_prompt_with_images(self, prompt: str, images: Sequence[ImageSource]) -> tuple[list[int], list[Any]]:
        """A text prompt holding one placeholder per image (`llm.processing.placeholder`,
        e.g. "<image>"): -> (ids with the images' tokens in place, the ImageInputs)."""
        from .vision.images import decode_image
        from .vision.preprocess import expand_prompt
        if not isinstance(prompt, str):
            raise TypeError("a prompt with images must be a string holding the image placeholders")
        if self.processing is None:
            raise ImageError(f"{self.source} takes no images (it has no vision tower)")
        inputs = [self.processing.preprocess(decode_image(img, self.image_limits, what=f"images[{i}]"))
                  for i, img in enumerate(images)]
        return self.tokenizer.encode(expand_prompt(prompt, self.processing, inputs), add_special_tokens=True), inputs

    def sampling_params(self, params: SamplingParams | None = None, **kwargs: Any) -> SamplingParams:
        """The SamplingParams a call runs with: params as given, or this model's defaults
        (`llm.defaults`), then keyword overrides. An unknown keyword is a TypeError."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        if params is not None:
            return SamplingParams.from_kwargs(params, **kwargs)
        return SamplingParams.from_kwargs(None, **{**self.defaults.as_dict(), **kwargs})

    def _requests(self, prompts: Any, params: SamplingParams,
                  images: Sequence[ImageSource] | None = None) -> tuple[list[_Request], bool]:
        if _is_messages(prompts):
            raise TypeError(CHAT_INPUT_HINT)
        single = _is_single(prompts)
        if images is not None or isinstance(prompts, _Encoded):   # [vision]
            if not single:
                raise ValueError("images= goes with one prompt; for several, call once per prompt")
            ids, inputs = self._prompt_with_images(prompts, images)
            return [(ids, _choice_params(params, j), inputs) for j in range(params.n)], True
        if not single and not hasattr(prompts, "__iter__"):
            raise TypeError(f"{CHAT_INPUT_HINT}; got {type(prompts).__name__}")
        batch = [prompts] if single else list(prompts)
        encoded = [self.encode_prompt(p) for p in batch]
        return [(ids, _choice_params(params, j), None) for ids in encoded for j in range(params.n)], single

    def _prompt_with_images(self, prompt: Any, images: Any) -> tuple[list[int], list[Any] | None]:
        if isinstance(prompt, _Encoded):   # chat(): already expanded
            return prompt.ids, prompt.images
        return self.encode_prompt_with_images(prompt, list(images))

    # -- generation (blocking; any thread) ----------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 *, images: Sequence[ImageSource] | None = None, adapter: str | None = None,
                 **kwargs: Any) -> Any:
        """Runs prompts to the end. A string or token-id prompt gives one CompletionOutput;
        a list of prompts gives a list, in order, all run together in one batch. With
        n > 1 each prompt gives a list of n CompletionOutputs instead (seeded: choice i
        uses seed + i), so a list of prompts gives a list of such lists. Strings are
        encoded as they are (no chat template; use chat() for that). Safe from any thread.
        images: for a model with a vision tower, the images (Pillow images, paths, bytes or
        data: URLs) of ONE string prompt that holds one placeholder per image
        (`llm.processing.placeholder`).
        adapter: the name of a LoRA adapter given to ellm.load(lora_adapters=...) to run
        these prompts with (None: the base model)."""
        params = self.sampling_params(params, **kwargs)
        reqs, single = self._requests(prompts, params, images)
        if not reqs:
            return []
        loop = self._loop()
        streams = []
        try:
            for ids, p, imgs in reqs:
                streams.append(loop.submit_blocking(ids, p, images=imgs, adapter=adapter, final_only=True))
            outs = [_completion(s.result(), params) for s in streams]
        finally:
            for s in streams:
                s.close()
        self._hint_chat_template(prompts, outs)
        return _shape(outs, params.n, single)

    def _hint_chat_template(self, prompts: Any, outs: list[CompletionOutput]) -> None:
        """A chat model given bare text often ends its turn at once, and '' alone says nothing:
        warn that generate() applies no chat template and name the method that does."""
        texts = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and any(isinstance(p, str) for p in prompts))
        tok = self.tokenizer
        if not texts or not tok.chat_template or tok.chat_template_builtin:
            return   # (a family's built-in template may belong to a base model: no hint)
        if any(o.text == "" and o.finish_reason == "stop" and len(o.token_ids) <= 1 for o in outs):
            warnings.warn(f"{self.source} ended its reply at once (an empty completion): it is a chat model, and "
                          "generate() sends the text as it is, without the model's chat template; "
                          "chat() applies it (llm.chat(\"...\"), or chat([{'role': 'user', 'content': ...}]))",
                          UserWarning, stacklevel=3)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
               images: Sequence[ImageSource] | None = None, adapter: str | None = None,
               **kwargs: Any) -> Iterator[str]:
        """Yields the text of one completion piece by piece. Closing the generator (or
        dropping it) aborts the request and frees its blocks. images, adapter: as in
        generate()."""
        params = self.sampling_params(params, **kwargs)
        if params.n != 1:
            raise ValueError(f"n={params.n}: stream() yields one completion; use generate() for n > 1")
        self.engine.adapter_slot(adapter)   # [lora] an unknown name fails here, not at the first next()
        if images is not None or isinstance(prompt, _Encoded):
            ids, inputs = self._prompt_with_images(prompt, images)
            return self._stream(ids, params, inputs, adapter)
        return self._stream(self.encode_prompt(prompt), params, adapter=adapter)

    def _stream(self, ids: list[int], params: SamplingParams, images: list[Any] | None = None,
                adapter: str | None = None) -> Iterator[str]:
        s = self._loop().submit_blocking(ids, params, images=images, adapter=adapter)
        try:
            for out in s:
                if out.new_text:
                    yield out.new_text
        finally:
            s.close()

    def chat(self, messages: list[dict[str, Any]] | str, params: SamplingParams | None = None, *,
             tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
             parallel_tool_calls: bool = True, **kwargs: Any) -> Any:
        """Applies the model's chat template and generates the assistant's reply: one
        CompletionOutput, or a list of n with n > 1.

        tools (OpenAI function tools) and tool_choice ("none" | "auto" | "required" |
        {"type": "function", "function": {"name": ...}}): each reply's `tool_calls` holds
        the parsed calls and `content` the text beside them (see ellm.server.tools and
        docs/structured-output-and-tools.md).

        A message's content may be a list of parts, images among them:
        {"type": "image", "image": <Pillow image | path | bytes | data: URL>} or OpenAI's
        {"type": "image_url", "image_url": {"url": "data:..."}} (see docs/vision.md).
        A string is one user message: chat("Hi") is chat([{"role": "user", "content": "Hi"}])."""
        messages = _chat_messages(messages)
        if tools is not None or tool_choice is not None:  # [tools]
            self._no_images_with_tools(messages)
            from .server.tools import ToolPlan
            plan = ToolPlan.make(self.tokenizer, tools, tool_choice, parallel_tool_calls)
            adapter = kwargs.pop("adapter", None)   # [lora]
            sp = plan.sampling(self.sampling_params(params, **kwargs))
            out = self.generate(plan.prompt_ids(self.tokenizer, messages), sp, adapter=adapter)
            for o in out if isinstance(out, list) else [out]:
                o.content, calls = plan.parse(o.text, cut=o.finish_reason == "length")
                o.tool_calls = calls or None
            return out
        return self.generate(self._chat_prompt(messages), params, **kwargs)

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> Any:
        ids, images = self.encode_chat_with_images(messages)
        return ids if images is None else _Encoded(ids, images)

    def _no_images_with_tools(self, messages: list[dict[str, Any]]) -> None:
        from .vision.chat import has_images
        if has_images(messages):
            raise ImageError("images together with tools are not supported yet: send them in separate calls")

    def chat_stream(self, messages: list[dict[str, Any]] | str, params: SamplingParams | None = None,
                    **kwargs: Any) -> Iterator[str]:
        """stream() of the assistant's reply under the chat template."""
        return self.stream(self._chat_prompt(_chat_messages(messages)), params, **kwargs)

    # -- generation (asyncio) -------------------------------------------------------------

    async def agenerate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                        *, images: Sequence[ImageSource] | None = None, adapter: str | None = None,
                        **kwargs: Any) -> Any:
        """generate() for asyncio: the same arguments and return shape. Cancelling the
        awaiting task aborts its requests and frees their blocks before the next step."""
        params = self.sampling_params(params, **kwargs)
        reqs, single = self._requests(prompts, params, images)
        if not reqs:
            return []
        loop = self._loop()
        loop.engine.adapter_slot(adapter)   # [lora] an unknown name fails before any request starts
        tasks = [asyncio.ensure_future(loop.generate(ids, p, images=imgs, adapter=adapter))
                 for ids, p, imgs in reqs]
        try:
            finals = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:   # one failed or we were cancelled: stop the others too
                t.cancel()
            raise
        outs = [_completion(f, params) for f in finals]
        self._hint_chat_template(prompts, outs)
        return _shape(outs, params.n, single)

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                      images: Sequence[ImageSource] | None = None, adapter: str | None = None,
                      **kwargs: Any) -> AsyncIterator[str]:
        """stream() for asyncio (`async for piece in llm.astream(...)`); closing the
        iterator or cancelling its task aborts the request."""
        params = self.sampling_params(params, **kwargs)
        if params.n != 1:
            raise ValueError(f"n={params.n}: astream() yields one completion; use agenerate() for n > 1")
        if images is not None or isinstance(prompt, _Encoded):
            ids, inputs = self._prompt_with_images(prompt, images)
        else:
            ids, inputs = self.encode_prompt(prompt), None
        s = self._loop().submit(ids, params, images=inputs, adapter=adapter)
        try:
            async for out in s:
                if out.new_text:
                    yield out.new_text
        finally:
            s.close()

    async def achat(self, messages: list[dict[str, Any]] | str, params: SamplingParams | None = None,
                    **kwargs: Any) -> Any:
        """chat() for asyncio."""
        return await self.agenerate(self._chat_prompt(_chat_messages(messages)), params, **kwargs)

    # -- one request's deltas (for layers over LLM: ellm.integrations) ------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, *,
               images: list[Any] | None = None) -> BlockingRequestStream:
        """Queues one request of prompt token ids (with the ImageInputs of its image tokens,
        as encode_chat_with_images gives them) and returns its stream: an iterator of the
        engine's RequestOutput deltas (new text and token ids, the totals so far, the
        finish reason, the prompt ids), for code that needs more than the text. Closing the
        stream, or dropping it, aborts the request. Safe from any thread."""
        return self._loop().submit_blocking([int(t) for t in prompt_ids], params, images=images)

    def asubmit(self, prompt_ids: Sequence[int], params: SamplingParams, *,
                images: list[Any] | None = None) -> RequestStream:
        """submit() for asyncio: call it inside a running event loop; `async for` the deltas."""
        return self._loop().submit([int(t) for t in prompt_ids], params, images=images)

    # -- direct model access ----------------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 logits (len(ids), vocab_size): one row per position. Computed on the
        engine thread between two steps; safe from any thread."""
        return self._loop().logits_blocking([int(t) for t in ids])

    def _embed_ids(self, texts: str | Sequence[Prompt], pooling: str) -> list[list[int]]:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        batch: list[Prompt] = [texts] if _is_single(texts) else list(texts)  # type: ignore[list-item]
        return [self.encode_prompt(t) for t in batch]

    def embed(self, texts: str | Sequence[Prompt], pooling: str = "mean", normalize: bool = True) -> np.ndarray:
        """Embeddings, float32 (len(texts), hidden_size) (one row for a single text): the
        model's final-normed hidden states pooled over each text's tokens ("mean"), or
        taken at its last ("last") or first ("cls") token, L2-normalised when normalize.
        Texts are encoded with special tokens (BOS), no template; token-id lists work too.
        Batched through the engine loop; decoding requests keep stepping in between."""
        return self._loop().embed_blocking(self._embed_ids(texts, pooling), pooling, normalize)

    async def aembed(self, texts: str | Sequence[Prompt], pooling: str = "mean",
                     normalize: bool = True) -> np.ndarray:
        """embed() for asyncio."""
        return await self._loop().embed(self._embed_ids(texts, pooling), pooling, normalize)


def _chat_template_source(value: str) -> str:
    """A template given to load(): Jinja text, or the path of a file holding it."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"chat_template={value!r} is neither a Jinja template (no '{{{{' or '{{%') "
                     "nor a file that exists")


def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be None, 0 (all CPUs this process may use) or an int >= 1, "
                         f"got {threads!r}")
    from ._native import _kernels
    _kernels.set_num_threads(threads)


# kv_cache_dtype= names ("auto": the device's, KV_CACHE_AUTO; the others: the cache's element type)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# the devices each cache type runs on (float32 everywhere)
KV_CACHE_DEVICES = {"float16": ("cpu",), "bfloat16": ("cuda", "reference")}
# "auto" by device: float32 elsewhere (every logit as the model computes it). On a GPU
# the cache is bfloat16, as GPU engines keep it: half the memory and of the bytes decode
# attention reads, for logits within ~0.6% of the float32 cache's (docs/kv-cache.md).
KV_CACHE_AUTO = {"cuda": "bfloat16"}


def kv_cache_element_type(kv_cache_dtype: str, device: str) -> str:
    """load's kv_cache_dtype on a normalized device -> the cache's element type."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return KV_CACHE_AUTO.get(device, "float32")
    kv_devices = KV_CACHE_DEVICES.get(kv_cache_dtype)
    if kv_devices is not None and device not in kv_devices:
        backend = "cpu backend" if kv_devices == ("cpu",) else "cuda backend (and the reference)"
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is for the {backend}; device {device!r} keeps a "
                         f"{'float32 or float16' if device == 'cpu' else 'float32 or bfloat16'} cache")
    return kv_cache_dtype


def load(source: str | Path | None = None, device: str = "cpu", *, max_model_len: int = 8192,
         max_num_seqs: int = 64, max_batch_tokens: int = 512, quantize: str | None = None,
         threads: int | None = None, chat_template: str | None = None,
         progress: bool = True, activations: str | None = None, mmproj: str | Path | None = None,
         speculative_config: dict[str, Any] | str | None = None, kv_cache_dtype: str = "auto",
         kv_cache_tokens: int = 0, lora_adapters: Mapping[str, str | Path] | None = None) -> LLM:
    """Loads a model from a folder, a .gguf file or a known name (pulled on first use).

    max_model_len: prompt + output tokens per sequence (capped by the model's own limit).
    threads: the kernels' thread pool size, for the whole process (None: leave it as it
    is, all CPUs this process may use unless set before; 0: all of them).
    chat_template: a Jinja chat template (the text, or a path to a file) used instead of
    the model's own by chat() and the server.
    activations: "int8" rounds a quantized matmul's input to 8-bit blocks; "f32" multiplies
    the dequantized weights by it unrounded (see ops.get_ops). None: "int8", except for the
    default model loaded as the default (no source), which gets hub.DEFAULT_MODEL_ACTIVATIONS.
    mmproj: [vision] llama.cpp's separate vision file (`convert_hf_to_gguf.py --mmproj`) for
    a .gguf text model (SmolVLM / Idefics3 on llama, Gemma 3); given explicitly, never guessed
    from the folder (docs/vision.md).
    speculative_config: [spec] speculative decoding, vLLM's names (docs/speculative-decoding.md):
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4} or
    {"method": "draft_model", "model": PATH_OR_NAME, "num_speculative_tokens": 4}.
    kv_cache_dtype: "auto" (the default: float32 on the cpu, every logit as the model
    computes it; bfloat16 on cuda), "float32", "float16" (cpu backend) or "bfloat16"
    (cuda backend): K and V are stored rounded to that type, half the cache's memory and
    of the bytes a decode step reads from it (docs/kv-cache.md).
    kv_cache_tokens: the KV cache's size in tokens, all sequences together (0, the
    default: max(max_model_len, 16384), on a GPU cut to what its free memory holds);
    it bounds the cache's memory (ellm info shows the bytes per token).
    lora_adapters: [lora] {name: path} of LoRA adapters (PEFT folders, or llama.cpp LoRA
    .gguf files for a .gguf base) served over this one base; a request picks one with
    adapter=name (docs/lora.md)."""
    from . import hub
    from . import sampling_defaults as defaults
    from ._memory import release_freed_memory
    from .formats.gguf import GGUFFile
    from .formats.safetensors import SafetensorsFolder
    from .models import build_model, config_from_folder, config_from_gguf, gguf_weights
    from .ops import get_ops, normalize_device
    from .tokenizer import Tokenizer
    from .weights import SafetensorsWeights

    device = normalize_device(device)   # "gpu", "cuda:0" -> "cuda"; another ordinal says how to pick one

    for name, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                        ("max_batch_tokens", max_batch_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(kv_cache_tokens, bool) or not isinstance(kv_cache_tokens, int) or kv_cache_tokens < 0:
        raise ValueError(f"kv_cache_tokens must be an int >= 0 (0: the default size), got {kv_cache_tokens!r}")
    kv_element_type = kv_cache_element_type(kv_cache_dtype, device)
    template = None
    if chat_template is not None:
        if not isinstance(chat_template, str):
            raise TypeError(f"chat_template must be a string (template or path), got {type(chat_template).__name__}")
        from .tokenization.template import compile_template
        template = _chat_template_source(chat_template)
        compile_template(template)   # a broken template fails here, not at the first chat
    from .engine.speculative import SpeculativeConfig, check_same_vocabulary
    spec = SpeculativeConfig.parse(speculative_config)  # [spec] a bad config fails before loading
    _set_threads(threads)
    if activations is None:
        activations = hub.DEFAULT_MODEL_ACTIVATIONS if source is None else "int8"
    ops = get_ops(device, activations=activations)
    resolved = hub.resolve(source, progress=progress)
    # Say what was loaded: a name and a path can look alike (see hub.resolve).
    log.info("loading %s", resolved.describe())
    if progress:
        print(f"ellm: loading {resolved.describe()}", file=sys.stderr, flush=True)
    if resolved.kind == "gguf":
        gguf = GGUFFile(resolved.path)
        config = config_from_gguf(gguf)
        weights: Any = gguf_weights(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
        sampling = defaults.from_gguf_metadata(gguf.metadata, str(resolved.path))
        gguf.drop_metadata("tokenizer.ggml.")  # the tokenizer holds its own copy
        moves_to_huge_pages = gguf if device == "cpu" else None
    else:
        moves_to_huge_pages = None
        config = config_from_folder(resolved.path)
        weights = SafetensorsWeights(SafetensorsFolder(resolved.path))
        tokenizer = Tokenizer.from_folder(resolved.path)
        sampling = defaults.from_folder(resolved.path)
    if source is None:   # the default model as the default: see hub.DEFAULT_MODEL_SAMPLING
        sampling = sampling.in_place_of_fallback(hub.DEFAULT_MODEL_SAMPLING, "ellm's default model")
    if mmproj is not None:   # [vision]
        if resolved.kind != "gguf":
            raise ValueError(f"mmproj= goes with a .gguf text model; {resolved.describe()} is not one "
                             "(a folder carries its vision tower itself)")
        from .models.mmproj import attach_mmproj
        config, weights = attach_mmproj(config, weights, tokenizer, mmproj)
    if template is not None:
        tokenizer.chat_template = template
        tokenizer.chat_template_builtin = False
    if quantize is not None:
        from .quantize import QuantizedWeights
        weights = QuantizedWeights(weights, quantize)
    model = build_model(config, weights, ops)
    model.source_files = weights.fingerprints()   # [files] the engine notices a rewrite in place
    if lora_adapters:   # [lora] checked against the base's matrices here, before any request
        from .lora import attach_adapters
        attach_adapters(model, lora_adapters)
    draft = None
    if spec is not None and spec.method == "draft_model":  # [spec] the draft: same device, its own file
        assert spec.model is not None   # SpeculativeConfig refuses a draft_model without one
        draft_llm_parts = _load_draft(spec.model, ops, progress)
        check_same_vocabulary(tokenizer, draft_llm_parts[1])
        draft = draft_llm_parts[0]
    release_freed_memory()
    if moves_to_huge_pages is not None:
        # A GGUF's weights are read in place from DRAM each decode step: onto 2 MiB pages, in the
        # background. Started only now, so that the copy does not page the weights in while
        # the load's own transient memory (the tokenizer's build) is still held: on Gemma 3
        # 270M that raised the process's peak resident memory from ~419 to ~506 MB.
        moves_to_huge_pages.move_onto_huge_pages()
    engine_config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 max_batch_tokens=max_batch_tokens, speculative=spec,
                                 kv_cache_dtype=kv_element_type, kv_cache_tokens=kv_cache_tokens)
    processing = _image_processing(model, resolved, mmproj)   # [vision]
    return LLM(model, tokenizer, config, resolved.name, engine_config, sampling, processing,
               draft_model=draft)


def _image_processing(model: Any, resolved: Any, mmproj: str | Path | None) -> Any:
    """[vision] The image processor of a model with a vision tower: from its folder's
    processor files, or from the clip.vision.* metadata of the GGUF mmproj it was given."""
    if not getattr(model, "takes_images", False):
        return None
    from .vision.preprocess import load_processing, processing_from_mmproj
    if mmproj is not None:
        from .formats.gguf import GGUFFile
        return processing_from_mmproj(GGUFFile(Path(mmproj)).metadata, where=str(mmproj))
    return load_processing(resolved.path)


def _load_draft(source: str, ops: Any, progress: bool) -> tuple[Any, Any]:
    """[spec] A speculative draft model and its tokenizer: (model, tokenizer)."""
    from . import hub
    from .formats.gguf import GGUFFile
    from .formats.safetensors import SafetensorsFolder
    from .models import build_model, config_from_folder, config_from_gguf, gguf_weights
    from .tokenizer import Tokenizer
    from .weights import SafetensorsWeights

    resolved = hub.resolve(source, progress=progress)
    if progress:
        print(f"ellm: loading the draft model {resolved.describe()}", file=sys.stderr, flush=True)
    if resolved.kind == "gguf":
        gguf = GGUFFile(resolved.path)
        config = config_from_gguf(gguf)
        if getattr(ops, "name", None) == "cpu":   # as the target's weights (load)
            gguf.move_onto_huge_pages()
        weights: Any = gguf_weights(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
        gguf.drop_metadata("tokenizer.ggml.")
    else:
        config = config_from_folder(resolved.path)
        weights = SafetensorsWeights(SafetensorsFolder(resolved.path))
        tokenizer = Tokenizer.from_folder(resolved.path)
    return build_model(config, weights, ops), tokenizer
