"""ellm.integrations.llm_plugin against the real `llm` package (its Python API and its
CLI, loaded through the "llm" entry point) and the real SmolLM2: prompt, stream, async,
--schema into a nested model, tools with a nested pydantic argument, embeddings."""
from __future__ import annotations

import asyncio
import json
import os
from importlib.metadata import version

import numpy as np
import pytest

llm = pytest.importorskip("llm")

from click.testing import CliRunner  # noqa: E402

import ellm  # noqa: E402
from ellm.integrations import shared  # noqa: E402
from integration_schemas import PERSON_PROMPT, QUESTION, Location, Person, check_weather_args  # noqa: E402

NAME = "smollm2-135m-instruct"    # a known name: the plugin offers it as ellm/<name>
MODEL = f"ellm/{NAME}"


@pytest.fixture(scope="module", autouse=True)
def user_dir(tmp_path_factory):
    """llm keeps its logs and keys in LLM_USER_PATH: a scratch folder here."""
    old = os.environ.get("LLM_USER_PATH")
    os.environ["LLM_USER_PATH"] = str(tmp_path_factory.mktemp("llm-user"))
    yield
    if old is None:
        del os.environ["LLM_USER_PATH"]
    else:
        os.environ["LLM_USER_PATH"] = old


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    loaded = ellm.load(smollm2_gguf, max_model_len=2048, progress=False)
    shared.share(loaded, NAME)      # what the plugin's ellm/<NAME> loads by name
    yield loaded
    shared.release(NAME)


def _reference(engine, prompt, max_tokens=12):
    return engine.chat([{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)


def test_plugin_is_found_through_its_entry_point():
    assert MODEL in {m.model_id for m in llm.get_models()}   # (loads the plugins)
    assert "ellm-engine" in {p["name"] for p in llm.get_plugins()}   # (the distribution's name)
    assert MODEL in {m.model_id for m in llm.get_embedding_models()}


def test_prompt_stream_and_usage(engine):
    ref = _reference(engine, "Name a colour.")
    model = llm.get_model(MODEL)
    r = model.prompt("Name a colour.", max_tokens=12, temperature=0)
    pieces = list(r)
    assert len(pieces) > 2 and "".join(pieces) == ref.text == r.text()
    u = r.usage()
    assert (u.input, u.output) == (len(ref.prompt_token_ids), len(ref.token_ids))
    assert model.prompt("Name a colour.", stream=False, max_tokens=12, temperature=0).text() == ref.text


def test_async_model(engine):
    ref = _reference(engine, "Name a colour.").text

    async def main():
        model = llm.get_async_model(MODEL)
        r = model.prompt("Name a colour.", max_tokens=12, temperature=0)
        return [p async for p in r]
    assert "".join(asyncio.run(main())) == ref


def test_schema_into_a_nested_model(engine):
    model = llm.get_model(MODEL)
    for seed in range(2):
        r = model.prompt(PERSON_PROMPT, schema=Person, max_tokens=96, temperature=0.8, seed=seed)
        Person.model_validate_json(r.text())


def get_weather(location: Location, unit: str) -> str:
    """Get the current weather at a location."""
    return f"21 degrees {unit} in {Location.model_validate(location).city}"


def test_tools_with_a_nested_argument(engine):
    model = llm.get_model(MODEL)
    for question in (QUESTION, "Weather in Tokyo, Japan, in fahrenheit please."):
        r = model.prompt(question, tools=[get_weather], tool_choice="required", max_tokens=96, temperature=0)
        calls = r.tool_calls()
        assert calls and all(c.name == "get_weather" for c in calls)
        for c in calls:
            check_weather_args(c.arguments | {"unit": "celsius"})   # unit is a plain string here
            Location.model_validate(c.arguments["location"])
        results = r.execute_tool_calls()
        assert results and "degrees" in results[0].output


def test_cli_prompt_schema_tools_and_embed(engine):
    runner = CliRunner()
    ref = _reference(engine, "Name a colour.").text
    from llm.cli import cli
    out = runner.invoke(cli, ["prompt", "-m", MODEL, "Name a colour.", "-o", "max_tokens", "12",
                              "-o", "temperature", "0"], catch_exceptions=False)
    assert out.exit_code == 0 and out.output == ref + "\n"
    out = runner.invoke(cli, ["prompt", "-m", MODEL, "--schema", "name, age int", PERSON_PROMPT,
                              "-o", "max_tokens", "64", "-o", "temperature", "0"], catch_exceptions=False)
    assert out.exit_code == 0
    person = json.loads(out.output)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    out = runner.invoke(cli, ["prompt", "-m", MODEL, "-T", "llm_version", "What version of llm is this?",
                              "-o", "tool_choice", "required", "-o", "max_tokens", "48", "--td"],
                        catch_exceptions=False)
    assert out.exit_code == 0 and "Tool call: llm_version({})" in out.output
    assert version("llm") in out.output     # the tool ran and its result is shown
    out = runner.invoke(cli, ["embed", "-m", MODEL, "-c", "The cat sat on the mat."], catch_exceptions=False)
    assert out.exit_code == 0
    np.testing.assert_allclose(json.loads(out.output), engine.embed(["The cat sat on the mat."])[0], rtol=1e-5,
                               atol=1e-6)


def test_embedding_model(engine):
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today."]
    em = llm.get_embedding_model(MODEL)
    got = np.array(list(em.embed_multi(texts)))
    np.testing.assert_allclose(got, engine.embed(texts), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(em.embed(texts[1]), got[1], rtol=1e-5, atol=1e-6)
