"""A test backend whose arrays NumPy cannot read, to prove models and engine use only ops.

`OpaqueOps(inner)` runs every op on an inner host backend (cpu or reference), but its
arrays are `Opaque` boxes: they have a shape, views and reshape like a device array, and
any NumPy call on one (np.take, np.asarray, arithmetic) raises. A model whose forward
pass, or an engine whose runner, touched an array with NumPy instead of asking the op set
fails on it; one that only calls ops gets exactly the inner backend's numbers. Its
`sample` chooses plain-greedy rows "on the device" (argmax inside the box) and its
`step_executor` runs decode steps from static input buffers, as a CUDA backend's graph
replay would, so the engine's hooks for both are exercised too.
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Sequence

import numpy as np

from ellm.engine.sampler import SampleResult
from ellm.models.batch import Batch
from ellm.ops.memory import EagerStep
from ellm.ops.reference import Experts
from ellm.weights import Linear


class Opaque:
    """A device-array stand-in: shape, dtype, views and reshape, nothing NumPy can read."""

    __array_ufunc__ = None   # a ufunc (np.add, a * b) refuses it

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("a device array was handed to NumPy (models and engine must ask the ops)")

    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    dtype = property(lambda self: self._a.dtype)
    strides = property(lambda self: self._a.strides)
    nbytes = property(lambda self: self._a.nbytes)

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, index: Any) -> "Opaque":
        if isinstance(index, Opaque):
            raise TypeError("indexing by a device array: use ops.gather_rows")
        return Opaque(self._a[index])

    def reshape(self, *shape: Any) -> "Opaque":
        return Opaque(self._a.reshape(*shape))


class OpaqueOps:
    """The op set of `inner` (a host backend) on Opaque arrays; counts what crossed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = f"opaque({inner.name})"
        self.linear_adds_bias = inner.linear_adds_bias
        self._host: dict[int, tuple[Any, Any]] = {}   # id(device object) -> (it, its host twin)
        self.counts = {"to_host": 0, "sample": 0, "replayed": 0, "eager": 0}
        self.memory: tuple[int, int] | None = None   # what device_memory says: a test sets it

    def device_memory(self) -> tuple[int, int] | None:
        """(bytes available, bytes in all), as a device backend reports them; None: host memory."""
        return self.memory

    # the layers one op at a time: so the comparison with the cpu backend, which runs
    # them as one call (ops.layer_stack), also holds that call to the ops bit for bit
    layer_stack = None

    # -- memory --------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Opaque:
        return Opaque(self.inner.empty(shape, dtype))

    def kv_zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Opaque:
        return Opaque(self.inner.kv_zeros(shape, dtype))

    def upload(self, x: np.ndarray) -> Opaque:
        return Opaque(np.array(x))   # a copy, as a device upload is

    def upload_linear(self, w: Linear) -> Linear:
        return replace(w, data=self.upload(w.data), bias=None if w.bias is None else self.upload(w.bias))

    def upload_batch(self, batch: Batch) -> Batch:
        """Every array field (and dict of arrays: block_tables) of the batch, uploaded."""
        def up(v: Any) -> Any:
            if isinstance(v, np.ndarray):
                return self.upload(v)
            return {k: up(x) for k, x in v.items()} if isinstance(v, dict) else v
        return replace(batch, **{f.name: up(getattr(batch, f.name)) for f in fields(batch)})

    def gather_rows(self, x: Opaque, rows: Opaque, out: Opaque | None = None) -> Opaque:
        got = self.inner.gather_rows(self._unbox(x), self._unbox(rows), self._unbox(out))
        return out if out is not None else Opaque(got)

    def to_host(self, x: Opaque) -> np.ndarray:
        self.counts["to_host"] += 1
        return np.array(self._unbox(x))

    def sample(self, logits: Opaque, samplers: Sequence[Any], masks: Any = None,
               rows: Sequence[int] | None = None) -> list[SampleResult] | None:
        if not samplers or masks is not None or not all(s.plain_greedy for s in samplers):
            return None
        self.counts["sample"] += 1
        x = self._unbox(logits)
        ids = np.argmax(x if rows is None else x[np.asarray(rows)], axis=1)   # "on the device": only ids leave
        return [SampleResult(int(t), float("nan"), None) for t in ids]

    def step_executor(self, model: Any, kv: Any, workspace: Any) -> "StaticDecodeStep":
        return StaticDecodeStep(self, model, kv, workspace)

    # -- compute: every other op runs on the inner backend ------------------------------

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)
        if not callable(fn):
            return fn

        def run(*args: Any, **kwargs: Any) -> Any:
            got = fn(*(self._unbox(a) for a in args), **{k: self._unbox(v) for k, v in kwargs.items()})
            return self._box(got, list(args) + list(kwargs.values()))
        return run

    def _unbox(self, x: Any) -> Any:
        if isinstance(x, Opaque):
            return x._a
        if isinstance(x, (Linear, Experts)):
            hit = self._host.get(id(x))
            if hit is None or hit[0] is not x:
                if isinstance(x, Linear):
                    twin: Any = replace(x, data=self._unbox(x.data), bias=self._unbox(x.bias))
                else:
                    twin = Experts(*([self._unbox(m) for m in mats] for mats in (x.gate, x.up, x.down)))
                hit = self._host[id(x)] = (x, twin)
            return hit[1]
        if isinstance(x, (list, tuple)):
            return type(x)(self._unbox(v) for v in x)
        if isinstance(x, np.ndarray):
            raise TypeError("a host array was handed to a device op (it was never uploaded)")
        return x

    def _box(self, got: Any, args: list[Any]) -> Any:
        """The op's result as the caller's own out box when it is one, else a new box."""
        if isinstance(got, list):
            return [self._box(g, args) for g in got]
        if isinstance(got, np.ndarray):
            for a in _flat(args):
                if isinstance(a, Opaque) and a._a is got:
                    return a
            return Opaque(got)
        return got


