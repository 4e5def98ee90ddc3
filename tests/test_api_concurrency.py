"""One LLM shared by threads, interleaved generators and asyncio tasks (issue 12).

Every request must get exactly the tokens it gets when it runs alone (the engine's batch
invariance makes that an exact check, greedy or seeded), requests from different callers
must share steps, and a cancelled or closed consumer must give its KV blocks back before
the next step. SmolLM2 (the fastest real model) throughout.
"""
from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import ellm
from ellm import SamplingParams
from ellm.engine.async_engine import EngineDeadError, EngineSnapshot

MAX_TOKENS = 8
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn",
           "In 1969, the first", "My favourite colour is", "Water boils at", "The quick brown fox"]


def case_params(i: int) -> SamplingParams:
    """Even cases greedy, odd cases seeded sampling (different seeds)."""
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS)


CASES = [(PROMPTS[i % len(PROMPTS)], case_params(i)) for i in range(32)]


@pytest.fixture(scope="module")
def llm(smollm2_gguf):
    with ellm.load(smollm2_gguf, max_model_len=512, progress=False) as m:
        yield m


@pytest.fixture(scope="module")
def alone(llm) -> list[list[int]]:
    """Each case's tokens when it is the only request in the engine (greedy cases that
    repeat a prompt are the same request: run once)."""
    seen: dict[str, list[int]] = {}
    for p, params in CASES:
        key = f"{p}|{params}"
        if key not in seen:
            seen[key] = llm.generate(p, params).token_ids
    return [seen[f"{p}|{params}"] for p, params in CASES]


def snapshot(llm) -> EngineSnapshot:
    """Counts read on the engine thread after every command posted before (aborts included)."""
    return llm.async_engine.snapshot_blocking()


def assert_idle(llm) -> None:
    snap = snapshot(llm)
    assert snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_blocks_used == 0, snap
    assert llm.async_engine.num_requests == 0


def test_threads_get_their_own_tokens_and_share_steps(llm, alone) -> None:
    """8 threads x 4 generate() calls each: every result is the one the request gives alone,
    and the requests were batched (fewer forward passes than requests x tokens)."""
    steps_before = llm.engine.stats["steps"]
    barrier = threading.Barrier(8)

    def worker(t: int) -> list[list[int]]:
        barrier.wait()
        return [llm.generate(*CASES[t * 4 + k]).token_ids for k in range(4)]

    with ThreadPoolExecutor(8) as pool:
        got = [tok for fut in [pool.submit(worker, t) for t in range(8)] for tok in fut.result(timeout=300)]
    assert got == alone
    steps = llm.engine.stats["steps"] - steps_before
    assert steps < sum(len(t) for t in alone) / 2, f"{steps} steps for {len(CASES)} requests: not batched"
    assert_idle(llm)


def test_interleaved_streams_keep_their_own_text(llm) -> None:
    a_prompt, b_prompt = PROMPTS[0], PROMPTS[1]
    params = dict(temperature=0.0, max_tokens=24)
    want_a = llm.generate(a_prompt, **params).text
    want_b = llm.generate(b_prompt, **params).text
    a, b = llm.stream(a_prompt, **params), llm.stream(b_prompt, **params)
    got = {"a": [], "b": []}
    live = {"a": a, "b": b}
    while live:
        for name in list(live):
            try:
                got[name].append(next(live[name]))
            except StopIteration:
                del live[name]
    assert "".join(got["a"]) == want_a and "".join(got["b"]) == want_b
    assert want_a != want_b
    assert_idle(llm)


def test_gather_of_16_agenerate(llm, alone) -> None:
    async def go() -> list[Any]:
        return await asyncio.gather(*(llm.agenerate(p, params) for p, params in CASES[:16]))

    outs = asyncio.run(asyncio.wait_for(go(), 300))
    assert [o.token_ids for o in outs] == alone[:16]
    assert_idle(llm)


def test_astream_and_achat(llm) -> None:
    params = dict(temperature=0.0, max_tokens=16)
    messages = [{"role": "user", "content": "Say hello."}]

    async def go() -> tuple[str, Any]:
        pieces = [p async for p in llm.astream(PROMPTS[2], **params)]
        return "".join(pieces), await llm.achat(messages, **params)

    text, reply = asyncio.run(asyncio.wait_for(go(), 120))
    assert text == llm.generate(PROMPTS[2], **params).text
    assert reply.token_ids == llm.chat(messages, **params).token_ids


def test_cancelled_task_frees_its_blocks(llm) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def go() -> tuple[EngineSnapshot, EngineSnapshot]:
        task = asyncio.ensure_future(llm.agenerate(PROMPTS[0], long))
        while llm.async_engine.num_running == 0:
            await asyncio.sleep(0.01)
        busy = await llm.async_engine.snapshot()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The abort was posted before this snapshot: no step ran in between.
        return busy, await llm.async_engine.snapshot()

    busy, after = asyncio.run(asyncio.wait_for(go(), 120))
    assert busy.num_running == 1 and busy.kv_blocks_used >= 1
    assert after.num_running == 0 and after.kv_blocks_used == 0 and after.num_requests == 0


