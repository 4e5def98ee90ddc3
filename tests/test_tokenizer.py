"""The tokenizer against transformers' (goldens made by tests/goldens/make_tokenizer_goldens.py):
ids, decodes, chat rendering, the GGUF-derived merges; plus the chat-template sandbox and
the streaming detokenizer."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest

from ellm.chat_templates import GEMMA_TEMPLATE, builtin_template
from ellm.formats.gguf import GGUFFile
from ellm.tokenization.gguf_vocab import _derive_merges_plain, backend_from_gguf, derive_merges
from ellm.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

GOLDENS = Path(__file__).parent / "goldens"
MODELS = {"smollm2": "smollm2_gguf", "gemma3": "gemma3_gguf"}


def golden(name: str) -> dict:
    return json.loads((GOLDENS / f"tokenizer_{name}.json").read_text(encoding="utf-8"))


def fixture_or_skip(request, name: str):
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        pytest.skip(f"fixture {name} is not available")


@pytest.fixture(scope="module")
def gguf_files(request) -> dict[str, GGUFFile]:
    return {}


@pytest.fixture(scope="module", params=[*sorted(MODELS), "llama_sp"])
def model(request, gguf_files, tmp_path_factory) -> tuple[str, Tokenizer]:
    """(name, tokenizer) for each golden: the two real GGUFs, and a Llama-2 style
    SentencePiece GGUF made from Gemma's vocabulary the way the golden script makes it."""
    name = request.param
    if name not in gguf_files:
        if name == "llama_sp":
            pytest.importorskip("gguf")
            if "gemma3" not in gguf_files:
                gguf_files["gemma3"] = GGUFFile(fixture_or_skip(request, MODELS["gemma3"]))
            meta = gguf_files["gemma3"].metadata
            path = tmp_path_factory.mktemp("llama_sp") / "llama-sentencepiece.gguf"
            _golden_script().write_llama_sentencepiece_gguf(
                meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"].tolist(),
                meta["tokenizer.ggml.token_type"].tolist(), path)
            gguf_files[name] = GGUFFile(path)
        else:
            gguf_files[name] = GGUFFile(fixture_or_skip(request, MODELS[name]))
    return name, _tokenizer(name, gguf_files[name])


