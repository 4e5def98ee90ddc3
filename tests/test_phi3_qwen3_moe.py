"""Phi-3 and Qwen3-MoE configs: what is read from config.json (both transformers layouts),
what is refused, and the rules the forward pass follows (which LongRoPE factors, the
attention factor, which layers are sparse). Their logits against transformers are in
test_tiny_models.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from ellm.config import ConfigError, ModelConfig
from ellm.models import config_from_folder

PHI3 = dict(model_type="phi3", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072,
            original_max_position_embeddings=4096)
SHORT = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5]      # 6 pairs: 12 of 16 dims rotate
LONG = [2.0, 3.0, 5.0, 8.0, 13.0, 21.0]
QMOE = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32)


def _load(tmp_path: Path, cfg: dict) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return config_from_folder(tmp_path)


def test_phi3_transformers5_layout(tmp_path: Path) -> None:
    """transformers 5 writes partial_rotary_factor and the factors under rope_parameters."""
    c = _load(tmp_path, {**PHI3, "rope_parameters": dict(rope_type="longrope", rope_theta=10000.0,
                                                         partial_rotary_factor=0.75, short_factor=SHORT,
                                                         long_factor=LONG)})
    assert c.rotary_dim == 12 and len(c.inv_freq(0)) == 6
    want = 1.0 / (np.asarray(SHORT, np.float32) * np.float32(10000.0) ** (np.arange(0, 12, 2) / 12).astype(np.float32))
    np.testing.assert_allclose(c.inv_freq(0), want, rtol=1e-6)
    # transformers' default attention factor: sqrt(1 + ln(131072 / 4096) / ln 4096)
    assert c.rope_mscale == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_phi3_legacy_layout(tmp_path: Path) -> None:
    """Phi-3.5's own config.json: rope_scaling of type "longrope" (or the older "su"),
    partial_rotary_factor at the top; an explicit attention_factor wins."""
    for kind in ("longrope", "su"):
        c = _load(tmp_path, {**PHI3, "partial_rotary_factor": 0.75,
                             "rope_scaling": dict(type=kind, short_factor=SHORT, long_factor=LONG,
                                                  attention_factor=1.25)})
        assert c.rotary_dim == 12 and c.rope_mscale == 1.25
        assert c.describe()["rotary_dims"] == "12 of 16"


def test_phi3_plain_rope(tmp_path: Path) -> None:
    """Phi-3-mini-4k: no scaling, full rotary, its sliding window on every layer."""
    c = _load(tmp_path, {**PHI3, "max_position_embeddings": 4096, "sliding_window": 2047})
    assert c.rotary_dim == 16 and c.rope_mscale == 1.0 and len(c.inv_freq(0)) == 8
    assert [c.layer_window(i) for i in range(2)] == [2047, 2047]


@pytest.mark.parametrize("change, needle", [
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
    ({"partial_rotary_factor": 0.7}, "rotary dims"),                  # 16 * 0.7 = 11: odd
    ({"rope_scaling": {"type": "longrope", "short_factor": SHORT[:5], "long_factor": LONG}}, "short_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": SHORT}}, "long_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [0.0] * 6, "long_factor": LONG}}, "short_factor"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "longrope"),
    ({"sliding_window": -3}, "sliding_window"),
])
def test_phi3_bad_config(tmp_path: Path, change, needle) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        _load(tmp_path, {**PHI3, "partial_rotary_factor": 0.75, **change})
    assert "config.json" in str(e.value)


def test_qwen3_moe_config(tmp_path: Path) -> None:
    """num_experts as released configs spell it, or num_local_experts as transformers 5
    writes it; mlp_only_layers and decoder_sparse_step decide the dense layers."""
    c = _load(tmp_path, {**QMOE, "mlp_only_layers": [0], "decoder_sparse_step": 1})
    assert c.num_experts == 8 and [c.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    cfg = {k: v for k, v in QMOE.items() if k != "num_experts"}
    c = _load(tmp_path, {**cfg, "num_local_experts": 6, "decoder_sparse_step": 2})
    assert c.num_experts == 6 and [c.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert "2 of 6" in c.describe()["experts"]


@pytest.mark.parametrize("change, needle", [
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
])
def test_qwen3_moe_bad_config(tmp_path: Path, change, needle) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        _load(tmp_path, {**QMOE, **change})
    assert "config.json" in str(e.value)
