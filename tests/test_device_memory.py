"""The KV cache sized to a device's free memory (engine/runner.py kv_cache_blocks).

A device backend says how much of its memory is free after the weights
(`ops.device_memory`); the cache must fit there beside KV_HEADROOM. Checked here on the
CPU with OpaqueOps, a device-like backend whose free memory the test sets, and real
model configs (SmolLM2: full attention; Gemma 3: sliding-window layers with their own
pool). tests/test_cuda.py checks the same on a GPU (or the host stand-in) through
ellm.load, with CuPy's pool limited.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from ellm.engine.engine import EngineConfig
from ellm.engine.kv_cache import KVCache, kv_cache_bytes
from ellm.engine.runner import KV_HEADROOM, kv_cache_blocks
from ellm.formats.gguf import GGUFFile
from ellm.models import config_from_gguf
from ellm.ops import get_ops
from ellm.ops.memory import DeviceMemoryError
from ellm.ops.reference import KV_BF16

from opaque_ops import OpaqueOps

GIB = 1 << 30


@pytest.fixture(scope="module")
def smollm2_config(smollm2_gguf: Path):
    return config_from_gguf(GGUFFile(smollm2_gguf))


@pytest.fixture(scope="module")
def gemma3_config(gemma3_gguf: Path):
    return config_from_gguf(GGUFFile(gemma3_gguf))


def device(available: int | None, total: int = 80 * GIB) -> OpaqueOps:
    ops = OpaqueOps(get_ops("cpu"))
    ops.memory = None if available is None else (available, total)
    return ops


def cache_bytes(mc, cfg: EngineConfig, blocks: tuple[int, int | None]) -> int:
    dtype = KV_BF16 if cfg.kv_cache_dtype == "bfloat16" else np.dtype(cfg.kv_cache_dtype)
    return kv_cache_bytes(mc, blocks[0], cfg.block_size, blocks[1], dtype)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_counted_bytes_are_the_caches_own(name: str, request: pytest.FixtureRequest) -> None:
    mc = request.getfixturevalue(f"{name}_config")
    sliding = 7 if name == "gemma3" else None
    for dtype in (np.float32, KV_BF16):
        kv = KVCache(mc, 12, 16, sliding, dtype=dtype)
        assert kv_cache_bytes(mc, 12, 16, sliding, dtype) == sum(a.nbytes for a in kv.k + kv.v)
    if name == "gemma3":   # both pools are counted: more sliding blocks, more bytes
        assert kv_cache_bytes(mc, 12, 16, 8, np.float32) > kv_cache_bytes(mc, 12, 16, 7, np.float32)


def test_host_memory_and_ample_device_memory_keep_the_asked_size(smollm2_config) -> None:
    cfg = EngineConfig(max_model_len=8192)
    assert kv_cache_blocks(smollm2_config, cfg, device(None)) == (16384 // 16, None)
    assert kv_cache_blocks(smollm2_config, cfg, device(40 * GIB)) == (16384 // 16, None)
    cfg = EngineConfig(max_model_len=8192, kv_cache_tokens=20000)
    assert kv_cache_blocks(smollm2_config, cfg, device(40 * GIB)) == (-(-20000 // 16), None)


def test_the_default_size_is_cut_to_what_fits(smollm2_config, caplog: pytest.LogCaptureFixture) -> None:
    """Room for 12,000 tokens (SmolLM2: 46,080 bytes a token in f32): the default 16,384 become
    the most whole blocks that fit, which still hold a max_model_len sequence."""
    mc, cfg = smollm2_config, EngineConfig(max_model_len=8192)
    budget = 12000 * 46080
    with caplog.at_level(logging.INFO, logger="ellm.engine.runner"):
        blocks = kv_cache_blocks(mc, cfg, device(budget + KV_HEADROOM))
    assert blocks == (12000 // 16, None)
    assert cache_bytes(mc, cfg, blocks) <= budget < cache_bytes(mc, cfg, (blocks[0] + 1, None))
    assert "12000 tokens, not 16384" in caplog.text


def test_a_sequence_that_cannot_fit_says_what_to_change(smollm2_config) -> None:
    mc = smollm2_config
    budget = 5000 * 46080   # under one 8,192-token sequence
    with pytest.raises(DeviceMemoryError) as info:
        kv_cache_blocks(mc, EngineConfig(max_model_len=8192), device(budget + KV_HEADROOM, 24 * GIB))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)   # the CLI and the server report it as a bad option
    assert "max_model_len=8192" in msg and "4992 tokens fit" in msg and "24.00 GiB" in msg, msg
    assert "kv_cache_dtype='bfloat16'" in msg and "quantized" in msg, msg
    # a bf16 cache takes half the bytes: the same memory holds 10,000 tokens, one sequence of 8,192
    bf16 = EngineConfig(max_model_len=8192, kv_cache_dtype="bfloat16")
    assert kv_cache_blocks(mc, bf16, device(budget + KV_HEADROOM)) == (10000 // 16, None)
    with pytest.raises(DeviceMemoryError) as info:
        kv_cache_blocks(mc, EngineConfig(max_model_len=8192, kv_cache_dtype="bfloat16"),
                        device(2000 * 46080 + KV_HEADROOM))
    assert "bfloat16'" not in str(info.value)   # nothing to halve any more
    with pytest.raises(DeviceMemoryError, match="0 tokens fit"):   # less free than the headroom
        kv_cache_blocks(mc, EngineConfig(max_model_len=512), device(KV_HEADROOM // 2))


def test_an_asked_size_that_does_not_fit_is_an_error_not_a_cut(smollm2_config) -> None:
    cfg = EngineConfig(max_model_len=2048, kv_cache_tokens=16384)
    with pytest.raises(DeviceMemoryError) as info:
        kv_cache_blocks(smollm2_config, cfg, device(12000 * 46080 + KV_HEADROOM))
    msg = str(info.value)
    assert "kv_cache_tokens=16384" in msg and "12000 tokens fit" in msg and "smaller kv_cache_tokens" in msg, msg


def test_sliding_window_pools_are_counted_when_cutting(gemma3_config) -> None:
    """Gemma 3's local layers keep a pool of their own, at most max_num_seqs sequences'
    windows: the cut keeps both pools within the budget, the sliding one no larger than
    the full one."""
    mc, cfg = gemma3_config, EngineConfig(max_model_len=8192, max_num_seqs=4)
    full = kv_cache_blocks(mc, cfg, device(None))
    need = cache_bytes(mc, cfg, full)
    blocks = kv_cache_blocks(mc, cfg, device(int(need * 0.8) + KV_HEADROOM))
    assert 8192 // 16 <= blocks[0] < full[0] and blocks[1] is not None and blocks[1] <= blocks[0]
    assert cache_bytes(mc, cfg, blocks) <= int(need * 0.8) < cache_bytes(mc, cfg, (blocks[0] + 1, blocks[1]))
