"""ellm on Ray Serve (ellm.server.ray_serve): a local Ray cluster on loopback, 2 replicas
of SmolLM2 x 1 thread behind one ingress, driven by the openai client and raw HTTP.

Checks that the ingress serves what the single-process server serves (greedy outputs,
error bodies, tokenize, embeddings, API key), that both replicas take requests, that
killing a replica's process under a 32-client streaming load leaves no client hung and
every stream either complete or ended by an error event (and that Serve brings the
replica back and later requests succeed), and that the prefix-affinity router gets a
higher prefix-cache hit rate than round robin on a multi-turn chat workload.

One cluster for the module (small: 3 logical CPUs, a 100 MB object store, no
dashboard), shut down at the end.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from ellm.server import ray_serve  # noqa: E402

API_KEY = "sk-ray-test-0123456789"
MAX_MODEL_LEN = 1024
NAME = "smol"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deploy(gguf: Path, router: str) -> None:
    app = ray_serve.build_app(str(gguf), replicas=2, threads_per_replica=1, router=router, api_key=API_KEY,
                              served_model_name=NAME, max_model_len=MAX_MODEL_LEN, max_num_seqs=32, max_queue=64)
    serve.run(app, name=ray_serve.APP_NAME, route_prefix="/")


@pytest.fixture(scope="module")
def cluster(smollm2_gguf: Path) -> Iterator[str]:
    """-> the ingress URL. Ray and Serve are stopped afterwards, whatever happened."""
    port = _free_port()
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=100 << 20, logging_level="warning",
             log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _deploy(smollm2_gguf, "prefix")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def single(smollm2_gguf: Path) -> Iterator[Any]:
    """The single-process server (server/app.py on a local engine) as a TestClient."""
    from starlette.testclient import TestClient

    import ellm
    from ellm.server import create_app
    llm = ellm.load(str(smollm2_gguf), threads=1, max_model_len=MAX_MODEL_LEN, max_num_seqs=32, progress=False)
    with TestClient(create_app(llm, served_model_name=NAME, api_key=API_KEY, max_queue=64)) as client:
        client.headers["authorization"] = f"Bearer {API_KEY}"
        yield client
    llm.close()


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)


def _metrics(url: str) -> str:
    with _client(url) as c:
        r = c.get("/metrics")
        assert r.status_code == 200, r.text
        return r.text


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of the metric `name` in Prometheus text."""
    out = []
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out.append((labels, float(m.group(2))))
    return out


def _total(text: str, name: str) -> float:
    return sum(v for _, v in _samples(text, name))


# ---------------------------------------------------------------------------------------
# no cluster needed
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [({"replicas": 0}, "replicas"), ({"replicas": True}, "replicas"),
                                           ({"threads_per_replica": 0}, "threads_per_replica"),
                                           ({"router": "random"}, "router"), ({"max_queue": 0}, "max_queue"),
                                           ({"kv_cache_dtype": "bf16"}, "kv_cache_dtype"),
                                           ({"quantize": "q5_0"}, "quantize"),
                                           ({"speculative_config": {"method": "eagle"}}, "method")])
def test_build_app_names_the_bad_argument(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ray_serve.build_app("smollm2-135m-instruct", **kwargs)


def test_cli_refuses_bad_replica_counts(capsys: pytest.CaptureFixture[str]) -> None:
    from ellm.cli import main
    assert main(["serve", "smollm2-135m-instruct", "--replicas", "0"]) == 2
    assert "--replicas" in capsys.readouterr().err


def test_prefix_table_longest_prefix_of_a_living_replica() -> None:
    table = ray_serve.PrefixTable(max_blocks=1000)
    system = list(range(64))                      # four full blocks
    table.record(system + [500] * 20, "a")
    table.record(system + [600] * 40, "b")        # shares the four system blocks, then its own
    assert table.owner_of(system + [600] * 40 + [7], {"a", "b"}) == "b"
    assert table.owner_of(system + [500] * 20 + [7], {"a", "b"}) == "a"
    assert table.owners_of(system + [9] * 16, {"a", "b"}) == ["b", "a"]   # both hold the system blocks
    assert table.owner_of(system + [600] * 40 + [7], {"a"}) == "a"  # b is gone: a holds the system part
    table.forget("a")
    assert table.owners_of(system + [500] * 20 + [7], {"a", "b"}) == ["b"]
    assert table.owner_of(list(range(1000, 1100)), {"a", "b"}) is None
    small = ray_serve.PrefixTable(max_blocks=3, owners_per_block=2)
    for r in "xyz":
        small.record(list(range(33)), r)
    assert small.owners_of(list(range(33)), {"x", "y", "z"}) == ["z", "y"]
    small.record(list(range(100, 150)), "x")                     # 3 more blocks: the LRU drops the first two
    assert len(small.owners) == 3
    assert ray_serve.block_hashes(list(range(16))) == []          # the last token's block is never cached
    assert len(ray_serve.block_hashes(list(range(33)))) == 2


CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 24, "temperature": 0}