def _golden_script():
    spec = importlib.util.spec_from_file_location("make_tokenizer_goldens", GOLDENS / "make_tokenizer_goldens.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_BUILT: dict[str, Tokenizer] = {}


def _tokenizer(name: str, gguf: GGUFFile) -> Tokenizer:
    if name not in _BUILT:
        _BUILT[name] = Tokenizer.from_gguf(gguf)
    return _BUILT[name]


def check_cases(tok: Tokenizer, g: dict, transformers_gguf: bool = False) -> None:
    """encode / decode of every golden string. `transformers_gguf` compares with the ids
    transformers gives for the SmolLM2 GGUF unchanged (see make_tokenizer_goldens.py)."""
    bos = [g["bos_token_id"]] if g["add_bos"] else []
    bad = []
    for c in g["cases"]:
        plain = c.get("ids_transformers_gguf", c["ids_plain"]) if transformers_gguf else c["ids_plain"]
        got_plain = tok.encode(c["text"], add_special_tokens=False)
        if got_plain != plain or tok.encode(c["text"]) != bos + plain:
            bad.append((c["text"][:40], got_plain[:12], plain[:12]))
        if tok.decode(c["ids"]) != c["decode"] or tok.decode(c["ids"], skip_special_tokens=True) != c["decode_skip"]:
            bad.append((c["text"][:40], "decode", tok.decode(c["ids"])[:40]))
    assert not bad, f"{len(bad)} of {len(g['cases'])} strings differ from transformers, first: {bad[:5]}"


# ---- ids and text against transformers ------------------------------------------------

def test_encode_decode_match_transformers(model):
    name, tok = model
    check_cases(tok, golden(name))


def test_decode_random_ids_match_transformers(model):
    name, tok = model
    g = golden(name)
    for d in g["decodes"]:
        assert tok.decode(d["ids"]) == d["decode"], d["ids"]
        assert tok.decode(d["ids"], skip_special_tokens=True) == d["decode_skip"], d["ids"]


def test_vocabulary_facts(model):
    name, tok = model
    g = golden(name)
    assert tok.vocab_size == g["vocab_size"]
    assert tok.bos_token_id == g["bos_token_id"]
    assert tok.eos_token_ids[0] == g["eos_token_id"]
    assert tok.add_bos == g["add_bos"]
    added = sorted((i, t.content, t.special) for i, t in tok.backend.get_added_tokens_decoder().items())
    assert len(added) == g["added_tokens"]["count"]
    assert hashlib.sha256(json.dumps([list(a) for a in added], ensure_ascii=False).encode()).hexdigest() \
        == g["added_tokens"]["sha256"]
    if name == "smollm2":
        assert tok.eos_token_ids == [2, 0]  # <|im_end|>, and <|endoftext|> like llama.cpp
        assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
        assert tok.chat_template and "<|im_start|>" in tok.chat_template
    elif name == "gemma3":
        assert tok.eos_token_ids == [1, 106]  # <eos>, <end_of_turn>
        assert tok.chat_template == GEMMA_TEMPLATE  # the GGUF has none
    else:
        assert tok.chat_template is None  # a llama-architecture file without one


def test_gemma_merges_match_transformers(request, gguf_files):
    if "gemma3" not in gguf_files:
        gguf_files["gemma3"] = GGUFFile(fixture_or_skip(request, "gemma3_gguf"))
    tokens = ["▁" * len(t) if " " in t and not t.strip() else t
              for t in gguf_files["gemma3"].metadata["tokenizer.ggml.tokens"]]
    merges = derive_merges(tokens)
    g = golden("gemma3")["merges"]
    assert len(merges) == g["count"]
    assert hashlib.sha256(json.dumps([list(m) for m in merges], ensure_ascii=False).encode()).hexdigest() == g["sha256"]


def test_smollm2_keeps_its_trained_digit_split():
    """transformers splits "smollm" GGUFs like GPT-2; SmolLM2's tokenizer.json (and llama.cpp)
    isolates digits first. They only part where whitespace runs meet a numeral."""
    g = golden("smollm2")
    differ = [c for c in g["cases"] if "ids_transformers_gguf" in c]
    assert differ, "the goldens should show where the two splits differ"
    for c in differ:
        assert any(ch.isspace() for ch in c["text"]) and any(ch.isnumeric() for ch in c["text"]), c["text"]


# ---- derive_merges: the vectorised path against plain dict lookups -----------------------

def test_derive_merges_hashed_equals_plain():
    rng = random.Random(3)
    alphabet = "abcdé日▁\n"
    tokens = list(dict.fromkeys(alphabet))
    while len(tokens) < 400:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if a + b not in tokens:
            tokens.append(a + b)
    rng.shuffle(tokens)
    scores = np.array([rng.choice([-1.0, -2.0, -3.5, 0.0]) for _ in tokens], np.float32)
    assert derive_merges(tokens) == _derive_merges_plain(tokens, None)
    assert derive_merges(tokens, scores) == _derive_merges_plain(tokens, scores)
    # a repeated token takes the plain path; it must still agree with itself
    dup = tokens + [tokens[5]]
    assert derive_merges(dup) == _derive_merges_plain(dup, None)


def test_derived_merges_kept_in_the_cache_and_refused_when_damaged(tmp_path):
    """The merges come back from the cache file the first derivation wrote, the same list;
    a damaged or foreign cache file (garbage, ids past the vocabulary) is derived again
    and rewritten; an unwritable cache costs nothing but the derivation."""
    rng = random.Random(5)
    tokens = list("abcdé▁")
    while len(tokens) < 300:
        a, b = rng.choice(tokens), rng.choice(tokens)
        if a + b not in tokens:
            tokens.append(a + b)
    scores = np.array([rng.choice([-1.0, -2.0, 0.5]) for _ in tokens], np.float32)
    want = derive_merges(tokens, scores)
    cache = tmp_path / "tokenizers"
    assert derive_merges(tokens, scores, cache=cache) == want
    (file,) = cache.glob("merges-*.npy")
    ids = np.load(file)
    assert ids.dtype == np.int32 and ids.shape == (len(want), 2)
    assert [(tokens[a], tokens[b]) for a, b in ids.tolist()] == want
    ids[0] = ids[1]   # a cache file that is read back, not derived again
    np.save(file, ids)
    assert derive_merges(tokens, scores, cache=cache)[0] == want[1]
    # other scores are another vocabulary: another file
    assert derive_merges(tokens, None, cache=cache) == derive_merges(tokens, None)
    assert len(list(cache.glob("merges-*.npy"))) == 2
    for damage in (b"not a numpy file", None):
        if damage is None:   # ids past the end of the vocabulary
            np.save(file, np.full((3, 2), len(tokens), np.int32))
        else:
            file.write_bytes(damage)
        assert derive_merges(tokens, scores, cache=cache) == want
        assert np.array_equal(np.load(file), np.asarray([[tokens.index(a), tokens.index(b)] for a, b in want]))
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    assert derive_merges(tokens, scores, cache=blocked) == want


def test_byte_level_token_written_outside_the_alphabet_is_respelled():
    """A gpt2-style vocabulary normally spells every token in the byte alphabet ("日" as
    three letters, one per UTF-8 byte); one written in plain UTF-8 is respelled through
    it, so both files encode alike."""
    from ellm.tokenization.gguf_vocab import byte_alphabet
    alphabet = byte_alphabet()
    spell = lambda t: "".join(alphabet[b] for b in t.encode("utf-8"))  # noqa: E731
    base = [alphabet[b] for b in range(256)]
    day = spell("日")
    merges = [f"{day[0]} {day[1]}", f"{day[:2]} {day[2]}", f"{day} t"]

    def meta(written: list[str]) -> dict:
        return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": base + written,
                "tokenizer.ggml.merges": merges}
    proper = backend_from_gguf(meta([day[:2], day, spell("日t")]))
    plain = backend_from_gguf(meta([day[:2], "日", "日t"]))
    for text in ("日t", "日日t", "t 日"):
        assert plain.encode(text).ids == proper.encode(text).ids
    assert proper.encode("日t").ids == [258]


