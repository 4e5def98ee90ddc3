"""Make the tokenizer goldens that tests/test_tokenizer.py compares ellm's tokenizer with.

Run with a Python that has transformers (the gold venv); ellm is not imported:

    /opt/venvs/gold/bin/python tests/goldens/make_tokenizer_goldens.py \\
        SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-q4_k_m.gguf [--folders DIR]

The reference is transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=name)`. For
each model it writes tests/goldens/tokenizer_<model>.json: a corpus of awkward strings with
their ids (add_special_tokens True and False) and decodes, decodes of random id sequences,
rendered chat conversations, and a digest of the merges and added tokens. A third golden,
tokenizer_llama_sp.json, covers Llama-2 style SentencePiece files with a synthetic
tokenizer-only GGUF made from Gemma's vocabulary (see write_llama_sentencepiece_gguf).

SmolLM2: transformers has no split rule for the GGUF's "smollm" pre-tokenizer and uses
plain GPT-2 splitting, whereas SmolLM2's own tokenizer.json isolates every digit first (as
does llama.cpp). The golden `ids` come from transformers' tokenizer with that pre-tokenizer
put back; `ids_transformers_gguf` keeps what transformers gives unchanged, for the strings
where the two differ (whitespace runs meeting digits).

--folders DIR also saves each reference tokenizer as a Hugging Face folder (DIR/<model>/,
the SmolLM2 one with its trained pre-tokenizer) for trying Tokenizer.from_folder by hand.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sys
import tempfile
from pathlib import Path

GOLDENS = Path(__file__).resolve().parent
REPO = GOLDENS.parents[1]


def corpus() -> list[str]:
    """Strings that tend to break tokenizers, then random ones (seeded)."""
    fixed = [
        "", " ", "  ", "Hello world", " Hello", "Hello ", "a  b", "a   b   c", "\t\n  \n", "trailing spaces   ",
        "   leading spaces", "\n\nfoo\n\n\n", "\n", "\r\n windows\r\nlines", "tabs\tand\ttabs",
        # digits
        "12345", "3.14159", "1,000,000", "a  1", "x\n\n1. first\n2. second", " 42 ", "2024-01-01T12:00:00Z",
        "0x1F 0b1010 1e-10", "١٢٣ ٤٥٦", "²³ ½ ¼ Ⅻ", "９８７６", "v1.2.3-rc4", "  7", "\t\t9",
        # emoji and sequences joined by ZWJ / modifiers / flags
        "😀", "👨‍👩‍👧‍👦 family", "🏳️‍🌈 flag", "👍🏽👍🏿", "🇯🇵🇺🇸🇫🇷", "I ❤️ NY", "🙂" * 40,
        # scripts
        "日本語のテキストです。", "中文分词测试，标点符号！", "한국어 문장입니다", "مرحبا بالعالم", "שלום עולם",
        "नमस्ते दुनिया", "สวัสดีชาวโลก", "Ελληνικά γράμματα", "Русский текст", "Tiếng Việt có dấu",
        # combining marks and normalization forms
        "e\u0301 vs \u00e9", "A\u030a vs \u00c5", "Z\u0351\u036b\u0343a\u0334l\u0335g\u0336o\u0337",
        "ﬁ ligature ﬀ", "café naïve résumé coöperate",
        # odd characters
        "\u00a0non-breaking\u00a0space", "zero\u200bwidth\u200cjoin\u200d", "\ufeffBOM", "nul\x00byte", "bell\x07",
        "\ue000 private use \U000F0000", "\U0010ffff", "math ∑∫√∞ ≤ ≥ ≠ ±", "“smart” ‘quotes’ — dash … ellipsis",
        # code
        "def f(x):\n    return x ** 2  # square\n", "if (a && b) { return; }\n\t}", '<div class="x">&amp;</div>',
        "SELECT * FROM t WHERE id = 1;", '{"key": [1, 2.5, null, true], "s": "a\\nb"}', "don't can't I'm we'll they've",
        "ALLCAPS Words MiXeD cAsE", "snake_case_name and camelCaseName",
        # special tokens written in the text
        "<|im_start|>user\nHello<|im_end|>\n", "<|im_start|>user", "<|endoftext|>", "<|im_start|><|im_start|>",
        "<|im_start", "text<|im_end|>more", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "<bos>text<eos>", "<pad><unk><mask>", "<start_of_image>", "<unused0> <unused99>", "[multimodal]",
        # long words
        "a" * 1000, "supercalifragilisticexpialidocious" * 20, "x" + "0123456789" * 30,
        "aGVsbG8gd29ybGQgdGhpcyBpcyBiYXNlNjQ=" * 5,
    ]
    rng = random.Random(1234)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x600, 0x6FF), (0x900, 0x97F),
              (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x2000, 0x206F),
              (0x300, 0x36F), (0x9, 0xD)]
    rand = []
    for _ in range(40):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        rand.append("".join(chars))
    return fixed + rand


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "  Tell me a joke.  \n"}],
    [{"role": "user", "content": "日本語で答えて 😀 <b>bold</b> & \"quotes\""}],
    [{"role": "system", "content": "Rules:\n1. Be kind.\n2. Be brief."},
     {"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."},
     {"role": "user", "content": "OK"}],
]


def dump(golden: dict) -> str:
    """JSON with one top-level key per line and one list entry per line: small, and
    diffs stay readable."""
    compact = {"ensure_ascii": False, "separators": (",", ":")}
    lines = []
    for key, value in golden.items():
        if isinstance(value, list):
            body = ",\n".join(json.dumps(v, **compact) for v in value)
            lines.append(f"{json.dumps(key)}:[\n{body}\n]")
        else:
            lines.append(f"{json.dumps(key)}:{json.dumps(value, **compact)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, ensure_ascii=False).encode("utf-8")).hexdigest()


def random_id_sequences(tok, n_vocab: int, seed: int) -> list[list[int]]:
    """Id sequences for decode goldens: any ids, byte-like tokens (single characters and
    <0xNN>), specials, and mixtures, so partial UTF-8 and special handling are covered."""
    rng = random.Random(seed)
    vocab = tok.get_vocab()
    short = sorted(i for t, i in vocab.items() if len(t) == 1 and i < n_vocab)
    byte_fb = sorted(i for t, i in vocab.items() if len(t) == 6 and t.startswith("<0x") and t.endswith(">"))
    special = sorted(set(tok.all_special_ids))[:64]
    pools = [list(range(n_vocab)), short, byte_fb or short, special]
    seqs = []
    for k in range(60):
        length = rng.randint(1, 48)
        if k % 4 == 0:
            seqs.append([rng.randrange(n_vocab) for _ in range(length)])
        else:
            seqs.append([rng.choice(rng.choice(pools[1:] if k % 4 == 1 else pools)) for _ in range(length)])
    return seqs


def write_llama_sentencepiece_gguf(tokens: list[str], scores: list[float], types: list[int], dest: Path,
                                   n_tokens: int = 20000) -> None:
    """A tokenizer-only GGUF in the Llama-2 SentencePiece style (architecture "llama",
    tokenizer "llama", scores, add_space_prefix) made from the first `n_tokens` entries of
    another SentencePiece vocabulary (Gemma's), since no such model is at hand. The tests
    rebuild the same file. Needs only the `gguf` package."""
    import gguf
    import numpy as np

    tokens, scores, types = list(tokens[:n_tokens]), [float(x) for x in scores[:n_tokens]], \
        [int(x) for x in types[:n_tokens]]
    w = gguf.GGUFWriter(str(dest), "llama")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(8)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_vocabulary(path: Path, n_tokens: int = 20000) -> tuple[list[str], list[float], list[int]]:
    """The first tokens of a GGUF vocabulary with their scores and types, via `gguf`."""
    import gguf

    fields = gguf.GGUFReader(str(path)).fields

    def column(key: str) -> list:
        f = fields[key]
        return [f.parts[i] for i in f.data[:n_tokens]]

    return ([bytes(p).decode("utf-8") for p in column("tokenizer.ggml.tokens")],
            [float(p[0]) for p in column("tokenizer.ggml.scores")],
            [int(p[0]) for p in column("tokenizer.ggml.token_type")])


def load_gemma_template() -> str:
    """ellm's Gemma template (CHAT_TEMPLATE in models/gemma.py), read without importing ellm."""
    tree = ast.parse((REPO / "src" / "ellm" / "models" / "gemma.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHAT_TEMPLATE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("models/gemma.py defines no CHAT_TEMPLATE")


def make(name: str, gguf: Path, folders: Path | None) -> None:
    import jinja2
    import tokenizers
    import transformers
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    as_loaded = None
    if name == "smollm2":
        as_loaded = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    elif name == "gemma3":
        tok.chat_template = load_gemma_template()  # the GGUF has none; ellm ships this one
    backend = json.loads(tok.backend_tokenizer.to_str())
    added = sorted((t["id"], t["content"], t["special"]) for t in backend["added_tokens"])

    cases = []
    for text in corpus():
        ids = tok.encode(text, add_special_tokens=True)
        plain = tok.encode(text, add_special_tokens=False)
        case = {"text": text, "ids": ids, "ids_plain": plain,
                "decode": tok.decode(ids), "decode_skip": tok.decode(ids, skip_special_tokens=True)}
        if as_loaded is not None:
            other = as_loaded.encode(text, add_special_tokens=False)
            if other != plain:
                case["ids_transformers_gguf"] = other
        cases.append(case)

    n_vocab = len(tok)
    decodes = [{"ids": s, "decode": tok.decode(s), "decode_skip": tok.decode(s, skip_special_tokens=True)}
               for s in random_id_sequences(tok, n_vocab, seed={"smollm2": 7, "gemma3": 11}.get(name, 13))]

    chats = []
    for conv in CONVERSATIONS if tok.chat_template else ():
        for gen in (True, False):
            try:
                text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
                if isinstance(ids, dict) or hasattr(ids, "keys"):
                    ids = ids["input_ids"]
                chats.append({"messages": conv, "add_generation_prompt": gen, "text": text, "ids": list(ids)})
            except (jinja2.TemplateError, ValueError, TypeError) as e:  # a refusal is a golden too
                chats.append({"messages": conv, "add_generation_prompt": gen, "error": f"{type(e).__name__}: {e}"})

    golden = {
        "model": name, "gguf_file": gguf.name,
        "reference": "transformers AutoTokenizer.from_pretrained(dir, gguf_file=...)"
                     + (" with SmolLM2's trained pre-tokenizer (Digits individual + ByteLevel)"
                        if name == "smollm2" else ""),
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "vocab_size": n_vocab, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "add_bos": bool(tok.encode("", add_special_tokens=True)),
        "merges": {"count": len(backend["model"]["merges"]), "sha256": digest(backend["model"]["merges"])},
        "added_tokens": {"count": len(added), "special": sum(1 for a in added if a[2]), "sha256": digest(added)},
        "cases": cases, "decodes": decodes, "chats": chats,
    }
    out = GOLDENS / f"tokenizer_{name}.json"
    out.write_text(dump(golden), encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB, {len(cases)} strings)")
    if folders is not None:
        dest = folders / name
        tok.save_pretrained(str(dest))
        print(f"saved the reference tokenizer to {dest}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("smollm2_gguf", type=Path)
    ap.add_argument("gemma3_gguf", type=Path)
    ap.add_argument("--folders", type=Path, default=None, help="also save HF tokenizer folders here")
    args = ap.parse_args()
    for name, path in (("smollm2", args.smollm2_gguf), ("gemma3", args.gemma3_gguf)):
        if not path.is_file():
            sys.exit(f"{path}: no such file")
        make(name, path.resolve(), args.folders)
    with tempfile.TemporaryDirectory() as tmp:
        synthetic = Path(tmp) / "llama-sentencepiece.gguf"
        write_llama_sentencepiece_gguf(*read_vocabulary(args.gemma3_gguf), synthetic)
        make("llama_sp", synthetic, None)


if __name__ == "__main__":
    main()
