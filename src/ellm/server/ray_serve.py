"""ellm on Ray Serve (extra `ellm[ray]`): N engine replicas behind one OpenAI ingress.

Two deployments make the application:

- `EllmReplica` (N of them): one ellm.LLM each, its own engine thread, KV cache and
  prefix cache. It takes prompt token ids and SamplingParams and streams the engine's
  deltas back (`generate`), embeds (`embed`), and says what it serves (`describe`).
- `EllmIngress`: the single-process server's own FastAPI app (server/app.py: the same
  routes, validation, errors, SSE, tools, /v1/responses, API key) over a `ReplicaPool`
  instead of a local AsyncEngine. It tokenizes and renders templates itself, so every
  replica receives token ids, and the router can see a request's prefix.

The handle from the ingress to the replicas routes with `PrefixAffinityRouter`, a Ray
Serve RequestRouter: a prompt whose leading KV blocks were last sent to a replica goes
there again (its prefix cache holds them), unless that replica is much busier than the
least-loaded one; a prompt nobody has seen goes to the less busy of two random replicas
(Serve's power of two choices). `RoundRobinRouter` is the baseline it is measured against.

Faults: a replica that dies before a request has streamed anything is invisible to the
client (the request is sent again, to a living replica); one that dies mid-stream ends
that stream with an OpenAI error event (`engine_stopped`), never a hang. Serve restarts
the dead replica. Shutdown waits for running streams (graceful_shutdown_timeout_s).

    from ellm.server.ray_serve import build_app
    serve.run(build_app("smollm2-135m-instruct", replicas=4), route_prefix="/")
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..engine.async_engine import EngineDeadError, EngineSnapshot, QueueFullError
from ..engine.engine import RequestError, SequenceError
from ..engine.sequence import RequestOutput, TokenLogprob
from ..sampling_params import SamplingParams
from . import DEFAULT_MAX_QUEUE

log = logging.getLogger("ellm.server.ray")

APP_NAME = "ellm"
BLOCK_SIZE = 16                # the engine's KV block size: the unit a prefix is cached in
RETRIES = 2                    # times a request that streamed nothing is sent again
ROUTERS = ("prefix", "round-robin", "pow2")
# Seconds Serve waits for a replica's (ingress's) running requests on shutdown or redeploy.
GRACEFUL_SHUTDOWN_S = 30.0

# Exceptions that mean "the replica is gone", as opposed to a failure of the request.
_REPLICA_LOST = (ActorDiedError, ActorUnavailableError, RayActorError)


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


# ---------------------------------------------------------------------------------------
# what travels from a replica to the ingress
# ---------------------------------------------------------------------------------------

@dataclass
class Delta:
    """One engine delta of one request (the totals are rebuilt at the ingress)."""
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
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


def _failure(e: BaseException) -> Failure:
    kind = ("request" if isinstance(e, RequestError) else "sequence" if isinstance(e, SequenceError)
            else "dead" if isinstance(e, EngineDeadError) else "queue_full" if isinstance(e, QueueFullError)
            else "other")
    return Failure(kind, str(e) if kind != "other" else f"{type(e).__name__}: {e}")


def _raise(f: Failure) -> None:
    exc = {"request": RequestError, "sequence": SequenceError, "dead": EngineDeadError,
           "queue_full": QueueFullError}.get(f.kind, RuntimeError)
    raise exc(f.message)


# ---------------------------------------------------------------------------------------
# the replica
# ---------------------------------------------------------------------------------------

class EllmReplica:
    """One engine. Serve runs N of these (see build_app for their options)."""

    def __init__(self, spec: ModelSpec, max_queue: int) -> None:
        import ellm
        self.llm = ellm.load(spec.model, device=spec.device, max_model_len=spec.max_model_len,
                             threads=spec.threads, max_num_seqs=spec.max_num_seqs,
                             max_batch_tokens=spec.max_batch_tokens, chat_template=spec.chat_template,
                             speculative_config=spec.speculative_config, kv_cache_dtype=spec.kv_cache_dtype,
                             progress=False)
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
            yield _failure(e)
        yield await self.stats()

    async def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> Any:
        try:
            return await self.engine.embed(prompts, pooling, normalize)
        except Exception as e:  # noqa: BLE001
            return _failure(e)

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


# ---------------------------------------------------------------------------------------
# routers (they run inside the process holding the handle: the ingress)
# ---------------------------------------------------------------------------------------

def block_hashes(ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained hashes of the prompt's full blocks, in the engine's unit: equal hashes at
    index j mean equal first (j+1) blocks. The last prompt token is left out, as the
    engine never serves the block holding it from the cache."""
    out, prev = [], 0
    usable = (len(ids) - 1) // block_size
    for j in range(usable):
        prev = hash((prev, tuple(ids[j * block_size:(j + 1) * block_size])))
        out.append(prev)
    return out


