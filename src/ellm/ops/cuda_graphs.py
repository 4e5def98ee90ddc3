"""CUDA graphs for decode steps: the step executor ops/cuda.py hands the model runner.

A decode step (one new token per sequence, every row's logits wanted) of B sequences is
padded to the next bucket (1, 2, 4, ..., 64) and replayed from a graph captured once per
bucket. A graph's kernel arguments are frozen at capture, so everything that changes
from step to step lives in static device buffers that the step overwrites before the
replay: token ids, positions, sequence rows and block tables, copied in with one
host-to-device copy. Padding rows point at block tables full of -1: they write no cache
slot and read no key (csrc/cuda/attention.cu), and their logits are never looked at.

Only RawKernels run inside a captured step (cuBLAS serves only products of more than 64
tokens, which a decode step never has), and nothing is allocated during a capture: the graphs share one workspace,
sized for the largest bucket by an eager warm-up before the first capture. Any other
batch (prefill, mixed, hidden states) runs eagerly, as does everything when capture is
unavailable (`enabled=False`, or CuPy without stream capture): the same kernels either
way, so a step's logits are the same replayed or eager. On compute capability 9.0+ the
captured kernels are programmatic dependent launches (ops/cuda_pdl.py: a kernel's blocks
may be scheduled before the previous kernel ends, and wait for it in the kernel); a
capture that fails with them is retried once with plain launches.

`launch_decode` starts a step without waiting for it: its inputs go up from page-locked
host memory, its rows are sampled on the device (the graph's own argmax for plain greedy
rows) and the ids come back into page-locked memory, all as work on the step's stream,
and the next step's token ids may be taken from this one's on the device.
So the engine can launch step N+1 before it reads step N's tokens, and its host work
(detokenizing, stops, the next batch) runs while the GPU computes.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from ..models.batch import Batch
from .cuda_sampling import read_logprob_records
from .workspace import Workspace

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
log = logging.getLogger(__name__)


def bucket_for(n: int) -> int | None:
    """The smallest bucket holding n rows, or None when n is larger than every bucket."""
    return next((b for b in BUCKETS if b >= n), None)


_ARANGE = np.arange(BUCKETS[-1], dtype=np.int32)
_ARANGE_BYTES = _ARANGE.tobytes()


def _is_arange(a: np.ndarray, t: int) -> bool:
    """a == 0, 1, ..., t - 1 (the engine's int32 arrays compared as bytes: a few times
    faster than np.array_equal, and this runs every step)."""
    if a.dtype == np.int32 and a.ndim == 1 and a.flags.c_contiguous:
        return a.tobytes() == _ARANGE_BYTES[:4 * t]
    return bool(np.array_equal(a, _ARANGE[:t]))


def is_decode_step(batch: Batch) -> bool:
    """One token per sequence, each its own row of the block tables, every row's logits
    wanted: the shape a captured graph replays (host arrays)."""
    t = len(batch.token_ids)
    return (0 < t <= BUCKETS[-1] and len(batch.logits_rows) == t
            and _is_arange(batch.logits_rows, t) and _is_arange(batch.seq_ids, t)
            and all(tbl.shape[0] == t for tbl in batch.block_tables.values()))


def input_layout(b: int, widths: dict[int, int]) -> list[tuple[str, Any, int]]:
    """(name, window or None, element count) of the int32 inputs of bucket b, in the order
    they sit in its one static buffer; widths: block-table columns per window."""
    parts: list[tuple[str, Any, int]] = [("token_ids", None, b), ("positions", None, b),
                                         ("seq_ids", None, b), ("logits_rows", None, b)]
    return parts + [("table", w, b * widths[w]) for w in sorted(widths)]


def pack_inputs(batch: Batch | None, b: int, widths: dict[int, int]) -> np.ndarray:
    """The int32 host image of bucket b's static buffer for a decode `batch` (host
    arrays; None: all padding). Padding rows: token 0 at position 0, block tables of -1."""
    t = 0 if batch is None else len(batch.token_ids)
    chunks = []
    for name, w, n in input_layout(b, widths):
        a: np.ndarray   # (b, width) for a table, else (b,)
        if name == "table":
            a = np.full((b, widths[w]), -1, np.int32)
            if batch is not None:
                tbl = batch.block_tables[w]
                a[:t, :tbl.shape[1]] = tbl
        elif name in ("seq_ids", "logits_rows"):
            a = np.arange(b, dtype=np.int32)
        else:
            a = np.zeros(b, np.int32)
            if batch is not None:
                a[:t] = getattr(batch, name)
        chunks.append(a.reshape(-1))
    return np.concatenate(chunks)


def pinned_empty(cp: Any, n: int, dtype: Any) -> np.ndarray:
    """A host array of n elements in page-locked memory: a copy from or to it on a stream
    is asynchronous (from pageable memory the driver may wait for the stream first)."""
    dtype = np.dtype(dtype)
    try:
        mem = cp.cuda.alloc_pinned_memory(max(n, 1) * dtype.itemsize)
        return np.frombuffer(mem, dtype, n)   # keeps mem alive
    except (AttributeError, TypeError, cp.cuda.runtime.CUDARuntimeError) as e:
        # still correct from pageable memory, only the copies may wait for the stream
        log.warning("page-locked host memory unavailable (%s: %s); steps copy from pageable memory",
                    type(e).__name__, e)
        return np.empty(n, dtype)


# cudaMemcpyKind (a stable part of CUDA's runtime API)
MEMCPY_KINDS = {"HostToDevice": 1, "DeviceToHost": 2, "DeviceToDevice": 3}


class InputImage:
    """Bucket b's host image of its static buffer, kept and refilled in place each step:
    what pack_inputs makes, without building it anew (the seq_ids and logits_rows parts
    never change). out: the array to keep it in (page-locked memory), else a new one."""

    def __init__(self, b: int, widths: dict[int, int], out: np.ndarray | None = None) -> None:
        image = pack_inputs(None, b, widths)
        if out is not None:
            out[:] = image
            image = out
        self.b, self.buf, self.ptr = b, image, image.ctypes.data
        self.copied: Any = None   # the event after the last copy of buf to the device
        self.parts = unpack_inputs(self.buf, b, widths)   # views into buf
        self.filled = 0   # rows holding a batch's values (the rest are padding)
        # per window, the leading columns that may hold blocks (the rest are -1): a table
        # is as wide as a sequence's largest possible table, mostly unused
        self.used = {w: 0 for w in widths}

    def fill(self, batch: Batch) -> np.ndarray:
        t, p, filled = len(batch.token_ids), self.parts, self.filled
        p.token_ids[:t] = batch.token_ids
        p.positions[:t] = batch.positions
        if filled > t:   # rows a larger batch used before go back to padding
            p.token_ids[t:filled] = 0
            p.positions[t:filled] = 0
        for w, dst in p.block_tables.items():
            src, used = batch.block_tables[w], self.used[w]
            width = src.shape[1]
            dst[:t, :width] = src
            if used > width:
                dst[:t, width:used] = -1
            if filled > t:
                dst[t:filled, :used] = -1
            self.used[w] = width
        self.filled = t
        return self.buf


def unpack_inputs(buf: Any, b: int, widths: dict[int, int]) -> Batch:
    """The Batch of views into a packed buffer (device or host) of bucket b."""
    views: dict[str, Any] = {}
    tables: dict[int, Any] = {}
    off = 0
    for name, w, n in input_layout(b, widths):
        v = buf[off:off + n]
        off += n
        if name == "table":
            tables[w] = v.reshape(b, widths[w])
        else:
            views[name] = v
    return Batch(views["token_ids"], views["positions"], views["seq_ids"], tables, views["logits_rows"])


class _Graph:
    """One bucket's captured step: its static inputs, its graph and its output view."""

    def __init__(self, b: int, graph: Any, ints_dev: Any, batch: Batch, logits: Any, argmax: Any,
                 sampled: Any, keep: list[Any], kernels: int) -> None:
        self.b, self.graph, self.ints_dev, self.batch, self.logits = b, graph, ints_dev, batch, logits
        self.keep = keep
        # the addresses the step's copies use, looked up once
        self.ints_ptr, self.argmax_ptr = int(ints_dev.data.ptr), int(argmax.data.ptr)
        self.sampled_ptr = int(sampled.data.ptr)
        self.argmax = argmax     # each row's greedy token, computed in the graph (ops.argmax_rows)
        self.kernels = kernels   # ellm's kernel launches in the step (CuPy's own copies aside)
        self.sampled = sampled   # each row's token when launch_decode samples after the replay
        self.last: PendingIds | None = None   # launch_decode's, when the latest replay was one


