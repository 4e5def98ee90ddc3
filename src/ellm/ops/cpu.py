"""The CPU backend: the op set of reference.py on the C kernels (csrc/ through Cython).

Every op takes an optional `out` (the model passes workspace views, so decode allocates
nothing) and returns it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .._native import _kernels, _quant


def _out(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, np.float32) if out is None else out


class CpuOps:
    name = "cpu"

    def embed(self, w, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        out = _out(out, (len(ids), w.in_features))
        _quant.get_rows(w.data, int(w.qtype), ids, out)
        return out

    def linear(self, x: np.ndarray, w, out: np.ndarray | None = None) -> np.ndarray:
        out = _out(out, (x.shape[0], w.out_features))
        _quant.linear(np.ascontiguousarray(x, dtype=np.float32), w.data, int(w.qtype), out,
                      w.bias)
        return out

    def linear_multi(self, x: np.ndarray, parts: Sequence[tuple]) -> list[np.ndarray]:
        """[(w, out), ...] -> outs: several matrices against one x, x quantized once."""
        _quant.linear_multi(np.ascontiguousarray(x, dtype=np.float32),
                            [(w.data, int(w.qtype), o, w.bias) for w, o in parts])
        return [o for _, o in parts]

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
        x2 = x.reshape(-1, x.shape[-1])
        o2 = _out(out, x.shape).reshape(x2.shape)
        _kernels.rmsnorm(x2, weight, float(eps), o2)
        return o2.reshape(x.shape)

    def add_rmsnorm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float,
                    out: np.ndarray | None = None) -> np.ndarray:
        """residual += x; -> rmsnorm(residual)."""
        out = _out(out, residual.shape)
        _kernels.add_rmsnorm(residual, x, weight, float(eps), out)
        return out

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        _kernels.add(a, b)
        return a

    def swiglu(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = _out(out, gate.shape)
        _kernels.swiglu(gate, up, out)
        return out

    def geglu(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = _out(out, gate.shape)
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
                       inv_freq, interleaved, scale, window=0, softcap_value=0.0, out=None,
                       rope_mscale=1.0):
        out = _out(out, q.shape)
        _kernels.rope_attention(q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                                inv_freq, bool(interleaved), float(scale), int(window),
                                float(softcap_value), out, rope_mscale=float(rope_mscale))
        return out