def test_unsupported_tokenizer_model():
    with pytest.raises(ValueError, match="not supported"):
        backend_from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
        backend_from_gguf({"tokenizer.ggml.model": "gpt2"})


# ---- chat templates ---------------------------------------------------------------------

def test_chat_matches_transformers(model):
    name, tok = model
    for c in golden(name)["chats"]:
        if "error" in c:
            with pytest.raises(ChatTemplateError):
                tok.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"])
            continue
        assert tok.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"]) == c["text"]
        assert tok.encode_chat(c["messages"], add_generation_prompt=c["add_generation_prompt"]) == c["ids"]


def render(template: str, messages: list[dict], **kw) -> str:
    from ellm.tokenization.template import render_chat
    return render_chat(template, messages, special_tokens={"bos_token": "<bos>"}, **kw)


def test_gemma_template_format():
    assert builtin_template("gemma3") is GEMMA_TEMPLATE and builtin_template("llama") is None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert render(GEMMA_TEMPLATE, msgs) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert render(GEMMA_TEMPLATE, msgs[1:2], add_generation_prompt=False) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this? "}]}]
    assert render(GEMMA_TEMPLATE, parts) == \
        "<bos><start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ChatTemplateError, match="alternate"):
        render(GEMMA_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__ }}",
    "{% if ''.__class__ %}x{% endif %}",
    "{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__['os'] }}",
    "{{ self.__init__.__globals__.__builtins__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ dict.mro() }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ lipsum.__globals__['os'].system('touch {marker}') }}",
    "{{ messages.append(1) }}",
    "{{ 'a' * 10**10 }}",
    "{{ [1] * 10**10 }}",
    "{{ 7 ** 99999999 }}",
    "{% for i in range(10**10) %}{% endfor %}",
]