# ---------------------------------------------------------------------------------------
# the same API as the single-process server
# ---------------------------------------------------------------------------------------

def test_openai_client_streams_through_the_ingress(cluster: str, single: Any) -> None:
    client = openai.OpenAI(base_url=cluster + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    pieces, reasons = [], []
    for chunk in client.chat.completions.create(**CHAT, stream=True):
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert len(pieces) > 1 and reasons == ["length"]
    # Greedy output is the single-process server's, streamed or not.
    want = single.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    assert "".join(pieces) == want
    got = client.chat.completions.create(**CHAT).choices[0].message.content
    assert got == want
    comp = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    assert (client.completions.create(**comp).choices[0].text
            == single.post("/v1/completions", json=comp).json()["choices"][0]["text"])


def test_errors_auth_tokenize_embeddings_as_single_process(cluster: str, single: Any) -> None:
    with _client(cluster) as c:
        cases = [
            ("/v1/chat/completions", {"model": NAME, "messages": [], "max_tokens": 4}),
            ("/v1/chat/completions", {**CHAT, "temperature": -1}),
            ("/v1/chat/completions", {**CHAT, "model": "nope"}),
            ("/v1/completions", {"model": NAME, "prompt": "x " * 3000, "max_tokens": 4}),
            ("/v1/completions", {"model": NAME, "prompt": [10 ** 9], "max_tokens": 4}),
        ]
        for path, body in cases:
            got, want = c.post(path, json=body), single.post(path, json=body)
            assert (got.status_code, got.json()) == (want.status_code, want.json()), (path, body)
        r = httpx.post(cluster + "/v1/chat/completions", json=CHAT, timeout=30)   # no key
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(cluster + "/health", timeout=30).status_code == 200
        tok = {"model": NAME, "messages": [{"role": "user", "content": "hello there"}]}
        assert c.post("/tokenize", json=tok).json() == single.post("/tokenize", json=tok).json()
        emb = {"model": NAME, "input": ["a red fox", "a blue whale"]}
        got_e = c.post("/v1/embeddings", json=emb).json()["data"]
        want_e = single.post("/v1/embeddings", json=emb).json()["data"]
        assert [d["embedding"] for d in got_e] == [d["embedding"] for d in want_e]
        resp = c.post("/v1/responses", json={"model": NAME, "input": "Say hi.", "max_output_tokens": 8,
                                              "temperature": 0})
        assert resp.status_code == 200 and resp.json()["status"] in ("completed", "incomplete")


def test_both_replicas_serve(cluster: str) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": NAME, "prompt": f"Request {i}: count from {i} to", "max_tokens": 6, "temperature": 0}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

    async def load() -> None:
        async with httpx.AsyncClient(base_url=cluster, headers={"authorization": f"Bearer {API_KEY}"},
                                     timeout=60) as c:
            await asyncio.gather(*(one(c, i) for i in range(16)))

    asyncio.run(load())
    time.sleep(0.5)   # the replicas' stats follow each request's last delta
    text = _metrics(cluster)
    routed = {lab["replica"]: v for lab, v in _samples(text, "ellm_replica_requests_total")}
    assert len(routed) == 2 and all(v > 0 for v in routed.values()), routed
    info = _samples(text, "ellm_replica_info")
    assert len({lab["pid"] for lab, _ in info}) == 2
    # Aggregated engine counters are the sum of the replicas' own.
    per = sum(v for _, v in _samples(text, "ellm_replica_prefix_cache_queries_total"))
    assert _total(text, "ellm_prefix_cache_queries_total") == per


# ---------------------------------------------------------------------------------------
# a replica dies under load
# ---------------------------------------------------------------------------------------

async def _stream(c: httpx.AsyncClient, i: int, deadline: float, started: asyncio.Event | None = None,
                  streaming: list[int] | None = None) -> str:
    """One streamed chat -> "done" (finish_reason and [DONE]), "error" (an error event,
    then [DONE]), "hung" (nothing ended it within deadline) or "broken" (anything else)."""
    body = {"model": NAME, "messages": [{"role": "user", "content": f"Story {i}: tell me about the number {i}."}],
            "max_tokens": 48, "temperature": 0, "stream": True}
    seen = {"finished": False, "errored": False, "done": False}

    async def read() -> str | None:
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return f"broken: status {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    seen["done"] = True
                    break
                event = json.loads(data)
                if "error" in event:
                    seen["errored"] = event["error"]["type"] == "server_error"
                elif any(ch.get("finish_reason") for ch in event["choices"]):
                    seen["finished"] = True
                elif streaming is not None and started is not None and any(
                        ch["delta"].get("content") for ch in event["choices"]) and not seen.get("counted"):
                    seen["counted"] = True
                    streaming[0] += 1
                    if streaming[0] >= 16:
                        started.set()
        return None

    try:
        broken = await asyncio.wait_for(read(), deadline)
    except asyncio.TimeoutError:
        return "hung"
    except Exception as e:  # noqa: BLE001 - counted, and the test fails on it
        return f"broken: {type(e).__name__}: {e}"
    if broken:
        return broken
    if seen["done"] and seen["errored"]:
        return "error"
    return "done" if seen["done"] and seen["finished"] else "broken: no end"


def _replica_pids(url: str) -> list[int]:
    """The replicas' process ids, once both have reported (a few small requests first)."""
    for attempt in range(5):
        pids = sorted({int(lab["pid"]) for lab, _ in _samples(_metrics(url), "ellm_replica_info")})
        if len(pids) >= 2:
            return pids
        with _client(url) as c:
            for i in range(8):
                c.post("/v1/completions", json={"model": NAME, "prompt": f"warm {attempt} {i}", "max_tokens": 2})
        time.sleep(0.5)
    return pids


def _routes(text: str) -> dict[int, float]:
    """pid -> the streams its replica has started (ellm_replica_requests_total)."""
    pid_of = {lab["replica"]: int(lab["pid"]) for lab, _ in _samples(text, "ellm_replica_info")}
    out: dict[int, float] = {}
    for lab, v in _samples(text, "ellm_replica_requests_total"):
        if lab.get("replica") in pid_of:
            out[pid_of[lab["replica"]]] = out.get(pid_of[lab["replica"]], 0) + v
    return out


def _running_replicas() -> int:
    status = serve.status().applications[ray_serve.APP_NAME].deployments["EllmReplica"]
    return int(status.replica_states.get("RUNNING", 0))


def test_replica_killed_under_load(cluster: str) -> None:
    pids = _replica_pids(cluster)
    assert len(pids) == 2, pids
    before = _routes(_metrics(cluster))
    killed_at: list[float] = []

    async def load() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster, headers={"authorization": f"Bearer {API_KEY}"},
                                     timeout=httpx.Timeout(120, connect=10),
                                     limits=httpx.Limits(max_connections=64)) as c:
            started, streaming = asyncio.Event(), [0]
            tasks = [asyncio.ensure_future(_stream(c, i, 120, started, streaming)) for i in range(32)]
            # Half the clients have content: streams are running on both replicas.
            await asyncio.wait_for(started.wait(), 90)
            # The victim is the replica that took the most of these streams (the router
            # may have sent them all to one), so the kill is sure to cut some.
            now = _routes((await c.get("/metrics")).text)
            victim = max(now, key=lambda pid: now[pid] - before.get(pid, 0))
            os.kill(victim, signal.SIGKILL)
            killed_at.append(time.monotonic())
            return list(await asyncio.gather(*tasks))

    outcomes = asyncio.run(load())
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    text = _metrics(cluster)
    retried = _total(text, "ellm_requests_retried_total")
    print(f"killing one replica of two under 32 streaming clients: {counts}; "
          f"{retried:.0f} requests sent again (nothing streamed yet)")
    assert counts.get("hung", 0) == 0, counts
    assert set(counts) <= {"done", "error"}, counts
    assert counts.get("done", 0) > 0
    assert counts.get("error", 0) + retried > 0, "the kill touched no request"

    # Later requests all succeed (on the survivor, then on the replica Serve restarts).
    with _client(cluster) as c:
        for i in range(6):
            r = c.post("/v1/completions", json={"model": NAME, "prompt": f"After {i}", "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"], r.text
    while _running_replicas() < 2:
        assert time.monotonic() - killed_at[0] < 90, "Serve did not restart the dead replica within 90 s"
        time.sleep(0.5)
    print(f"2 replicas running again {time.monotonic() - killed_at[0]:.1f} s after the kill")


# ---------------------------------------------------------------------------------------
# prefix affinity vs round robin
# ---------------------------------------------------------------------------------------

TOPICS = ["gardening", "astronomy", "cooking", "chess", "sailing", "painting"]


def _system(topic: str) -> str:
    return (f"You are a patient tutor who only talks about {topic}. Answer in one short sentence, "
            f"with no lists and no greetings; if asked about anything but {topic}, steer back to {topic}. "
            f"Session tag: {topic.upper()}-{len(topic) * 37}.")


def _multi_turn(url: str, turns: int = 3) -> float:
    """Six conversations at once, `turns` user turns each (each turn sends the whole
    history so far). -> the prefix-cache hit rate over the workload (hit / looked-up blocks)."""
    before = _metrics(url)

    async def conversation(c: httpx.AsyncClient, topic: str) -> None:
        messages = [{"role": "system", "content": _system(topic)}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"Question {t + 1} about {topic}, please?"})
            r = await c.post("/v1/chat/completions", json={"model": NAME, "messages": messages,
                                                           "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {API_KEY}"},
                                     timeout=60) as c:
            await asyncio.gather(*(conversation(c, topic) for topic in TOPICS))

    asyncio.run(run())
    time.sleep(0.5)
    after = _metrics(url)
    hits = _total(after, "ellm_prefix_cache_hits_total") - _total(before, "ellm_prefix_cache_hits_total")
    queries = _total(after, "ellm_prefix_cache_queries_total") - _total(before, "ellm_prefix_cache_queries_total")
    assert queries > 0
    return hits / queries


