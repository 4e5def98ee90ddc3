"""The memory half of the op set: where a backend's arrays live and how data gets there.

A backend owns its memory. The model runner (engine/runner.py) and the model ask the op
set, never NumPy, for every buffer: the workspace's activations (`empty`), the paged KV
cache (`kv_zeros`), the weights (`upload`, `upload_linear`, once at load), the step's
index arrays (`upload_batch`), the rows whose logits are wanted (`gather_rows`) or that
are given (`scatter_rows`), and the logits the host sampler reads (`to_host`). A device
backend says how much of its memory is free (`device_memory`), so that the KV cache is
sized to fit. A backend that can sample on its device says so in `sample`; one that can
replay a captured decode step returns its own executor from `step_executor`.

`HostMemory` is that interface for the backends whose arrays are NumPy arrays in host
memory (reference, cpu): uploads are the identity (the weights stay mmapped views, never
copied), and sampling is left to the host sampler. It is also the specification: a
device backend (ops/cuda.py) implements the same methods with the same meaning.
"""
from __future__ import annotations

import mmap
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:   # types only: ops sits below models and engine
    from ..engine.sampler import SampleResult, SequenceSampler
    from ..models.batch import Batch
    from ..weights import Linear
    from .workspace import Workspace


class StepExecutor(Protocol):
    """Runs one forward pass of a host-side Batch -> the backend's array (R, vocab) of
    logits, or (R, H) final hidden states with hidden_only. R = len(batch.logits_rows)."""

    def __call__(self, batch: "Batch", hidden_only: bool = False) -> Any: ...


class EagerStep:
    """The plain executor: the batch's index arrays to the backend, then model.forward.
    (A CUDA backend replaces it with one that replays a captured graph for decode steps
    of a known batch-size bucket, copying the step's ids, positions and block tables into
    the graph's static input buffers first.)"""

    def __init__(self, ops: Any, model: Any, kv: Any, workspace: "Workspace") -> None:
        self.ops, self.model, self.kv, self.workspace = ops, model, kv, workspace

    def __call__(self, batch: "Batch", hidden_only: bool = False) -> Any:
        return self.model.forward(self.ops.upload_batch(batch), self.kv, hidden_only=hidden_only,
                                  ws=self.workspace)


def host_kv_zeros(shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """A zero array (float32, or float16 for an f16 KV cache) whose memory is committed
    4 KiB page by page as blocks are written. (np.zeros would do the same but asks for
    transparent huge pages on large arrays, so one written block could commit 2 MiB, and
    RSS would depend on luck.)

    The mapping is private: mmap's default (MAP_SHARED) is backed by shmem, whose first
    write to a page cost 2.6-3.2 us against 1.5-2.0 us private (2-vCPU EPYC), and a prefill
    into fresh blocks writes ~46 KB a token (SmolLM2). Cold 512-token prefills: 1.00-1.05x,
    within the host's noise (benchmarks/bench_kv_first_touch.py)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    n = count * dtype.itemsize
    buf = mmap.mmap(-1, max(n, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):   # 4 KiB pages even where THP is "always"
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)


class DeviceMemoryError(ValueError, MemoryError):
    """What the model or its KV cache asked of a device's memory does not fit there; the
    message says how much was asked, how much is free, and what to change. A ValueError,
    so the CLI and the server report it like any bad option."""


def mem_size(n: int) -> str:
    """Bytes as a person reads them in an error: GiB, or MiB under one GiB."""
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


class HostMemory:
    """Memory methods of the host backends (mixed into ReferenceOps and CpuOps)."""

    def device_memory(self) -> tuple[int, int] | None:
        """(bytes available, bytes in all) of the backend's device; None for host memory,
        which the KV cache commits page by page as it is written (nothing to size ahead)."""
        return None

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """An uninitialised buffer of the backend (the Workspace's activations)."""
        return np.empty(shape, dtype)

    def kv_zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
        """Zeroed storage for one layer's K or V: (num_blocks, block_size, nkv, hd), float32
        or (an f16 KV cache) float16."""
        return host_kv_zeros(shape, dtype)

    def upload(self, x: np.ndarray) -> np.ndarray:
        """A constant the forward pass reads (norm weight, inv_freq, bias) as a backend
        array. Host backends: x itself (no copy)."""
        return x

    def upload_linear(self, w: "Linear") -> "Linear":
        """A weight matrix with its data (and bias) on the backend, same qtype and shape.
        Host backends: w itself (the mmapped view)."""
        return w

    def upload_batch(self, batch: "Batch") -> "Batch":
        """The Batch with every array field (token_ids, positions, seq_ids, block_tables,
        logits_rows, and any other a Batch carries) on the backend. Host backends: batch itself."""
        return batch

    def gather_rows(self, x: np.ndarray, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x (T, ...) -> x[rows] (R, ...), into out when given."""
        return np.take(x, rows, axis=0, out=out)

    def scatter_rows(self, x: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """x[rows] = values (R, ...) in place (rows distinct) -> x. (Image embeddings put
        into the batch's residual rows.)"""
        x[rows] = values
        return x

    def to_host(self, x: Any) -> np.ndarray:
        """A backend array as a host NumPy array (host backends: x itself, no copy; like
        every workspace view it stays valid until the next forward pass)."""
        return np.asarray(x)

    def sample(self, logits: Any, samplers: Sequence["SequenceSampler"],
               masks: Sequence[Any] | None = None,
               rows: Sequence[int] | None = None) -> list["SampleResult | Exception"] | None:
        """One token per row of logits (B, vocab) chosen on the device, or None: copy the
        logits to the host and let the host sampler choose (host backends always say None).
        masks: None, or per row a grammar's int32 bitmask row (or None) to apply first.
        rows: which rows of logits the samplers take, in their order (None: every row).
        A device backend returns None for any row it cannot serve; a row it served but
        could not sample gets, in its place, the exception the host's sampler raises."""
        return None

    def step_executor(self, model: Any, kv: Any, workspace: "Workspace") -> StepExecutor:
        """The executor the model runner calls for each forward pass."""
        return EagerStep(self, model, kv, workspace)
