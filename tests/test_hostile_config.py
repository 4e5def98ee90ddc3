"""Hostile GGUF metadata semantics: a real model file with one metadata value changed in
place (same type, same size, so every other byte is the real model's) must be refused by
ellm.load with a ConfigError / FormatError naming the file and the field: no
ZeroDivisionError for a head count of 0, and no allocation sized by a claimed
block_count or embedding_length before the tensors are checked against it.

Each load runs in a child process under an address-space cap (resource.setrlimit), so
an allocation sized by a lie fails the test instead of taking the machine's memory.
"""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
from capped_child import run_capped

from ellm.formats.gguf import GGUFFile

_UINT32, _INT32, _FLOAT32 = 4, 5, 6

# The child loads the file under a cap of what it has mapped after import + this much
# (the real model's weights are ~100 MB; its KV cache at max_model_len 256 is small).
CAP_MB = 1500

_CHILD = r"""
import json, resource, sys
import ellm
with open("/proc/self/status") as f:
    vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + int(sys.argv[2]) * 2**20, resource.RLIM_INFINITY))
for path in sys.argv[3:]:
    try:
        ellm.load(path, max_model_len=256, max_num_seqs=2, progress=False)
        print(json.dumps({"path": path, "ok": True}), flush=True)
    except BaseException as e:
        print(json.dumps({"path": path, "ok": False, "type": type(e).__name__,
                          "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)[:2000]}), flush=True)
"""


def _patched(tmp_path: Path, src: Path, key: str, value: int | float, stem: str) -> Path:
    """A copy of src with the scalar metadata `key` overwritten in place."""
    g = GGUFFile(src)
    assert key in g.metadata, key
    data = bytearray(src.read_bytes())
    name = key.encode()
    at = data.find(struct.pack("<Q", len(name)) + name)
    assert at > 0
    pos = at + 8 + len(name)
    (vtype,) = struct.unpack_from("<I", data, pos)
    fmt = {_UINT32: "<I", _INT32: "<i", _FLOAT32: "<f"}[vtype]
    struct.pack_into(fmt, data, pos + 4, value)
    out = tmp_path / f"{stem}.gguf"
    out.write_bytes(bytes(data))
    assert GGUFFile(out).metadata[key] == pytest.approx(value)
    return out


def _load_in_child(paths: list[Path]) -> dict[str, dict]:
    """path -> outcome of ellm.load(path), all loaded by one capped child, one by one."""
    return run_capped(_CHILD, ["-", str(CAP_MB)], paths, timeout=600)


# GGUF key (after the architecture) -> the ModelConfig / Hugging Face field it sets: a
# message may name either.
HF_NAMES = {"attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
            "block_count": "num_hidden_layers", "embedding_length": "hidden_size",
            "feed_forward_length": "intermediate_size", "vocab_size": "vocab_size"}

CASES = [
    ("llama.attention.head_count", 0),
    ("llama.attention.head_count_kv", 0),
    ("llama.block_count", 0),
    ("llama.block_count", 2**31),
    ("llama.block_count", 2**32 - 1),
    ("llama.embedding_length", 2**31),
    ("llama.embedding_length", 0),
    ("llama.feed_forward_length", 2**32 - 1),
    ("llama.attention.head_count", 2**32 - 1),
    ("llama.vocab_size", 2**32 - 1),
]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> dict[str, dict]:
    """Every case's outcome, plus "same": the unchanged copy (the harness itself must load
    the real model under the same cap)."""
    tmp = tmp_path_factory.mktemp("lying")
    paths = {}
    for i, (field, value) in enumerate(CASES):
        paths[f"{field}={value}"] = _patched(tmp, smollm2_gguf, field, value, f"case{i}")
    paths["same"] = tmp / "same.gguf"
    shutil.copy(smollm2_gguf, paths["same"])
    got = _load_in_child(list(paths.values()))
    return {case: {**got[str(p)], "file": str(p)} for case, p in paths.items()}


def test_unpatched_copy_loads(outcomes: dict[str, dict]) -> None:
    assert outcomes["same"]["ok"], outcomes["same"]


@pytest.mark.parametrize("field,value", CASES)
def test_lying_metadata_is_a_config_error(outcomes: dict[str, dict], field: str, value: int) -> None:
    got = outcomes[f"{field}={value}"]
    assert not got["ok"], f"{field}={value} loaded"
    assert got["type"] in ("ConfigError", "FormatError"), f"{field}={value}: {got['type']}: {got['message']}"
    names = (field, field.split(".", 1)[1], HF_NAMES[field.split(".", 1)[1]])
    assert got["file"] in got["message"] and any(n in got["message"] for n in names), got["message"]