class _IdsSlot:
    """Page-locked room for one launched step's ids and logprob records, and which
    PendingIds holds it now."""

    def __init__(self, cp: Any, b: int) -> None:
        self.cp = cp
        self.host = pinned_empty(cp, b, np.int32)
        self.host_ptr = self.host.ctypes.data
        self.records: np.ndarray | None = None   # grown to the largest records seen
        self.event = cp.cuda.Event(disable_timing=True)
        self.owner: PendingIds | None = None

    def records_room(self, words: int) -> np.ndarray:
        if self.records is None or self.records.size < words:
            self.records = pinned_empty(self.cp, max(words, 1024), np.int32)
        return self.records


class _Staging:
    """Page-locked room for the bytes of one upload (grown as needed), and the event after
    its last copy to the device."""

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.copied: Any = None


def _take_turn(ring: list[Any], cp: Any) -> Any:
    """The first of the host buffers used in turn (it goes to the back of the ring), once
    the copy last made from it has run; its `copied` event is then recorded anew."""
    item = ring.pop(0)
    ring.append(item)
    if item.copied is None:
        item.copied = cp.cuda.Event(disable_timing=True)
    else:
        item.copied.synchronize()   # its copy (len(ring) uploads ago) has left it
    return item


class PendingIds:
    """The token ids of a decode step launched by `GraphStep.launch_decode`: on the device
    (at `dev_ptr`, until the same graph runs again) and, once `wait` returns, on the host,
    with the logprobs of the rows that asked for them (`logprobs`, per row None or (the
    token's logprob, its top ones)) and, per row, the error of one whose logprobs could
    not be taken (`errors`, the host sampler's; None when there is none)."""

    def __init__(self, graph: _Graph, slot: _IdsSlot, rows: int, dev_ptr: int,
                 plan: Any = None, records: Any = None) -> None:
        self._graph, self._slot, self.rows, self.dev_ptr = graph, slot, rows, dev_ptr
        self._plan, self._records = plan, records   # (the device records kept until copied)
        self.errors: list[Exception | None] | None = None
        self.logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
        slot.owner = self

    @property
    def feeds_next(self) -> bool:
        """Whether a step launched now may take these ids as its tokens: no replay of the
        same graph came after (an engine.logits() call of one token could)."""
        return self._graph.last is self

    def wait(self) -> np.ndarray:
        """Blocks until the step and the copy of its ids are done -> int32 (rows,)."""
        if self._slot.owner is not self:
            raise RuntimeError("these token ids were overwritten: a step's ids must be read before the "
                               "second launch after it")
        self._slot.event.synchronize()
        if self._plan is not None and self.logprobs is None:
            self._read_records()
        return self._slot.host[:self.rows].copy()

    def _read_records(self) -> None:
        plan, shape = self._plan, self._records.shape
        assert self._slot.records is not None
        records = self._slot.records[:shape[0] * shape[1]].reshape(shape)
        self.logprobs = [None] * self.rows
        errors: list[Exception | None] = [None] * self.rows
        for b, got in zip(plan.want, read_logprob_records(records, plan.asked)):
            if isinstance(got, Exception):
                errors[b] = got
            else:
                self.logprobs[b] = got
        self.errors = errors if any(errors) else None
        self._records = None


