"""Hostile vocabularies: a GGUF whose tokenizer metadata cannot make a tokenizer gives
FormatError naming the file, never a pyo3 PanicException (which derives from
BaseException and so escapes `except Exception`) nor a bare Exception from the tokenizers
library. The files are written with the `gguf` package; the same payloads are also given
to the tokenizers library directly, to show that they do panic there."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ellm.formats.errors import FormatError
from ellm.formats.gguf import GGUFFile
from ellm.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

CONTROL, NORMAL = 3, 1


def vocab_gguf(path: Path, tokens: list[str], types: list[int], merges: list[str] | None = None,
               model: str = "gpt2", **extra: int) -> GGUFFile:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", model)
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", types)
    if merges is not None:
        w.add_array("tokenizer.ggml.merges", merges)
    for key, value in extra.items():
        w.add_int32(f"tokenizer.ggml.{key}", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


# Merges whose parts are not tokens of the vocabulary: the first three make the tokenizers
# library's BPE builder panic (found by the fuzzer, tests/fuzz/fuzz_readers.py vocab).
PANICKING = [
    (["<0x41>", "▁", "", "Ġ", "</s>", "<unk>"], [2, 1, 3, 3, 2, 2], ["<0x41> <0x41>", "</s> ", "<unk> ▁"]),
    (["ab", " ", "", "▁", "</s>", "<0xZZ>"], [5, 4, 3, 5, 5, 3], ["<unk> ab", "</s> ab", "<0xZZ> <0xZZ>"]),
    (["<s>", " ", "b", "a", "</s>"], [6, 3, 1, 6, 6], ["<s> </s>", "a b", "<unk> <s>"]),
]


def _panics_in_tokenizers(tokens: list[str], merges: list[str]) -> bool:
    """Whether the raw tokenizers library panics on this BPE (the reason for the checks)."""
    from tokenizers import models

    try:
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges])
    except BaseException as e:  # noqa: BLE001 (looking for exactly the panic)
        return type(e).__name__ == "PanicException"
    return False


@pytest.mark.parametrize("tokens,types,merges", PANICKING)
def test_merges_that_panic_the_library_are_a_format_error(tmp_path: Path, tokens, types, merges) -> None:
    g = vocab_gguf(tmp_path / "v.gguf", tokens, types, merges)
    with pytest.raises(FormatError, match=r"tokenizer\.ggml\.merges\[\d+\]") as e:
        Tokenizer.from_gguf(g)
    assert str(g.path) in str(e.value)


def test_the_payloads_do_panic_the_raw_library() -> None:
    # At least one of them must panic there, or these tests no longer test the panic path.
    assert any(_panics_in_tokenizers(t, m) for t, _, m in PANICKING)


@pytest.mark.parametrize("tokens,types,merges,extra,needle", [
    ([], [], None, {}, "no tokenizer.ggml.tokens"),
    (["a", "b"], [1], None, {}, "2 tokens but 1 token types"),
    (["a", "b", "ab"], [1, 1, 1], ["a c"], {}, r"merges\[0\]"),
    (["a", "b", "ab"], [1, 1, 1], ["a b", "ab ab"], {}, r"merges\[1\]"),
    (["a", "b"], [1, 1], None, {"model_kind": 0}, "not supported"),
])
def test_malformed_vocabularies(tmp_path: Path, tokens, types, merges, extra, needle) -> None:
    model = "bert" if extra.pop("model_kind", None) is not None else "gpt2"
    g = vocab_gguf(tmp_path / "v.gguf", tokens, types, merges, model=model, **extra)
    with pytest.raises(FormatError, match=needle) as e:
        Tokenizer.from_gguf(g)
    assert str(g.path) in str(e.value)


def test_wrongly_typed_metadata_is_a_format_error(tmp_path: Path) -> None:
    # token types written as strings, bos id as a string: TypeError/ValueError inside
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", ["<unk>", "a"])
    w.add_array("tokenizer.ggml.token_type", ["x", "y"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(FormatError, match="do not make a tokenizer"):
        Tokenizer.from_gguf(GGUFFile(tmp_path / "v.gguf"))


def test_valid_small_vocabulary_still_builds(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    tokens = ["a", "b", "ab", "c", "abc"]
    g = vocab_gguf(tmp_path / "v.gguf", tokens, [NORMAL] * 5, ["a b", "ab c"])
    tok = Tokenizer.from_gguf(g)
    # the library's own BPE over the same vocabulary and merges is the reference
    ref = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("a", "b"), ("ab", "c")]))
    assert tok.encode("abcab", add_special_tokens=False) == ref.encode("abcab", add_special_tokens=False).ids


@pytest.mark.parametrize("payload", [
    '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a", "zz"]]}}',
    '{"model": {"type": "Nope"}}',
    "not json",
    '{"model": ' * 5000 + "1" + "}" * 5000,
])
def test_malformed_tokenizer_json_is_a_format_error(tmp_path: Path, payload: str) -> None:
    (tmp_path / "tokenizer.json").write_text(payload)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "a"}))
    with pytest.raises(FormatError, match="tokenizer files do not make a tokenizer") as e:
        Tokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(e.value)


def test_malformed_tokenizer_config_is_a_format_error(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    Backend(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    for bad in ("{", '{"added_tokens_decoder": {"5": {"content": 7}}}', "[" * 100_000):
        (tmp_path / "tokenizer_config.json").write_text(bad)
        with pytest.raises(FormatError, match="tokenizer files do not make a tokenizer") as e:
            Tokenizer.from_folder(tmp_path)
        assert str(tmp_path) in str(e.value)
    # a FIFO named like a side file is refused, not waited on
    import os
    (tmp_path / "tokenizer_config.json").unlink()
    os.mkfifo(tmp_path / "tokenizer_config.json")
    with pytest.raises(FormatError, match="FIFO"):
        Tokenizer.from_folder(tmp_path)


def test_real_vocabulary_unchanged(smollm2_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(GGUFFile(smollm2_gguf))
    assert tok.vocab_size == 49152
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world" and np.all(np.asarray(ids) < tok.vocab_size)
