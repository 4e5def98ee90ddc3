"""The building blocks every family's forward pass is composed of.

Attention (GQA; optional q/k RMSNorm per head or over the whole projection; optional
bias; sliding window; NoPE layers through zero inverse frequencies; soft-capping; any
scale), the gated MLP (SwiGLU or GeGLU), and a pre-/post-norm decoder layer stack with
embedding / residual / logits multipliers. Also the weight-loading helpers and the
llama.cpp tensor names most families share.

Blocks only call the op set (`ops`), never NumPy: their buffers come from a Workspace
the backend allocates (the model runner's), so a decode step allocates nothing and the
same code runs on every backend. `upload_weights` puts a built model's weights on its
backend once, at load.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from ..config import ModelConfig
from ..ops.workspace import Workspace
from ..weights import Linear, WeightSource
from .batch import Batch

# llama.cpp tensor names -> Hugging Face names ({i} is the layer index); a family's
# GGUF_TENSORS come first and win.
GGUF_COMMON_TENSORS: list[tuple[str, str]] = [
    (r"token_embd\.weight", "model.embed_tokens.weight"),
    (r"output_norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"rope_freqs\.weight", "rope_freqs.weight"),
    (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{i}.input_layernorm.weight"),
    (r"blk\.(\d+)\.attn_q\.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    (r"blk\.(\d+)\.attn_k\.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    (r"blk\.(\d+)\.attn_v\.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    (r"blk\.(\d+)\.attn_q\.bias", "model.layers.{i}.self_attn.q_proj.bias"),
    (r"blk\.(\d+)\.attn_k\.bias", "model.layers.{i}.self_attn.k_proj.bias"),
    (r"blk\.(\d+)\.attn_v\.bias", "model.layers.{i}.self_attn.v_proj.bias"),
    (r"blk\.(\d+)\.attn_output\.bias", "model.layers.{i}.self_attn.o_proj.bias"),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{i}.mlp.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{i}.mlp.down_proj.weight"),
    # the norm before the MLP (Llama's post_attention_layernorm)
    (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
]


def gguf_tensor_table(overrides: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(overrides) + GGUF_COMMON_TENSORS


# -- loading ---------------------------------------------------------------------------

def load_linear(weights: WeightSource, prefix: str, rows: int, cols: int) -> Linear:
    """`prefix`.weight (rows, cols), with `prefix`.bias attached when the file has one."""
    w = weights.linear(prefix + ".weight")
    if (w.out_features, w.in_features) != (rows, cols):
        raise ValueError(f"{prefix}.weight is {(w.out_features, w.in_features)}, the config says {(rows, cols)}")
    if prefix + ".bias" in weights:
        w = replace(w, bias=weights.vector(prefix + ".bias"))  # its shape is checked there
    return w


def load_norm(weights: WeightSource, name: str, size: int, plus_one: bool = False) -> np.ndarray:
    """An RMSNorm weight (size,) f32; plus_one: the family multiplies by (1 + w) (Gemma),
    which llama.cpp's converter has already added in GGUF files."""
    w = weights.vector(name)
    if w.shape != (size,):
        raise ValueError(f"{name} has shape {w.shape}, expected ({size},)")
    if plus_one and not weights.norm_weights_include_one:
        w = (w + np.float32(1.0)).astype(np.float32)
    return w


def maybe_norm(weights: WeightSource, name: str, size: int, plus_one: bool = False) -> np.ndarray | None:
    return load_norm(weights, name, size, plus_one) if name in weights else None


def embedding_and_head(weights: WeightSource, config: ModelConfig) -> tuple[Linear, Linear]:
    embed = weights.linear("model.embed_tokens.weight")
    if (embed.out_features, embed.in_features) != (config.vocab_size, config.hidden_size):
        raise ValueError(f"embedding is {(embed.out_features, embed.in_features)}, "
                         f"config says {(config.vocab_size, config.hidden_size)}")
    if "lm_head.weight" in weights and not config.tie_word_embeddings:
        return embed, load_linear(weights, "lm_head", config.vocab_size, config.hidden_size)
    return embed, embed