class GraphStep:
    """The runner's step executor on CUDA (ops/memory.py StepExecutor). `use_graphs`
    can be switched off at any time (the benchmark compares both)."""

    def __init__(self, ops: Any, model: Any, kv: Any, workspace: Workspace, enabled: bool = True) -> None:
        self.ops, self.model, self.kv, self.workspace = ops, model, kv, workspace
        self.use_graphs = enabled and hasattr(ops.cp.cuda.Stream, "begin_capture")
        # static block-table widths: a sequence holds at most its pool's blocks
        self.widths = {w: int(kv.num_blocks[w]) for w in kv.windows}
        self.graph_ws: Workspace | None = None
        self.graphs: dict[int, _Graph] = {}
        # per bucket, two host images of its inputs, used in turn: one may still be on its
        # way to the device while the next step's is filled
        self.images: dict[int, list[InputImage]] = {}
        self.ids_slots: dict[int, list[_IdsSlot]] = {}   # per bucket, launch_decode's ids, in turn
        # sampling parameters on their way up, in turn: a launched step makes up to two
        # uploads (its logprob rows, its samplers' arrays), each copied after the step's
        # replay, so a buffer is taken again only two steps later, once that step is read
        self.staging = [_Staging() for _ in range(4)]
        self.stats = {"replays": 0, "eager": 0, "captures": 0, "dependent_captures": 0, "fed": 0}

    @property
    def overlaps(self) -> bool:
        """Whether launch_decode runs steps on the device while the host goes on."""
        return self.use_graphs

    # launch_decode's penalties count the tokens of the step launched before (`after`),
    # which the samplers have not seen yet: penalised rows may run ahead too
    counts_pending_tokens = True
    @property
    def returns_logprobs(self) -> bool:
        """Whether launch_decode takes rows asking for logprobs (PendingIds.logprobs): unless
        ELLM_CUDA_LOGPROBS=0 sends them to the host."""
        return bool(self.ops.device_logprobs)

    def __call__(self, batch: Batch, hidden_only: bool = False) -> Any:
        ops = self.ops
        ops.graph_argmax = None   # set again only by a replay
        with ops.stream:
            if not hidden_only and self._replayable(batch):
                g = self._guarded(batch, None)
                if g is not None:
                    t = len(batch.token_ids)
                    logits = g.logits[:t]
                    # plain greedy rows then need no sampling launch: ops.sample reads these
                    ops.graph_argmax = (logits, g.argmax[:t])
                    return logits
            self.stats["eager"] += 1
            return self.model.forward(ops.upload_batch(batch), self.kv, hidden_only=hidden_only,
                                      ws=self.workspace)

    def launch_decode(self, batch: Batch, samplers: Sequence[Any],
                      after: PendingIds | None = None) -> PendingIds | None:
        """Replays the decode step of `batch`, samples its rows on the device (row i by
        samplers[i], ops.sample_ids: plain greedy rows take the graph's own argmax) and
        starts the copy of the ids to the host, without waiting: -> what to wait for, or
        None when the step is not one a graph replays (the caller runs it through
        __call__). after: the step launched just before, with the same rows in the same
        order, whose ids are this step's token ids: copied on the device
        (batch.token_ids are placeholders then), and which the penalties count although
        the samplers have not seen them yet. Rows asking for logprobs get them from the
        device too (ops.logprob_records: a record a row comes back, not the row)."""
        ops = self.ops
        ops.graph_argmax = None
        if not self._replayable(batch):
            return None
        t = len(batch.token_ids)
        if len(samplers) != t:
            raise ValueError(f"launch_decode: {len(samplers)} samplers for {t} rows")
        if after is not None and not (after.feeds_next and after.rows == t):
            raise ValueError("launch_decode: `after` must be the step launched last on these rows")
        with ops.stream:
            g = self._guarded(batch, after)
            if g is None:
                return None
            ids_ptr, ids = g.argmax_ptr, g.argmax
            plan = ops.logprobs_before_sampling(g.logits[:t], samplers, upload=self._upload_staged)
            if not all(s.argmax_choice for s in samplers):
                # after: this step's tokens (the ids at the head of its inputs) are not yet in
                # the samplers, so the penalties take them from there
                ops.sample_ids(g.logits[:t], samplers, out=g.sampled[:t], upload=self._upload_staged,
                               pending=None if after is None else g.ints_dev[:t])
                ids_ptr, ids = g.sampled_ptr, g.sampled
            records = None if plan is None else ops.logprob_records(plan, ids[:t])
            slots = self.ids_slots.get(g.b)
            if slots is None:
                slots = self.ids_slots[g.b] = [_IdsSlot(ops.cp, g.b), _IdsSlot(ops.cp, g.b)]
            slot = slots[0]
            slots.reverse()   # the other one next time: this step's ids stay until the one after
            self._copy(slot.host_ptr, ids_ptr, 4 * t, "DeviceToHost")
            if records is not None:
                room = slot.records_room(int(records.size))
                self._copy(room.ctypes.data, int(records.data.ptr), int(records.nbytes), "DeviceToHost")
            slot.event.record(ops.stream)
            g.last = PendingIds(g, slot, t, ids_ptr, plan, records)
        return g.last

    def _upload_staged(self, host: np.ndarray) -> Any:
        """host's bytes as a new device array, copied on the stream from page-locked
        memory (buffers in turn: the host goes on while the copy waits its turn)."""
        ops = self.ops
        st = _take_turn(self.staging, ops.cp)
        n = int(host.nbytes)
        if st.buf is None or st.buf.nbytes < n:
            st.buf = pinned_empty(ops.cp, max(n, 4096), np.uint8)
        st.buf[:n] = host.view(np.uint8).reshape(-1)
        dev = ops.cp.empty(n, np.uint8)
        self._copy(int(dev.data.ptr), st.buf.ctypes.data, n, "HostToDevice")
        st.copied.record(ops.stream)
        return dev

    def _replayable(self, batch: Batch) -> bool:
        # [lora] a step with adapters runs eagerly (the captured graphs hold no adapter slots);
        # [trace] so does a pass being recorded (a replay would tell the recorder nothing)
        return (self.use_graphs and batch.adapter_slots is None
                and getattr(self.model, "recorder", None) is None and is_decode_step(batch)
                and self._fits(batch))

    def _guarded(self, batch: Batch, after: PendingIds | None) -> _Graph | None:
        """_replay, falling back when capture fails: once more with plain launches where
        dependent launches were used, then eager for good (None)."""
        ops = self.ops
        try:
            return self._replay(batch, after)
        except Exception as e:
            if ops.dependent_launcher is not None:
                # capture once more with plain launches before giving graphs up
                log.warning("CUDA graph capture with programmatic dependent launches failed "
                            "(%s: %s); capturing with plain launches", type(e).__name__, e)
                ops.dependent_launcher = None
                self.graphs.clear()
                try:
                    return self._replay(batch, after)
                except Exception as e2:
                    e = e2
            # capture not supported here: eager from now on
            log.warning("CUDA graph capture failed (%s: %s); decode steps run eagerly",
                        type(e).__name__, e)
            self.use_graphs = False
            self.graphs.clear()
            return None

    def _fits(self, batch: Batch) -> bool:
        return all(w in self.widths and tbl.shape[1] <= self.widths[w]
                   for w, tbl in batch.block_tables.items())

    # -- static inputs ---------------------------------------------------------------------

    def _host_inputs(self, batch: Batch | None, b: int) -> np.ndarray:
        return pack_inputs(batch, b, self.widths)

    def _upload_inputs(self, g: _Graph, batch: Batch) -> None:
        """The batch's inputs into the graph's static buffer: filled into the bucket's
        host image not used last time, then one asynchronous copy on the stream."""
        b, ops = g.b, self.ops
        images = self.images.get(b)
        if images is None:
            n = int(g.ints_dev.size)
            images = self.images[b] = [InputImage(b, self.widths, pinned_empty(ops.cp, n, np.int32))
                                       for _ in range(2)]
        image = _take_turn(images, ops.cp)
        buf = image.fill(batch)
        self._copy(g.ints_ptr, image.ptr, buf.nbytes, "HostToDevice")
        image.copied.record(ops.stream)

    def _copy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        self.ops.cp.cuda.runtime.memcpyAsync(dst, src, nbytes, MEMCPY_KINDS[kind], self.ops.stream.ptr)

    def _static_batch(self, ints_dev: Any, b: int) -> Batch:
        return unpack_inputs(ints_dev, b, self.widths)

    # -- capture and replay ------------------------------------------------------------------

    def _replay(self, batch: Batch, after: PendingIds | None = None) -> _Graph:
        t = len(batch.token_ids)
        b = bucket_for(t)
        assert b is not None
        g = self.graphs.get(b) or self._capture(b)
        self._upload_inputs(g, batch)
        if after is not None:   # this step's tokens are that step's ids, still on the device
            self._copy(g.ints_ptr, after.dev_ptr, 4 * t, "DeviceToDevice")
            self.stats["fed"] += 1
        g.graph.launch(self.ops.stream)
        g.last = None   # its argmax now holds this step's ids
        self.stats["replays"] += 1
        return g

    def _capture(self, b: int) -> _Graph:
        ops, cp = self.ops, self.ops.cp
        if self.graph_ws is None:
            # size every buffer for the largest bucket first (no allocation during capture)
            self.graph_ws = Workspace(ops)
            big = BUCKETS[-1]
            warm = cp.asarray(self._host_inputs(None, big))
            self.model.forward(self._static_batch(warm, big), self.kv, ws=self.graph_ws,
                               greedy_ids=cp.empty(big, np.int32))
        ints_dev = cp.asarray(self._host_inputs(None, b))
        argmax, sampled = cp.empty(b, np.int32), cp.zeros(b, np.int32)
        static = self._static_batch(ints_dev, b)
        self.model.forward(static, self.kv, ws=self.graph_ws, greedy_ids=argmax)   # compiles what is not yet
        ops.stream.synchronize()
        keep: list[Any] = []
        ops.capture_keep = keep
        # the step's kernels as programmatic dependent launches where the GPU has them
        # (ops/cuda_pdl.py): the gaps between a step's ~5 kernels a layer shrink
        ops.dependent_launch = ops.dependent_launcher is not None
        launched = ops.launches
        try:
            ops.stream.begin_capture()
            try:
                # each row's greedy token in the head's own launch where it can (mmv.cu)
                logits = self.model.forward(static, self.kv, ws=self.graph_ws, greedy_ids=argmax)
            finally:
                graph = ops.stream.end_capture()
        finally:
            ops.capture_keep = None
            ops.dependent_launch = False
        if ops.dependent_launcher is not None:
            self.stats["dependent_captures"] += 1
        g = self.graphs[b] = _Graph(b, graph, ints_dev, static, logits, argmax, sampled, keep,
                                    ops.launches - launched)
        self.stats["captures"] += 1
        return g
