"""The Serve application: N EllmReplica deployments behind one EllmIngress, the
single-process server's own FastAPI app (ellm.server.app) over a ReplicaPool. The
ingress tokenizes and renders templates itself, so every replica receives token ids
and the router can see a request's prefix."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from .. import DEFAULT_MAX_QUEUE
from ..app import build_app as build_fastapi
from ..core import Server, ServerConfig
from .messages import ModelSpec
from .pool import ReplicaCollector, ReplicaPool
from .replica import EllmReplica
from .router import PrefixAffinityRouter, RoundRobinRouter

APP_NAME = "ellm"
ROUTERS = ("prefix", "round-robin", "pow2")
# Seconds Serve waits for a replica's (ingress's) running requests on shutdown or redeploy.
GRACEFUL_SHUTDOWN_S = 30.0


def _load_tokenizer(spec: ModelSpec) -> Any:
    """The model's tokenizer alone (no weights): the ingress tokenizes and renders."""
    from ... import hub
    from ...llm import _chat_template_source
    from ...tokenizer import Tokenizer
    resolved = hub.resolve(spec.model, progress=False)
    if resolved.kind == "gguf":
        from ...formats.gguf import GGUFFile
        tok = Tokenizer.from_gguf(GGUFFile(resolved.path))
    else:
        tok = Tokenizer.from_folder(resolved.path)
    if spec.chat_template is not None:
        tok.chat_template = _chat_template_source(spec.chat_template)
        tok.chat_template_builtin = False
    return tok


@serve.ingress()
class EllmIngress:
    """Serve's HTTP proxy hands every request to this replica's FastAPI app (app.py's)."""

    # Serve awaits an async constructor, which mypy refuses for any class (it returns a coroutine)
    async def __init__(self, replicas: DeploymentHandle, spec: ModelSpec,  # type: ignore[misc]
                       served_model_name: Sequence[str] | None, api_key: str | None, max_queue: int,
                       allowed_origins: Sequence[str]) -> None:
        # The first describe() waits until a replica is up (Serve queues the call).
        facts = await replicas.describe.remote()
        self.pool = ReplicaPool(replicas, max_queue)
        tokenizer = await asyncio.get_running_loop().run_in_executor(None, _load_tokenizer, spec)
        names = list(served_model_name or [spec.model if spec.model is not None else facts["source"]])
        cfg = ServerConfig(model_names=names, max_model_len=facts["max_model_len"], vocab_size=facts["vocab_size"],
                           embedding_size=facts["hidden_size"], api_key=api_key, source=facts["source"],
                           allowed_origins=tuple(allowed_origins))
        self.server = Server(self.pool, tokenizer, cfg, facts["defaults"].params,  # type: ignore[arg-type]
                             processing=facts.get("processing"))
        self.server.metrics.registry.register(ReplicaCollector(self.pool, cfg.model_name))  # type: ignore[arg-type]

    def __serve_build_asgi_app__(self) -> Any:
        return build_fastapi(self.server)


# ---------------------------------------------------------------------------------------
# the application
# ---------------------------------------------------------------------------------------

def _router_config(router: str, imbalance: int) -> RequestRouterConfig:
    if router == "prefix":
        return RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                   request_router_kwargs={"imbalance": imbalance})
    if router == "round-robin":
        return RequestRouterConfig(request_router_class=RoundRobinRouter)
    return RequestRouterConfig()   # Serve's default, power of two choices


def build_app(model: str | None = None, *, replicas: int = 2, threads_per_replica: int | None = 1,
              router: str = "prefix", imbalance: int = 8, api_key: str | None = None,
              served_model_name: str | Sequence[str] | None = None, max_queue: int = DEFAULT_MAX_QUEUE,
              allowed_origins: Sequence[str] = (), device: str = "cpu", max_model_len: int = 8192,
              max_num_seqs: int = 64, max_batch_tokens: int = 512, chat_template: str | None = None,
              replica_options: dict[str, Any] | None = None, speculative_config: Any = None,
              kv_cache_dtype: str = "auto", quantize: str | None = None) -> Any:
    """The Serve application: `replicas` EllmReplica deployments of model behind one
    EllmIngress. Run it with serve.run(app, name=..., route_prefix="/"), or compose it.

    router: "prefix" (PrefixAffinityRouter; imbalance: how many more queued requests the
    replica holding a prefix may have than the least busy one before the prefix is given
    up), "round-robin", or "pow2" (Serve's default). threads_per_replica: the kernels'
    threads in each replica, also its Ray CPU reservation. replica_options: more
    ray_actor_options for the replicas (e.g. {"resources": {...}}, {"num_gpus": 1}).
    speculative_config, kv_cache_dtype, quantize: as ellm.load's, for every replica (checked
    here, before any replica starts)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if threads_per_replica is not None and (isinstance(threads_per_replica, bool)
                                            or not isinstance(threads_per_replica, int) or threads_per_replica < 1):
        raise ValueError(f"threads_per_replica must be None or an int >= 1, got {threads_per_replica!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    from ...engine.speculative import SpeculativeConfig
    from ...llm import KV_CACHE_DTYPES
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    from ...quantize import QUANTIZE_TYPES
    if quantize is not None and quantize not in QUANTIZE_TYPES:
        raise ValueError(f"quantize must be None or one of {', '.join(map(repr, sorted(QUANTIZE_TYPES)))}, "
                         f"got {quantize!r}")
    SpeculativeConfig.parse(speculative_config)   # a bad config fails here, not in every replica
    spec = ModelSpec(model, device, threads_per_replica, max_model_len, max_num_seqs, max_batch_tokens, chat_template,
                     speculative_config, kv_cache_dtype, quantize)
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    actor_options = {"num_cpus": threads_per_replica or 1, **(replica_options or {})}
    replica = serve.deployment(
        EllmReplica, name="EllmReplica", num_replicas=replicas, ray_actor_options=actor_options,
        # Up to a full batch per replica; more wait in the router (FIFO) for room.
        max_ongoing_requests=max_num_seqs, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        health_check_period_s=5, request_router_config=_router_config(router, imbalance))
    ingress = serve.deployment(
        EllmIngress, name="EllmIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(max_queue * 2, 100), graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S)
    return ingress.bind(replica.bind(spec, max_num_seqs), spec, names or None, api_key, max_queue,
                        tuple(allowed_origins))