# -- blocks ----------------------------------------------------------------------------

# Views kept per (workspace, rows) by a block: at most this many row counts at once (a
# decode step and a prefill chunk of another size alternate in continuous batching).
_VIEW_CACHE_ROWS = 8


def _cached_views(owner: Any, ws: Workspace, t: int, make: Any) -> Any:
    """make(ws, t) -> the views a block takes from ws for t rows, made once and reused
    while they are views of ws's current buffers, so a decode step of t rows skips the
    lookups, slicing and reshaping of every call. owner._views holds them."""
    cache = owner.__dict__.get("_views")
    if cache is None:
        cache = owner.__dict__["_views"] = {}
    key = (id(ws), t)
    hit = cache.get(key)
    if hit is not None and hit[0] is ws and hit[1] == ws.generation:
        return hit[2]
    views = make(ws, t)
    if hit is not None and hit[0] is ws and _same_buffers(hit[2], views):
        # ws made buffers for other blocks since (a forward that sized them): still valid
        hit[1] = ws.generation
        return hit[2]
    if len(cache) >= _VIEW_CACHE_ROWS:
        cache.clear()
    cache[key] = [ws, ws.generation, views]   # ws is held so its id cannot be reused
    return views


# the workspace views in a layer stack's spec of each layer (Decoder._layer_spec)
_STACK_VIEWS = ("q_out", "k_out", "v_out", "q_rot", "attn_out", "gate_out", "up_out", "act_out")


def _arrays(views: Any) -> Iterator[Any]:
    for v in views:
        if isinstance(v, tuple):
            yield from _arrays(v)
        elif not isinstance(v, Linear):
            yield v


def _same_buffers(old: Any, new: Any) -> bool:
    """True when two results of one make() are views of the same workspace buffers (an
    array type that does not say its base, a backend's own, never counts as the same)."""
    for a, b in zip(_arrays(old), _arrays(new)):
        base = getattr(a, "base", None)
        if base is None or base is not getattr(b, "base", None):
            return False
    return True


def _add_lora(ops: Any, lora: tuple[dict[str, Any], Any], x: Any, outs: tuple) -> None:
    """Adds the batch's LoRA products of the projections in outs ((name, y), one input x)
    that any adapter changes in this layer (ellm/lora.py)."""
    tables, slots = lora
    parts = [(tables[name], y) for name, y in outs if name in tables]
    if parts:
        ops.lora(x, slots, parts)