@pytest.mark.parametrize("payload", SANDBOX_ESCAPES)
def test_template_cannot_reach_python(payload, tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(ChatTemplateError):
        render(payload.replace("{marker}", str(marker)), [{"role": "user", "content": "x"}])
    assert not marker.exists()


def test_template_environment_matches_hf_conventions():
    msgs = [{"role": "user", "content": "<a> & 'b'", "tool_calls": None}]
    assert render("{{ messages[0] | tojson }}", msgs) == '{"role": "user", "content": "<a> & \'b\'"}'
    assert render("{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}", msgs) == '{\n  "a": 2,\n  "b": 1\n}'
    assert render("{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}", msgs) == "01"
    assert render("{% generation %}gen{% endgeneration %}", msgs) == "gen"
    assert render("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}", msgs) == "2"
    assert len(render("{{ strftime_now('%Y-%m-%d') }}", msgs)) == 10
    assert render("{{ tools[0].name }}|{{ foo }}", msgs, tools=[{"name": "calc"}], foo="bar") == "calc|bar"
    # trim_blocks / lstrip_blocks as in transformers
    assert render("  {% if true %}\nyes\n  {% endif %}\n", msgs) == "yes\n"
    with pytest.raises(ChatTemplateError, match="custom failure"):
        render("{{ raise_exception('custom failure') }}", msgs)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render("{% if %}", msgs)


def test_no_template_is_an_error(model):
    _, tok = model
    bare = Tokenizer(tok.backend, name="bare")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


# ---- streaming detokenizer --------------------------------------------------------------

def stream(tok: Tokenizer, ids: list[int], skip: bool, prompt: list[int] | None = None) -> list[str]:
    d = tok.incremental(prompt, skip_special_tokens=skip)
    return [d.push(i) for i in ids] + [d.flush()]


def check_stream(tok: Tokenizer, ids: list[int]) -> None:
    for skip in (True, False):
        full = tok.decode(ids, skip_special_tokens=skip)
        pieces = stream(tok, ids, skip)
        assert "".join(pieces) == full, ids
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces), ids


def test_incremental_equals_decode(model):
    name, tok = model
    g = golden(name)
    for c in g["cases"]:
        check_stream(tok, c["ids"])
    for d in g["decodes"]:
        check_stream(tok, d["ids"])


def test_incremental_random_byte_heavy(model):
    """Random sequences biased towards single-byte / single-character tokens, where UTF-8
    characters are split across tokens."""
    _, tok = model
    rng = random.Random(5)
    vocab = tok.backend.get_vocab()
    short = [i for t, i in vocab.items() if len(t) == 1 or (t.startswith("<0x") and len(t) == 6)]
    multi = tok.encode("日本語 😀👨‍👩‍👧 é ठ 🏳️‍🌈 Ελλη", add_special_tokens=False)
    for _ in range(150):
        n = rng.randint(1, 60)
        ids = [rng.choice(short) if rng.random() < 0.6 else
               (rng.choice(multi) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)) for _ in range(n)]
        check_stream(tok, ids)


def test_incremental_holds_byte_runs_until_they_end(model):
    """A byte-fallback run is all-or-nothing in the decoder: "é" then an invalid byte turns
    both into U+FFFD, so nothing of a run may be handed out before the run ends."""
    _, tok = model
    if not tok.byte_token_ids:
        pytest.skip("byte-level vocabulary: no byte-fallback tokens")
    b = {v: tok.token_to_id(f"<0x{v:02X}>") for v in (0xC3, 0xA9, 0xFF)}
    word = tok.encode("x", add_special_tokens=False)
    for ids, n_run in (([b[0xC3], b[0xA9], b[0xFF]] + word, 3), ([b[0xC3], b[0xA9]] + word, 2),
                       ([b[0xC3]] + word + [b[0xA9]], 1)):
        d = tok.incremental(None, skip_special_tokens=False)
        pieces = [d.push(i) for i in ids] + [d.flush()]
        assert "".join(pieces) == tok.decode(ids), ids
        assert pieces[:n_run] == [""] * n_run


def test_incremental_after_prompt(model):
    _, tok = model
    prompt = tok.encode("Once upon a time, in a land")
    gen = tok.encode(" far, far away — 日本 😀 lived 42 dragons.", add_special_tokens=False)
    for skip in (True, False):
        full = tok.decode(prompt + gen, skip_special_tokens=skip)
        head = tok.decode(prompt, skip_special_tokens=skip)
        assert full.startswith(head)
        assert "".join(stream(tok, gen, skip, prompt)) == full[len(head):]


