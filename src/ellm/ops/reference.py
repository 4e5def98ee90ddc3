"""Plain NumPy definitions of every op the models use.

These are the specification: the C kernels (ops/cpu.py) and the CUDA kernels must agree
with them, and the kernel tests compare against them. They are written for clarity, not
speed (loops over sequences are fine here, never in the fast backends).

Shapes: T tokens in the batch (all sequences' new tokens, concatenated), H hidden size,
nh query heads, nkv key/value heads, hd head dim. The paged KV cache of one layer is a
pair of arrays (num_blocks, block_size, nkv, hd); a sequence's block table lists the
physical blocks holding its positions 0, block_size, 2*block_size, ...

Mixture-of-experts layers take their experts as an `Experts` (below): E SwiGLU MLPs of
one shape, each matrix a `Linear` (usually a view into the weights file).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .memory import HostMemory

if TYPE_CHECKING:
    from ..lora import LoraProjection
    from ..weights import Linear


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (..., H) f32, weight (H,) -> x / sqrt(mean(x^2) + eps) * weight, in f32."""
    x = x.astype(np.float32)
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(eps))) * weight.astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Llama MLP activation: silu(gate) * up."""
    return silu(gate) * up


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Gemma MLP activation: gelu_tanh(gate) * up."""
    return gelu_tanh(gate) * up


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(x / cap); cap <= 0 means no capping."""
    if cap <= 0:
        return x
    return np.float32(cap) * np.tanh(x / np.float32(cap))


def rope_angles(positions: np.ndarray, inv_freq: np.ndarray,
                mscale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """positions (T,), inv_freq (n_rot,) -> cos, sin (T, n_rot), computed in f32 like
    transformers, each multiplied by mscale (longrope's attention factor) after rounding."""
    ang = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
    m = np.float32(mscale)
    return np.cos(ang) * m, np.sin(ang) * m


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, interleaved: bool,
         mscale: float = 1.0) -> np.ndarray:
    """Rotary embedding on x (T, n_heads, hd).

    Only the first 2 * n_rot dims of each head rotate, n_rot = len(inv_freq) <= hd/2 (partial
    rotary: Phi-3's partial_rotary_factor); the rest pass through unchanged.
    interleaved=False (transformers' rotate_half): pairs (i, i + n_rot).
    interleaved=True (GGUF llama weights, whose Q/K rows the converter permuted): pairs (2i, 2i+1).
    mscale multiplies cos and sin.
    """
    n_rot = len(inv_freq)
    if n_rot > x.shape[-1] // 2:
        raise ValueError(f"inv_freq has {n_rot} entries, more than head_dim/2 = {x.shape[-1] // 2}")
    cos, sin = rope_angles(positions, inv_freq, mscale)
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    rot = x[..., : 2 * n_rot]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out[..., 0: 2 * n_rot: 2] = a * cos - b * sin
        out[..., 1: 2 * n_rot: 2] = b * cos + a * sin
        return out
    a, b = rot[..., :n_rot], rot[..., n_rot:]
    out[..., :n_rot] = a * cos - b * sin
    out[..., n_rot: 2 * n_rot] = b * cos + a * sin
    return out


# A KV cache of this element type holds bfloat16 values as their 16-bit patterns (NumPy
# has no bfloat16): each key and value rounded to nearest even as it is stored, widened
# exactly to f32 as it is read (kv_cache_dtype="bfloat16", the cuda backend's cache).
KV_BF16 = np.dtype(np.uint16)


def kv_storage_dtype(name: str) -> np.dtype:
    """EngineConfig.kv_cache_dtype ("float32", "float16", "bfloat16") -> the array dtype
    a KV cache is made of (KV_BF16 for bfloat16)."""
    if name == "bfloat16":
        return KV_BF16
    return np.dtype(name)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bit patterns (uint16), round to nearest even (NaN stays NaN)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, np.uint16(0x7FC0), r)