def _prompt_of(pending: PendingRequest | None) -> list[int] | None:
    """The prompt ids of a `generate` call (its first argument), else None."""
    if pending is None or pending.metadata.call_method != "generate" or not pending.args:
        return None
    ids = pending.args[0]
    return ids if isinstance(ids, list) else None


class PrefixTable:
    """Which replicas were last sent each known prompt prefix, in KV blocks: the state of
    PrefixAffinityRouter, apart from Ray so that it can be simulated at scale
    (benchmarks/ray_router_sim.py). An LRU of block hash -> its last `owners_per_block`
    replicas (most recent last), max_blocks long. Several owners let a hot prefix (a
    shared system prompt) that spilled to other replicas stay a hit on all of them."""

    def __init__(self, max_blocks: int = 200_000, owners_per_block: int = 4) -> None:
        self.max_blocks = max_blocks
        self.owners_per_block = owners_per_block
        self.owners: OrderedDict[int, list[Any]] = OrderedDict()

    def owners_of(self, ids: Sequence[int], alive: Any) -> list[Any]:
        """The replicas (those in `alive`) last sent the longest prefix of ids that any
        living replica was sent, most recent first; [] when none."""
        for h in reversed(block_hashes(ids)):
            found = [r for r in reversed(self.owners.get(h, ())) if r in alive]
            if found:
                return found
        return []

    def owner_of(self, ids: Sequence[int], alive: Any) -> Any:
        """The most recent of owners_of, or None."""
        found = self.owners_of(ids, alive)
        return found[0] if found else None

    def record(self, ids: Sequence[int], replica: Any) -> None:
        for h in block_hashes(ids):
            owners = self.owners.get(h)
            if owners is None:
                self.owners[h] = [replica]
            else:
                if replica in owners:
                    owners.remove(replica)
                owners.append(replica)
                del owners[:-self.owners_per_block]
                self.owners.move_to_end(h)
        while len(self.owners) > self.max_blocks:
            self.owners.popitem(last=False)

    def forget(self, replica: Any) -> None:
        """A replica died: its cache died with it."""
        for h in list(self.owners):
            owners = self.owners[h]
            if replica in owners:
                owners.remove(replica)
                if not owners:
                    del self.owners[h]


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Sends a prompt to the least busy of the replicas last sent its longest known
    prefix (in KV blocks), unless that replica's queue is longer than the shortest one by
    more than `imbalance` requests; otherwise, and for new prefixes, to the less busy of
    two random replicas (Serve probes their queue lengths)."""

    def initialize_state(self, imbalance: int = 8, max_blocks: int = 200_000, **kwargs: Any) -> None:
        self.imbalance = imbalance
        self.table = PrefixTable(max_blocks)
        self.affine_routes = 0       # requests sent to the replica holding their prefix
        self.spilled = 0             # requests whose replica was too busy

    def _queue_len(self, r: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(r.replica_id)
        return 0 if q is None else q

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True   # every replica is a candidate
        if not candidate_replicas:
            return []
        fallback = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        ids = _prompt_of(pending_request)
        if ids:
            by_id = {r.replica_id: r for r in candidate_replicas}
            owners = [by_id[o] for o in self.table.owners_of(ids, by_id)]
            if owners:
                owner = min(owners, key=self._queue_len)   # of those holding the prefix, the least busy
                shortest = min(self._queue_len(r) for r in candidate_replicas)
                if self._queue_len(owner) - shortest <= self.imbalance:
                    self.affine_routes += 1
                    # Ranked: the owner first; if it is full, the less busy of two others.
                    return [[owner], [r for r in fallback if r is not owner] or fallback]
                self.spilled += 1
        return [fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        ids = _prompt_of(pending_request)
        if ids:
            self.table.record(ids, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn (skipping full ones): the baseline."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        k = next(self._turn) % len(ordered)
        return [[ordered[k]], ordered[k + 1:] + ordered[:k]]


# ---------------------------------------------------------------------------------------
# the ingress side: an AsyncEngine look-alike over the replicas
# ---------------------------------------------------------------------------------------

class _NoLocalEngine:
    """Server calls engine.engine.prepare_constraints(); the replicas do that themselves."""

    def prepare_constraints(self) -> None:
        return None


class RemoteStream:
    """RequestStream over one `generate` call: the same RequestOutput deltas, the same
    errors. Sends the request again (to another replica) when its replica was lost
    before it streamed anything."""

    def __init__(self, pool: ReplicaPool, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 images: list[Any] | None = None) -> None:
        self.request_id = request_id
        self._pool = pool
        self._args = (list(prompt_ids), params, request_id, images)
        self._call: Any = None
        self._streamed = False
        self._tries = 0
        self._text = ""
        self._ids: list[int] = []
        self.replica = ""
        self.done = False

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        while True:
            if self._call is None:
                self._call = self._pool.handle.options(stream=True).generate.remote(*self._args)
            try:
                item = await self._call.__anext__()
            except StopAsyncIteration:
                self._finish()
                raise EngineDeadError("the replica ended the stream without a final output") from None
            except _REPLICA_LOST as e:
                self._call = None
                self._pool.replica_losses += 1
                if not self._streamed and self._tries < RETRIES:
                    self._tries += 1
                    self._pool.retries += 1
                    log.warning("request %s: replica lost before it streamed (%s); sending it again",
                                self.request_id, type(e).__name__)
                    continue
                self._finish()
                raise EngineDeadError(f"the replica serving this request{' ' + self.replica if self.replica else ''} "
                                      f"died ({type(e).__name__}); the output so far stands, the rest is lost") from None
            except asyncio.CancelledError:
                self.close()
                raise
            except Exception as e:
                self._finish()
                raise EngineDeadError(f"the replica call failed: {type(e).__name__}: {e}") from None
            if isinstance(item, Failure):
                self._finish()
                _raise(item)
            if isinstance(item, ReplicaStats):   # (only after a final delta; not expected here)
                self._pool.record(item)
                continue
            return self._output(item)

    def _output(self, d: Delta) -> RequestOutput:
        if d.replica:
            self.replica = d.replica
            self._pool.count_route(d.replica)
        self._streamed = True
        self._text += d.new_text
        self._ids.extend(d.new_token_ids)
        if d.finished:
            self.done = True
            self._pool.finished(self)
            # The replica sends its stats next: read them without holding up the client.
            call, self._call = self._call, None
            asyncio.ensure_future(self._pool.read_stats(call))
        return RequestOutput(self.request_id, d.new_text, list(d.new_token_ids), self._text, list(self._ids),
                             d.finished, d.finish_reason, self._args[0], list(d.new_logprobs),
                             d.num_cached_tokens)

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self._pool.finished(self)

    def close(self) -> None:
        """Aborts the request (Serve cancels the replica's generator); safe twice."""
        if self._call is not None:
            call, self._call = self._call, None
            if not self.done:
                call.cancel()
        self._finish()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        if not self.done:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass


_ZERO = EngineSnapshot(*([0] * len(dataclasses.fields(EngineSnapshot))))


class ReplicaPool:
    """What server/app.py's Server needs of an AsyncEngine (submit, embed, snapshot,
    capacity, health), answered by the replicas through one DeploymentHandle.

    max_queue bounds the requests in flight through this ingress (429 beyond). Engine
    counts are the sum of each replica's latest ReplicaStats; replicas that have not
    reported for `stale_s` no longer count towards the gauges (running, waiting, KV
    blocks) but their counters stay, as counters never go down."""

    def __init__(self, handle: DeploymentHandle, max_queue: int = DEFAULT_MAX_QUEUE, stale_s: float = 60.0) -> None:
        self.handle = handle
        self.max_queue = max_queue
        self.stale_s = stale_s
        self.engine = _NoLocalEngine()
        self._pending: set[int] = set()
        self._running = False
        self.stats: dict[str, ReplicaStats] = {}
        self.routes: dict[str, int] = {}       # requests each replica started streaming
        self.retries = 0
        self.replica_losses = 0

    # -- life cycle and counts (AsyncEngine's names) ---------------------------------------
    def start(self) -> None:
        self._running = True

    def shutdown(self, timeout: float | None = None) -> None:
        self._running = False

    @property
    def is_running(self) -> bool:
        return self._running

    @property
    def num_requests(self) -> int:
        return len(self._pending)

    @property
    def num_running(self) -> int:
        return sum(s.snapshot.num_running for s in self._fresh())

    @property
    def num_waiting(self) -> int:
        return sum(s.snapshot.num_waiting for s in self._fresh())

    def check_capacity(self, n: int) -> None:
        if len(self._pending) + n > self.max_queue:
            raise QueueFullError(f"the server has {len(self._pending)} requests queued or running "
                                 f"(limit {self.max_queue}); retry later")

    # -- requests -----------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
               images: list[Any] | None = None) -> RemoteStream:
        if not self._running:
            raise EngineDeadError("the ingress is shutting down")
        self.check_capacity(1)
        s = RemoteStream(self, prompt_ids, params, request_id or f"rreq-{id(prompt_ids)}", images)
        self._pending.add(id(s))
        return s

    def finished(self, s: RemoteStream) -> None:
        self._pending.discard(id(s))

    async def embed(self, prompts: list[list[int]], pooling: str, normalize: bool) -> Any:
        for attempt in range(RETRIES + 1):
            try:
                result = await self.handle.embed.remote(prompts, pooling, normalize)
                break
            except _REPLICA_LOST:
                self.replica_losses += 1
                if attempt == RETRIES:
                    raise EngineDeadError("every replica tried for this request was lost") from None
                self.retries += 1
        if isinstance(result, Failure):
            _raise(result)
        return result

    # -- stats ----------------------------------------------------------------------------
    def count_route(self, replica: str) -> None:
        self.routes[replica] = self.routes.get(replica, 0) + 1

    def record(self, st: ReplicaStats) -> None:
        old = self.stats.get(st.replica)
        if old is None or old.at <= st.at:
            self.stats[st.replica] = st

    async def read_stats(self, call: Any) -> None:
        """The item after a final delta: the replica's stats (and then the end)."""
        try:
            async for item in call:
                if isinstance(item, ReplicaStats):
                    self.record(item)
        except Exception:  # noqa: BLE001 - stats are best effort: a lost replica sends none
            pass

    def _fresh(self) -> list[ReplicaStats]:
        now = time.time()
        return [s for s in self.stats.values() if now - s.at <= self.stale_s]

    def _sum(self) -> EngineSnapshot:
        fresh = {s.replica for s in self._fresh()}
        gauges = {"num_running", "num_waiting", "kv_blocks_used", "kv_blocks_cached", "kv_blocks_total"}
        total = {f.name: 0 for f in dataclasses.fields(EngineSnapshot)}
        for s in self.stats.values():
            for name in total:
                if name in gauges and s.replica not in fresh:
                    continue
                total[name] += getattr(s.snapshot, name)
        total["num_requests"] = len(self._pending)
        return EngineSnapshot(**total)

    async def snapshot(self) -> EngineSnapshot:
        return self._sum()

    def snapshot_now(self) -> EngineSnapshot:
        return self._sum()