def test_prefix_affinity_beats_round_robin(cluster: str, smollm2_gguf: Path) -> None:
    # The module's prefix-router replicas (one restarted by the test above): the earlier
    # tests' prompts share no 16-token block with these conversations (their first block
    # already holds a different system prompt), so they cannot add hits here.
    affinity = _multi_turn(cluster)
    serve.delete(ray_serve.APP_NAME)          # fresh replicas: empty prefix caches
    _deploy(smollm2_gguf, "round-robin")
    round_robin = _multi_turn(cluster)
    print(f"prefix-cache hit rate, 6 conversations x 3 turns on 2 replicas: "
          f"affinity {affinity:.3f}, round robin {round_robin:.3f}")
    assert affinity > round_robin


# ---------------------------------------------------------------------------------------
# shutdown (last: it deletes the application; draining is the replicas' own, so the
# round-robin deployment the test above leaves serves as well as any)
# ---------------------------------------------------------------------------------------

def test_delete_drains_running_streams(cluster: str) -> None:
    """serve.delete (what `ellm serve --replicas` does on SIGTERM) lets a running stream
    finish before the replicas go."""
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster, headers={"authorization": f"Bearer {API_KEY}"},
                                     timeout=120) as c:
            started, streaming = asyncio.Event(), [0]
            tasks = [asyncio.ensure_future(_stream(c, 100 + i, 120, started, streaming)) for i in range(16)]
            await asyncio.wait_for(started.wait(), 90)    # all 16 are streaming
            await asyncio.get_running_loop().run_in_executor(None, serve.delete, ray_serve.APP_NAME)
            return list(await asyncio.gather(*tasks))

    outcomes = asyncio.run(run())
    assert outcomes == ["done"] * 16, outcomes
    # (The last test of the module: nothing is deployed after it.)
