"""Tool calling (ellm.server.tools, LLM.chat(tools=...)).

The chat templates of the Hermes (Qwen / SmolLM3), Llama 3 and Mistral families are
represented by small templates written for these tests (tests/fixtures/templates), the
generic format by the real SmolLM2 and Gemma templates. Model-style outputs are written
here by writers of each format independent of the parsers; constrained calls on the real
SmolLM2 are checked with `jsonschema`.
"""
from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import jsonschema
import pytest

import ellm
from ellm.sampling_params import SamplingParams
from ellm.server import tools as T

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 40},
                                                    "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
                   "required": ["query"]}}}
TOOLS = [WEATHER, ADD, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo, and 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"},
    {"role": "tool", "tool_call_id": "call_2", "content": "5"},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return ellm.load(smollm2_gguf, max_model_len=2048, progress=False)


def _with_template(tok, name: str):
    t = copy.copy(tok)
    t.chat_template = (TEMPLATES / name).read_text()
    return t


# ---------------------------------------------------------------- format writers

def write_calls(fmt: str, calls: list[tuple[str, dict]], before: str = "") -> str:
    """Model-style text for calls in format fmt (written from the formats' specs)."""
    if fmt in ("hermes", "generic"):
        blocks = [f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls]
        return before + "\n".join(blocks)
    if fmt == "llama3":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return before + "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def _calls(calls: list[T.ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# ---------------------------------------------------------------- request fields

def test_bad_tools_and_tool_choice_name_the_field() -> None:
    for bad, where in [("x", "tools"), ([{"type": "retrieval"}], "tools[0]"),
                       ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
                       ([{"type": "function", "function": {"name": "f", "parameters": 3}}], "tools[0].function.parameters"),
                       ([ADD, ADD], "tools[1]")]:
        with pytest.raises(T.ToolError) as e:
            T.parse_tools(bad)
        assert e.value.param == where
    fns = T.parse_tools(TOOLS)
    assert T.parse_tool_choice(None, fns) == ("auto", None)
    assert T.parse_tool_choice(None, []) == ("none", None)
    assert T.parse_tool_choice({"type": "function", "function": {"name": "add"}}, fns) == ("named", "add")
    assert T.parse_tool_choice({"type": "function", "name": "add"}, fns) == ("named", "add")  # Responses form
    for bad in ("always", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(T.ToolError, match="tool_choice"):
            T.parse_tool_choice(bad, fns)
    with pytest.raises(T.ToolError, match="needs tools"):
        T.parse_tool_choice("required", [])


# ---------------------------------------------------------------- templates

def test_formats_are_detected_from_the_templates(smollm2) -> None:
    assert T.detect_format((TEMPLATES / "hermes_tools.jinja").read_text()) == "hermes"
    assert T.detect_format((TEMPLATES / "llama3_tools.jinja").read_text()) == "llama3"
    assert T.detect_format((TEMPLATES / "mistral_tools.jinja").read_text()) == "mistral"
    assert T.detect_format(smollm2.tokenizer.chat_template) == "generic"  # SmolLM2 takes no tools
    from ellm.chat_templates import GEMMA_TEMPLATE
    assert T.detect_format(GEMMA_TEMPLATE) == "generic"
    assert T.detect_format(None) == "generic"


@pytest.mark.parametrize("name", ["hermes_tools.jinja", "llama3_tools.jinja", "mistral_tools.jinja"])
def test_tools_and_history_reach_a_tools_aware_template(smollm2, name: str) -> None:
    tok = _with_template(smollm2.tokenizer, name)
    plan = T.ToolPlan.make(tok, TOOLS, "auto")
    assert plan.native
    msgs, tools = plan.render(HISTORY)
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tools=tools)
    for t in TOOLS:  # every tool, with its schema as JSON
        assert json.dumps(t["function"]["parameters"]["properties"])[1:-1] in text
    assert '{"city": "Oslo"}' in text and "-3 C, snow" in text  # the call's arguments as an object
    assert '"{\\"city' not in text  # not a JSON string holding JSON
    if name != "llama3_tools.jinja":  # (this Llama template shows one call per turn)
        assert '{"a": 2, "b": 3}' in text and "5" in text
    assert plan.prompt_ids(tok, HISTORY)  # and it tokenizes


def test_generic_format_on_templates_without_tools(smollm2) -> None:
    plan = T.ToolPlan.make(smollm2.tokenizer, TOOLS, "auto")
    assert not plan.native and plan.fmt == "generic"
    text = smollm2.tokenizer.apply_chat_template(plan.render(HISTORY)[0], add_generation_prompt=True)
    assert text.count("<tool_call>") == 3  # the instructions' example and the two calls
    assert '"name": "search"' in text and "Be brief." in text
    assert '<tool_response>\n{"name": "get_weather", "content": "-3 C, snow"}' in text
    # Gemma's template insists on alternating turns: the two tool results merge into one
    from ellm.chat_templates import GEMMA_TEMPLATE
    gemma = copy.copy(smollm2.tokenizer)
    gemma.chat_template, gemma.bos_token = GEMMA_TEMPLATE, "<bos>"
    gplan = T.ToolPlan.make(gemma, TOOLS, "auto")
    gtext = gemma.apply_chat_template(gplan.render(HISTORY)[0], add_generation_prompt=True)
    assert gtext.count("<tool_response>") == 3  # the instructions mention it once
    assert "</tool_response>\n<tool_response>" in gtext and gtext.endswith("<start_of_turn>model\n")
    # tool_choice none: no tools shown, history still rendered
    none = T.ToolPlan.make(smollm2.tokenizer, TOOLS, "none")
    ntext = smollm2.tokenizer.apply_chat_template(none.render(HISTORY)[0])
    assert "<tools>" not in ntext and "-3 C, snow" in ntext


# ---------------------------------------------------------------- parsing

CALLS = [("get_weather", {"city": "Oslo", "unit": "celsius"}), ("add", {"a": 2, "b": -3}),
         ("search", {"query": "ümlaut \"quotes\" </tool_call"})]


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_parsers_read_each_format(fmt: str) -> None:
    fns = T.parse_tools(TOOLS)
    for calls in (CALLS[:1], CALLS):
        before = "Let me check. " if fmt != "llama3" else ""
        content, got = T.parse_calls(write_calls(fmt, calls, before), fmt, fns)
        assert _calls(got) == calls
        assert content == (before.strip() or None)
    # plain answers stay plain
    assert T.parse_calls("The answer is 5.", fmt, fns) == ("The answer is 5.", [])
    # an unknown function is not a call
    content, got = T.parse_calls(write_calls(fmt, [("delete_all", {})]), fmt, fns)
    assert got == [] and content


def test_hermes_blocks_that_do_not_parse_stay_text() -> None:
    text = 'a <tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call> b'
    assert T.parse_calls(text, "hermes") == (text, [])
    # an unterminated last block (EOS before the closing tag) still counts
    content, got = T.parse_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "hermes")
    assert content is None and _calls(got) == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("fmt", T.FORMATS)