def test_incremental_decodes_a_small_window(model):
    name, tok = model
    if name == "llama_sp":
        pytest.skip("the synthetic vocabulary spells English in byte-fallback tokens: one long run")
    seen: list[int] = []

    def decode(ids: list[int], skip: bool) -> str:
        seen.append(len(ids))
        return tok.backend.decode(ids, skip_special_tokens=skip)

    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)
    d = IncrementalDetokenizer(decode, None, True, byte_ids=tok.byte_token_ids, special_ids=tok.special_token_ids)
    text = "".join(d.push(i) for i in ids) + d.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)
    # the window restarts at 16 ids, plus at most the byte-fallback run open at that moment
    assert max(seen) <= 32 and len(seen) <= 2 * len(ids) + 1


# ---- folders ----------------------------------------------------------------------------

def write_folder(tok: Tokenizer, dest: Path, name: str) -> None:
    """A Hugging Face style folder holding the same tokenizer."""
    tok.backend.save(str(dest / "tokenizer.json"))
    g = golden(name)
    cfg = {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": tok.unk_token,
           "pad_token": tok.pad_token, "add_bos_token": g["add_bos"]}
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    if name == "smollm2":
        (dest / "chat_template.jinja").write_text(tok.chat_template)
        (dest / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    elif name == "llama_sp":
        (dest / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [1, 106]}))
    else:
        (dest / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "eos_token_id": 1}))
        (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))


def test_from_folder(model, tmp_path):
    name, tok = model
    write_folder(tok, tmp_path, name)
    again = Tokenizer.from_folder(tmp_path)
    check_cases(again, golden(name))
    assert again.eos_token_ids == tok.eos_token_ids
    assert again.bos_token_id == tok.bos_token_id and again.add_bos == tok.add_bos
    assert again.chat_template == tok.chat_template
    for c in golden(name)["chats"]:
        if "text" in c:
            text = again.apply_chat_template(c["messages"], add_generation_prompt=c["add_generation_prompt"])
            assert text == c["text"]


@pytest.mark.parametrize("add_bos", [True, False])
def test_from_folder_add_bos_override(request, gguf_files, tmp_path, add_bos):
    """tokenizer_config's add_bos_token decides, whatever tokenizer.json's post-processor says."""
    if "smollm2" not in gguf_files:
        gguf_files["smollm2"] = GGUFFile(fixture_or_skip(request, MODELS["smollm2"]))
    tok = _tokenizer("smollm2", gguf_files["smollm2"])
    write_folder(tok, tmp_path, "smollm2")
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = add_bos
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    again = Tokenizer.from_folder(tmp_path)
    assert again.add_bos == add_bos
    assert again.encode("hi") == [1] * add_bos + tok.encode("hi")


def test_from_folder_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_folder(tmp_path)


def test_from_hf_folder_smollm2(request):
    """The Hugging Face folder made by transformers from the SmolLM2 GGUF (conftest)."""
    folder = Path(fixture_or_skip(request, "smollm2_hf_f32"))
    tok = Tokenizer.from_folder(folder)
    g = golden("smollm2")
    pre = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["pre_tokenizer"]
    # transformers writes its own GPT-2 split unless the folder was given SmolLM2's digit split
    check_cases(tok, g, transformers_gguf="Digits" not in json.dumps(pre))
    assert tok.eos_token_ids[0] == 2 and tok.bos_token_id == 1 and not tok.add_bos
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]).startswith("<|im_start|>system\n")


def test_from_hf_folder_gemma3(request):
    """The Hugging Face folder made by transformers from the Gemma 3 GGUF (conftest): its
    generation_config names only <eos>, <end_of_turn> still ends generation, and the
    built-in template applies because config.json says gemma3_text."""
    folder = Path(fixture_or_skip(request, "gemma3_hf_f32"))
    tok = Tokenizer.from_folder(folder)
    check_cases(tok, golden("gemma3"))
    assert tok.eos_token_ids == [1, 106] and tok.bos_token_id == 2 and tok.add_bos
    assert tok.chat_template == GEMMA_TEMPLATE
