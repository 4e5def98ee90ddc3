"""The CPU backend: the op set of reference.py on the C kernels (csrc/ through Cython)."""
from __future__ import annotations

import numpy as np

from .._native import _kernels, _quant


class CpuOps:
    name = "cpu"

    def embed(self, w, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        out = np.empty((len(ids), w.in_features), np.float32)
        _quant.get_rows(w.data, int(w.qtype), ids, out)
        return out

    def linear(self, x: np.ndarray, w) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], w.out_features), np.float32)
        _quant.linear(x, w.data, int(w.qtype), out)
        return out

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        x2 = x.reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        _kernels.rmsnorm(x2, weight, float(eps), out)
        return out.reshape(x.shape)

    def add_rmsnorm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        out = np.empty_like(residual)
        _kernels.add_rmsnorm(residual, np.ascontiguousarray(x), weight, float(eps), out)
        return out

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        _kernels.add(a, np.ascontiguousarray(b))
        return a

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        out = np.empty_like(gate)
        _kernels.swiglu(gate, up, out)
        return out

    def geglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        out = np.empty_like(gate)
        _kernels.geglu(gate, up, out)
        return out

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        if cap > 0:
            _kernels.softcap_(x, float(cap))
        return x

    def scale(self, x: np.ndarray, s: float) -> np.ndarray:
        _kernels.scale_(x, float(s))
        return x

    def rope_attention(self, q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                       inv_freq, interleaved, scale, window=0, softcap_value=0.0):
        out = np.empty_like(q)
        _kernels.rope_attention(q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                                inv_freq, bool(interleaved), float(scale), int(window),
                                float(softcap_value), out)
        return out
