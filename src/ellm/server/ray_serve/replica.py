"""EllmReplica: one ellm.LLM (its own engine thread, KV cache and prefix cache) that
streams a request's deltas to the ingress. Serve runs N of them."""
from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from ...sampling_params import SamplingParams
from .messages import Delta, Failure, ModelSpec, ReplicaStats, failure


class EllmReplica:
    """One engine. Serve runs N of these (see build_app for their options)."""

    def __init__(self, spec: ModelSpec, max_queue: int) -> None:
        import ellm
        self.llm = ellm.load(spec.model, device=spec.device, max_model_len=spec.max_model_len,
                             threads=spec.threads, max_num_seqs=spec.max_num_seqs,
                             max_batch_tokens=spec.max_batch_tokens, chat_template=spec.chat_template,
                             speculative_config=spec.speculative_config, kv_cache_dtype=spec.kv_cache_dtype,
                             quantize=spec.quantize, progress=False)
        self.engine = self.llm.async_engine
        self.engine.max_queue = max_queue
        self.engine.start()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.node = socket.gethostname()

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to validate requests as this replica would."""
        return {"max_model_len": self.llm.engine.cfg.max_model_len, "vocab_size": self.llm.config.vocab_size,
                "hidden_size": self.llm.config.hidden_size, "source": self.llm.source,
                "defaults": self.llm.defaults,
                "processing": getattr(self.llm, "processing", None)}   # [vision] None: text only

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       images: list[Any] | None = None) -> AsyncIterator[Delta | Failure | ReplicaStats]:
        """The request's deltas, then this replica's stats. A cancelled call (the client
        left) closes the engine stream, which aborts the request and frees its blocks."""
        first = True
        try:
            if params.constraint is not None:   # llguidance's tokenizer, off the engine thread
                await asyncio.get_running_loop().run_in_executor(None, self.llm.engine.prepare_constraints)
            async for out in self.engine.stream(prompt_ids, params, request_id, images):
                yield Delta(out.new_text, list(out.new_token_ids), out.finished, out.finish_reason,
                            list(out.new_logprobs), out.num_cached_tokens, self.name if first else "")
                first = False
        except Exception as e:  # noqa: BLE001 - the ingress raises it again as the same kind
            yield failure(e)
        yield await self.stats()

    async def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> Any:
        try:
            return await self.engine.embed(prompts, pooling, normalize)
        except Exception as e:  # noqa: BLE001
            return failure(e)

    async def stats(self) -> ReplicaStats:
        return ReplicaStats(self.name, os.getpid(), self.node, await self.engine.snapshot(), time.time())

    def check_health(self) -> None:
        """Serve calls this periodically; a dead engine thread makes Serve replace us."""
        if not self.engine.is_running:
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5.0)
