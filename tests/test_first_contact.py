"""What a new user runs into first, from the Python API and the command line: chat-shaped
input given to the text API, the module-level functions, the default model's first
answer, and the command line's mistakes (an unquoted prompt, a model with no prompt, an
unknown option, a bad value, a busy port), each refused before a model loads.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

import ellm
from ellm.cli_args import CommandLineError, split_model_prompt
from ellm.llm import CompletionOutput
from ellm.tokenization.template import ChatTemplateError, render_chat

QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> Any:
    with ellm.load(str(smollm2_gguf), max_model_len=512, progress=False) as m:
        yield m


def ellm_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ellm", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ})


# -- chat-shaped input to the text API ----------------------------------------------------


def test_messages_given_to_generate_or_stream_name_chat(llm: Any) -> None:
    for call in (lambda: llm.generate(MESSAGES), lambda: llm.generate(MESSAGES[0]),
                 lambda: llm.generate([MESSAGES, MESSAGES]), lambda: llm.stream(MESSAGES[0]),
                 lambda: llm.generate(["fine", MESSAGES[0]])):
        with pytest.raises(TypeError, match=r"chat\(messages\)"):
            call()
    with pytest.raises(TypeError, match="holds ints, not str"):
        llm.generate([[1, 2, "three"]])


def test_chat_takes_a_string_as_one_user_message(llm: Any) -> None:
    greedy = dict(max_tokens=12, temperature=0.0)
    assert llm.chat(QUESTION, **greedy).text == llm.chat(MESSAGES, **greedy).text
    assert "".join(llm.chat_stream(QUESTION, **greedy)) == llm.chat(MESSAGES, **greedy).text
    with pytest.raises(TypeError, match=r"chat\(\[message\]\)"):
        llm.chat(MESSAGES[0])


def test_the_template_renderer_names_the_shape_it_wants() -> None:
    for wrong in ("hello", {"role": "user", "content": "hi"}):
        with pytest.raises(ChatTemplateError, match="list of"):
            render_chat("{{ messages }}", wrong)  # type: ignore[arg-type]


def test_an_instruct_model_that_ends_at_once_on_bare_text_says_why(llm: Any) -> None:
    """SmolLM2-Instruct given "What is the capital of France?" without its template ends its
    turn on the first token, greedy: '' alone would say nothing."""
    with pytest.warns(UserWarning, match=r"without the model's chat template; chat\(\) applies it"):
        out = llm.generate(QUESTION, max_tokens=8, temperature=0.0)
    assert out.text == "" and out.finish_reason == "stop"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # a completion with text, or one from chat(): no warning
        assert llm.generate("The capital of France is", max_tokens=4, temperature=0.0).text
        llm.chat(QUESTION, max_tokens=4, temperature=0.0)


# -- the module-level functions and the default model --------------------------------------


def test_module_functions_return_what_the_methods_return(smollm2_gguf: Path) -> None:
    reply = ellm.chat(QUESTION, max_tokens=16, temperature=0.0)
    assert isinstance(reply, CompletionOutput) and reply.finish_reason in ("stop", "length")
    many = ellm.generate(["The sky is", "Grass is"], n=2, max_tokens=3, seed=1)
    assert [[type(o) for o in per_prompt] for per_prompt in many] == [[CompletionOutput] * 2] * 2
    with pytest.raises(TypeError, match=r"chat\(messages\)"):
        ellm.generate(MESSAGES)


def test_the_default_model_answers_the_first_question(smollm2_gguf: Path) -> None:
    """Greedy, through the chat template: exact activations (the default model's setting)
    answer Paris where the 8-bit ones start "L'Étoile" (a 0.08-logit near-tie)."""
    assert "Paris" in ellm.chat(QUESTION, max_tokens=16, temperature=0.0).text
    run = ellm_cli("run", QUESTION, "-n", "16", "--temperature", "0")
    assert run.returncode == 0 and "Paris" in run.stdout, run.stderr


def test_the_default_model_loaded_as_the_default_gets_its_settings(smollm2_gguf: Path) -> None:
    with ellm.load(progress=False, max_model_len=64) as default, \
            ellm.load("smollm2-135m-instruct", progress=False, max_model_len=64) as named:
        assert default.engine.model.ops.exact_activations and not named.engine.model.ops.exact_activations
        assert (default.defaults.temperature, default.defaults.repetition_penalty) == (0.0, 1.1)
        assert dict(default.defaults.sources)["temperature"] == "ellm's default model"
        assert named.defaults.temperature == 1.0 and dict(named.defaults.sources)["temperature"] == "ellm"
        assert default.sampling_params(temperature=0.7).temperature == 0.7   # a request's own choice wins


# -- the command line -------------------------------------------------------------------


@pytest.mark.parametrize("words,model,prompt", [
    (["Why", "is", "the", "sky", "blue?"], None, "Why is the sky blue?"),
    (["gemma-3-270m", "Once", "upon", "a", "time"], "gemma-3-270m", "Once upon a time"),
    (["m.gguf", "Hi"], "m.gguf", "Hi"),
    (["org/Repo-GGUF:Q8_0", "Hi", "there"], "org/Repo-GGUF:Q8_0", "Hi there"),
    (["no-such-model", "a quoted prompt"], "no-such-model", "a quoted prompt"),   # a misspelt model
    (["Hello", "world"], None, "Hello world"),
    (["a quoted prompt"], None, "a quoted prompt"),
    (["-"], None, "-"),
])
def test_run_words(words: list[str], model: str | None, prompt: str) -> None:
    assert split_model_prompt(words) == (model, prompt)


@pytest.mark.parametrize("words", [["gemma-3-270m"], ["./model.gguf"], ["HuggingFaceTB/SmolLM2-360M-Instruct"], []])
def test_run_refuses_a_model_with_no_prompt(words: list[str]) -> None:
    with pytest.raises(CommandLineError, match="no prompt"):
        split_model_prompt(words)


def test_an_unquoted_prompt_runs(smollm2_gguf: Path, llm: Any) -> None:
    proc = ellm_cli("run", str(smollm2_gguf), *QUESTION.split(), "-n", "8", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == llm.chat(QUESTION, max_tokens=8, temperature=0.0).text + "\n"


def test_chat_replies_are_capped_and_run_replies_too() -> None:
    from ellm.cli import CHAT_MAX_TOKENS, build_parser
    assert build_parser().parse_args(["chat"]).max_tokens == CHAT_MAX_TOKENS == 512
    assert build_parser().parse_args(["run", "Hi"]).max_tokens == 256
    assert build_parser().parse_args(["chat", "-n", "2048"]).max_tokens == 2048


def test_command_line_mistakes_fail_before_the_model_loads(tmp_path: Path) -> None:
    """Each names the mistake, with status 2, and never reaches the model: the model given
    does not exist, so an error about it would mean it was looked for first."""
    absent = str(tmp_path / "absent.gguf")
    no_prompt = ellm_cli("run", "gemma-3-270m")
    assert no_prompt.returncode == 2 and 'ellm run gemma-3-270m "PROMPT"' in no_prompt.stderr
    for option in (["--max-tokens", "-1"], ["--temperature", "-2"], ["--top-p", "3"]):
        proc = ellm_cli("run", absent, "Hi", *option)
        assert proc.returncode == 2 and "absent" not in proc.stderr, (option, proc.stderr)
        assert option[0].lstrip("-").replace("-", "_") in proc.stderr, proc.stderr
    unknown = ellm_cli("run", absent, "Hi", "--bogus")
    assert unknown.returncode == 2 and "usage: ellm run" in unknown.stderr and "--bogus" in unknown.stderr
    chat = ellm_cli("chat", absent, "--max-tokens", "0")
    assert chat.returncode == 2 and "max_tokens" in chat.stderr and "absent" not in chat.stderr


def test_serve_on_a_busy_port_fails_before_loading(tmp_path: Path) -> None:
    pytest.importorskip("uvicorn")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = ellm_cli("serve", str(tmp_path / "absent.gguf"), "--port", str(port), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"port {port} on 127.0.0.1 is in use" in proc.stderr and "serving" not in proc.stderr
    assert "absent" not in proc.stderr   # the model was never looked for
