"""The ingress side: ReplicaPool, an AsyncEngine look-alike over the replicas (what
ellm.server.core.Server needs of an engine), its RemoteStreams (one `generate` call
each, sent again when a replica is lost before it streamed anything), and the
per-replica Prometheus metrics."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from ...engine.async_engine import EngineDeadError, EngineSnapshot, QueueFullError
from ...engine.sequence import RequestOutput
from ...sampling_params import SamplingParams
from .. import DEFAULT_MAX_QUEUE
from .messages import REPLICA_LOST, Delta, Failure, ReplicaStats, raise_failure

log = logging.getLogger("ellm.server.ray")

RETRIES = 2                    # times a request that streamed nothing is sent again


class _NoLocalEngine:
    """Server calls engine.engine.prepare_constraints(); the replicas do that themselves."""

    def prepare_constraints(self, params: Any = None) -> None:
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
            except REPLICA_LOST as e:
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
                                      f"died ({type(e).__name__}); the output so far stands, "
                                      "the rest is lost") from None
            except asyncio.CancelledError:
                self.close()
                raise
            except Exception as e:
                self._finish()
                raise EngineDeadError(f"the replica call failed: {type(e).__name__}: {e}") from None
            if isinstance(item, Failure):
                self._finish()
                raise_failure(item)
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
            except REPLICA_LOST:
                self.replica_losses += 1
                if attempt == RETRIES:
                    raise EngineDeadError("every replica tried for this request was lost") from None
                self.retries += 1
        if isinstance(result, Failure):
            raise_failure(result)
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

