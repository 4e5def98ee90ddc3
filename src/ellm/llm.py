"""LLM: a tokenizer, a model and an engine behind generate / stream / chat / logits."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import numpy as np

from .config import ModelConfig
from .engine.engine import Engine, EngineConfig
from .engine.sequence import TokenLogprob
from .sampling_params import SamplingParams

Prompt = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None        # "stop" | "length" | "abort"
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None

    def __str__(self) -> str:
        return self.text


def _is_single(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, (list, tuple, np.ndarray)) and len(prompt) > 0 and \
        all(isinstance(t, (int, np.integer)) for t in prompt)


def _one_completion(params: SamplingParams) -> SamplingParams:
    if params.n != 1:
        raise ValueError(f"n={params.n}: LLM.generate and LLM.stream give one completion per prompt; "
                         "pass the prompt n times (with different seeds), or use the server's n")
    return params


class LLM:
    """A loaded model. Build with `ellm.load(source)`."""

    def __init__(self, model: Any, tokenizer: Any, config: ModelConfig, source: str,
                 engine_config: EngineConfig | None = None) -> None:
        self.model, self.tokenizer, self.config, self.source = model, tokenizer, config, source
        self.engine = Engine(model, tokenizer, engine_config)

    def __repr__(self) -> str:
        return f"LLM({self.source!r}, {self.config.model_type}, {self.config.num_hidden_layers} layers)"

    # -- prompts ------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    # -- generation ---------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 **kwargs: Any) -> CompletionOutput | list[CompletionOutput]:
        """A string or token-id prompt gives one result; a list of prompts gives a list,
        run together in batches."""
        params = _one_completion(SamplingParams.from_kwargs(params, **kwargs))
        single = _is_single(prompts)
        batch = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if not batch:
            return []
        encoded = [self.encode_prompt(p) for p in batch]
        ids = [self.engine.add_request(e, params) for e in encoded]
        results: dict[str, CompletionOutput] = {}
        logprobs: dict[str, list[TokenLogprob]] = {rid: [] for rid in ids}
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    logprobs[out.request_id].extend(out.new_logprobs)
                    if out.finished:
                        results[out.request_id] = CompletionOutput(
                            out.text, list(out.token_ids), out.finish_reason, list(out.prompt_token_ids),
                            logprobs[out.request_id] if params.logprobs is not None else None)
        finally:
            for rid in ids:
                if rid not in results:
                    self.engine.abort(rid)
        outs = [results[r] for r in ids]
        return outs[0] if single else outs

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, **kwargs: Any) -> Iterator[str]:
        """Yields text pieces as they are generated."""
        params = _one_completion(SamplingParams.from_kwargs(params, **kwargs))
        rid = self.engine.add_request(self.encode_prompt(prompt), params)
        try:
            while True:
                outs = [o for o in self.engine.step() if o.request_id == rid]
                for out in outs:
                    if out.new_text:
                        yield out.new_text
                    if out.finished:
                        return
                if not self.engine.has_unfinished():
                    return
        finally:
            self.engine.abort(rid)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
             **kwargs: Any) -> CompletionOutput:
        """Applies the model's chat template and generates the assistant's reply."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        if self.tokenizer.add_bos and self.tokenizer.bos_token_id is not None and \
                (not ids or ids[0] != self.tokenizer.bos_token_id):
            ids = [self.tokenizer.bos_token_id] + ids
        return self.generate(ids, params, **kwargs)  # type: ignore[return-value]

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 logits (len(ids), vocab_size): one row per position."""
        return self.engine.logits([int(t) for t in ids])


def load(source: str | Path | None = None, device: str = "cpu", *, max_model_len: int = 8192,
         max_num_seqs: int = 64, max_batch_tokens: int = 512, quantize: str | None = None,
         progress: bool = True, activations: str = "int8") -> LLM:
    """Loads a model from a folder, a .gguf file or a known name (pulled on first use).

    activations="f32" runs quantized matmuls on unrounded activations (see ops.get_ops)."""
    from . import hub
    from ._memory import release_freed_memory
    from .formats.gguf import GGUFFile
    from .formats.safetensors import SafetensorsFolder
    from .models import build_model
    from .ops import get_ops
    from .tokenizer import Tokenizer
    from .weights import GGUFWeights, SafetensorsWeights

    ops = get_ops(device, activations=activations)
    resolved = hub.resolve(source, progress=progress)
    if resolved.kind == "gguf":
        gguf = GGUFFile(resolved.path)
        config = ModelConfig.from_gguf(gguf)
        weights: Any = GGUFWeights(gguf)
        tokenizer = Tokenizer.from_gguf(gguf)
        gguf.drop_metadata("tokenizer.ggml.")  # the tokenizer holds its own copy
    else:
        config = ModelConfig.from_folder(resolved.path)
        weights = SafetensorsWeights(SafetensorsFolder(resolved.path))
        tokenizer = Tokenizer.from_folder(resolved.path)
    if quantize is not None:
        from .quantize import QuantizedWeights
        weights = QuantizedWeights(weights, quantize)
    model = build_model(config, weights, ops)
    release_freed_memory()
    engine_config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 max_batch_tokens=max_batch_tokens)
    return LLM(model, tokenizer, config, resolved.name, engine_config)
