"""What travels between the ingress and the replicas: the model spec every replica loads,
a request's deltas, a failure (named by kind, raised again as the same ellm exception
at the ingress), and a replica's engine counts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from ...engine.async_engine import EngineDeadError, EngineSnapshot, QueueFullError
from ...engine.engine import RequestError, SequenceError
from ...engine.sequence import FinishReason, TokenLogprob

# Exceptions that mean "the replica is gone", as opposed to a failure of the request.
REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)


@dataclass(frozen=True)
class ModelSpec:
    """What every replica loads, and how (ellm.load's arguments)."""
    model: str | None = None          # a .gguf, a folder or a known name (None: the default model)
    device: str = "cpu"
    threads: int | None = 1           # the kernels' threads in each replica
    max_model_len: int = 8192
    max_num_seqs: int = 64
    max_batch_tokens: int = 512
    chat_template: str | None = None
    speculative_config: Any = None    # [spec] ellm.load's speculative_config (a dict or its JSON)
    kv_cache_dtype: str = "auto"
    quantize: str | None = None       # ellm.load's quantize ("q8_0", "q4_0")


@dataclass
class Delta:
    """One engine delta of one request (the totals are rebuilt at the ingress)."""
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0
    replica: str = ""                 # set on a request's first delta


@dataclass(frozen=True)
class Failure:
    """The request failed in the replica; kind names the ellm exception to raise again."""
    kind: str                         # "request" | "sequence" | "dead" | "queue_full" | "other"
    message: str


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's engine counts, sent after each request it finished."""
    replica: str
    pid: int
    node: str
    snapshot: EngineSnapshot
    at: float                         # time.time() when read


def failure(e: BaseException) -> Failure:
    kind = ("request" if isinstance(e, RequestError) else "sequence" if isinstance(e, SequenceError)
            else "dead" if isinstance(e, EngineDeadError) else "queue_full" if isinstance(e, QueueFullError)
            else "other")
    return Failure(kind, str(e) if kind != "other" else f"{type(e).__name__}: {e}")


def raise_failure(f: Failure) -> None:
    exc = {"request": RequestError, "sequence": SequenceError, "dead": EngineDeadError,
           "queue_full": QueueFullError}.get(f.kind, RuntimeError)
    raise exc(f.message)

