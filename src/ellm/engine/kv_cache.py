"""The paged KV cache: fixed-size blocks, a block table per sequence, shared prefix blocks.

Layers are grouped by attention window: full-attention layers share one block pool and
one block table per sequence; sliding-window layers (Gemma) have their own pool, and a
sequence hands back the blocks that fall wholly out of its window, so local layers never
hold more than window + one block of keys per sequence.

Prefix caching: a full block of prompt tokens is identified by a hash of its tokens and of
the hash of the block before it. Finished sequences leave such blocks in the cache (the
cache holds one reference); a new sequence whose prompt starts with the same blocks takes
them instead of recomputing. Cached blocks that nobody uses are evicted, least recently
used first, when a pool runs dry.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..ops.memory import host_kv_zeros


def kv_cache_bytes(config: ModelConfig, num_blocks: int, block_size: int, sliding_num_blocks: int | None,
                   dtype: Any) -> int:
    """The bytes a KVCache of these sizes takes (K and V of every layer)."""
    block = block_size * config.num_key_value_heads * config.head_dim * np.dtype(dtype).itemsize
    total = 0
    for i in range(config.num_hidden_layers):
        sliding = config.layer_window(i) and sliding_num_blocks is not None
        total += 2 * block * (sliding_num_blocks if sliding else num_blocks)
    return total


class KVCache:
    """The K/V storage: per layer a pair (num_blocks, block_size, nkv, hd) float32 (or
    float16: dtype, EngineConfig.kv_cache_dtype), made
    by the backend (`ops.kv_zeros`: host memory committed page by page, or device memory);
    no ops: host memory."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int = 16,
                 sliding_num_blocks: int | None = None, ops: Any = None, dtype: Any = np.float32) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.windows = sorted({config.layer_window(i) for i in range(config.num_hidden_layers)})
        self.num_blocks: dict[int, int] = {}
        for w in self.windows:
            if w and sliding_num_blocks is not None:
                self.num_blocks[w] = sliding_num_blocks
            else:
                self.num_blocks[w] = num_blocks
        self.layer_window = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        shape_tail = (block_size, config.num_key_value_heads, config.head_dim)
        zeros = host_kv_zeros if ops is None else ops.kv_zeros
        self.k = [zeros((self.num_blocks[w],) + shape_tail, dtype) for w in self.layer_window]
        self.v = [zeros((self.num_blocks[w],) + shape_tail, dtype) for w in self.layer_window]

    def layer(self, i: int) -> tuple[Any, Any]:
        return self.k[i], self.v[i]

    @property
    def bytes_per_token(self) -> int:
        return sum(int(k.strides[1]) * 2 for k in self.k)


@dataclass
class _Pool:
    num_blocks: int
    free: list[int] = field(default_factory=list)
    refs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.refs = np.zeros(self.num_blocks, np.int32)


