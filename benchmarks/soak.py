"""Soak: many concurrent hostile and honest clients against the real server for minutes.

    nice -n 10 .venv/bin/python benchmarks/soak.py --clients 64 --duration 300

Starts the server (uvicorn, the real SmolLM2 model, in a child process) unless --url is
given, then runs --clients asyncio clients for --duration seconds, each looping over a
random mix of:
  stream      a valid streamed completion or chat, read to the end
  cancel      a streamed request dropped after a few chunks (the generation is aborted)
  plain       a valid non-streamed request
  hostile     parameters no kernel can represent, wrong types, lone surrogates, integers
              of thousands of digits, bad token ids (each must be a 4xx)
  oversized   prompts over the character limit or the context (4xx, refused before work)
  constrained a valid guided_choice / json_schema / regex / grammar request (200), or a
              hostile one: a 3,000-rule chain, 20,000 choices, a $ref cycle, a schema as
              JSON text nested 5,000 deep (each must be a 4xx, the server alive)
  vision      (--vision, a vision model) a chat with an image as a data: URL, or as an
              http URL of a local image host (allowed by name), some of them slow (3 s):
              a slow fetch must not hold up anyone else's text chat
while a prober in a process of its own asks /health every 50 ms. Afterwards it checks, and prints as JSON:
  - no answer was a 5xx and no client saw a transport error other than its own cancel;
  - every KV block came back (ellm_kv_blocks_used == 0, nothing running or waiting);
  - the server's RSS is flat: the last quarter's median is within --rss-slack of the
    median of the second quarter (after warm-up);
  - /health always answered within --health-ms (default 100 ms), with its percentiles;
  - a greedy request gives the same text after the soak as before it.
Exit status 0 when every check holds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx

_LAUNCH = r"""
import sys, uvicorn, ellm
from ellm.server import create_app
from ellm.server.timeouts import header_timeout_protocol
template = sys.argv[6] or None
llm = ellm.load(sys.argv[1], max_model_len=int(sys.argv[3]), max_num_seqs=int(sys.argv[4]), progress=False,
                chat_template=template)
app = create_app(llm, served_model_name="m", max_queue=256, allow_image_urls=True,
                 allowed_image_hosts=("127.0.0.1",))
app.state.server.cfg.max_prompt_chars = int(sys.argv[5])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", http=header_timeout_protocol(10))
"""

# The tiny SmolVLM's chat template (tests/test_vision_api.py): its tokenizer carries none.
SMOLVLM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}:{% if m['content'] is string %} "
                    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
                    "{% else %} {{ p['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant:{% endif %}")


def _png(seed: int) -> bytes:
    """A small PNG of noise (Pillow: the vision extra's)."""
    import io

    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _image_host() -> tuple[str, Any]:
    """A local image host in a thread: /img.png at once, /slow.png after 3 s."""
    import http.server
    import threading
    body = _png(7)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:   # noqa: N802
            if self.path.startswith("/slow"):
                time.sleep(3.0)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}", srv


def _constraints(rng: random.Random) -> tuple[dict[str, Any], bool]:
    """A structured-output field set, and whether it is valid."""
    valid = [
        {"guided_choice": ["red", "green", "blue"]},
        {"guided_choice": [f"option {k}" for k in range(rng.choice([100, 2000]))]},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}},
        {"guided_regex": "[a-z]{1,8}"},
        {"guided_grammar": 'start: "yes" | "no"'},
    ]
    hostile = [
        {"guided_grammar": "\n".join(["start: r0"] + [f'r{k}: "x" r{k + 1} | "y"' for k in range(3000)]
                                     + ['r3000: "z"'])},
        {"guided_choice": [f"o{k}" for k in range(20_000)]},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
        {"guided_json": "[" * 5000 + "]" * 5000},
    ]
    if rng.random() < 0.75:
        return rng.choice(valid), True
    return rng.choice(hostile), False

GREEDY = {"prompt": "The three primary colours are", "max_tokens": 24, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _hostile_bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    big = b"9" * rng.randint(1000, 6000)
    return [
        ("/v1/completions", json.dumps({"prompt": "hi", "repetition_penalty": 1e30, "temperature": 1.0}).encode()),
        ("/v1/completions", json.dumps({"prompt": "hi", "top_p": 1e-300, "temperature": 1.0}).encode()),
        ("/v1/completions", json.dumps({"prompt": "hi", "temperature": 1e300}).encode()),
        ("/v1/completions", json.dumps({"prompt": [True, 3], "max_tokens": 2}).encode()),
        ("/v1/completions", json.dumps({"prompt": [10**9], "max_tokens": 2}).encode()),
        ("/v1/completions", json.dumps({"prompt": "hi", "logit_bias": {"99999999": 5}}).encode()),
        ("/v1/completions", json.dumps({"prompt": "hi", "n": 10**6}).encode()),
        ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + big + b"}"),
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfff"}], "max_tokens": 2}'),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode()),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
        ("/v1/completions", b"{" * 100_000),
        ("/v1/completions", b"\xff\xfe not json"),
        ("/tokenize", b'{"prompt": "\\udc80"}'),
    ]