@dataclass
class Attention:
    q: Linear                          # (nh*hd, H)
    k: Linear                          # (nkv*hd, H)
    v: Linear                          # (nkv*hd, H)
    o: Linear                          # (H, nh*hd)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inv_freq: np.ndarray               # (hd/2,) f32; all zeros: a NoPE layer
    scale: float                       # on q.k
    window: int = 0                    # > 0: sliding window
    softcap: float = 0.0               # attention-logit soft-capping (Gemma 2)
    interleaved: bool = False          # RoPE pairs (2i, 2i+1) (permuted GGUF weights)
    q_norm: np.ndarray | None = None   # (hd,) per head, or (nh*hd,) when qk_norm_whole
    k_norm: np.ndarray | None = None   # (hd,) per head, or (nkv*hd,)
    qk_norm_whole: bool = False        # OLMo 2: one norm over the whole projection
    eps: float = 1e-6
    rope_mscale: float = 1.0           # multiplies RoPE's cos and sin (Phi-3 LongRoPE's attention factor)

    def __call__(self, ops: Any, ws: Workspace, h: np.ndarray, batch: Batch, kv_layer: tuple,
                 out: np.ndarray, rec: Any = None, layer: int = 0, lora: Any = None) -> np.ndarray:
        """h (T, H) -> out (T, H); this step's k/v are written into the paged cache.
        rec: a trace.Recorder (or None), told what `layer` computes. lora: (this layer's
        adapter tables by projection, each row's adapter slot) when the batch has adapters."""
        q, k, v, q3, k3, v3, attn, attn2, parts = _cached_views(self, ws, len(h), self._make_views)
        ops.linear_multi(h, parts)   # + their biases (Qwen2)
        if lora is not None:
            _add_lora(ops, lora, h, (("q", q), ("k", k), ("v", v)))
        if rec is not None:   # [trace]
            rec(layer, "q", q), rec(layer, "k", k), rec(layer, "v", v)
        if self.q_norm is not None:   # in place
            if self.qk_norm_whole:
                ops.rmsnorm(q, self.q_norm, self.eps, out=q)
                ops.rmsnorm(k, self.k_norm, self.eps, out=k)
            else:
                ops.rmsnorm(q3, self.q_norm, self.eps, out=q3)
                ops.rmsnorm(k3, self.k_norm, self.eps, out=k3)
            if rec is not None:   # [trace]
                rec(layer, "q_norm", q), rec(layer, "k_norm", k)
        k_cache, v_cache = kv_layer
        ops.rope_attention(q3, k3, v3, batch.positions, batch.seq_ids, batch.block_tables[self.window],
                           k_cache, v_cache, self.inv_freq, self.interleaved, self.scale,
                           self.window, self.softcap, out=attn, rope_mscale=self.rope_mscale,
                           key_limit=batch.key_limit)  # (T, nh, hd)
        if rec is not None:   # [trace] q after RoPE and the weights are rebuilt from q and the cache
            rec.attention(layer, q3, k_cache, v_cache, batch.block_tables[self.window], self.inv_freq,
                          self.interleaved, self.scale, self.window, self.softcap, self.rope_mscale)
            rec(layer, "attn", attn)
        ops.linear(attn2, self.o, out=out)
        if lora is not None:
            _add_lora(ops, lora, attn2, (("o", out),))
        if rec is not None:   # [trace]
            rec(layer, "o_proj", out)
        return out

    def _make_views(self, ws: Workspace, t: int) -> tuple:
        """q, k, v (T, n*hd), their (T, n, hd) views, the attention output (T, nh, hd) and
        its (T, nh*hd) view, and the projections' (Linear, out) parts as a tuple."""
        nh, nkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = ws.get("q", t, nh * hd), ws.get("k", t, nkv * hd), ws.get("v", t, nkv * hd)
        attn = ws.get("attn", t, nh, hd)
        return (q, k, v, q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd),
                attn, attn.reshape(t, nh * hd), ((self.q, q), (self.k, k), (self.v, v)))


@dataclass
class MLP:
    gate: Linear                       # (F, H)
    up: Linear                         # (F, H)
    down: Linear                       # (H, F)
    act: str = "silu"                  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)

    def __call__(self, ops: Any, ws: Workspace, h: np.ndarray, out: np.ndarray,
                 rec: Any = None, layer: int = 0, lora: Any = None) -> np.ndarray:
        gate, up, parts = _cached_views(self, ws, len(h), self._make_views)
        ops.linear_multi(h, parts)
        if lora is not None:
            _add_lora(ops, lora, h, (("gate", gate), ("up", up)))
        # The activation overwrites gate, which nothing reads after it: no third (T, F)
        # buffer (29 MB at 512 tokens of an 8B model). [trace] A trace records gate too.
        act = gate if rec is None else ws.get("act", len(h), self.gate.out_features)
        (ops.swiglu if self.act == "silu" else ops.geglu)(gate, up, out=act)
        ops.linear(act, self.down, out=out)
        if lora is not None:
            _add_lora(ops, lora, act, (("down", out),))
        if rec is not None:   # [trace]
            rec(layer, "gate", gate), rec(layer, "up", up), rec(layer, "act", act), rec(layer, "down", out)
        return out

    def _make_views(self, ws: Workspace, t: int) -> tuple:
        f = self.gate.out_features
        gate, up = ws.get("gate", t, f), ws.get("up", t, f)
        return gate, up, ((self.gate, gate), (self.up, up))


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def load_mlp(weights: WeightSource, config: ModelConfig, prefix: str) -> MLP:
    act = ACTIVATIONS.get(config.hidden_act)
    if act is None:
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
    H, F = config.hidden_size, config.intermediate_size
    return MLP(gate=load_linear(weights, prefix + "gate_proj", F, H), up=load_linear(weights, prefix + "up_proj", F, H),
               down=load_linear(weights, prefix + "down_proj", H, F), act=act)


