"""The CPU backend: the op set of reference.py on the C kernels (csrc/ through Cython).

Every op takes an optional `out` (the model passes workspace views, so decode allocates
nothing) and returns it. Its arrays are host NumPy arrays: the memory methods are
ops.memory.HostMemory's.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .._native import _kernels, _lora, _moe, _quant, _stack, _vision
from .memory import HostMemory
from .reference import Experts, FusedByComposition


# linear_multi part lists remembered at once: two per layer for a few batch sizes
_KERNEL_PARTS_KEPT = 1024


def _lora_bits(m: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 factor (whose values the file held in `dtype`) as the kernel reads it:
    float32, float16, or bfloat16 bits (the top half of each float32: exact, the values
    came from bfloat16)."""
    m = np.ascontiguousarray(m, dtype=np.float32)
    if dtype == "f16":
        return m.astype(np.float16)
    if dtype == "bf16":
        return np.ascontiguousarray((m.view(np.uint32) >> 16).astype(np.uint16))
    return m


# an MoE layer's (gate, up, down) pointer tables
_ExpertStacks = tuple[_moe.ExpertStack, _moe.ExpertStack, _moe.ExpertStack]


def _out(out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, np.float32) if out is None else out


class CpuOps(FusedByComposition, HostMemory):
    # the fused ops (norm_linear_multi, ...) are reference.FusedByComposition's: this
    # backend's own plain ops, composed (whole layers go through layer_stack instead)

    name = "cpu"
    # linear / linear_multi add Linear.bias themselves (models/blocks.py asks)
    linear_adds_bias = True

    def __init__(self, activations: str = "int8") -> None:
        # id(Experts) -> (the Experts, its (gate, up, down) pointer tables), made once per
        # layer; the Experts is held so its id cannot be reused
        self._expert_stacks: dict[int, tuple[Experts, _ExpertStacks]] = {}
        # "f32": quantized weights meet unrounded activations (ops.get_ops)
        self.exact_activations = activations == "f32"
        # id(parts tuple) -> (the tuple, its parts as the kernel takes them): the blocks
        # pass the same tuple every decode step (models/blocks.py caches it with the
        # views), so it is converted once; the tuple is held so its id cannot be reused
        self._kernel_parts: dict[int, tuple[tuple, list[tuple]]] = {}
        # [lora] the adapters' factors, packed in the order the tables are made (prepare_lora)
        self._lora_arena: _lora.FactorArena | None = None

    def embed(self, w, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        out = _out(out, (len(ids), w.in_features))
        _quant.get_rows(w.data, int(w.qtype), ids, out)
        return out

    def linear(self, x: np.ndarray, w, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty((x.shape[0], w.out_features), np.float32)
        if self.exact_activations:
            _quant.linear_multi_exact(np.ascontiguousarray(x, dtype=np.float32),
                                      [(w.data, int(w.qtype), out, w.bias)])
            return out
        _quant.linear(np.ascontiguousarray(x, dtype=np.float32), w.data, int(w.qtype), out,
                      w.bias)
        return out

    def linear_multi(self, x: np.ndarray, parts: Sequence[tuple]) -> list[np.ndarray]:
        """[(w, out), ...] -> outs: several matrices against one x, x quantized once."""
        run = _quant.linear_multi_exact if self.exact_activations else _quant.linear_multi
        run(np.ascontiguousarray(x, dtype=np.float32), self._parts(parts))
        return [o for _, o in parts]

    def _parts(self, parts: Sequence[tuple]) -> list[tuple]:
        """[(w.data, qtype, out, bias), ...] of [(w, out), ...]; remembered for a tuple
        (immutable, so the same object always means the same parts)."""
        if not isinstance(parts, tuple):
            return [(w.data, int(w.qtype), o, w.bias) for w, o in parts]
        hit = self._kernel_parts.get(id(parts))
        if hit is None or hit[0] is not parts:
            if len(self._kernel_parts) >= _KERNEL_PARTS_KEPT:
                self._kernel_parts.clear()
            hit = (parts, [(w.data, int(w.qtype), o, w.bias) for w, o in parts])
            self._kernel_parts[id(parts)] = hit
        return hit[1]

    # -- LoRA adapters (ellm/lora.py, csrc/lora.c) -----------------------------------

    def prepare_lora(self, projection) -> _lora.LoraTable:
        """Every adapter's factors of one projection as the C kernel's table: A^T and B^T
        in the adapter file's own type (16-bit factors stay 16-bit: half the bytes a step
        reads), which the table holds."""
        if self._lora_arena is None:
            self._lora_arena = _lora.FactorArena()
        return _lora.LoraTable([None if f is None else (_lora_bits(f.a.T, f.dtype), _lora_bits(f.b.T, f.dtype),
                                                        f.scale, f.dtype)
                                for f in projection.slots], projection.out_features, projection.in_features,
                               self._lora_arena)

    def lora(self, x: np.ndarray, row_slots: np.ndarray, parts: Sequence[tuple]) -> None:
        """y += each row's adapter's scale * B (A x) for every (table, y) of parts, every
        adapter of the batch in one call into C (rows grouped by adapter there)."""
        _lora.apply(np.ascontiguousarray(x, dtype=np.float32), row_slots, parts)

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
        if out is not None and x.ndim == 2 and out.ndim == 2:   # the blocks' rows: no reshaping
            _kernels.rmsnorm(x, weight, float(eps), out)
            return out
        x2 = x.reshape(-1, x.shape[-1])
        o2 = _out(out, x.shape).reshape(x2.shape)
        _kernels.rmsnorm(x2, weight, float(eps), o2)
        return o2.reshape(x.shape)

    def add_rmsnorm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float,
                    out: np.ndarray | None = None) -> np.ndarray:
        """residual += x; -> rmsnorm(residual)."""
        if out is None:
            out = np.empty(residual.shape, np.float32)
        _kernels.add_rmsnorm(residual, x, weight, float(eps), out)
        return out

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        _kernels.add(a, b)
        return a

    def swiglu(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.empty(gate.shape, np.float32)
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

    # -- vision towers (csrc/vision.c) -----------------------------------------------

    def layernorm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float,
                  out: np.ndarray | None = None) -> np.ndarray:
        return _vision.layernorm(x, weight, bias, float(eps), _out(out, x.shape))

    def gelu_tanh(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return _vision.gelu_tanh(x, _out(out, x.shape))

    def full_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_len: int, scale: float,
                       out: np.ndarray | None = None) -> np.ndarray:
        """q, k, v (T, nh, hd): T / seq_len independent sequences, no mask. -> (T, nh, hd)."""
        return _vision.full_attention(q, k, v, int(seq_len), float(scale), _out(out, q.shape))

    def moe(self, x: np.ndarray, router, experts: Experts, top_k: int, norm_topk_prob: bool,
            out: np.ndarray | None = None) -> np.ndarray:
        """x (T, H) -> (T, H): router logits, top-k routing and the chosen experts' SwiGLU
        MLPs, all in C (tokens grouped per expert there; no Python loop over tokens)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        T = x.shape[0]
        logits = self.linear(x, router)                                     # (T, E)
        ids = np.empty((T, top_k), np.int32)
        weights = np.empty((T, top_k), np.float32)
        _moe.route(logits, int(top_k), bool(norm_topk_prob), ids, weights)
        out = _out(out, x.shape)
        if self.exact_activations:
            return self._moe_experts_exact(x, ids, weights, experts, out)
        _moe.experts(x, ids, weights, *self._stacks(experts), out)
        return out

    def _moe_experts_exact(self, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                           experts: Experts, out: np.ndarray) -> np.ndarray:
        """The experts on the f32-activation kernels: one batched call per expert for the
        tokens routed to it (a loop over experts, not tokens), each token's terms added in
        ascending expert id as reference.moe_experts adds them."""
        out[...] = 0.0
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)          # rows ascend; a token picks e once
            xe = np.ascontiguousarray(x[rows])
            gate, up = self.linear(xe, experts.gate[e]), self.linear(xe, experts.up[e])
            h = self.linear(self.swiglu(gate, up), experts.down[e])
            out[rows] += weights[rows, slot][:, None] * h
        return out

    def _stacks(self, experts: Experts) -> _ExpertStacks:
        hit = self._expert_stacks.get(id(experts))
        if hit is None or hit[0] is not experts:
            gate, up, down = (_moe.ExpertStack([m.data for m in mats], int(mats[0].qtype), mats[0].in_features)
                              for mats in (experts.gate, experts.up, experts.down))
            hit = (experts, (gate, up, down))
            self._expert_stacks[id(experts)] = hit
        return hit[1]

    def layer_stack(self, specs: list[dict], t: int, hidden: int, residual: np.ndarray, proj: np.ndarray,
                    h: np.ndarray, eps: float) -> _stack.LayerStack | None:
        """Every layer of a forward of t rows as one call into C (Decoder._layer_stack says
        what specs hold); None with exact activations, whose kernels it does not call, or
        with mixture-of-experts layers, which it does not run."""
        if self.exact_activations or any(s["moe"] is not None for s in specs):
            return None
        return _stack.LayerStack(specs, t, hidden, residual, proj, h, eps)

    def rope_attention(self, q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                       inv_freq, interleaved, scale, window=0, softcap_value=0.0, out=None,
                       rope_mscale=1.0, key_limit=None):
        out = _out(out, q.shape)
        _kernels.rope_attention(q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                                inv_freq, bool(interleaved), float(scale), int(window),
                                float(softcap_value), out, rope_mscale=float(rope_mscale),
                                key_limit=key_limit)
        return out
