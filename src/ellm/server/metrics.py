"""Server metrics for Prometheus, on prometheus_client.

Each server has its own CollectorRegistry (so two apps in one process do not share
counts). Request counters and latency histograms are updated as requests run; the engine
gauges (running, waiting, KV blocks) and the engine's own counters come from an
EngineSnapshot taken on the engine thread when /metrics is read, so they agree with
each other.

The names and meanings are those of ellm's earlier hand-written exporter: every metric
is `ellm_*`, engine metrics carry a `model` label.
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from ..engine.async_engine import EngineSnapshot

# Seconds. TTFT includes queueing and prefill; ITL is one decode step of the whole batch.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector(Collector):
    """Reports the snapshot it was last given (Metrics.render sets it just before)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.snapshot: EngineSnapshot | None = None

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        if snap is None:
            return
        gauges = (
            ("num_requests_running", "Sequences in the running batch.", snap.num_running),
            ("num_requests_waiting", "Sequences waiting to be scheduled.", snap.num_waiting),
            ("kv_blocks_used", "KV cache blocks held by queued or running sequences.", snap.kv_blocks_used),
            ("kv_blocks_cached", "KV cache blocks held only by the prefix cache (evictable).",
             snap.kv_blocks_cached),
            ("kv_blocks_total", "KV cache blocks in all pools.", snap.kv_blocks_total),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(f"ellm_{name}", doc, labels=["model"])
            g.add_metric([self.model], value)
            yield g
        counters = (
            ("prefix_cache_hits", "Prompt blocks found in the prefix cache.", snap.prefix_cache_hits),
            ("prefix_cache_queries", "Prompt blocks looked up in the prefix cache.", snap.prefix_cache_queries),
            ("preemptions", "Sequences preempted for lack of KV blocks.", snap.num_preemptions),
            ("engine_step_errors", "Engine steps that raised (their batch failed).", snap.step_errors),
            ("spec_proposed_tokens", "Speculative tokens guessed and checked.", snap.spec_proposed_tokens),
            ("spec_accepted_tokens", "Speculative tokens the check kept.", snap.spec_accepted_tokens),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(f"ellm_{name}", doc, labels=["model"])
            c.add_metric([self.model], value)
            yield c


class Metrics:
    """Everything /metrics reports."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ellm_requests", "HTTP requests answered, by route and status code.",
                                ["route", "status"], registry=r)
        self.finished = Counter("ellm_sequences_finished", "Generated sequences by finish reason.",
                                ["reason"], registry=r)
        self.prompt_tokens = Counter("ellm_prompt_tokens", "Prompt tokens of requests the server accepted.",
                                     ["model"], registry=r).labels(model)
        self.generation_tokens = Counter("ellm_generation_tokens", "Tokens generated for clients.",
                                         ["model"], registry=r).labels(model)
        self.ttft = Histogram("ellm_time_to_first_token_seconds",
                              "Seconds from a request's arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("ellm_inter_token_latency_seconds",
                             "Seconds between two generated tokens of one sequence.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ellm_request_latency_seconds", "Seconds from a request's arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.constraint_compile = Histogram(
            "ellm_constraint_compile_seconds",
            "Seconds a request's structured-output constraint took to check and compile (off the event loop; "
            "part of that request's latency).", buckets=TTFT_BUCKETS, registry=r)
        self._engine = _EngineCollector(model)
        r.register(self._engine)

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def count_finished(self, reason: str | None) -> None:
        self.finished.labels(reason or "unknown").inc()

    def render(self, snap: EngineSnapshot, accept: str | None) -> tuple[bytes, str]:
        """-> (body, content type): the Prometheus text format, or OpenMetrics when the
        scraper's Accept header asks for it."""
        self._engine.snapshot = snap
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