class BlockManager:
    """Hands out blocks of every pool to sequences and keeps the prefix cache."""

    def __init__(self, cache: KVCache, enable_prefix_caching: bool = True) -> None:
        self.block_size = cache.block_size
        self.windows = cache.windows
        self.pools = {w: _Pool(cache.num_blocks[w]) for w in self.windows}
        self.enable_prefix_caching = enable_prefix_caching
        # prefix hash -> {window: block}; OrderedDict gives LRU order
        self.cached: OrderedDict[int, dict[int, int]] = OrderedDict()
        self.tables: dict[object, dict[int, list[int]]] = {}   # seq key -> window -> blocks (-1 freed)
        # seq key -> a number that changes whenever its tables do (never one it had before),
        # so a caller may keep an array of the tables and rewrite only the rows that changed
        self.versions: dict[object, int] = {}
        self._tick = itertools.count(1)
        self.hits = 0
        self.queries = 0

    # -- accounting ---------------------------------------------------------------

    def num_free(self, window: int = 0) -> int:
        """Blocks that can be had now, counting cached blocks nobody uses."""
        pool = self.pools[window]
        evictable = sum(1 for blocks in self.cached.values() if pool.refs[blocks[window]] == 1)
        return len(pool.free) + evictable

    def num_used(self) -> int:
        return sum(p.num_blocks - len(p.free) for p in self.pools.values())

    def _blocks_needed(self, window: int, table: list[int], n_tokens: int) -> int:
        return max(0, -(-n_tokens // self.block_size) - len(table))

    def can_allocate(self, key: object, n_tokens: int) -> bool:
        tables = self.tables.get(key)
        for w in self.windows:
            need = self._blocks_needed(w, tables[w] if tables else [], n_tokens)
            # the free list answers most asks; only a shortfall counts the evictable blocks
            # (a walk over the whole prefix cache)
            if need > len(self.pools[w].free) and need > self.num_free(w):
                return False
        return True

    # -- allocation ---------------------------------------------------------------

    def _take(self, window: int) -> int:
        pool = self.pools[window]
        if not pool.free:
            self._evict_one(window)
        b = pool.free.pop()
        pool.refs[b] = 1
        return b

    def _release(self, window: int, block: int) -> None:
        pool = self.pools[window]
        pool.refs[block] -= 1
        if pool.refs[block] == 0:
            pool.free.append(block)

    def _evict_one(self, window: int) -> None:
        pool = self.pools[window]
        for h, blocks in self.cached.items():
            if pool.refs[blocks[window]] == 1:
                del self.cached[h]
                for w, b in blocks.items():
                    self._release(w, b)
                return
        raise MemoryError("KV cache is out of blocks")

    def allocate(self, key: object, n_tokens: int) -> bool:
        """Grows the sequence's tables to hold n_tokens positions. False (nothing taken) if short."""
        tables = self.tables.get(key)
        if tables is not None:   # most decode steps: every table already reaches n_tokens
            reach = n_tokens - 1
            if all(len(tables[w]) * self.block_size > reach for w in self.windows):
                return True
        if not self.can_allocate(key, n_tokens):
            return False
        if tables is None:
            tables = self.tables[key] = {w: [] for w in self.windows}
        for w in self.windows:
            for _ in range(self._blocks_needed(w, tables[w], n_tokens)):
                tables[w].append(self._take(w))
        self.versions[key] = next(self._tick)
        return True

    def free(self, key: object) -> None:
        self.versions.pop(key, None)
        tables = self.tables.pop(key, None)
        if not tables:
            return
        for w, blocks in tables.items():
            for b in blocks:
                if b >= 0:
                    self._release(w, b)

    def truncate(self, key: object, n_tokens: int) -> None:
        """[spec] Frees the sequence's blocks past the first n_tokens positions (the slots
        of rejected speculative tokens; the prefix cache holds prompt blocks only, and a
        released block it shares keeps the cache's reference)."""
        tables = self.tables.get(key)
        if not tables:
            return
        keep = -(-n_tokens // self.block_size)
        self.versions[key] = next(self._tick)
        for w, blocks in tables.items():
            for b in blocks[keep:]:
                if b >= 0:
                    self._release(w, b)
            del blocks[keep:]

    def release_out_of_window(self, key: object, first_new_position: int) -> None:
        """Sliding layers: drop blocks no token at or after first_new_position can see."""
        tables = self.tables.get(key)
        if not tables:
            return
        for w, blocks in tables.items():
            if w == 0:
                continue
            lowest_visible = first_new_position - w + 1
            end = min(len(blocks), max(0, lowest_visible) // self.block_size)
            # the released blocks are a prefix of the table: find its end from `end` back
            # (not from 0 each step), then release in ascending order as always
            start = end
            while start > 0 and blocks[start - 1] >= 0:
                start -= 1
            for j in range(start, end):
                self._release(w, blocks[j])
                blocks[j] = -1
            if start < end:
                self.versions[key] = next(self._tick)

    def table(self, key: object, window: int) -> list[int]:
        return self.tables[key][window]

    # -- prefix cache -------------------------------------------------------------

    @staticmethod
    def block_hashes(tokens: list[int], block_size: int, salt: int = 0) -> list[int]:
        """The hash chain of tokens' full blocks; salt starts it ([lora] the adapter's)."""
        hashes, prev = [], salt
        for j in range(len(tokens) // block_size):
            prev = hash((prev, tuple(tokens[j * block_size:(j + 1) * block_size])))
            hashes.append(prev)
        return hashes

    def match_prefix(self, key: object, tokens: list[int], salt: int = 0) -> int:
        """Gives the sequence every cached full block its prompt starts with (never the block
        holding the last prompt token, whose logits must be computed). -> tokens covered.
        salt: [lora] the adapter's start of the hash chain (0: the base)."""
        if not self.enable_prefix_caching or key in self.tables:
            return 0
        usable = (len(tokens) - 1) // self.block_size
        hashes = self.block_hashes(tokens[:usable * self.block_size], self.block_size, salt)
        self.queries += len(hashes)
        tables: dict[int, list[int]] = {w: [] for w in self.windows}
        for h in hashes:
            blocks = self.cached.get(h)
            if blocks is None:
                break
            self.cached.move_to_end(h)
            for w, b in blocks.items():
                self.pools[w].refs[b] += 1
                tables[w].append(b)
            self.hits += 1
        self.tables[key] = tables
        self.versions[key] = next(self._tick)
        return len(tables[0] if 0 in tables else next(iter(tables.values()))) * self.block_size

    def cache_prefix(self, key: object, tokens: list[int], n_computed: int, salt: int = 0) -> None:
        """Records the sequence's full, computed prompt blocks in the prefix cache (salt:
        as in match_prefix)."""
        if not self.enable_prefix_caching or key not in self.tables:
            return
        tables = self.tables[key]
        n_full = min(n_computed, len(tokens)) // self.block_size
        for j, h in enumerate(self.block_hashes(tokens[:n_full * self.block_size], self.block_size, salt)):
            if h in self.cached:
                continue
            blocks = {w: tables[w][j] for w in self.windows}
            if any(b < 0 for b in blocks.values()):
                break  # a sliding block already out of its window: nothing after it is reusable
            for w, b in blocks.items():
                self.pools[w].refs[b] += 1
            self.cached[h] = blocks

    def clear_prefix_cache(self) -> None:
        for blocks in self.cached.values():
            for w, b in blocks.items():
                self._release(w, b)
        self.cached.clear()
