"""The architecture registry and the checks on configs: unknown families, bad config.json
values and bad GGUF metadata are ConfigErrors naming the file and the key; Linear.rows."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ellm.config import ConfigError, ModelConfig
from ellm.formats.ggml_types import GGMLType
from ellm.formats.gguf import GGUFFile
from ellm.models import (config_from_folder, config_from_gguf, family_for_gguf, family_for_model_type,
                         supported_model_types)
from ellm.ops import get_ops
from ellm.weights import Linear

BASE = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def _folder(tmp_path: Path, **changes) -> Path:
    cfg = {**BASE, **changes}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not ...}))
    return tmp_path


def test_every_family_is_importable_and_has_its_parts() -> None:
    for model_type in supported_model_types():
        family = family_for_model_type(model_type)
        assert issubclass(family.Args, ModelConfig) and hasattr(family, "Model"), model_type
        for arch in family.Args.gguf_architectures:
            assert family_for_gguf(arch) is family


def test_unknown_model_type_is_one_line_listing_the_supported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_folder(_folder(tmp_path, model_type="phi9"))
    msg = str(e.value)
    assert "\n" not in msg and "'phi9'" in msg and "config.json" in msg
    assert all(t in msg for t in supported_model_types())


def test_the_base_config_class_points_at_the_registry(tmp_path: Path) -> None:
    """ModelConfig itself knows no family (the registry, a floor above, chooses one): its
    constructors say which registry function to call instead of building a familyless config."""
    folder = _folder(tmp_path)
    for build, name in [(lambda: ModelConfig.from_folder(folder), "config_from_folder"),
                        (lambda: ModelConfig.from_dict(dict(BASE)), "config_from_dict")]:
        with pytest.raises(TypeError, match=f"ellm.models.{name}"):
            build()
    assert type(config_from_folder(folder)) is family_for_model_type("llama").Args
    assert family_for_model_type("llama").Args.from_folder(folder) == config_from_folder(folder)


@pytest.mark.parametrize("changes,needle", [
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"hidden_size": "64"}, "hidden_size must be int"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ({"rms_norm_eps": True}, "rms_norm_eps"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": ...}, "missing a field"),
    ({"model_type": "qwen2", "layer_types": ["full_attention"]}, "layer_types"),
    ({"model_type": "smollm3", "no_rope_layer_interval": 0}, "no_rope_layer_interval"),
    ({"model_type": "mistral", "sliding_window": -4}, "sliding_window"),
])
def test_bad_config_values_name_file_and_key(tmp_path: Path, changes, needle) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_folder(_folder(tmp_path, **changes))
    assert needle in str(e.value) and "config.json" in str(e.value)


def test_unknown_keys_are_ignored(tmp_path: Path) -> None:
    config = config_from_folder(_folder(tmp_path, model_type="granite", something_new=[1, 2],
                                             logits_scaling=4.0))
    assert config.logits_scaling == 4.0 and config.head_dim == 16


def test_mistral_window_without_layer_types_slides_every_layer(tmp_path: Path) -> None:
    config = config_from_folder(_folder(tmp_path, model_type="mistral", sliding_window=8))
    assert [config.layer_window(i) for i in range(2)] == [8, 8]
    llama = config_from_folder(_folder(tmp_path, model_type="llama", sliding_window=8))
    assert [llama.layer_window(i) for i in range(2)] == [0, 0]


def _gguf(path: Path, arch: str = "llama", **meta) -> GGUFFile:
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    values = {"embedding_length": 64, "feed_forward_length": 96, "block_count": 2,
              "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": 32, **meta}
    for key, value in values.items():
        full = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif value is not None:
            w.add_uint64(full, value)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFFile(path)


def test_gguf_config_reads(tmp_path: Path) -> None:
    config = config_from_gguf(_gguf(tmp_path / "m.gguf", "qwen3", **{"attention.key_length": 24}))
    assert (config.model_type, config.head_dim, config.num_key_value_heads) == ("qwen3", 24, 2)


@pytest.mark.parametrize("meta,needle", [
    ({"attention.head_count": 0}, "llama.attention.head_count must be between 1"),
    ({"block_count": 10**12}, "llama.block_count must be between 1"),
    ({"embedding_length": "wide"}, "llama.embedding_length must be an integer"),
    ({"embedding_length": 66}, "not a multiple of llama.attention.head_count"),
    ({"attention.layer_norm_rms_epsilon": "small"}, "llama.attention.layer_norm_rms_epsilon must be a finite"),
    ({"feed_forward_length": None}, "lacks llama.feed_forward_length"),
])
def test_bad_gguf_metadata_names_file_and_key(tmp_path: Path, meta, needle) -> None:
    path = tmp_path / "bad.gguf"
    with pytest.raises(ConfigError) as e:
        config_from_gguf(_gguf(path, **meta))
    assert needle in str(e.value) and str(path) in str(e.value)


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="GGUF architecture 'mamba9' is not supported .*llama"):
        config_from_gguf(_gguf(tmp_path / "m.gguf", "mamba9"))


@pytest.mark.parametrize("qtype", [GGMLType.F32, GGMLType.Q8_0])
@pytest.mark.parametrize("device", ["cpu", "reference"])
def test_linear_rows_is_a_zero_copy_slice(qtype, device) -> None:
    from ellm._native import _quant
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    data = w if qtype == GGMLType.F32 else _quant.quantize(w, int(qtype))
    full = Linear(data, qtype, 48, 64, "w", bias=rng.standard_normal(48).astype(np.float32))
    part = full.rows(16, 40)
    assert np.shares_memory(part.data, full.data) and part.out_features == 24
    np.testing.assert_array_equal(part.bias, full.bias[16:40])
    ops, x = get_ops(device), rng.standard_normal((3, 64)).astype(np.float32)
    no_bias = Linear(data, qtype, 48, 64, "w")
    np.testing.assert_array_equal(ops.linear(x, no_bias.rows(16, 40)), ops.linear(x, no_bias)[:, 16:40])
    for lo, hi in ((-1, 4), (4, 4), (0, 49)):
        with pytest.raises(ValueError, match="out of range"):
            full.rows(lo, hi)