def from_bf16_bits(u: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> f32, exactly."""
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def kv_store(cache: np.ndarray, index: tuple, value: np.ndarray) -> None:
    """cache[index] = value, rounded to the cache's element type (bf16 bits for KV_BF16)."""
    cache[index] = to_bf16_bits(value) if cache.dtype == KV_BF16 else value


def kv_load(cache: np.ndarray, index: tuple) -> np.ndarray:
    """cache[index] as the values it holds (bf16 bits widened to f32)."""
    got = cache[index]
    return from_bf16_bits(got) if cache.dtype == KV_BF16 else got


def rope_attention(
    q: np.ndarray,             # (T, nh, hd)
    k: np.ndarray,             # (T, nkv, hd)
    v: np.ndarray,             # (T, nkv, hd)
    positions: np.ndarray,     # (T,) int32: each token's position in its sequence
    seq_ids: np.ndarray,       # (T,) int32: each token's row in block_tables
    block_tables: np.ndarray,  # (B, max_blocks) int32, -1 where unused
    k_cache: np.ndarray,       # (num_blocks, block_size, nkv, hd), updated in place
    v_cache: np.ndarray,       # (num_blocks, block_size, nkv, hd), updated in place
    inv_freq: np.ndarray,      # (n_rot,) f32, n_rot <= hd/2: dims >= 2 n_rot are not rotated
    interleaved: bool,
    scale: float,
    window: int = 0,           # > 0: a token at position p sees positions > p - window
    softcap_value: float = 0.0,
    rope_mscale: float = 1.0,  # multiplies cos and sin (longrope's attention factor)
    key_limit: np.ndarray | None = None,  # (T,) int32: last position each token sees
) -> np.ndarray:
    """RoPE on q and k, k/v written to the paged cache, then causal attention. -> (T, nh, hd).

    All of this step's k/v are written before any attention is computed, so a token sees
    every earlier token of its sequence, whether cached before or new in this batch.
    key_limit lets a token see later positions too, up to key_limit[t] >= positions[t]
    (Gemma 3: an image's tokens see the whole image); those must be written in this call
    or an earlier one. A window still bounds the first key: (p - window, key_limit[t]].
    """
    T, nh, hd = q.shape
    nkv = k.shape[1]
    group = nh // nkv
    block_size = k_cache.shape[1]
    q = rope(q, positions, inv_freq, interleaved, rope_mscale)
    k = rope(k, positions, inv_freq, interleaved, rope_mscale)
    for t in range(T):
        blk = block_tables[seq_ids[t], positions[t] // block_size]
        kv_store(k_cache, (blk, positions[t] % block_size), k[t])
        kv_store(v_cache, (blk, positions[t] % block_size), v[t])
    out = np.empty_like(q)
    if key_limit is not None and (np.shape(key_limit) != (T,) or np.any(key_limit < positions)):
        raise ValueError(f"key_limit must be (T,) = ({T},) with key_limit[t] >= positions[t]")
    for t in range(T):
        p = int(positions[t])
        lo = max(0, p - window + 1) if window > 0 else 0
        pos = np.arange(lo, (p if key_limit is None else int(key_limit[t])) + 1)
        table = block_tables[seq_ids[t]]
        keys = kv_load(k_cache, (table[pos // block_size], pos % block_size))   # (L, nkv, hd)
        vals = kv_load(v_cache, (table[pos // block_size], pos % block_size))
        for h in range(nh):
            s = keys[:, h // group, :] @ q[t, h] * np.float32(scale)  # (L,)
            s = softcap(s, softcap_value)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ vals[:, h // group, :]
    return out


def rope_kv_write(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
                  block_tables: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, inv_freq: np.ndarray,
                  interleaved: bool, rope_mscale: float = 1.0) -> np.ndarray:
    """The first half of rope_attention: RoPE on q (T, nh, hd) and k (T, nkv, hd), the
    rotated k and v stored in their cache slots (rounded to the cache's element type).
    -> the rotated q."""
    block_size = k_cache.shape[1]
    q = rope(q, positions, inv_freq, interleaved, rope_mscale)
    k = rope(k, positions, inv_freq, interleaved, rope_mscale)
    for t in range(q.shape[0]):
        blk = block_tables[seq_ids[t], positions[t] // block_size]
        if blk < 0:   # a padding row of a captured batch: no slot
            continue
        kv_store(k_cache, (blk, positions[t] % block_size), k[t])
        kv_store(v_cache, (blk, positions[t] % block_size), v[t])
    return q


def paged_attention(q: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray, block_tables: np.ndarray,
                    k_cache: np.ndarray, v_cache: np.ndarray, scale: float, window: int = 0,
                    softcap_value: float = 0.0, key_limit: np.ndarray | None = None) -> np.ndarray:
    """The second half of rope_attention: q (T, nh, hd), already rotated, attends to the
    keys and values its sequence has in the cache (positions [lo, key_limit[t] or
    positions[t]], lo as rope_attention says). A token whose sequence has no block (-1) for
    a key it would read sees no keys at all and gets zeros (the padding rows of a captured
    batch). -> (T, nh, hd)."""
    T, nh, hd = q.shape
    group = nh // k_cache.shape[2]
    block_size = k_cache.shape[1]
    if key_limit is not None and (np.shape(key_limit) != (T,) or np.any(key_limit < positions)):
        raise ValueError(f"key_limit must be (T,) = ({T},) with key_limit[t] >= positions[t]")
    out = np.zeros((T, nh, hd), np.float32)
    for t in range(T):
        p = int(positions[t])
        lo = max(0, p - window + 1) if window > 0 else 0
        pos = np.arange(lo, (p if key_limit is None else int(key_limit[t])) + 1)
        table = block_tables[seq_ids[t]]
        blocks = table[pos // block_size]
        if np.any(blocks < 0):
            continue
        keys = kv_load(k_cache, (blocks, pos % block_size)).astype(np.float32)   # (L, nkv, hd)
        vals = kv_load(v_cache, (blocks, pos % block_size)).astype(np.float32)
        for h in range(nh):
            s = keys[:, h // group, :] @ q[t, h].astype(np.float32) * np.float32(scale)
            s = softcap(s, softcap_value)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ vals[:, h // group, :]
    return out


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (T, K) @ w (N, K)^T -> (T, N), w already float."""
    return x.astype(np.float32) @ w.astype(np.float32).T


def lora_add(x: np.ndarray, row_slots: np.ndarray, slots: Sequence, y: np.ndarray) -> np.ndarray:
    """LoRA adapters over a base product y (T, >= N), in place: for every row t whose slot
    s = row_slots[t] >= 0 has factors (a (r, K), b (N, r), scale) in slots[s],
    y[t, :N] += scale * b @ (a @ x[t]); rows of slot -1 or of an adapter that leaves this
    projection alone (None) keep the base's product. A row's result depends only on its
    own x, slot and the factors (batch invariance)."""
    if len(row_slots) != len(x) or np.any((row_slots < -1) | (row_slots >= len(slots))):
        raise IndexError(f"row slots must be ({len(x)},) in [-1, {len(slots)})")
    for t in range(len(x)):
        f = slots[row_slots[t]] if row_slots[t] >= 0 else None
        if f is not None:
            u = f.a.astype(np.float32) @ x[t].astype(np.float32)
            n = f.b.shape[0]
            y[t, :n] += np.float32(f.scale) * (f.b.astype(np.float32) @ u)
    return y


# ------------------------------------------------------------------------------------
# Vision towers (SigLIP): layernorm with bias, GELU, attention without a mask
# ------------------------------------------------------------------------------------

def layernorm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """x (..., D) f32 -> (x - mean) / sqrt(var + eps) * weight + bias over the last axis
    (the biased variance, as torch.nn.LayerNorm), in f32."""
    x = x.astype(np.float32)
    mean = np.mean(x, axis=-1, keepdims=True, dtype=np.float32)
    d = x - mean
    var = np.mean(d * d, axis=-1, keepdims=True, dtype=np.float32)
    return d / np.sqrt(var + np.float32(eps)) * weight.astype(np.float32) + bias.astype(np.float32)


def full_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_len: int, scale: float) -> np.ndarray:
    """q, k, v (T, nh, hd), T = n * seq_len: n independent sequences of seq_len rows each
    (an image tile's patches), every row attending to every row of its own sequence (no
    causal mask, no cache). -> (T, nh, hd)."""
    T, nh, hd = q.shape
    if seq_len < 1 or T % seq_len:
        raise ValueError(f"{T} rows are not a whole number of sequences of {seq_len}")
    out = np.empty((T, nh, hd), np.float32)
    for s in range(0, T, seq_len):
        qs, ks, vs = (a[s:s + seq_len].astype(np.float32).transpose(1, 0, 2) for a in (q, k, v))  # (nh, L, hd)
        w = qs @ ks.transpose(0, 2, 1) * np.float32(scale)                                         # (nh, L, L)
        w = np.exp(w - w.max(axis=-1, keepdims=True))
        out[s:s + seq_len] = ((w / w.sum(axis=-1, keepdims=True)) @ vs).transpose(1, 0, 2)
    return out


# ------------------------------------------------------------------------------------
# Mixture of experts
# ------------------------------------------------------------------------------------

@dataclass(eq=False)
class Experts:
    """The experts of one MoE layer: E SwiGLU MLPs down(silu(gate x) * up x) of one shape.

    gate[e], up[e]: Linear (F, H); down[e]: Linear (H, F), for e < E. Every matrix of a list
    has the same type and shape. Each is usually a zero-copy view: expert e's slice of a
    GGUF stacked tensor (`blk.N.ffn_gate_exps`, (E, F, H)), a per-expert safetensors
    tensor (`mlp.experts.{e}.gate_proj.weight`, what transformers 5.24's save_pretrained
    writes for Qwen3-MoE), or a row slice of a fused (E, 2F, H) gate_up tensor.
    Compared by identity: a backend may keep what it prepares for one (e.g. pointer tables).
    """
    gate: Sequence["Linear"]
    up: Sequence["Linear"]
    down: Sequence["Linear"]

    def __post_init__(self) -> None:
        E = len(self.gate)
        if E < 1 or len(self.up) != E or len(self.down) != E:
            raise ValueError(f"Experts: gate, up, down hold {len(self.gate)}, {len(self.up)}, "
                             f"{len(self.down)} matrices; need the same E >= 1")
        H, F = self.gate[0].in_features, self.gate[0].out_features
        for name, mats, shape in (("gate", self.gate, (F, H)), ("up", self.up, (F, H)),
                                  ("down", self.down, (H, F))):
            qtype = mats[0].qtype
            for e, m in enumerate(mats):
                if (m.out_features, m.in_features) != shape or m.qtype != qtype:
                    raise ValueError(f"Experts: {name}[{e}] is {m.qtype.name} "
                                     f"({m.out_features}, {m.in_features}); expected "
                                     f"{qtype.name} {shape} like {name}[0]")

    @property
    def num_experts(self) -> int:
        return len(self.gate)

    @property
    def hidden_size(self) -> int:
        return self.gate[0].in_features

    @property
    def intermediate_size(self) -> int:
        return self.gate[0].out_features


def moe_route(logits: np.ndarray, top_k: int, norm_topk_prob: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits (T, E) -> expert ids (T, top_k) int32 and weights (T, top_k) f32.

    softmax over the experts in f32, the top_k most probable (highest first; ties to the
    lower id), their probabilities divided by their sum when norm_topk_prob (Qwen3-MoE's
    flag; Mixtral always renormalises)."""
    logits = logits.astype(np.float32)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs = e / e.sum(axis=-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k].astype(np.int32)
    weights = np.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return ids, weights.astype(np.float32)


def moe_experts(x: np.ndarray, ids: np.ndarray, weights: np.ndarray, gate: Sequence[np.ndarray],
                up: Sequence[np.ndarray], down: Sequence[np.ndarray]) -> np.ndarray:
    """x (T, H), ids / weights (T, k), float expert matrices gate[e], up[e] (F, H), down[e]
    (H, F) -> (T, H): each token's sum over its experts, in ascending expert id, of
    weight * down(swiglu(gate x, up x))."""
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in np.argsort(ids[t], kind="stable"):
            e = int(ids[t, j])
            h = swiglu(linear(x[t:t + 1], gate[e]), linear(x[t:t + 1], up[e]))
            out[t] += weights[t, j] * linear(h, down[e])[0]
    return out


def argmax_ids(logits: np.ndarray) -> np.ndarray:
    """Each row's greedy token (B, V) -> int32 (B,): the first index of its largest value,
    -inf and NaN never chosen (a row of only those gives 0), as the samplers choose."""
    x = np.asarray(logits, dtype=np.float32)
    return np.argmax(np.where(np.isnan(x), -np.inf, x), axis=1).astype(np.int32)


def _into(out: np.ndarray | None, value: np.ndarray) -> np.ndarray:
    if out is None:
        return np.ascontiguousarray(value, dtype=np.float32)
    out[...] = value
    return out


def check_qk_norms(q_norm: Any, k_norm: Any, nh: int, nkv: int, hd: int, whole: bool) -> None:
    """qk_norm_rope_write's norm weights: hd each (per head), or nh * hd and nkv * hd (whole)."""
    want = (nh * hd, nkv * hd) if whole else (hd, hd)
    got = (int(q_norm.size), int(k_norm.size))
    if got != want:
        raise ValueError(f"qk_norm_rope_write: q/k norm weights of {got[0]} / {got[1]} values, not "
                         f"{want[0]} / {want[1]} ({'the whole projection' if whole else 'per head'})")


class FusedByComposition:
    """The fused ops of the op set, each spelled as the plain ops it stands for.

    A backend may run one of these as a single kernel (ops/cuda.py does, for decode: the
    RMSNorm folded into the product after it, q/k/v + RoPE + the paged KV write in one
    launch, gate/up + activation in one, the residual add in the down / o product's
    epilogue); what it computes is what these compositions compute (up to f32 rounding:
    a fused kernel may scale after the dot product rather than before), and
    tests/test_backends.py holds every backend to them. The host backends inherit them
    as they are, so their results are their own plain ops' (the cpu backend runs whole
    layers through layer_stack instead; these are there for the op tests and for a
    model that calls them). ops/fused_stack.py runs a decoder's layers with them."""

    if TYPE_CHECKING:   # the backend's plain ops, which the compositions call (a mixin's needs)
        def rmsnorm(self, x: Any, weight: Any, eps: float, out: Any = None) -> Any: ...
        def linear(self, x: Any, w: "Linear", out: Any = None) -> Any: ...
        def linear_multi(self, x: Any, parts: Sequence[tuple]) -> list[Any]: ...
        def swiglu(self, gate: Any, up: Any, out: Any = None) -> Any: ...
        def geglu(self, gate: Any, up: Any, out: Any = None) -> Any: ...
        def scale(self, x: Any, s: float) -> Any: ...
        def add(self, a: Any, b: Any) -> Any: ...
        def to_host(self, x: Any) -> np.ndarray: ...
        def moe(self, x: Any, router: "Linear", experts: Experts, top_k: int, norm_topk_prob: bool,
                out: Any = None) -> Any: ...

    def norm_linear_multi(self, x: Any, norm: Any, eps: float, parts: Sequence[tuple],
                          normed: Any = None) -> list[Any]:
        """h = rmsnorm(x, norm, eps) (x itself when norm is None), then linear_multi(h,
        parts): [(w, out), ...] -> outs. normed: where h may be kept (else a buffer of the
        backend's own)."""
        h = x if norm is None else self.rmsnorm(x, norm, eps, out=normed)
        return self.linear_multi(h, parts)

    def norm_linear_greedy(self, x: Any, norm: Any, eps: float, w: "Linear", logits: Any, ids: Any) -> Any:
        """A decode step's head: norm_linear_multi(x, norm, eps, ((w, logits),)), then each
        row's greedy token into ids (T,) int32 (argmax_rows) -> ids."""
        self.norm_linear_multi(x, norm, eps, ((w, logits),))
        return self.argmax_rows(logits, out=ids)

    def argmax_rows(self, logits: Any, out: Any = None) -> Any:
        """Each row's greedy token (B, V) -> int32 (B,): argmax_ids, into out when given."""
        ids = argmax_ids(self.to_host(logits))
        if out is None:
            return ids
        out[...] = ids
        return out

    def norm_linear_glu(self, x: Any, norm: Any, eps: float, gate: "Linear", up: "Linear", act: str,
                        out: Any = None) -> Any:
        """h = rmsnorm(x) (or x); -> act(h @ gate^T (+ bias)) * (h @ up^T (+ bias)) (T, F),
        act "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"norm_linear_glu: act must be 'silu' or 'gelu_tanh', got {act!r}")
        h = x if norm is None else self.rmsnorm(x, norm, eps)
        g = self.linear(h, gate)
        u = self.linear(h, up)
        return (self.swiglu if act == "silu" else self.geglu)(g, u, out=out)

    def linear_add(self, x: Any, w: "Linear", residual: Any) -> Any:
        """residual += x @ W^T (+ bias), in place -> residual."""
        return self.add(residual, self.linear(x, w))

    def norm_moe_add(self, residual: Any, norm: Any, eps: float, router: "Linear", experts: Experts, top_k: int,
                     norm_topk_prob: bool, normed: Any = None, out: Any = None) -> Any:
        """residual += moe(rmsnorm(residual, norm, eps)) (norm None: of residual itself), in
        place -> residual: a mixture-of-experts block with its input norm and residual add.
        normed, out: where the normed input and the block's output may be kept."""
        h = residual if norm is None else self.rmsnorm(residual, norm, eps, out=normed)
        return self.add(residual, self.moe(h, router, experts, top_k, norm_topk_prob, out=out))

    def norm_add(self, residual: Any, x: Any, weight: Any, eps: float, scale: float = 1.0) -> Any:
        """residual += scale * rmsnorm(x, weight, eps) (weight None: scale * x), in place ->
        residual: a block's post norm and residual multiplier with its add."""
        h = x if weight is None else self.rmsnorm(x, weight, eps)
        if scale != 1.0:
            h = self.scale(h.copy() if h is x else h, scale)   # (x itself unchanged)
        return self.add(residual, h)

    def norm_qkv_rope_write(self, x: Any, norm: Any, eps: float, q: "Linear", k: "Linear", v: "Linear",
                            head_dim: int, positions: Any, seq_ids: Any, block_tables: Any, k_cache: Any,
                            v_cache: Any, inv_freq: Any, interleaved: bool, rope_mscale: float = 1.0,
                            q_out: Any = None) -> Any:
        """h = rmsnorm(x) (or x); the projections h @ q/k/v^T (+ biases) as (T, n, head_dim);
        then rope_kv_write: RoPE on q and k, k and v into their cache slots. -> the rotated
        q (T, nh, head_dim), in q_out when given. With paged_attention after it, this is
        rope_attention of the projections."""
        h = x if norm is None else self.rmsnorm(x, norm, eps)
        T = int(h.shape[0])
        qs, ks, vs = (self.to_host(self.linear(h, w)).reshape(T, -1, head_dim) for w in (q, k, v))
        rotated = rope_kv_write(qs, ks, vs, self.to_host(positions), self.to_host(seq_ids),
                                self.to_host(block_tables), k_cache, v_cache, self.to_host(inv_freq),
                                interleaved, rope_mscale)
        return _into(q_out, rotated)

    def qk_norm_rope_write(self, q: Any, k: Any, v: Any, q_norm: Any, k_norm: Any, eps: float, whole: bool,
                           positions: Any, seq_ids: Any, block_tables: Any, k_cache: Any, v_cache: Any,
                           inv_freq: Any, interleaved: bool, rope_mscale: float = 1.0, q_out: Any = None) -> Any:
        """q (T, nh, hd) and k (T, nkv, hd) through their RMSNorms (each head's hd values;
        whole: each token's projection, weights of nh * hd and nkv * hd), then
        rope_kv_write. q and k are left as they were. -> the rotated q, in q_out when
        given. With paged_attention after it, this is the q/k-norm attention of Qwen3,
        Gemma 3 and OLMo 2 (models/blocks.py Attention)."""
        T, nh, hd = (int(s) for s in q.shape)
        nkv = int(k.shape[1])
        check_qk_norms(q_norm, k_norm, nh, nkv, hd, whole)
        if whole:
            qn = self.rmsnorm(q.reshape(T, nh * hd), q_norm, eps).reshape(T, nh, hd)
            kn = self.rmsnorm(k.reshape(T, nkv * hd), k_norm, eps).reshape(T, nkv, hd)
        else:
            qn, kn = self.rmsnorm(q, q_norm, eps), self.rmsnorm(k, k_norm, eps)
        rotated = rope_kv_write(self.to_host(qn), self.to_host(kn), self.to_host(v), self.to_host(positions),
                                self.to_host(seq_ids), self.to_host(block_tables), k_cache, v_cache,
                                self.to_host(inv_freq), interleaved, rope_mscale)
        return _into(q_out, rotated)

    def paged_attention(self, q: Any, positions: Any, seq_ids: Any, block_tables: Any, k_cache: Any,
                        v_cache: Any, scale: float, window: int = 0, softcap_value: float = 0.0,
                        key_limit: Any = None, out: Any = None) -> Any:
        """paged_attention (above) of a rotated q (T, nh, hd) -> (T, nh, hd)."""
        return _into(out, paged_attention(q, positions, seq_ids, block_tables, k_cache, v_cache, scale,
                                          window, softcap_value, key_limit))


class ReferenceOps(FusedByComposition, HostMemory):
    """The model op set in plain NumPy (slow): the oracle the fast backends are tested against.

    Same signatures as ops.cpu.CpuOps (an optional `out` on every op that makes an array).
    The memory methods (empty, kv_zeros, upload, upload_linear, upload_batch, gather_rows,
    to_host, sample, step_executor) come from ops.memory.HostMemory, their specification."""

    name = "reference"
    # linear / linear_multi add Linear.bias themselves (models/blocks.py asks)
    linear_adds_bias = True

    def embed(self, w: "Linear", ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        from ..formats.dequant import dequantize
        rows = w.data[np.asarray(ids, dtype=np.int64)]
        return _into(out, dequantize(np.ascontiguousarray(rows), w.qtype, (len(ids), w.in_features)))

    def linear(self, x: np.ndarray, w: "Linear", out: np.ndarray | None = None) -> np.ndarray:
        """x (T, K) @ W^T (+ w.bias, (N,) f32, when the layer has one)."""
        from ..formats.dequant import dequantize
        y = linear(x, dequantize(w.data, w.qtype, (w.out_features, w.in_features)))
        if w.bias is not None:
            y = y + w.bias.astype(np.float32)
        return _into(out, y)

    def linear_multi(self, x: np.ndarray, parts) -> list[np.ndarray]:
        return [self.linear(x, w, o) for w, o in parts]

    # -- LoRA adapters (ellm/lora.py) ----------------------------------------------

    def prepare_lora(self, projection: "LoraProjection") -> "LoraProjection":
        """One projection's factors of every adapter, as this backend runs them (once, when
        adapters are attached). Here: the LoraProjection itself."""
        return projection

    def lora(self, x: np.ndarray, row_slots: np.ndarray, parts: Sequence[tuple]) -> None:
        """For each (prepared projection, y) of parts, y += each row's adapter's
        scale * B (A x) (lora_add); x (T, K) is the projections' common input."""
        for proj, y in parts:
            lora_add(x, np.asarray(row_slots), proj.slots, y)

    def rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
        return _into(out, rmsnorm(x, weight, eps))

    def add_rmsnorm(self, residual: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float,
                    out: np.ndarray | None = None) -> np.ndarray:
        residual += x
        return _into(out, rmsnorm(residual, weight, eps))

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a += b
        return a

    def swiglu(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return _into(out, swiglu(gate, up))

    def geglu(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return _into(out, geglu(gate, up))

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        x[...] = softcap(x, cap)
        return x

    # -- vision towers ------------------------------------------------------------

    def layernorm(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float,
                  out: np.ndarray | None = None) -> np.ndarray:
        return _into(out, layernorm(x, weight, bias, eps))

    def gelu_tanh(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        return _into(out, gelu_tanh(x.astype(np.float32)))

    def full_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_len: int, scale: float,
                       out: np.ndarray | None = None) -> np.ndarray:
        return _into(out, full_attention(q, k, v, seq_len, scale))

    def scale(self, x: np.ndarray, s: float) -> np.ndarray:
        x *= np.float32(s)
        return x

    def moe(self, x: np.ndarray, router: "Linear", experts: Experts, top_k: int,
            norm_topk_prob: bool, out: np.ndarray | None = None) -> np.ndarray:
        """x (T, H) -> (T, H): the MoE feed-forward (router logits x @ router^T, top-k
        routing, each chosen expert's SwiGLU MLP weighted and summed)."""
        from ..formats.dequant import dequantize

        def dense(m: "Linear") -> np.ndarray:
            return dequantize(m.data, m.qtype, (m.out_features, m.in_features))
        ids, weights = moe_route(self.linear(x, router), top_k, norm_topk_prob)
        return _into(out, moe_experts(x.astype(np.float32), ids, weights,
                                      [dense(m) for m in experts.gate], [dense(m) for m in experts.up],
                                      [dense(m) for m in experts.down]))

    def rope_attention(self, q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                       inv_freq, interleaved, scale, window=0, softcap_value=0.0, out=None,
                       rope_mscale=1.0, key_limit=None):
        return _into(out, rope_attention(q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                                         inv_freq, interleaved, scale, window, softcap_value,
                                         rope_mscale, key_limit))