def test_closed_iterators_free_their_blocks(llm) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    gen = llm.stream(PROMPTS[1], long)
    next(gen)
    assert snapshot(llm).kv_blocks_used >= 1
    gen.close()
    assert_idle(llm)

    async def go() -> EngineSnapshot:
        it = llm.astream(PROMPTS[1], long)
        await it.__anext__()
        await it.aclose()
        return await llm.async_engine.snapshot()

    after = asyncio.run(asyncio.wait_for(go(), 120))
    assert after.num_running == 0 and after.kv_blocks_used == 0


def test_n_completions(llm) -> None:
    outs = llm.generate(PROMPTS[3], n=3, temperature=0.9, seed=11, max_tokens=8)
    assert isinstance(outs, list) and len(outs) == 3
    for i, out in enumerate(outs):
        assert out.token_ids == llm.generate(PROMPTS[3], temperature=0.9, seed=11 + i, max_tokens=8).token_ids
    nested = llm.generate(PROMPTS[:2], n=2, temperature=0.0, max_tokens=4)
    assert [len(x) for x in nested] == [2, 2] and nested[1][0].token_ids == nested[1][1].token_ids
    together = asyncio.run(llm.agenerate(PROMPTS[3], n=3, temperature=0.9, seed=11, max_tokens=8))
    assert [o.token_ids for o in together] == [o.token_ids for o in outs]
    with pytest.raises(ValueError, match="n=2"):
        llm.stream("x", n=2)


def test_hammering_threads_while_one_streams(llm) -> None:
    """A pool mixes generate, chat, logits, embed and short streams while another thread
    streams a long reply: no error, the stream and the logits are what they are alone,
    everything finishes within the bound."""
    params = dict(temperature=0.0, max_tokens=48, ignore_eos=True)
    want_stream = llm.generate(PROMPTS[4], **params).text
    ids = llm.tokenizer.encode(PROMPTS[5])
    want_logits = llm.logits(ids)
    streamed: list[str] = []

    def streamer() -> None:
        streamed.extend(llm.stream(PROMPTS[4], **params))

    def job(i: int) -> None:
        kind = i % 5
        if kind == 0:
            assert llm.generate(CASES[i][0], CASES[i][1]).token_ids
        elif kind == 1:
            assert llm.chat([{"role": "user", "content": PROMPTS[i % 8]}], max_tokens=4, seed=i).finish_reason
        elif kind == 2:
            np.testing.assert_array_equal(llm.logits(ids), want_logits)
        elif kind == 3:
            assert llm.embed([PROMPTS[i % 8], PROMPTS[(i + 1) % 8]]).shape == (2, llm.config.hidden_size)
        else:
            gen = llm.stream(PROMPTS[i % 8], max_tokens=20, seed=i)
            next(gen, None)
            gen.close()   # abandoned mid-way

    start = time.monotonic()
    t = threading.Thread(target=streamer)
    t.start()
    with ThreadPoolExecutor(6) as pool:
        for fut in [pool.submit(job, i) for i in range(30)]:
            fut.result(timeout=300)
    t.join(300)
    assert not t.is_alive() and time.monotonic() - start < 300
    assert "".join(streamed) == want_stream
    assert_idle(llm)


def test_close_stops_the_loop(smollm2_gguf) -> None:
    llm = ellm.load(smollm2_gguf, max_model_len=256, progress=False)
    with llm:
        assert llm.generate("Hi", max_tokens=2, temperature=0.0).token_ids
        thread = llm.async_engine._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate("Hi", max_tokens=2)
    llm.close()   # twice is fine

    other = ellm.load(smollm2_gguf, max_model_len=256, progress=False)
    other.generate("Hi", max_tokens=2, temperature=0.0)
    thread = other.async_engine._thread
    del other
    gc.collect()
    thread.join(30)
    assert not thread.is_alive(), "the engine thread outlived its LLM"


def test_interpreter_exit_with_a_running_request_does_not_hang(smollm2_gguf) -> None:
    code = (
        "import sys, ellm\n"
        f"llm = ellm.load({str(smollm2_gguf)!r}, max_model_len=256, progress=False)\n"
        "s = llm.stream('Once upon a time', max_tokens=200, ignore_eos=True)\n"
        "print(next(s), flush=True)\n"
        "sys.exit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_ctrl_c_stops_a_blocking_generate_and_frees_its_blocks(smollm2_gguf) -> None:
    code = (
        "import os, signal, threading, ellm\n"
        # Python's own Ctrl-C handler, also when this suite runs with SIGINT ignored (a
        # background job), which a child would inherit
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"llm = ellm.load({str(smollm2_gguf)!r}, max_model_len=512, progress=False)\n"
        "llm.generate('Hi', max_tokens=1)\n"
        "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()\n"
        "try:\n"
        "    llm.generate('Once upon a time', max_tokens=450, ignore_eos=True)\n"
        "    print('not interrupted')\n"
        "except KeyboardInterrupt:\n"
        "    snap = llm.async_engine.snapshot_blocking()\n"
        "    print('interrupted', snap.num_running, snap.kv_blocks_used)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["interrupted", "0", "0"], proc.stdout