def _flat(args: list[Any]) -> list[Any]:
    out: list[Any] = []
    for a in args:
        out.extend(_flat(list(a)) if isinstance(a, (list, tuple)) else [a])
    return out


class StaticDecodeStep(EagerStep):
    """Decode steps (one new token per sequence) run from static input buffers made once
    per batch size, filled in place before each run, as a captured CUDA graph's inputs
    are; any other batch runs eagerly."""

    def __init__(self, ops: OpaqueOps, model: Any, kv: Any, workspace: Any) -> None:
        super().__init__(ops, model, kv, workspace)
        self.static: dict[tuple[int, tuple[tuple[int, int], ...]], Batch] = {}

    def __call__(self, batch: Batch, hidden_only: bool = False) -> Any:
        n = len(batch.token_ids)
        decode = not hidden_only and n == len(batch.logits_rows) == int(batch.seq_ids.max()) + 1 \
            and np.array_equal(batch.seq_ids, np.arange(n)) \
            and batch.adapter_slots is None   # [lora] as ops/cuda_graphs.py: adapters run eagerly
        if not decode:
            self.ops.counts["eager"] += 1
            return super().__call__(batch, hidden_only)
        key = (n, tuple((w, t.shape[1]) for w, t in sorted(batch.block_tables.items())))
        static = self.static.get(key)
        if static is None:
            static = self.static[key] = self.ops.upload_batch(batch)
        for name in ("token_ids", "positions", "seq_ids", "logits_rows"):
            getattr(static, name)._a[...] = getattr(batch, name)   # copied in, as before a replay
        for w, t in batch.block_tables.items():
            static.block_tables[w]._a[...] = t
        self.ops.counts["replayed"] += 1
        return self.model.forward(static, self.kv, hidden_only=False, ws=self.workspace)