def load_attention(weights: WeightSource, config: ModelConfig, layer: int, **options: Any) -> Attention:
    """The attention of layer `layer` under Hugging Face names; options override fields."""
    c, p = config, f"model.layers.{layer}.self_attn."
    nh, nkv, hd, H = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    fields: dict[str, Any] = dict(
        q=load_linear(weights, p + "q_proj", nh * hd, H), k=load_linear(weights, p + "k_proj", nkv * hd, H),
        v=load_linear(weights, p + "v_proj", nkv * hd, H), o=load_linear(weights, p + "o_proj", H, nh * hd),
        n_heads=nh, n_kv_heads=nkv, head_dim=hd, inv_freq=c.inv_freq(layer), scale=c.attention_scale,
        window=c.layer_window(layer), interleaved=c.rope_interleaved, eps=c.rms_norm_eps)
    fields.update(options)
    return Attention(**fields)


class SparseBlock(Protocol):
    """A feed-forward block in MLP's place that a layer stack takes as a mixture of experts
    (models/qwen3_moe.py MoE): called as MLP is, and saying what norm_moe_add needs of it."""

    def __call__(self, ops: Any, ws: Workspace, h: Any, out: Any, rec: Any = None, layer: int = 0,
                 lora: Any = None) -> Any: ...

    def stack_moe(self) -> tuple[Linear, Any, int, bool]: ...   # router, Experts, top_k, norm_topk_prob


@dataclass
class DecoderLayer:
    attn: Attention
    mlp: MLP | SparseBlock
    input_norm: np.ndarray | None      # (H,) before attention; None: the residual itself goes in (OLMo 2)
    pre_mlp_norm: np.ndarray | None    # (H,) before the MLP; None: the residual itself
    post_attn_norm: np.ndarray | None = None  # (H,) on the attention output (Gemma 2/3, OLMo 2)
    post_mlp_norm: np.ndarray | None = None   # (H,) on the MLP output
    residual_multiplier: float = 1.0   # on each block's output before it is added (Granite)