class ReplicaCollector:
    """Per-replica metrics for Prometheus, beside the aggregated engine metrics that
    Metrics reports from ReplicaPool.snapshot(): labelled replica=<Serve's replica id>."""

    def __init__(self, pool: ReplicaPool, model: str) -> None:
        self.pool, self.model = pool, model

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        p = self.pool
        routed = CounterMetricFamily("ellm_replica_requests", "Requests each replica started streaming.",
                                     labels=["model", "replica"])
        for name, n in sorted(p.routes.items()):
            routed.add_metric([self.model, name], n)
        yield routed
        info = GaugeMetricFamily("ellm_replica_info", "1 for each replica that has reported; its process and node.",
                                 labels=["model", "replica", "pid", "node"])
        for s in p.stats.values():
            info.add_metric([self.model, s.replica, str(s.pid), s.node], 1)
        yield info
        fields = (("prefix_cache_hits", "Prompt blocks this replica found in its prefix cache.", CounterMetricFamily),
                  ("prefix_cache_queries", "Prompt blocks this replica looked up.", CounterMetricFamily),
                  ("num_running", "Sequences in this replica's running batch.", GaugeMetricFamily),
                  ("num_waiting", "Sequences waiting in this replica.", GaugeMetricFamily),
                  ("kv_blocks_used", "KV blocks held by this replica's sequences.", GaugeMetricFamily))
        for name, doc, kind in fields:
            fam = kind(f"ellm_replica_{name}", doc, labels=["model", "replica"])
            for s in p.stats.values():
                fam.add_metric([self.model, s.replica], getattr(s.snapshot, name))
            yield fam
        for name, doc, value in (("requests_retried", "Requests sent again after their replica was lost.", p.retries),
                                 ("replica_losses", "Replica calls that failed because the replica was lost.",
                                  p.replica_losses)):
            c = CounterMetricFamily(f"ellm_{name}", doc, labels=["model"])
            c.add_metric([self.model], value)
            yield c


