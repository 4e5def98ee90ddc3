"""Load test: concurrent streaming clients against `ellm serve` (and optionally llama.cpp's
OpenAI server), loopback only.

For each concurrency level, that many clients send streaming /v1/completions requests
back to back (greedy, EOS suppressed through logit_bias so every request generates
exactly --max-tokens tokens) until the level's request count or time budget is used up.
Printed per level: aggregate output tokens/s over the level's wall time, time to first
token and inter-token latency percentiles (p50/p90/p99, milliseconds, measured at the
client from SSE chunk arrival times).

    python benchmarks/load.py                                   # ellm only
    python benchmarks/load.py --llamacpp-python benchmarks/.venv-llamacpp/bin/python
    python benchmarks/load.py --ray-replicas 2                  # + `ellm serve --replicas 2` (Ray Serve)
    python benchmarks/load.py --clients 16 --rounds 3 --ellm-pythons /work/main/.venv/bin/python,.venv/bin/python
                                                                # two checkouts' servers, alternating; medians

Each prompt starts with its own request number, so no request reuses another's prefix
blocks; both servers compute every prompt in full. llama-cpp-python's server runs one
request at a time, so its concurrency levels measure queueing; ellm batches them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

MODEL_NAME = "smollm2"
# SmolLM2's end-of-text ids (<|endoftext|>, <|im_end|>): biased away so lengths are equal.
EOS_BIAS = {"0": -100, "2": -100}
TOPICS = ["the history of bridges", "how bees make honey", "a day on a fishing boat", "the rules of chess",
          "why leaves change colour", "building a small wooden table", "the life of a lighthouse keeper",
          "how a steam engine works"]


@dataclass
class RequestResult:
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    engine: str
    clients: int
    results: list[RequestResult]
    wall: float

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens for r in self.results if r.error is None) / self.wall

    def row(self) -> str:
        ok = [r for r in self.results if r.error is None]
        tokens = sum(r.tokens for r in ok)
        ttft = [r.ttft for r in ok if r.ttft is not None]
        itl = [x for r in ok for x in r.itl]
        errors = len(self.results) - len(ok)
        return (f"| {self.engine:<9} | {self.clients:>7} | {len(ok):>4}{'' if not errors else f' ({errors} err)'} "
                f"| {tokens / self.wall:>8.1f} | {_pcts(ttft)} | {_pcts(itl)} |")


def _pcts(xs: list[float]) -> str:
    if not xs:
        return "    -  /    -  /    - "
    qs = statistics.quantiles(xs, n=100, method="inclusive") if len(xs) > 1 else [xs[0]] * 99
    return f"{qs[49] * 1e3:6.0f} / {qs[89] * 1e3:6.0f} / {qs[98] * 1e3:6.0f}"


HEADER = ("| engine    | clients | reqs | out tok/s | TTFT ms p50 / p90 / p99  | ITL ms p50 / p90 / p99   |\n"
          "| --------- | ------- | ---- | --------- | ------------------------ | ------------------------ |")


def _prompt(i: int) -> str:
    return (f"Request {i}. Write a short, plain essay about {TOPICS[i % len(TOPICS)]}, "
            f"for readers who know nothing about it yet. Begin with one clear sentence.")


async def _one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> RequestResult:
    body = {"model": MODEL_NAME, "prompt": _prompt(i), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "logit_bias": EOS_BIAS}
    res = RequestResult()
    t0 = time.perf_counter()
    last = None
    finish = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = str(chunk["error"])
                    return res
                if not chunk.get("choices"):
                    continue
                if chunk["choices"][0].get("finish_reason"):
                    finish = chunk["choices"][0]["finish_reason"]
                if not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                res.tokens += 1          # both servers stream one token per chunk, nearly always
        if finish == "length":
            res.tokens = max_tokens      # exact: EOS is suppressed, so length means all of them
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_level(engine: str, base: str, clients: int, requests: int, budget_s: float,
                    max_tokens: int, first_id: int) -> LevelResult:
    url = base + "/v1/completions"
    counter = iter(range(first_id, first_id + requests))
    results: list[RequestResult] = []
    deadline = time.perf_counter() + budget_s

    async def worker(client: httpx.AsyncClient) -> None:
        for i in counter:
            if time.perf_counter() > deadline:
                return
            results.append(await _one(client, url, i, max_tokens))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(budget_s + 120), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(clients)])
        wall = time.perf_counter() - t0
    return LevelResult(engine, clients, results, wall)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None,
          timeout: float = 180) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited with {proc.returncode}; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{cmd[0]} did not come up in {timeout:.0f} s; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench(servers: dict[str, str], args: argparse.Namespace) -> list[LevelResult]:
    """Runs every level on every server, alternating servers within a level so that a
    noisy spell on the machine hits both (idle servers take no CPU)."""
    for base in servers.values():
        asyncio.run(run_level("warm-up", base, 1, 1, 60, 4, 10**6))   # not reported
    print(HEADER, flush=True)
    out, first = [], 0
    rates: dict[tuple[int, str], list[float]] = {}
    for c in args.clients:
        n = max(args.min_requests, args.requests_per_client * c)
        for r in range(args.rounds):
            order = list(servers.items())
            for engine, base in (order if r % 2 == 0 else order[::-1]):   # alternate who goes first
                lvl = asyncio.run(run_level(engine, base, c, n, args.level_seconds, args.max_tokens, first))
                print(lvl.row(), flush=True)
                errors = [r.error for r in lvl.results if r.error]
                if errors:
                    print(f"  first error: {errors[0]}", flush=True)
                out.append(lvl)
                rates.setdefault((c, engine), []).append(lvl.tokens_per_s)
            first += n
    if args.rounds > 1 or len(servers) > 1:
        names = list(servers)
        print(f"{'clients':>7}" + "".join(f" {e:>22}" for e in names)
              + (f" {'last / first':>12}" if len(names) > 1 else "")
              + f"   (aggregate output tok/s, median of {args.rounds})")
        for c in args.clients:
            meds = [statistics.median(rates[(c, e)]) for e in names]
            print(f"{c:>7}" + "".join(f" {m:22.1f}" for m in meds)
                  + (f" {meds[-1] / meds[0]:12.2f}" if len(names) > 1 and meds[0] else ""))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="the GGUF both servers load (default: smollm2-135m-instruct, pulled through ellm.hub)")
    p.add_argument("--clients", default="1,4,16,64", help="comma-separated concurrency levels")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per request")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    p.add_argument("--level-seconds", type=float, default=90, help="no new request starts after this")
    p.add_argument("--threads", type=int, default=2, help="CPU threads for each server")
    p.add_argument("--llamacpp-python", default=None,
                   help="a Python with llama-cpp-python[server]; runs the same load against llama_cpp.server")
    p.add_argument("--llamacpp-pythonpath", default=None,
                   help="extra PYTHONPATH for that Python only (e.g. its server extras installed with --target)")
    p.add_argument("--ray-replicas", type=int, default=0, metavar="N",
                   help="also run `ellm serve --replicas N` (Ray Serve, needs ellm-engine[ray]) with --threads split "
                        "between the replicas, alternating with the single process")
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--ellm-pythons", default=sys.executable,
                   help="comma-separated interpreters, each with an ellm to serve (e.g. main's and a "
                        "branch's .venv/bin/python); every level alternates between their servers")
    p.add_argument("--rounds", type=int, default=1, help="times each level runs on each server (medians)")
    args = p.parse_args()
    args.clients = [int(x) for x in args.clients.split(",")]
    if args.model is None:
        from ellm import hub
        args.model = str(hub.pull("smollm2-135m-instruct"))
    if not Path(args.model).exists():
        raise SystemExit(f"no model at {args.model}")
    load = os.getloadavg()[0]
    print(f"model {args.model}; {args.max_tokens} tokens per request; load average {load:.2f} at start")
    max_seqs = max(args.clients)
    procs: list[subprocess.Popen[bytes]] = []
    servers: dict[str, str] = {}
    try:
        pythons = args.ellm_pythons.split(",")
        for i, py in enumerate(pythons):
            # several: each server is named by its checkout (<checkout>/.venv/bin/python)
            name = "ellm" if len(pythons) == 1 else f"ellm {Path(os.path.abspath(py)).parents[2].name}"
            port = _free_port()
            procs.append(start([py, "-m", "ellm", "serve", args.model, "--port", str(port),
                                "--served-model-name", MODEL_NAME, "--threads", str(args.threads),
                                "--max-num-seqs", str(max_seqs), "--max-queue", str(4 * max_seqs),
                                "--max-model-len", "2048", "--log-level", "warning"],
                               port, Path(args.log_dir) / (f"load-ellm-{i}.log" if i else "load-ellm.log")))
            servers[name] = f"http://127.0.0.1:{port}"
        if args.ray_replicas:
            port = _free_port()
            per = max(1, args.threads // args.ray_replicas)
            procs.append(start([sys.executable, "-m", "ellm", "serve", args.model, "--port", str(port),
                                "--served-model-name", MODEL_NAME, "--replicas", str(args.ray_replicas),
                                "--threads-per-replica", str(per), "--max-num-seqs", str(max_seqs),
                                "--max-queue", str(4 * max_seqs), "--max-model-len", "2048",
                                "--log-level", "warning"],
                               port, Path(args.log_dir) / "load-ellm-ray.log", timeout=300))
            servers[f"ray x{args.ray_replicas}"] = f"http://127.0.0.1:{port}"
        if args.llamacpp_python:
            env = dict(os.environ)
            if args.llamacpp_pythonpath:
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.llamacpp_pythonpath, env.get("PYTHONPATH")]))
            port = _free_port()
            procs.append(start([args.llamacpp_python, "-m", "llama_cpp.server", "--model", args.model,
                                "--model_alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
                                "--n_ctx", "2048", "--n_threads", str(args.threads),
                                "--n_threads_batch", str(args.threads),
                                # by default a new request interrupts the one streaming
                                "--interrupt_requests", "False"],
                               port, Path(args.log_dir) / "load-llamacpp.log", env))
            servers["llama.cpp"] = f"http://127.0.0.1:{port}"
        bench(servers, args)
    finally:
        for proc in procs:
            stop(proc)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