class Decoder:
    """A decoder-only transformer: embedding, layers, final norm, head. The `Model` of
    most families is this, built from its weights."""

    # [vision] True: an image's tokens attend to each other both ways (Gemma 3); the
    # engine then gives the batch a key_limit and keeps each image in one prefill chunk
    bidirectional_images: bool = False
    # [lora] the LoRA adapters attached (ellm.lora.attach_adapters), or None
    lora: Any = None

    def __init__(self, config: ModelConfig, ops: Any, embed: Linear, lm_head: Linear,
                 layers: list[DecoderLayer], norm: np.ndarray, embed_scale: float = 1.0,
                 logits_scale: float = 1.0, final_softcap: float = 0.0) -> None:
        self.config, self.ops = config, ops
        self._ws: Workspace | None = None   # for callers that pass none (the runner passes its own)
        self.embed, self.lm_head, self.layers, self.norm = embed, lm_head, layers, norm
        self.embed_scale, self.logits_scale, self.final_softcap = embed_scale, logits_scale, final_softcap
        self.recorder: Any = None   # [trace] a trace.Recorder while `ellm trace` / inspect runs

    def _block_out(self, x: np.ndarray, post_norm: np.ndarray | None, multiplier: float) -> None:
        if post_norm is not None:
            self.ops.rmsnorm(x, post_norm, self.config.rms_norm_eps, out=x)
        if multiplier != 1.0:
            self.ops.scale(x, multiplier)

    def _make_views(self, ws: Workspace, t: int) -> tuple:
        """The (T, H) buffers of a forward: block outputs, normed hidden states, residual."""
        H = self.config.hidden_size
        return ws.get("proj", t, H), ws.get("h", t, H), ws.get("residual", t, H)

    def _next_norms(self) -> list[np.ndarray | None]:
        """Per layer, the norm its residual goes through after its MLP: the next layer's
        input norm, the final norm after the last layer (read each forward: a family may
        set its layers after __init__)."""
        return [layer.input_norm for layer in self.layers[1:]] + [self.norm]

    def upload_weights(self) -> None:
        """Puts every weight on the backend (ops.upload / ops.upload_linear; the identity on
        the host backends). Called once by models.build_model."""
        memo: dict[int, Any] = {}
        self.embed, self.lm_head, self.norm, self.layers = (
            upload_weights(self.ops, x, memo) for x in (self.embed, self.lm_head, self.norm, self.layers))

    def forward(self, batch: Batch, kv: Any, hidden_only: bool = False,
                ws: Workspace | None = None, greedy_ids: Any = None) -> np.ndarray:
        """-> logits (len(batch.logits_rows), vocab) float32, or with hidden_only the final-
        normed hidden states (len(batch.logits_rows), H): a backend array, a view of the
        workspace `ws` that stays valid until the next forward. The batch's arrays and the
        KV cache `kv` are the backend's (ops.upload_batch, ops.kv_zeros). greedy_ids: a
        backend int32 array (len(batch.logits_rows),) that also gets each row's greedy
        token (ops.argmax_rows; a decode step's head may take it in its own launch)."""
        if ws is None:
            ws = self._ws = self._ws or Workspace(self.ops)
        c, ops = self.config, self.ops
        t, r, H = len(batch.token_ids), len(batch.logits_rows), c.hidden_size
        eps = c.rms_norm_eps
        proj, h_buf, residual = _cached_views(self, ws, t, self._make_views)
        residual = ops.embed(self.embed, batch.token_ids, out=residual)   # (T, H)
        if self.embed_scale != 1.0:
            ops.scale(residual, self.embed_scale)
        if batch.embed_rows is not None:   # [vision] image rows replace the image tokens' embeddings
            ops.scatter_rows(residual, batch.embed_rows, batch.embed_values)
        rec = self.recorder   # [trace] None unless tracing: then one comparison per block below
        if rec is not None:
            rec(None, "embed", residual)
        slots = batch.adapter_slots   # [lora] each row's adapter, or None: the base alone
        if slots is not None and self.lora is None:
            raise ValueError("the batch names LoRA adapters, and this model has none attached")
        # Only the rows that give logits (or hidden states) are read after the last layer's
        # attention (which writes every row's keys and values): with fewer of them than rows
        # (a prefill), that layer's residual adds, MLP and final norm take those rows alone
        # (_last_layer_rows). The trace records every row, and adapters go by row: neither.
        last_rows = r < t and rec is None and slots is None
        count = len(self.layers) - 1 if last_rows else len(self.layers)   # layers run over every row
        stack = self._layer_stack(ws, t, kv, count) if rec is None and count else None
        if stack is not None and slots is not None and not getattr(stack, "takes_adapters", True):
            stack = None   # [lora] this backend's stack has no adapter path (ops/fused_stack.py)
        folds = stack is not None and getattr(stack, "folds_norms", False)   # (ops/fused_stack.py)
        first = self.layers[0].input_norm
        if first is None or folds:
            h = residual   # (or the first layer's products take its norm: ops/fused_stack.py)
        else:
            h = ops.rmsnorm(residual, first, eps, out=h_buf)
        if (stack is not None and folds and r == t and not hidden_only and self.logits_scale == 1.0
                and self.final_softcap <= 0):
            # every row gives logits (a decode step): the final norm folded into the head
            logits = ws.get("logits", r, c.vocab_size)
            stack.run(batch.positions, batch.seq_ids, batch.block_tables, batch.key_limit, slots,
                      head=(self.lm_head, logits, greedy_ids))
            return logits
        if stack is not None:   # the layers in one call, leaving residual and h_buf as the loop does
            stack.run(batch.positions, batch.seq_ids, batch.block_tables, batch.key_limit, slots)
            h = residual if self._next_norms()[count - 1] is None else h_buf
        else:
            h = self._layers_one_by_one(ws, h, batch, kv, proj, h_buf, residual, slots, count)
        if last_rows:
            h = self._last_layer_rows(ws, h, batch, kv, proj, residual)
        if rec is not None:   # [trace]
            rec(None, "final_norm", h)
        if r != t and not last_rows:
            h = ops.gather_rows(h, batch.logits_rows, out=ws.get("rows", r, H))
        if hidden_only:
            return h
        logits = ops.linear(h, self.lm_head, out=ws.get("logits", r, c.vocab_size))
        if self.logits_scale != 1.0:
            ops.scale(logits, self.logits_scale)
        if self.final_softcap > 0:
            ops.softcap(logits, self.final_softcap)
        if greedy_ids is not None:
            ops.argmax_rows(logits, out=greedy_ids)
        return logits

    def _layers_one_by_one(self, ws: Workspace, h: np.ndarray, batch: Batch, kv: Any, proj: np.ndarray,
                           h_buf: np.ndarray, residual: np.ndarray, slots: Any = None,
                           count: int | None = None) -> np.ndarray:
        """The first `count` layers (all by default), each block's ops called from here (and
        told to the trace recorder). slots: [lora] each row's adapter slot (-1: none), or None."""
        ops, rec = self.ops, self.recorder
        lora = None
        # per layer: its norm after each block, and the norm the residual goes through next
        for i, (layer, next_norm) in enumerate(zip(self.layers[:count], self._next_norms())):
            if rec is not None and layer.input_norm is not None:   # [trace]
                rec(i, "attn_norm", h)
            if slots is not None:   # [lora]
                lora = (self.lora.layers[i], slots)
            layer.attn(ops, ws, h, batch, kv.layer(i), out=proj, rec=rec, layer=i, lora=lora)
            h = self._after_attention(ws, i, layer, next_norm, residual, proj, h_buf, lora)
        return h

    def _after_attention(self, ws: Workspace, i: int, layer: DecoderLayer, next_norm: np.ndarray | None,
                         residual: np.ndarray, proj: np.ndarray, normed: np.ndarray, lora: Any = None) -> np.ndarray:
        """Layer i past its attention, proj holding the attention's output: the residual
        adds, the MLP (into proj) and the norm the residual goes through next (into normed)
        -> the next layer's input. Rows are independent: any subset of a step's rows may be
        given (_last_layer_rows)."""
        ops, eps, rec = self.ops, self.config.rms_norm_eps, self.recorder
        if layer.post_attn_norm is not None or layer.residual_multiplier != 1.0:
            self._block_out(proj, layer.post_attn_norm, layer.residual_multiplier)
        if rec is not None and layer.post_attn_norm is not None:   # [trace]
            rec(i, "post_attn_norm", proj)
        pre_mlp = layer.pre_mlp_norm
        h = ops.add(residual, proj) if pre_mlp is None else ops.add_rmsnorm(residual, proj, pre_mlp, eps, out=normed)
        if rec is not None:   # [trace]
            rec(i, "resid_attn", residual)
            if pre_mlp is not None:
                rec(i, "mlp_norm", h)
        layer.mlp(ops, ws, h, out=proj, rec=rec, layer=i, lora=lora)
        if layer.post_mlp_norm is not None or layer.residual_multiplier != 1.0:
            self._block_out(proj, layer.post_mlp_norm, layer.residual_multiplier)
        if rec is not None and layer.post_mlp_norm is not None:   # [trace]
            rec(i, "post_mlp_norm", proj)
        h = (ops.add(residual, proj) if next_norm is None
             else ops.add_rmsnorm(residual, proj, next_norm, eps, out=normed))
        if rec is not None:   # [trace]
            rec(i, "resid_mlp", residual)
        return h

    def _last_layer_rows(self, ws: Workspace, h: np.ndarray, batch: Batch, kv: Any, proj: np.ndarray,
                         residual: np.ndarray) -> np.ndarray:
        """The last layer, h its normed input: attention over every row (each row's keys
        and values go into the cache), then the rest of the layer and the final norm
        (_after_attention) for batch.logits_rows alone -> their hidden states (r, H), as
        gather_rows would take them from the whole layer's."""
        ops = self.ops
        i, layer = len(self.layers) - 1, self.layers[-1]
        r, H = len(batch.logits_rows), self.config.hidden_size
        layer.attn(ops, ws, h, batch, kv.layer(i), out=proj)
        if r == 0:   # a chunk in the middle of a prompt: its keys and values were all it gave
            return ws.get("last_h", 0, H)
        res = ops.gather_rows(residual, batch.logits_rows, out=ws.get("last_residual", r, H))
        part = ops.gather_rows(proj, batch.logits_rows, out=ws.get("last_proj", r, H))
        return self._after_attention(ws, i, layer, self._next_norms()[i], res, part, ws.get("last_h", r, H))

    def _layer_stack(self, ws: Workspace, t: int, kv: Any, count: int | None = None) -> Any:
        """The backend's one-call runner of the first `count` layers (all by default;
        ops.layer_stack) for t rows of ws and this KV cache, made once and kept while ws's
        buffers stay; None where the backend has none (or takes none of these layers) or a
        layer is not the standard attention with an MLP or a mixture-of-experts block (one
        with stack_moe)."""
        make = getattr(self.ops, "layer_stack", None)
        if make is None:
            return None
        count = len(self.layers) if count is None else count
        cache = self.__dict__.setdefault("_stacks", {})
        key = (id(ws), t, id(kv), count)
        hit = cache.get(key)
        ours = hit is not None and hit[0] is ws and hit[2] is kv and hit[3] is self.layers and hit[6] is self.lora
        if ours and (hit[1] == ws.generation or all(ws.holds(v) for v in hit[5])):
            hit[1] = ws.generation   # ws made buffers for something else since (the logits)
            return hit[4]
        layers = self.layers[:count]
        if not all(type(layer.attn) is Attention and (type(layer.mlp) is MLP or hasattr(layer.mlp, "stack_moe"))
                   for layer in layers):
            stack, views = None, []
        else:
            proj, h_buf, residual = _cached_views(self, ws, t, self._make_views)
            specs = [self._layer_spec(ws, t, kv, i, layer, next_norm)
                     for i, (layer, next_norm) in enumerate(zip(layers, self._next_norms()))]
            if self.lora is not None:   # [lora] the adapters' tables of each layer
                for spec, tables in zip(specs, self.lora.layers):
                    spec["lora"] = tables
            stack = make(specs, t, self.config.hidden_size, residual, proj, h_buf, self.config.rms_norm_eps)
            # one view of each workspace buffer the stack points into
            views = list({id(v.base): v for v in [proj, h_buf, residual] +
                          [spec[name] for spec in specs for name in _STACK_VIEWS
                           if spec[name] is not None]}.values())
        if len(cache) >= _VIEW_CACHE_ROWS:
            cache.clear()
        # ws and kv held: their ids stay theirs
        cache[key] = [ws, ws.generation, kv, self.layers, stack, views, self.lora]
        return stack

    @staticmethod
    def _layer_spec(ws: Workspace, t: int, kv: Any, i: int, layer: DecoderLayer,
                    next_norm: np.ndarray | None) -> dict[str, Any]:
        """What a layer stack needs of one layer: its weights, norms and workspace views."""
        a, m = layer.attn, layer.mlp
        q, k, v, _, _, _, attn, _, _ = _cached_views(a, ws, t, a._make_views)
        if isinstance(m, MLP):
            gate, up, _ = _cached_views(m, ws, t, m._make_views)
            mlp = dict(gate=m.gate, up=m.up, down=m.down, gate_out=gate, up_out=up,
                       act_out=gate, act=m.act, moe=None)   # the activation overwrites gate (see MLP)
        else:   # a mixture-of-experts block: (router, experts, top_k, norm_topk_prob)
            mlp = dict(gate=None, up=None, down=None, gate_out=None, up_out=None, act_out=None, act=None,
                       moe=m.stack_moe())
        k_cache, v_cache = kv.layer(i)
        return dict(
            reads_normed=layer.input_norm is not None, input_norm=layer.input_norm, q=a.q, k=a.k, v=a.v, o=a.o,
            q_out=q, k_out=k, v_out=v, attn_out=attn, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
            # the rotated q of a layer with q/k norms (it cannot overwrite q: OLMo 2's norm reads all of it)
            q_rot=None if a.q_norm is None else ws.get("q_rot", t, a.n_heads, a.head_dim),
            head_dim=a.head_dim, q_norm=a.q_norm, k_norm=a.k_norm, qk_norm_whole=a.qk_norm_whole,
            attn_eps=a.eps, k_cache=k_cache, v_cache=v_cache, inv_freq=a.inv_freq, interleaved=a.interleaved,
            window=a.window, scale=a.scale, softcap=a.softcap, rope_mscale=a.rope_mscale,
            post_attn_norm=layer.post_attn_norm, post_mlp_norm=layer.post_mlp_norm,
            residual_multiplier=layer.residual_multiplier, pre_mlp_norm=layer.pre_mlp_norm,
            next_norm=next_norm, **mlp)


