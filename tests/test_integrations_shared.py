"""Two integrations in one process share one loaded model: given the same LLM, or the
same model name (one load, through ellm.integrations.shared), from two threads at once.
And ellm itself never imports the integrations."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from llama_index.core.base.llms.types import ChatMessage  # noqa: E402

import ellm  # noqa: E402
from ellm.integrations import shared  # noqa: E402
from ellm.integrations.langchain import ChatEllm  # noqa: E402
from ellm.integrations.llama_index import EllmLLM  # noqa: E402

QUESTIONS = ["Name a colour.", "Name a fruit.", "Name an animal."]


def _in_two_threads(a, b):
    """Runs a() and b() at once (a barrier releases them together); their results."""
    barrier = threading.Barrier(2)
    out: dict[str, object] = {}

    def run(key, fn):
        barrier.wait()
        try:
            out[key] = fn()
        except BaseException as e:   # reported by the assertion below
            out[key] = e
    threads = [threading.Thread(target=run, args=("a", a)), threading.Thread(target=run, args=("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    for v in out.values():
        if isinstance(v, BaseException):
            raise v
    return out["a"], out["b"]


def _answers(engine):
    return [engine.chat([{"role": "user", "content": q}], max_tokens=8, temperature=0).text for q in QUESTIONS]


def test_one_llm_two_integrations_two_threads(smollm2_gguf):
    with ellm.load(smollm2_gguf, max_model_len=1024, progress=False) as engine:
        lc = ChatEllm(llm=engine, max_tokens=8, temperature=0)
        li = EllmLLM(llm=engine, max_tokens=8, temperature=0)
        assert lc._engine is engine and li._engine is engine
        a, b = _in_two_threads(lambda: [lc.invoke(q).content for q in QUESTIONS],
                               lambda: [li.chat([ChatMessage(role="user", content=q)]).message.content
                                        for q in QUESTIONS])
        ref = _answers(engine)
        assert a == ref and b == ref   # greedy: batched together, each gets its own tokens


def test_by_name_one_load_from_two_threads(smollm2_gguf):
    source = str(smollm2_gguf)
    opts = {"max_model_len": 1024, "progress": False}
    shared.release(source)
    try:
        lc, li = _in_two_threads(lambda: ChatEllm(model=source, load_kwargs=opts, max_tokens=8, temperature=0),
                                 lambda: EllmLLM(model=source, load_kwargs=opts, max_tokens=8, temperature=0))
        assert lc._engine is li._engine          # one load, shared
        assert shared.get_llm(source, **opts) is lc._engine and source in shared.loaded()
        assert shared.get_llm(source, max_model_len=512, progress=False) is not lc._engine  # other options: another
        a, b = _in_two_threads(lambda: lc.invoke(QUESTIONS[0]).content,
                               lambda: li.complete(QUESTIONS[0]).text)
        assert a == b == _answers(lc._engine)[0]
    finally:
        shared.release(source)
    assert source not in shared.loaded()


def test_get_llm_errors(smollm2_gguf):
    with pytest.raises(ValueError, match="model= .* or llm="):
        shared.get_llm()
    with pytest.raises(TypeError, match="ellm.LLM"):
        shared.get_llm(llm=object())
    with ellm.load(smollm2_gguf, max_model_len=256, progress=False) as engine:
        with pytest.raises(ValueError, match="load options"):
            shared.get_llm(llm=engine, max_model_len=64)


def test_ellm_never_imports_the_integrations():
    code = ("import sys, ellm, ellm.cli, ellm.server.app\n"
            "bad = [m for m in sys.modules if m.startswith('ellm.integrations') or m.split('.')[0] in "
            "('langchain_core', 'llama_index', 'litellm', 'llm')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