# ---------------------------------------------------------------------------------------
# the ingress deployment
# ---------------------------------------------------------------------------------------

def _load_tokenizer(spec: ModelSpec) -> Any:
    """The model's tokenizer alone (no weights): the ingress tokenizes and renders."""
    from .. import hub
    from ..llm import _chat_template_source
    from ..tokenizer import Tokenizer
    resolved = hub.resolve(spec.model, progress=False)
    if resolved.kind == "gguf":
        from ..formats.gguf import GGUFFile
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

    async def __init__(self, replicas: DeploymentHandle, spec: ModelSpec, served_model_name: Sequence[str] | None,
                       api_key: str | None, max_queue: int, allowed_origins: Sequence[str]) -> None:
        from .app import Server, ServerConfig
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
        from .app import build_app as build_fastapi
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
              kv_cache_dtype: str = "auto") -> Any:
    """The Serve application: `replicas` EllmReplica deployments of model behind one
    EllmIngress. Run it with serve.run(app, name=..., route_prefix="/"), or compose it.

    router: "prefix" (PrefixAffinityRouter; imbalance: how many more queued requests the
    replica holding a prefix may have than the least busy one before the prefix is given
    up), "round-robin", or "pow2" (Serve's default). threads_per_replica: the kernels'
    threads in each replica, also its Ray CPU reservation. replica_options: more
    ray_actor_options for the replicas (e.g. {"resources": {...}}, {"num_gpus": 1}).
    speculative_config, kv_cache_dtype: as ellm.load's, for every replica (checked here,
    before any replica starts)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    if threads_per_replica is not None and (isinstance(threads_per_replica, bool)
                                            or not isinstance(threads_per_replica, int) or threads_per_replica < 1):
        raise ValueError(f"threads_per_replica must be None or an int >= 1, got {threads_per_replica!r}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {router!r}")
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    from ..engine.speculative import SpeculativeConfig
    from ..llm import KV_CACHE_DTYPES
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                         f"got {kv_cache_dtype!r}")
    SpeculativeConfig.parse(speculative_config)   # a bad config fails here, not in every replica
    spec = ModelSpec(model, device, threads_per_replica, max_model_len, max_num_seqs, max_batch_tokens, chat_template,
                     speculative_config, kv_cache_dtype)
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


# ---------------------------------------------------------------------------------------
# `ellm serve --replicas N`
# ---------------------------------------------------------------------------------------

# The object store only carries small messages here (ids, deltas): keep it small.
LOCAL_OBJECT_STORE_BYTES = 200 << 20


def start_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Joins the cluster at address, or starts a local one (no dashboard, a small object
    store) sized for num_cpus. -> whether this process started it (and so stops it)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
             logging_level=logging.WARNING)
    return True


def serve_forever(args: Any, api_key: str | None) -> int:
    """`ellm serve MODEL --replicas N`: deploys build_app(...) on Ray Serve with its HTTP
    proxy on --host:--port and serves until SIGINT/SIGTERM; then deletes the app (Serve
    lets running streams finish, up to GRACEFUL_SHUTDOWN_S) and stops what it started."""
    import signal
    import sys
    import threading

    from .cli import _is_loopback, _url_host
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if api_key is None and not _is_loopback(args.host):
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it",
              file=sys.stderr)
    app = build_app(args.model, replicas=args.replicas, threads_per_replica=args.threads_per_replica,
                    router=args.router, api_key=api_key, served_model_name=args.served_model_name,
                    max_queue=args.max_queue, allowed_origins=args.allowed_origins or (), device=args.device,
                    max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                    max_batch_tokens=args.max_batch_tokens, chat_template=args.chat_template,
                    speculative_config=args.speculative_config, kv_cache_dtype=args.kv_cache_dtype)
    owned = start_ray(args.ray_address, num_cpus=args.replicas * args.threads_per_replica)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        print(f"ellm: serving {args.replicas} replicas on http://{_url_host(args.host)}:{args.port}/v1 "
              f"(Ray Serve, router: {args.router})", file=sys.stderr, flush=True)
        stop.wait()
        print("ellm: draining streams and stopping", file=sys.stderr, flush=True)
    finally:
        try:
            serve.delete(APP_NAME)
            if owned:
                serve.shutdown()
        finally:
            if owned:
                ray.shutdown()
    return 0


__all__ = ["EllmIngress", "EllmReplica", "ModelSpec", "PrefixAffinityRouter", "PrefixTable", "ReplicaPool", "RoundRobinRouter",
           "block_hashes", "build_app", "serve_forever", "start_ray"]