def test_streaming_parser_agrees_with_the_whole_text_parser(fmt: str) -> None:
    fns = T.parse_tools(TOOLS)
    rng = random.Random(5)
    samples = [write_calls(fmt, CALLS, "Sure. " if fmt != "llama3" else ""), "Just text, <tool no call.",
               "  " + write_calls(fmt, CALLS[1:2]), "Tokyo is [sunny] today."]
    for text in samples:
        content, calls = T.parse_calls(text, fmt, fns)
        for _ in range(5):
            parser, events, i = T.StreamParser(fmt, fns), [], 0
            while i < len(text):
                n = rng.randint(1, 7)
                events += parser.feed(text[i:i + n])
                i += n
            events += parser.finish()
            streamed = "".join(v for k, v in events if k == "content")
            assert (streamed.strip() or None) == content, (fmt, text, events)
            assert _calls([v for k, v in events if k == "call"]) == _calls(calls)
    # plain text streams out before the end, not all at finish()
    p = T.StreamParser(fmt, fns)
    assert p.feed("Hello there, ") == [("content", "Hello there, ")]


def test_a_closing_tag_inside_an_argument_string_stays_in_the_arguments() -> None:
    """A constrained call's JSON may hold "</tool_call>" in a string (Gemma 3 wrote one);
    the block ends after the JSON value, whole or streamed in pieces of any size."""
    fns = T.parse_tools(TOOLS)
    name = fns[0].name
    args = {"city": "x},</tool_call> /> 3"}
    text = f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'
    content, calls = T.parse_calls(text, "hermes", fns)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]
    for n in (1, 3, 7, len(text)):
        parser, events = T.StreamParser("hermes", fns), []
        for i in range(0, len(text), n):
            events += parser.feed(text[i:i + n])
        events += parser.finish()
        assert [k for k, _ in events] == ["call"], (n, events)
        assert json.loads(events[0][1].arguments) == args


# ---------------------------------------------------------------- constrained calls