def _probe_health(url: str, stop: Any, results: Any) -> None:
    """Asks /health every 50 ms until stop is set; puts (latencies in ms, errors)."""
    latencies: list[float] = []
    errors: list[str] = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            r = c.get("/health")
            latencies.append((time.perf_counter() - t) * 1000)
            if r.status_code != 200:
                errors.append(f"health: HTTP {r.status_code}")
            time.sleep(0.05)
    results.put((latencies, errors))


class Soak:
    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.status: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.errors: list[str] = []
        self.health_ms: list[float] = []
        self.rss: list[tuple[float, int]] = []
        self.stop = asyncio.Event()
        self.image_url = ""
        self.prompt_repeat = 8 if args.vision else 20   # (the tiny SmolVLM's context is 256 tokens)

    async def client(self, i: int) -> None:
        rng = random.Random(i)
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as c:
            while not self.stop.is_set():
                kinds = ["stream", "cancel", "plain", "hostile", "oversized", "constrained"]
                weights = [3, 2, 2, 3, 1, 2]
                if self.args.vision:
                    kinds, weights = kinds + ["vision"], weights + [2]
                kind = rng.choices(kinds, weights)[0]
                self.kinds[kind] += 1
                try:
                    await getattr(self, kind)(c, rng)
                except httpx.HTTPError as e:
                    self.errors.append(f"{kind}: {type(e).__name__}: {e}")

    def _count(self, r: httpx.Response, kind: str, want_ok: bool) -> None:
        self.status[f"{r.status_code // 100}xx"] += 1
        if r.status_code >= 500 or (want_ok and r.status_code != 200) or (not want_ok and r.status_code < 400):
            self.errors.append(f"{kind}: HTTP {r.status_code}: {r.text[:200]}")

    def _body(self, rng: random.Random, stream: bool) -> tuple[str, dict[str, Any]]:
        params: dict[str, Any] = {"max_tokens": rng.randint(1, 40), "stream": stream,
                                  "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 99)}
        if rng.random() < 0.3:
            params.update(top_p=0.9, top_k=40, repetition_penalty=1.1, logprobs=2 if rng.random() < 0.5 else None)
        if rng.random() < 0.5:
            return "/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about " + rng.choice(
                ["rivers", "bread", "stars", "cats"])}], **{k: v for k, v in params.items() if k != "logprobs"}}
        return "/v1/completions", {"prompt": "Once upon a time " * rng.randint(1, self.prompt_repeat), **params}

    async def stream(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self._body(rng, True)
        async with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
            chunks = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        self._count(r, "stream", True)
        if r.status_code == 200 and (not chunks or chunks[-1] != "data: [DONE]"):
            self.errors.append(f"stream: no [DONE] ({chunks[-1:] if chunks else 'no chunks'})")
        bad = [ch for ch in chunks if '"error"' in ch]
        if bad:
            self.errors.append(f"stream: error event {bad[0][:200]}")

    async def cancel(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self._body(rng, True)
        body["max_tokens"] = 200
        keep = rng.randint(0, 4)
        async with c.stream("POST", path, json=body) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n > keep:
                    break  # leaving the block drops the connection mid-stream
        self.status[f"{r.status_code // 100}xx"] += 1

    async def plain(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        path, body = self._body(rng, False)
        self._count(await c.post(path, json=body), "plain", True)

    async def hostile(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        path, raw = rng.choice(_hostile_bodies(rng))
        self._count(await c.post(path, content=raw, headers={"content-type": "application/json"}), "hostile", False)

    async def oversized(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        if rng.random() < 0.5:  # over the character limit: refused before tokenizing
            prompt = "x " * (self.args.max_prompt_chars // 2 + 10)
        else:                   # under it but over the context: refused after tokenizing
            prompt = "hello " * (self.args.max_model_len * 2)
        self._count(await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), "oversized", False)

    async def constrained(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        fields, valid = _constraints(rng)
        body = {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 16, "temperature": 0.7,
                "seed": rng.randint(0, 99), **fields}
        self._count(await c.post("/v1/chat/completions", json=body), "constrained", valid)

    async def vision(self, c: httpx.AsyncClient, rng: random.Random) -> None:
        import base64
        r_ = rng.random()
        if r_ < 0.4:
            url = "data:image/png;base64," + base64.b64encode(_png(rng.randint(0, 3))).decode()
        elif r_ < 0.8:
            url = self.image_url + "/img.png"
        else:
            url = self.image_url + "/slow.png"
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                          {"type": "text", "text": "What is this?"}]}],
                "max_tokens": rng.randint(1, 12), "temperature": 0.7, "stream": rng.random() < 0.5}
        if body["stream"]:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                chunks = [line async for line in r.aiter_lines() if line.startswith("data: ")]
            self._count(r, "vision", True)
            if r.status_code == 200 and (not chunks or chunks[-1] != "data: [DONE]"):
                self.errors.append("vision: no [DONE]")
        else:
            self._count(await c.post("/v1/chat/completions", json=body), "vision", True)

    async def rss_sampler(self, pid: int | None) -> None:
        while pid is not None and not self.stop.is_set():
            self.rss.append((time.monotonic(), _rss_kb(pid)))
            await asyncio.sleep(1.0)

    async def run(self, pid: int | None) -> None:
        # /health is timed from a process of its own: inside this one, the 64 clients'
        # event loop (parsing streams) would add its own delays to the server's answer.
        ctx = multiprocessing.get_context("spawn")
        stop, results = ctx.Event(), ctx.Queue()
        probe = ctx.Process(target=_probe_health, args=(self.url, stop, results))
        probe.start()
        tasks = [asyncio.create_task(self.client(i)) for i in range(self.args.clients)]
        sampler = asyncio.create_task(self.rss_sampler(pid))
        await asyncio.sleep(self.args.duration)
        self.stop.set()
        stop.set()
        await asyncio.gather(*tasks, sampler)
        self.health_ms, errors = await asyncio.to_thread(results.get, True, 60)
        self.errors.extend(errors)
        probe.join(10)


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("kv_blocks_used", "num_requests_running", "num_requests_waiting", "engine_step_errors_total"):
        m = re.search(rf"^ellm_{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.MULTILINE)
        if m:
            out[name] = float(m.group(1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running server (else one is started)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-prompt-chars", type=int, default=100_000)
    ap.add_argument("--health-ms", type=float, default=100.0)
    ap.add_argument("--rss-slack", type=float, default=0.10, help="allowed RSS growth, a fraction")
    ap.add_argument("--vision", action="store_true",
                    help="--model is a tiny SmolVLM folder (tests/goldens/tiny_vision_models.py): add vision requests")
    args = ap.parse_args()
    image_url, image_srv = _image_host()

    proc = None
    url = args.url
    if url is None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, args.model, str(port), str(args.max_model_len),
                                 str(args.max_num_seqs), str(args.max_prompt_chars),
                                 SMOLVLM_TEMPLATE if args.vision else ""],
                                stdout=subprocess.DEVNULL, stderr=open(os.devnull, "wb"))
        for _ in range(900):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
    try:
        before = httpx.post(url + "/v1/completions", json=GREEDY, timeout=300).json()["choices"][0]["text"]
        soak = Soak(url, args)
        soak.image_url = image_url
        t0 = time.perf_counter()
        asyncio.run(soak.run(proc.pid if proc else None))
        wall = time.perf_counter() - t0
        for _ in range(100):  # let aborted sequences reach the engine thread
            g = _gauges(url)
            if not (g.get("kv_blocks_used") or g.get("num_requests_running") or g.get("num_requests_waiting")):
                break
            time.sleep(0.1)
        after = httpx.post(url + "/v1/completions", json=GREEDY, timeout=300).json()["choices"][0]["text"]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    h = sorted(soak.health_ms)
    rss = [kb for _, kb in soak.rss]
    q = max(1, len(rss) // 4)
    rss_warm = statistics.median(rss[q:2 * q]) if len(rss) >= 4 else None
    rss_end = statistics.median(rss[-q:]) if len(rss) >= 4 else None
    checks = {
        "no_5xx_or_transport_errors": not soak.errors,
        "kv_blocks_back": g.get("kv_blocks_used") == 0 and not g.get("num_requests_running")
        and not g.get("num_requests_waiting"),
        "rss_flat": rss_warm is None or rss_end <= rss_warm * (1 + args.rss_slack),
        "health_within_ms": bool(h) and h[-1] <= args.health_ms,
        "greedy_unchanged": before == after,
    }
    report = {
        "clients": args.clients, "seconds": round(wall, 1), "requests": dict(soak.kinds), "status": dict(soak.status),
        "errors": soak.errors[:20], "n_errors": len(soak.errors),
        "error_kinds": dict(Counter(e[:60] for e in soak.errors).most_common(10)), "gauges_after": g,
        "health_ms": {"n": len(h), "p50": round(h[len(h) // 2], 1) if h else None,
                      "p99": round(h[int(len(h) * 0.99)], 1) if h else None, "max": round(h[-1], 1) if h else None},
        "rss_mb": {"warm_median": rss_warm and round(rss_warm / 1024, 1),
                   "end_median": rss_end and round(rss_end / 1024, 1),
                   "min": rss and round(min(rss) / 1024, 1), "max": rss and round(max(rss) / 1024, 1)},
        "greedy_before": before, "greedy_after": after, "checks": checks,
    }
    print(json.dumps(report, indent=2, ensure_ascii=False))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
