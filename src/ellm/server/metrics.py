"""Server metrics in the Prometheus text format (version 0.0.4), without a client library.

Counters and histograms are updated on the event-loop thread only, so they need no lock.
Engine gauges (running, waiting, KV blocks) come from an EngineSnapshot taken on the
engine thread when /metrics is read.
"""
from __future__ import annotations

import bisect
import math
from collections import Counter

from ..engine.async_engine import EngineSnapshot

# Seconds. TTFT includes queueing and prefill; ITL is one decode step of the whole batch.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

PREFIX = "ellm"


class Histogram:
    """Cumulative-bucket histogram: counts[i] = observations <= buckets[i]."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.sum += value

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for le, c in zip(self.buckets, self.counts):
            running += c
            lines.append(f'{name}_bucket{{le="{le:g}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.sum:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines


class Metrics:
    """Everything /metrics reports besides the engine snapshot."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()   # (route, HTTP status) -> count
        self.finished: Counter[str] = Counter()                # finish reason -> sequences
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def count_request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def render(self, snap: EngineSnapshot, model_name: str) -> str:
        p = PREFIX
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {p}_{name} {help_text}")
            lines.append(f"# TYPE {p}_{name} {kind}")
            for labels, value in samples:
                lines.append(f"{p}_{name}{labels} {value:g}" if isinstance(value, float)
                             else f"{p}_{name}{labels} {value}")

        model = f'model="{_escape(model_name)}"'
        metric("requests_total", "counter", "HTTP requests answered, by route and status code.",
               [(f'{{route="{_escape(r)}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
        metric("sequences_finished_total", "counter", "Generated sequences by finish reason.",
               [(f'{{reason="{_escape(r)}"}}', n) for r, n in sorted(self.finished.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of requests the server accepted.",
               [(f"{{{model}}}", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated for clients.",
               [(f"{{{model}}}", self.generation_tokens)])
        metric("num_requests_running", "gauge", "Sequences in the running batch.",
               [(f"{{{model}}}", snap.num_running)])
        metric("num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
               [(f"{{{model}}}", snap.num_waiting)])
        metric("kv_blocks_used", "gauge", "KV cache blocks held by queued or running sequences.",
               [(f"{{{model}}}", snap.kv_blocks_used)])
        metric("kv_blocks_cached", "gauge", "KV cache blocks held only by the prefix cache (evictable).",
               [(f"{{{model}}}", snap.kv_blocks_cached)])
        metric("kv_blocks_total", "gauge", "KV cache blocks in all pools.",
               [(f"{{{model}}}", snap.kv_blocks_total)])
        metric("prefix_cache_hits_total", "counter", "Prompt blocks found in the prefix cache.",
               [(f"{{{model}}}", snap.prefix_cache_hits)])
        metric("prefix_cache_queries_total", "counter", "Prompt blocks looked up in the prefix cache.",
               [(f"{{{model}}}", snap.prefix_cache_queries)])
        metric("preemptions_total", "counter", "Sequences preempted for lack of KV blocks.",
               [(f"{{{model}}}", snap.num_preemptions)])
        metric("engine_step_errors_total", "counter", "Engine steps that raised (their batch failed).",
               [(f"{{{model}}}", snap.step_errors)])
        lines += self.ttft.render(f"{p}_time_to_first_token_seconds",
                                  "Seconds from a request's arrival to its first generated token.")
        lines += self.itl.render(f"{p}_inter_token_latency_seconds",
                                 "Seconds between two generated tokens of one sequence.")
        lines += self.e2e.render(f"{p}_request_latency_seconds",
                                 "Seconds from a request's arrival to its last token.")
        return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