@pytest.mark.parametrize("fmt", T.FORMATS)
def test_call_grammars_accept_calls_and_refuse_bad_arguments(smollm2, fmt: str) -> None:
    from ellm.engine.structured import GrammarState, llg_tokenizer
    fns = T.parse_tools(TOOLS)
    llt = llg_tokenizer(smollm2.tokenizer, smollm2.config.vocab_size, smollm2.engine.eos_ids)
    enc = smollm2.tokenizer.encode

    def accepts(grammar: str, text: str) -> bool:
        st = GrammarState(llt, SamplingParams(grammar=grammar).constraint[1])
        ids = enc(text, add_special_tokens=False)
        return st.matcher.try_consume_tokens(ids) == len(ids) and st.matcher.is_accepting()

    compact = write_calls(fmt, CALLS[:2]).replace("<|python_tag|>", "").replace("[TOOL_CALLS]", "")
    assert accepts(T.call_grammar(fns, fmt), compact)
    assert not accepts(T.call_grammar(fns, fmt, parallel=False), compact)  # two calls, one allowed
    one = write_calls(fmt, CALLS[1:2]).replace("<|python_tag|>", "").replace("[TOOL_CALLS]", "")
    assert accepts(T.call_grammar(fns, fmt, parallel=False), one)
    assert not accepts(T.call_grammar(fns, fmt), one.replace("-3", '"minus three"'))  # b must be an integer
    assert not accepts(T.call_grammar(fns[:1], fmt), one)  # add is not offered


def _engine_run(llm, jobs):
    """[(plan, messages, params)] as one batch through the engine -> [(plan, output)]."""
    rids = []
    with llm._loop().lock:  # the engine loop's thread must not step the engine meanwhile
        for plan, msgs, params in jobs:
            rids.append(llm.engine.add_request(plan.prompt_ids(llm.tokenizer, msgs), plan.sampling(params)))
        done = {}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out
    return [done[r] for r in rids]


QUESTIONS = ["What's the weather in Paris?", "Add 17 and 25.", "Search for the best pizza in Naples.",
             "Is it raining in Tokyo? Use fahrenheit.", "What is 3 plus 4?", "Find news about Mars rovers."]


def test_required_and_named_calls_always_parse_and_validate(smollm2) -> None:
    """24 sampled requests (varied questions, tool sets, seeds, temperatures), batched with
    auto and plain requests: every required / named output parses into calls whose
    arguments validate against the function's schema."""
    jobs, kinds = [], []
    for i in range(24):
        tools = [TOOLS[(i + k) % 3] for k in range(1 + i % 3)]
        choice = "required" if i % 2 else {"type": "function", "function": {"name": tools[-1]["function"]["name"]}}
        plan = T.ToolPlan.make(smollm2.tokenizer, tools, choice, parallel_tool_calls=i % 4 != 1)
        msgs = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        jobs.append((plan, msgs, SamplingParams(temperature=0.6 + 0.1 * (i % 5), seed=i, max_tokens=160)))
        kinds.append(choice)
    for i in range(3):
        jobs.append((T.ToolPlan.make(smollm2.tokenizer, TOOLS, "auto"),
                     [{"role": "user", "content": QUESTIONS[i]}], SamplingParams(seed=i, max_tokens=40)))
        kinds.append("auto")
    for (plan, _, _), choice, out in zip(jobs, kinds, _engine_run(smollm2, jobs)):
        if choice == "auto":
            plan.parse(out.text)  # whatever it says, parsing does not fail
            continue
        assert out.finish_reason == "stop", out.text
        content, calls = plan.parse(out.text)
        assert calls and content is None, out.text
        if isinstance(choice, dict):
            assert [c.name for c in calls] == [choice["function"]["name"]]
        if not plan.parallel:
            assert len(calls) == 1
        for c in calls:
            assert c.name in {f.name for f in plan.functions}
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])


def test_llm_chat_tool_round_trip(smollm2) -> None:
    msgs = [{"role": "user", "content": "What is 17 plus 25? Use the add tool."}]
    first = smollm2.chat(msgs, tools=[ADD, WEATHER], tool_choice="required", temperature=0.0,
                        parallel_tool_calls=False, max_tokens=60)
    assert first.tool_calls and first.content is None
    call = first.tool_calls[0]
    args = json.loads(call.arguments)
    jsonschema.validate(args, SCHEMAS[call.name])
    result = str(args["a"] + args["b"]) if call.name == "add" else "sunny"
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.to_openai()]},
             {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = smollm2.chat(msgs, tools=[ADD, WEATHER], tool_choice="none", temperature=0.0, max_tokens=40)
    assert final.tool_calls is None and final.text.strip()
    # a constraint of one's own and tool_choice required cannot be combined
    with pytest.raises(T.ToolError, match="cannot be combined"):
        smollm2.chat(msgs, tools=[ADD], tool_choice="required", regex="a+")
