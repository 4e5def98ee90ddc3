"""Small valid files that start each fuzz corpus (written with the `gguf` package and by
hand for safetensors), so the fuzzer begins inside the formats instead of at the magic."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def _gguf(path: Path, arch: str, kv: dict, tensors: dict[str, np.ndarray]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _model_kv(arch: str) -> dict:
    return {f"{arch}.block_count": 2, f"{arch}.embedding_length": 64, f"{arch}.feed_forward_length": 128,
            f"{arch}.attention.head_count": 4, f"{arch}.attention.head_count_kv": 2,
            f"{arch}.context_length": 256, f"{arch}.rope.freq_base": 10000.0,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-5}


def _byte_level_vocab() -> dict:
    # GPT-2's byte alphabet: printable bytes stand for themselves, the rest are shifted.
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    alphabet, extra = {}, 0
    for b in range(256):
        if b in keep:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    tokens = [alphabet[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "l l", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "H e", "He ll"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": len(tokens) - 2, "tokenizer.ggml.eos_token_id": len(tokens) - 1,
            "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"}


def _sentencepiece_vocab() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "el", "ll", "▁hel", "lo", "▁w", "or", "ld", "▁wor"]
    tokens += pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_bos_token": True}


def write_seeds(target: str, folder: Path) -> None:
    rng = np.random.default_rng(0)
    if target == "safetensors":
        for i, shapes in enumerate([[(4, 6)], [(3,), (2, 5)], [(1,), (0,), (2, 2, 2)]]):
            header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
            for j, shape in enumerate(shapes):
                dtype, arr = (("F32", rng.standard_normal(shape).astype(np.float32)) if j % 2 == 0
                              else ("BF16", rng.integers(0, 1 << 16, shape).astype(np.uint16)))
                raw = arr.tobytes()
                header[f"t{j}"] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
                blobs.append(raw)
                off += len(raw)
            h = json.dumps(header).encode()
            h += b" " * (-len(h) % 8)
            (folder / f"seed{i}.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
        return
    import gguf

    tensors = {"a": rng.standard_normal((4, 32)).astype(np.float32),
               "h": rng.standard_normal((2, 64)).astype(np.float16)}
    if target == "gguf":
        _gguf(folder / "seed0.gguf", "llama", {"t.u": 7, "t.s": "héllo", "t.arr": [1, 2, 3],
                                               "t.strs": ["a", "bc", ""]}, tensors)
        q = gguf.quants.quantize(rng.standard_normal((2, 256)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        w = gguf.GGUFWriter(str(folder / "seed1.gguf"), "llama")
        w.add_tensor("q", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return
    _gguf(folder / "seed0.gguf", "llama", {**_model_kv("llama"), **_byte_level_vocab()}, {})
    _gguf(folder / "seed1.gguf", "llama", {**_model_kv("llama"), **_sentencepiece_vocab()}, {})
    _gguf(folder / "seed2.gguf", "gemma3", {**_model_kv("gemma3"), **_sentencepiece_vocab(),
                                            "gemma3.attention.sliding_window": 64}, {})