def upload_weights(ops: Any, x: Any, memo: dict[int, Any]) -> Any:
    """x with every Linear (ops.upload_linear) and float array (ops.upload) in it, through
    dataclass fields, lists and tuples, on the backend. memo (id -> uploaded) uploads a
    shared weight once (tied embeddings); an object nothing in which changed is returned
    as it is (so the host backends keep every object, and its identity, unchanged)."""
    key = id(x)
    if key in memo:
        return memo[key][1]
    if isinstance(x, Linear):
        new: Any = ops.upload_linear(x)
    elif isinstance(x, np.ndarray):
        new = ops.upload(x)
    elif isinstance(x, (list, tuple)):
        items = [upload_weights(ops, v, memo) for v in x]
        new = x if all(a is b for a, b in zip(items, x)) else type(x)(items)
    elif is_dataclass(x) and not isinstance(x, type):
        changed = {f.name: v for f in fields(x) if (v := upload_weights(ops, getattr(x, f.name), memo))
                   is not getattr(x, f.name)}
        new = replace(x, **changed) if changed else x
    else:
        new = x   # numbers, strings, None
    memo[key] = (x, new)   # x is held so its id cannot be reused during the walk
    return new


def standard_layers(weights: WeightSource, config: ModelConfig, plus_one: bool = False,
                    **attention_options: Any) -> list[DecoderLayer]:
    """Pre-norm layers under the usual names (input_layernorm, post_attention_layernorm
    before the MLP), as Llama and most of its descendants have them."""
    H, layers = config.hidden_size, []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(DecoderLayer(
            attn=load_attention(weights, config, i, **attention_options),
            mlp=load_mlp(weights, config, p + "mlp."),
            input_norm=load_norm(weights, p + "input_layernorm.weight", H, plus_one),
            pre_mlp_norm=load_norm(weights, p + "post_attention_layernorm.weight", H, plus_one)))
    return layers
