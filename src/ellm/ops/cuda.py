"""The CUDA backend: the op set of ops/reference.py and the memory interface of
ops/memory.py on an NVIDIA GPU, through CuPy RawKernels.

Weights are uploaded once (quantized GGUF blocks stay quantized and are dequantized in
the kernels), activations and the paged KV cache live on the device, sampling runs on
the device (only token ids come back), and decode steps are replayed as CUDA graphs, one
per batch-size bucket (ops/cuda_graphs.py). The kernels are the .cu files in csrc/cuda/,
shipped in the package (ellm/cuda/) and compiled at run time by NVRTC through CuPy's
RawModule, which caches the result per device: users need no nvcc.

This module imports without CuPy; `CudaOps()` says what is missing (CuPy, a GPU) and
what to install. ops/cuda_kernels.py holds the kernel files' catalogue, how their source
is found and compiled in units, and the row layout the quantized kernels read.
docs/gpu.md describes the kernels and what has been checked on hardware.
"""
from __future__ import annotations

import functools
import logging
import math
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Collection, NamedTuple, Sequence

import numpy as np

from ..formats.ggml_types import GGMLType
from ..models.batch import Batch
from ..weights import Linear
from .cuda_kernels import (INSTALL_HINT, KERNEL_UNITS, LOAD_KERNEL_FILES, MMV_X4_TYPES, NVRTC_OPTIONS,
                           SPLIT_BUFFER_MAX, SPLIT_TYPES, WEIGHT_TYPES, CudaUnavailableError, KernelUnit, ceil_div,
                           import_cupy, kernel_units, rows_split, unit_source)
from .cuda_pdl import DependentLauncher
from .cuda_sampling import LOGPROB_HEAD, LogprobPlan, mask_allows_any, mask_table, read_logprob_records
from .memory import DeviceMemoryError, mem_size
from .reference import KV_BF16, Experts, check_qk_norms

log = logging.getLogger(__name__)

# Above this many tokens a product runs on the tensor cores (bf16 inputs); at or below it
# on the f32 GEMV kernels. A fixed count, so a decode step's results never depend on how
# many sequences share it (decode batches are at most this large: the graph buckets).
GEMM_MIN_TOKENS = 64
GEMV_TOKENS, GEMV_WARPS = 8, 4          # as in linear.cu
FUSED_WARPS = 4                         # as in linear.cu (the fused decode kernels)
# Decode products of these types on the tensor cores (mmv.cu: every weight read once per
# step, whatever the batch) when K % 32 == 0; F32 rows stay on linear.cu's kernels.
MMV_TYPES = frozenset(q for q in WEIGHT_TYPES if q != GGMLType.F32)
MMV_ROWS, MMV_TASKS, MMV_THREADS = 16, 8, 256   # rows (tasks) a tile; as in mmv.cu
# Above this many tokens a block of mmv.cu takes two tiles (the `x2` kernels): it reads the
# activations once for both, which halves the reads that dominate at 32-64 tokens; at
# fewer, one tile a block keeps twice the blocks (batch 1). The same bits either way.
# ELLM_CUDA_MMV_X2=0: one tile a block for every step (the benchmark's comparison).
MMV_X2_ABOVE = 16
MMV_X2_ENV = "ELLM_CUDA_MMV_X2"
# Above this many tokens a block of these types' kernels takes four tiles (the `x4`
# kernels: the activations read a quarter as often as with one; the other types' four-tile
# kernels would spill registers). The same bits again. ELLM_CUDA_MMV_X4=0: two at most.
MMV_X4_ABOVE = 32
MMV_X4_ENV = "ELLM_CUDA_MMV_X4"
# mmv3's and mmv_glu's blocks resident on an SM (one tile: <= 128 registers, 2 blocks of
# 256 threads; two or four tiles: 1). A product with more row groups than fit at once (a
# vocabulary head: 3,072 groups on SmolLM2, 8,016 on Llama 3; Llama-3-8B's gate/up: 1,792)
# runs on that many blocks, each walking its groups with the next one's first weights
# asked for ahead, instead of in waves of short blocks. The same sums.
# ELLM_CUDA_MMV_LOOP=0: one block a group (the comparison).
MMV3_RESIDENT = {1: 2, 2: 1, 4: 1}
MMV_LOOP_ENV = "ELLM_CUDA_MMV_LOOP"
# ELLM_CUDA_MMV=0: decode products on linear.cu's f32 kernels for every type (the benchmark
# compares both; a fallback should mmv.cu misbehave on some GPU)
MMV_ENV = "ELLM_CUDA_MMV"
# ELLM_CUDA_FUSED=0: decode runs one kernel per op (the benchmark compares both)
FUSED_ENV = "ELLM_CUDA_FUSED"
# ELLM_CUDA_LOGPROBS=0: rows asking for logprobs or under a grammar are sampled on the host
# from a copy of their logits and never run ahead, as before sample.cu took them (the
# benchmark compares both; a fallback should logprob_rows misbehave on some GPU)
LOGPROBS_ENV = "ELLM_CUDA_LOGPROBS"
# ELLM_CUDA_PDL=0: a captured decode step's kernels launched plainly, not as programmatic
# dependent launches (ops/cuda_pdl.py; the benchmark compares both)
PDL_ENV = "ELLM_CUDA_PDL"
GLU_ACTS = {"silu": 0, "gelu_tanh": 1}
GEMM_TILE = 64                          # as in linear.cu
ARGMAX_THREADS, ARGMAX_CHUNK = 256, 2048   # as in sample.cu
# Keys per attention chunk: small for decode (more blocks at batch 1), large for prefill
# (bounded partial buffers). Fixed per side of GEMM_MIN_TOKENS, like the products.
DECODE_CHUNK, PREFILL_CHUNK = 64, 512
ATTN_BLOCKS_PER_SM = 4   # attention.cu's __launch_bounds__: blocks of attn_partial / attn_decode resident an SM
HEAD_DIM_MAX = 256
FA_HEAD_DIM_MAX = 256   # attn_prefill (tensor cores): head_dim % 32 == 0 up to this; else attn_partial
FA_OUT = 128            # attn_prefill's output dims a block: above, attn_prefill_wide on ceil(hd / FA_OUT) blocks
FA_WARPS = 4            # attn_prefill's warps a block (16 query rows each, sharing K and V)
FA_WIDE_WARPS = 2       # attn_prefill_wide's (Q of 32 rows x 256 dims fills the shared memory)
# ELLM_CUDA_FA_WARPS=1 (read when the backend is made): a warp a block, each staging every
# key and value itself, as until 2026-12-06 (the device check's comparison; the same bits)
FA_WARPS_ENV = "ELLM_CUDA_FA_WARPS"
ELEMENTWISE_THREADS = 256
MOE_ROUTE_THREADS, MOE_EXPERTS_MAX, MOE_ENTRIES_MAX, MOE_TOP_K_MAX = 32, 4096, 4096, 64   # as in elementwise.cu
# At most this much scratch for a mixture-of-experts block's rows (its entries' gate/up and
# down outputs): a prefill's tokens are routed as many at a time as it and moe_route's layout allow
# (at least 64), so an expert's rows are read once for all of them (once per 64 of its own)
MOE_SCRATCH_BYTES = 128 << 20
_NULL = np.uintp(0)                     # a null pointer kernel argument (no bias)


class ExpertTables(NamedTuple):
    """A mixture-of-experts layer's matrices as moe.cu reads them: per projection its first
    expert's matrix (the base) and a device table of each expert's offset from it in bytes
    (int64), one row stride for gate and up and one for down, the kernels' type names and
    the shape."""
    gate: tuple[Any, Any]
    up: tuple[Any, Any]
    down: tuple[Any, Any]
    gate_up_stride: int
    down_stride: int
    gate_type: str
    down_type: str
    num_experts: int
    hidden: int
    ffn: int


# cuBLAS (cublasGemmEx, the API's constants) for prefill products: bf16 inputs, f32
# accumulation and output, as gemm_<type> means, near the tensor cores' peak
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1
# ELLM_CUDA_CUBLAS=0: every prefill product on linear.cu's gemm kernels
CUBLAS_ENV = "ELLM_CUDA_CUBLAS"
# A quantized matrix of at most this many weights is dequantized to bf16 (a grow-only
# scratch) for cuBLAS; a larger one (a vocabulary head) stays on gemm_<type>
CUBLAS_DEQUANT_MAX = 64 << 20

def _on_stream(method: Any) -> Any:
    """Runs an op on the backend's stream, whoever calls it (the engine thread, a test),
    so every copy and kernel of the backend is ordered on that one stream."""
    @functools.wraps(method)
    def run(self: "CudaOps", *args: Any, **kwargs: Any) -> Any:
        with self.stream:
            return method(self, *args, **kwargs)
    return run



class CudaOps:
    """The op set on one CUDA device. Arrays are CuPy arrays (float32 activations, int32
    indices); every op takes an optional `out` and returns it, like ops.cpu.CpuOps."""

    name = "cuda"
    linear_adds_bias = True   # the product kernels add Linear.bias in their epilogue

    def __init__(self, activations: str = "int8", device_id: int = 0, graphs: bool = True) -> None:
        cp = self.cp = import_cupy()
        # Quantized weights always meet f32 activations here (dequantized in the kernel),
        # so `activations` changes nothing on this backend.
        self.activations = activations
        self.device = cp.cuda.Device(device_id)
        self.device.use()
        self.graphs = graphs
        # the fused decode kernels through ops/fused_stack.py (layer_stack); off: one per op
        self.fused = os.environ.get(FUSED_ENV, "1") != "0"
        self.use_mmv = os.environ.get(MMV_ENV, "1") != "0"
        self.mmv_x2 = os.environ.get(MMV_X2_ENV, "1") != "0"
        self.mmv_x4 = self.mmv_x2 and os.environ.get(MMV_X4_ENV, "1") != "0"
        self.mmv_loop = os.environ.get(MMV_LOOP_ENV, "1") != "0"
        self.fa_warps = 1 if os.environ.get(FA_WARPS_ENV, str(FA_WARPS)) == "1" else FA_WARPS
        self.device_logprobs = os.environ.get(LOGPROBS_ENV, "1") != "0"
        self._cublas: Any = None   # (module, handle) once a prefill product first asks
        self.use_cublas = os.environ.get(CUBLAS_ENV, "1") != "0"
        # One stream for everything (kernels, copies, graph replays; see _on_stream): a
        # graph is captured on a stream of its own, non-blocking as CuPy advises.
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.num_sms = int(self.device.attributes["MultiProcessorCount"])
        cc = int(self.device.compute_capability)
        if cc < 80:
            raise CudaUnavailableError(f"the GPU has compute capability {cc / 10:.1f}; ellm's kernels "
                                       "need 8.0 or newer (Ampere, Hopper, Blackwell); use device='cpu'")
        self._modules: dict[KernelUnit, Any] = {}
        self._kernels: dict[str, Any] = {}
        # programmatic dependent launches (sm_90+) for the kernels of a captured decode
        # step: cuda_graphs.py sets `dependent_launch` while it captures
        self.dependent_launcher = self._dependent_launcher(cc)
        self.dependent_launch = False
        self.launches = 0   # kernels launched so far (cuda_graphs.py counts a step's)
        # (logits, greedy ids) of the decode step just replayed: its graph ends with
        # argmax_rows, so sample() needs no launch for plain greedy rows of those logits
        self.graph_argmax: tuple[Any, Any] | None = None
        self._scratch: dict[str, Any] = {}
        self.weight_bytes = 0   # uploaded so far (upload, upload_linear), for a clear error when they do not fit
        self.capture_keep: list[Any] | None = None   # set while a graph is captured
        # per SequenceSampler: its seed and the draws made so far (device sampling)
        self._rng_state: "weakref.WeakKeyDictionary[Any, list[int]]" = weakref.WeakKeyDictionary()
        self._split_buffer = np.empty(0, np.uint8)   # host memory upload_linear splits rows in
        # id(Experts) -> (the Experts, its device tables or None: _expert_tables), the
        # Experts held so its id cannot be reused
        self._expert_tables_of: dict[int, tuple[Experts, ExpertTables | None]] = {}
        self.compile_kernels()

    # -- kernels -----------------------------------------------------------------------

    def compile_kernels(self, files: Sequence[str] = LOAD_KERNEL_FILES,
                        qtypes: Collection[GGMLType] | None = None) -> None:
        """Compiles the kernel files every model needs now (lora.cu when an adapter first
        asks), so that a CuPy which cannot compile them (no NVRTC, one built for another
        CUDA) fails the load, saying what to do, rather than the first request. CuPy
        keeps the binaries on disk: a later load of any model reads them back. The units
        (KERNEL_UNITS: linear.cu and mmv.cu a weight type each, the other files whole)
        compile side by side (CuPy calls NVRTC without the GIL), so a first load waits
        for the longest of them, not for their sum; one that fails so is tried once more
        alone before the load fails. qtypes: only those types' units of typed files (the
        experts' types of moe.cu)."""
        first_kernel = {u: name for name, u in reversed(KERNEL_UNITS.items())}

        def compile_unit(unit: KernelUnit) -> Exception | None:
            try:
                self.device.use()   # a worker thread's current device is CuPy's default, not ours
                self.kernel(first_kernel[unit])
                return None
            except Exception as e:   # CompileException, NVRTCError, a missing libnvrtc (RuntimeError, OSError)
                self._modules.pop(unit, None)
                return e

        from .._native import _kernels   # the CPUs this process may use (affinity), as the thread pool counts
        units = [u for u in kernel_units(files) if qtypes is None or u[1] is None or u[1] in qtypes]
        workers = max(1, min(len(units), _kernels.cpu_count()))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ellm-nvrtc") as pool:
            failures = list(pool.map(compile_unit, units))
        for unit, e in zip(units, failures):
            what = unit[0] if unit[1] is None else f"{unit[0]}, {unit[1].name} kernels"
            if e is not None and workers > 1 and compile_unit(unit) is None:
                log.warning("%s compiled alone after failing beside the others (%s: %s)", what,
                            type(e).__name__, " ".join(str(e).split())[:200])
                continue
            if e is not None:
                detail = " ".join(str(e).split())[:500]
                raise CudaUnavailableError(
                    f"CuPy could not compile ellm's CUDA kernels ({what}: {type(e).__name__}: {detail}); CuPy "
                    f"compiles them with NVRTC, which must match the CUDA version it was built for: "
                    f"{INSTALL_HINT}; or use device='cpu'") from None

    def kernel(self, name: str) -> Any:
        k = self._kernels.get(name)
        if k is None:
            unit = KERNEL_UNITS.get(name)
            if unit is None:
                raise KeyError(f"no CUDA kernel named {name!r}")
            mod = self._modules.get(unit)
            if mod is None:
                mod = self.cp.RawModule(code=unit_source(unit), options=NVRTC_OPTIONS)
                self._modules[unit] = mod
            k = self._kernels[name] = mod.get_function(name)
        return k

    def _dependent_launcher(self, cc: int) -> DependentLauncher | None:
        if cc < 90 or os.environ.get(PDL_ENV, "1") == "0":
            return None
        try:
            return DependentLauncher.from_driver()
        except (OSError, AttributeError) as e:   # no libcuda (a stand-in CuPy) or a pre-12.0 driver
            log.info("programmatic dependent launch unavailable (%s); graphs launch kernels plainly", e)
            return None

    def _launch(self, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple) -> None:
        k = self.kernel(name)
        self.launches += 1
        if self.dependent_launch and self.dependent_launcher is not None:
            self.dependent_launcher(k.kernel.ptr, grid, block, args, self.stream.ptr, name)
        else:
            k(grid, block, args)

    def _elementwise(self, name: str, n: int, *args: Any) -> None:
        if n:
            self._launch(name, (ceil_div(n, ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), args)

    def scratch(self, name: str, size: int, dtype: Any = np.float32) -> Any:
        """A grow-only device buffer of at least `size` elements (attention partials).
        While a graph is being captured the buffer is also held by the graph, so a later
        growth cannot free memory a captured step still writes."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < size or buf.dtype != dtype:
            buf = self._scratch[name] = self.cp.empty(max(size, 1), dtype)
        if self.capture_keep is not None:
            self.capture_keep.append(buf)
        return buf[:size]

    # -- memory (ops/memory.py HostMemory's meaning) ------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return self.cp.empty(shape, dtype)

    def device_memory(self) -> tuple[int, int]:
        """(bytes available, bytes in all): the driver's free memory plus the blocks CuPy's
        pool holds for reuse, within the pool's limit where one is set."""
        free, total = self.cp.cuda.runtime.memGetInfo()
        pool = self.cp.get_default_memory_pool()
        available = int(free) + int(pool.free_bytes())
        limit = int(pool.get_limit())   # the process's own cap (cupy's set_limit), 0: none
        if limit:
            available, total = min(available, limit - int(pool.used_bytes())), min(int(total), limit)
        return available, int(total)

    def _weights_to_device(self, x: np.ndarray) -> Any:
        """A weight on the device, or DeviceMemoryError saying the model does not fit."""
        try:
            data = self.cp.asarray(x)
        except MemoryError:
            free, total = self.device_memory()
            raise DeviceMemoryError(
                f"the model's weights do not fit in the GPU's memory: {mem_size(self.weight_bytes)} were on "
                f"the device when {mem_size(x.nbytes)} more were asked for, with {mem_size(free)} of "
                f"{mem_size(total)} free; "
                "use a smaller model or a quantized one (a 4- or 8-bit GGUF, or quantize='q8_0' / 'q4_0'), "
                "or device='cpu'") from None
        self.weight_bytes += x.nbytes
        return data

    @_on_stream
    def kv_zeros(self, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        """float32, or KV_BF16 (bfloat16 bits as uint16: kv_cache_dtype="bfloat16")."""
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.float32), KV_BF16):
            raise ValueError(f"kv_cache_dtype {dtype.name}: the cuda backend keeps its KV cache in float32 or "
                             "bfloat16 (an f16 cache is a cpu-backend option)")
        try:   # sized to fit beforehand (engine/runner.py kv_cache_blocks); this is what it did not foresee
            return self.cp.zeros(shape, dtype)
        except MemoryError:
            free, total = self.device_memory()
            raise DeviceMemoryError(
                f"the KV cache does not fit in the GPU's memory ({mem_size(free)} of {mem_size(total)} free when "
                f"a layer's {mem_size(int(np.prod(shape)) * dtype.itemsize)} were asked for); pass a smaller "
                "kv_cache_tokens or max_model_len, or kv_cache_dtype='bfloat16'") from None

    def _counters(self, size: int, name: str = "attn_counters", dtype: Any = np.int32) -> Any:
        """Completion counters (attn_decode's per (token, head), argmax_rows' per row, a
        greedy head's keys): zeroed once, grow-only (the kernels leave them at zero), held
        by a graph being captured."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < size:
            buf = self._scratch[name] = self.cp.zeros(max(size, 1), dtype)
        if self.capture_keep is not None:
            self.capture_keep.append(buf)
        return buf

    @_on_stream
    def upload(self, x: np.ndarray) -> Any:
        """A host array on the device; floating arrays become float32 (what every kernel reads)."""
        x = np.ascontiguousarray(x)
        if x.dtype.kind == "f" and x.dtype != np.float32:
            x = x.astype(np.float32)
        return self._weights_to_device(x)

    @_on_stream
    def upload_linear(self, w: Linear) -> Linear:
        """The matrix on the device in its own type; types without a kernel (Q5_0, Q2_K,
        ...) are dequantized to f32 on the host first (4 bytes a weight: correct, not fast).
        Q8_0, Q4_0, Q4_1 and the K-quants' rows are stored with their values and scales
        apart (rows_split)."""
        from dataclasses import replace
        if isinstance(w.data, self.cp.ndarray):
            return w
        bias = None if w.bias is None else self.upload(np.asarray(w.bias, np.float32))
        if w.qtype not in WEIGHT_TYPES:
            from ..formats.dequant import dequantize
            dense = dequantize(w.data, w.qtype, (w.out_features, w.in_features))
            return replace(w, data=self._weights_to_device(dense), qtype=GGMLType.F32, bias=bias)
        if w.qtype in SPLIT_TYPES:
            need = w.out_features * ceil_div(w.data.shape[1], 16) * 16
            if self._split_buffer.size < need <= SPLIT_BUFFER_MAX:
                self._split_buffer = np.empty(need, np.uint8)
            buffer = self._split_buffer if need <= SPLIT_BUFFER_MAX else None
            split = self._weights_to_device(rows_split(w.data, w.qtype, buffer))
            return replace(w, data=split[:, :w.data.shape[1]], bias=bias)
        return replace(w, data=self._weights_to_device(np.ascontiguousarray(w.data)), bias=bias)

    @_on_stream
    def upload_batch(self, batch: Batch) -> Batch:
        """The Batch with every array field (and dict of arrays: the block tables) on the
        device; index arrays as int32, float arrays as float32 (fields added later, e.g.
        image rows, come along)."""
        from dataclasses import fields, replace

        def dev(a: Any) -> Any:
            if isinstance(a, np.ndarray):
                kind = np.int32 if a.dtype.kind in "iub" else np.float32
                return self.cp.asarray(np.ascontiguousarray(a, dtype=kind))
            if isinstance(a, dict):
                return {k: dev(v) for k, v in a.items()}
            return a
        return replace(batch, **{f.name: dev(getattr(batch, f.name)) for f in fields(batch)})

    @_on_stream
    def gather_rows(self, x: Any, rows: Any, out: Any = None) -> Any:
        R, H = int(rows.shape[0]), int(x.size) // max(int(x.shape[0]), 1)
        out = self.cp.empty((R, *x.shape[1:]), np.float32) if out is None else out
        if R:
            self._launch("gather_rows_f32", (R,), (256,), (x, rows, out, np.int32(H)))
        return out

    @_on_stream
    def scatter_rows(self, x: Any, rows: Any, values: Any) -> Any:
        """x[rows] = values (R, ...) in place (rows distinct) -> x."""
        R = int(rows.shape[0])
        H = int(x.size) // max(int(x.shape[0]), 1)
        values = self.cp.ascontiguousarray(values, dtype=np.float32)
        if int(values.size) != R * H:
            raise ValueError(f"scatter_rows: {R} rows of {H} values expected, got {values.shape}")
        if R:
            self._launch("scatter_rows_f32", (R,), (256,), (x, rows, values, np.int32(H)))
        return x

    def to_host(self, x: Any) -> np.ndarray:
        if isinstance(x, self.cp.ndarray):
            return self.cp.asnumpy(x, stream=self.stream)   # waits for the stream's work
        return np.asarray(x)

    def step_executor(self, model: Any, kv: Any, workspace: Any) -> Any:
        from .cuda_graphs import GraphStep
        return GraphStep(self, model, kv, workspace, enabled=self.graphs)

    # -- products ----------------------------------------------------------------------

    def _weight(self, w: Linear) -> Any:
        if not isinstance(w.data, self.cp.ndarray):
            raise ValueError(f"{w.name or 'a weight'} is not on the GPU: the model's weights must be "
                             "uploaded (models.build_model does it) before a CUDA forward pass")
        return w.data

    @_on_stream
    def linear(self, x: Any, w: Linear, out: Any = None) -> Any:
        """x (T, K) @ W^T (+ w.bias) -> (T, N)."""
        data = self._weight(w)
        T, K, N = int(x.shape[0]), w.in_features, w.out_features
        if int(x.shape[1]) != K:
            raise ValueError(f"linear: x has {x.shape[1]} columns, {w.name or 'the weight'} takes {K}")
        x = self.cp.ascontiguousarray(x, dtype=np.float32)
        if x.data.ptr % 16:   # the kernels read x as float4: a view starting mid-vector is copied
            x = x.copy()
        out = self.cp.empty((T, N), np.float32) if out is None else out
        if T == 0:
            return out
        tname = WEIGHT_TYPES[w.qtype]
        bias = _NULL if w.bias is None else w.bias
        args = (data, np.int64(data.strides[0]), x, bias, out, np.int32(T), np.int32(K), np.int32(N))
        if T > GEMM_MIN_TOKENS and K % 32 == 0 and w.qtype != GGMLType.F32:
            if self._cublas_handle() and (w.qtype == GGMLType.BF16 or N * K <= CUBLAS_DEQUANT_MAX):
                if w.qtype != GGMLType.BF16:   # dequantized to bf16 first: gemm_<type>'s rounding
                    dense = self.scratch("w_bf16", N * K, np.uint16).reshape(N, K)
                    self._launch(f"dequant_bf16_{tname}", (ceil_div(N * K // 8, 256),), (256,),
                                 (data, np.int64(data.strides[0]), dense, np.int32(N), np.int32(K)))
                    data = dense
                self._gemm_cublas(x, data, w.bias, out, T, K, N)
            else:
                self._launch(f"gemm_{tname}", (ceil_div(N, GEMM_TILE), ceil_div(T, GEMM_TILE)), (128,), args)
        elif T <= GEMM_MIN_TOKENS and self._mmv(w.qtype, K):
            self._mmv3(x, [w, w, w], [out, out, out], [N, 0, 0], None, 0.0)
        else:
            if K % 8:
                raise ValueError(f"linear: in_features {K} is not a multiple of 8 (the CUDA kernels need it)")
            self._launch(f"gemv_{tname}", (ceil_div(N, GEMV_WARPS), ceil_div(T, GEMV_TOKENS)),
                         (32 * GEMV_WARPS,), args)
        return out

    def _cublas_handle(self) -> Any:
        """CuPy's cuBLAS module and handle, or None where it cannot be loaded (then the
        gemm kernels serve; logged once)."""
        if not self.use_cublas:
            return None
        if self._cublas is None:
            try:
                from cupy_backends.cuda.libs import cublas
                handle = self.cp.cuda.device.get_cublas_handle()
                self._cublas = (cublas, handle)
            except Exception as e:   # no libcublas in this CuPy install
                log.warning(
                    "cuBLAS is unavailable (%s: %s); prefill products run on ellm's gemm kernels", type(e).__name__, e)
                self.use_cublas = False
                return None
        return self._cublas

    def _gemm_cublas(self, x: Any, w: Any, bias: Any, out: Any, T: int, K: int, N: int) -> None:
        """out (T, N) = bf16(x) @ w^T (+ bias) through cublasGemmEx: w (N, K) bf16, f32
        accumulation. Column-major, that is out^T (N x T) = w (K x N)^T . x^T (K x T)."""
        cublas, handle = self._cublas
        xb = self.scratch("x_bf16", T * K, np.uint16)
        self._elementwise("to_bf16_f32", T * K, x, xb, np.int64(T * K))
        one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        cublas.setStream(handle, self.stream.ptr)
        cublas.gemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, one.ctypes.data, w.data.ptr, CUDA_R_16BF,
                      int(w.strides[0]) // 2,
                      xb.data.ptr, CUDA_R_16BF, K, zero.ctypes.data, out.data.ptr, CUDA_R_32F, N,
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
        if bias is not None:
            self._elementwise("add_bias_rows_f32", T * N, out, bias, np.int64(T * N), np.int32(N))

    @_on_stream
    def linear_multi(self, x: Any, parts: Sequence[tuple]) -> list[Any]:
        """[(w, out), ...] -> outs: several matrices against one x. Decode-sized x and two
        or three matrices of one type run as one launch (gemv3, the same bits as gemv)."""
        T = int(x.shape[0])
        ws = [w for w, _ in parts]
        if (not 2 <= len(parts) <= 3 or T == 0 or T > GEMM_MIN_TOKENS
                or len({(w.qtype, w.in_features) for w in ws}) != 1 or int(x.shape[1]) != ws[0].in_features
                or ws[0].in_features % 8
                or any(o is None or not o.flags.c_contiguous or tuple(o.shape) != (T, w.out_features)
                       for w, o in parts)):
            return [self.linear(x, w, o) for w, o in parts]
        x = self.cp.ascontiguousarray(x, dtype=np.float32)
        if x.data.ptr % 16:
            x = x.copy()
        datas = [self._weight(w) for w in ws]
        outs = [o for _, o in parts]
        ns = [w.out_features for w in ws]
        if len(parts) == 2:   # a third part of no rows
            datas, outs, ns, ws = datas + [datas[0]], outs + [outs[0]], ns + [0], ws + [ws[0]]
        if self._mmv(ws[0].qtype, ws[0].in_features):
            self._mmv3(x, ws, outs, ns, None, 0.0)
            return [o for _, o in parts]
        biases = [_NULL if w.bias is None or n == 0 else w.bias for w, n in zip(ws, ns)]
        self._launch(f"gemv3_{WEIGHT_TYPES[ws[0].qtype]}", (ceil_div(sum(ns), GEMV_WARPS), ceil_div(T, GEMV_TOKENS)),
                     (32 * GEMV_WARPS,),
                     (*datas, *(np.int64(d.strides[0]) for d in datas), *biases, *outs, x,
                      np.int32(T), np.int32(ws[0].in_features), *(np.int32(n) for n in ns)))
        return [o for _, o in parts]

    # -- [lora] adapters (ellm/lora.py; csrc/cuda/lora.cu) ----------------------------------

    @_on_stream
    def prepare_lora(self, projection: Any) -> dict[str, Any]:
        """Every adapter's factors of one projection on the device: A and B of all slots in
        two flat float32 arrays, with each slot's offsets, rank (0: not adapted) and scale."""
        a_parts, b_parts, a_off, b_off, ranks, scales = [], [], [], [], [], []
        na = nb = 0
        for f in projection.slots:
            a_off.append(na)
            b_off.append(nb)
            ranks.append(0 if f is None else f.rank)
            scales.append(0.0 if f is None else f.scale)
            if f is not None:
                a_parts.append(f.a.ravel())
                b_parts.append(f.b.ravel())
                na, nb = na + f.a.size, nb + f.b.size
        cp = self.cp
        return dict(a=cp.asarray(np.concatenate(a_parts).astype(np.float32)),
                    b=cp.asarray(np.concatenate(b_parts).astype(np.float32)),
                    a_off=cp.asarray(np.asarray(a_off, np.int64)), b_off=cp.asarray(np.asarray(b_off, np.int64)),
                    ranks=cp.asarray(np.asarray(ranks, np.int32)), scales=cp.asarray(np.asarray(scales, np.float32)),
                    max_rank=max(ranks), n_slots=len(ranks), N=projection.out_features, K=projection.in_features)

    @_on_stream
    def lora(self, x: Any, row_slots: Any, parts: Sequence[tuple]) -> None:
        """y += each row's adapter's scale * B (A x) for every (prepared table, y) of parts."""
        T = int(x.shape[0])
        if T == 0:
            return
        x = self.cp.ascontiguousarray(x, dtype=np.float32)
        slots = self.cp.ascontiguousarray(row_slots, dtype=np.int32)
        for table, y in parts:
            K, N, R = table["K"], table["N"], table["max_rank"]
            if int(x.shape[1]) != K or int(slots.shape[0]) != T or tuple(y.shape[:1]) != (T,) or int(y.shape[1]) < N \
                    or y.strides[1] != 4:
                raise ValueError(f"lora: x {tuple(x.shape)}, {int(slots.shape[0])} slots and y {tuple(y.shape)} "
                                 f"do not fit a ({N}, {K}) projection")
            u = self.scratch("lora_u", T * R)
            self._launch("lora_shrink_f32", (T, ceil_div(R, 4)), (128,),
                         (x, slots, table["a"], table["a_off"], table["ranks"], u, np.int32(K), np.int32(R)))
            self._launch("lora_expand_f32", (T, ceil_div(N, 256)), (256,),
                         (u, slots, table["b"], table["b_off"], table["ranks"], table["scales"], y,
                          np.int64(y.strides[0] // 4), np.int32(N), np.int32(R)))

    @_on_stream
    def embed(self, w: Linear, ids: Any, out: Any = None) -> Any:
        data = self._weight(w)
        T, K = int(ids.shape[0]), w.in_features
        if K % 8:   # (embed_<type> takes a row 8 elements at a time, 16-byte aligned)
            raise ValueError(f"embed: hidden size {K} is not a multiple of 8 (the CUDA kernels need it)")
        out = self.cp.empty((T, K), np.float32) if out is None else out
        if T:
            self._launch(f"embed_{WEIGHT_TYPES[w.qtype]}", (T,), (128,),
                         (data, np.int64(data.strides[0]), np.int32(w.out_features), ids, out, np.int32(K)))
        return out

    # -- norms and element-wise ----------------------------------------------------------

    @_on_stream
    def rmsnorm(self, x: Any, weight: Any, eps: float, out: Any = None) -> Any:
        H = int(x.shape[-1])
        out = self.cp.empty(x.shape, np.float32) if out is None else out
        rows = int(x.size) // H
        if rows:
            self._launch("rmsnorm_f32", (rows,), (256,), (x, weight, out, np.int32(H), np.float32(eps)))
        return out

    @_on_stream
    def add_rmsnorm(self, residual: Any, x: Any, weight: Any, eps: float, out: Any = None) -> Any:
        H = int(residual.shape[-1])
        out = self.cp.empty(residual.shape, np.float32) if out is None else out
        rows = int(residual.size) // H
        if rows:
            self._launch("add_rmsnorm_f32", (rows,), (256,),
                         (residual, x, weight, out, np.int32(H), np.float32(eps)))
        return out

    @_on_stream
    def norm_add(self, residual: Any, x: Any, weight: Any, eps: float, scale: float = 1.0) -> Any:
        H = int(residual.shape[-1])
        if tuple(x.shape) != tuple(residual.shape):   # (the kernel reads x row for row)
            raise ValueError(f"norm_add: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
        rows = int(residual.size) // H
        if rows:
            self._launch("norm_add_f32", (rows,), (256,),
                         (residual, self.cp.ascontiguousarray(x, dtype=np.float32),
                          _NULL if weight is None else weight, np.int32(H), np.float32(eps), np.float32(scale)))
        return residual

    @_on_stream
    def add(self, a: Any, b: Any) -> Any:
        self._elementwise("add_f32", int(a.size), a, b, np.int64(a.size))
        return a

    @_on_stream
    def swiglu(self, gate: Any, up: Any, out: Any = None) -> Any:
        out = self.cp.empty(gate.shape, np.float32) if out is None else out
        self._elementwise("swiglu_f32", int(gate.size), gate, up, out, np.int64(gate.size))
        return out

    @_on_stream
    def geglu(self, gate: Any, up: Any, out: Any = None) -> Any:
        out = self.cp.empty(gate.shape, np.float32) if out is None else out
        self._elementwise("geglu_f32", int(gate.size), gate, up, out, np.int64(gate.size))
        return out

    @_on_stream
    def softcap(self, x: Any, cap: float) -> Any:
        if cap > 0:
            self._elementwise("softcap_f32", int(x.size), x, np.int64(x.size), np.float32(cap))
        return x

    @_on_stream
    def scale(self, x: Any, s: float) -> Any:
        self._elementwise("scale_f32", int(x.size), x, np.int64(x.size), np.float32(s))
        return x

    @_on_stream
    def moe(self, x: Any, router: Linear, experts: Experts, top_k: int, norm_topk_prob: bool,
            out: Any = None) -> Any:
        """x (T, H) -> (T, H): where mmv.cu can read the experts, everything on the device
        (_moe_device, a prefill's tokens in chunks: no copy back, so decode
        steps are captured as graphs), else router logits on the device, the routing on the host
        (reference.moe_route on a copy of the (T, E) logits) and per chosen expert one
        batched SwiGLU MLP over its tokens, added into their rows in ascending expert id."""
        from .reference import moe_route
        cp = self.cp
        T, H = int(x.shape[0]), int(x.shape[1])
        out = cp.empty((T, H), np.float32) if out is None else out
        if T == 0:
            return out
        tables = self._moe_tables(experts, top_k)
        if tables is not None and out.flags.c_contiguous:
            self._moe_device(cp.ascontiguousarray(x, dtype=np.float32), router, tables, top_k, norm_topk_prob, out)
            return out
        out.fill(0)
        ids, weights = moe_route(self.to_host(self.linear(x, router)), top_k, norm_topk_prob)
        for e in np.unique(ids).tolist():
            rows, slot = np.nonzero(ids == e)          # rows ascend; a token picks e once
            rows_d = cp.asarray(rows.astype(np.int32))
            xe = self.gather_rows(x, rows_d)
            F = experts.gate[e].out_features
            gate, up = self.linear_multi(xe, [(experts.gate[e], cp.empty((len(rows), F), np.float32)),
                                              (experts.up[e], cp.empty((len(rows), F), np.float32))])
            h = self.linear(self.swiglu(gate, up), experts.down[e])
            self._launch("scatter_add_rows_f32", (len(rows),), (256,),
                         (out, rows_d, cp.asarray(weights[rows, slot].astype(np.float32)), h, np.int32(H)))
        return out

    @_on_stream
    def norm_moe_add(self, residual: Any, norm: Any, eps: float, router: Linear, experts: Experts, top_k: int,
                     norm_topk_prob: bool, normed: Any = None, out: Any = None) -> Any:
        """residual += moe(rmsnorm(residual)) (reference.FusedByComposition): on the device
        (_moe_device) in five launches a chunk of tokens, the norm folded into the router's
        and the experts' gate/up products (each token's 1/rms from its own row, as the
        other folded norms) and the sum added into the residual by moe_combine; otherwise
        rmsnorm, moe and add."""
        tables = self._moe_tables(experts, top_k)
        if tables is not None and norm is not None and residual.flags.c_contiguous:
            self._moe_device(residual, router, tables, top_k, norm_topk_prob, residual, norm=norm, eps=eps, add=True)
            return residual
        h = residual if norm is None else self.rmsnorm(residual, norm, eps, out=normed)
        return self.add(residual, self.moe(h, router, experts, top_k, norm_topk_prob, out=out))

    def _expert_tables(self, experts: Experts) -> ExpertTables | None:
        """The device tables moe.cu reads a layer's experts through, made (and moe.cu's
        units of their types compiled) on the layer's first step; None where mmv.cu cannot
        read them (F32, a width not a multiple of 32, gate and up of two types,
        ELLM_CUDA_MMV=0)."""
        hit = self._expert_tables_of.get(id(experts))
        if hit is not None and hit[0] is experts:
            return hit[1]
        g, u, d = experts.gate[0], experts.up[0], experts.down[0]
        tables = None
        if (self._mmv(g.qtype, g.in_features) and self._mmv(d.qtype, d.in_features) and u.qtype == g.qtype
                and experts.num_experts <= MOE_EXPERTS_MAX):
            datas = [[self._weight(w) for w in ws] for ws in (experts.gate, experts.up, experts.down)]
            strides = [{int(m.strides[0]) for m in ms} for ms in datas]
            if strides[0] == strides[1] and all(len(st) == 1 for st in strides):
                self.compile_kernels(("moe.cu",), {g.qtype, d.qtype})
                at = [(ms[0], self.cp.asarray(np.array([m.data.ptr - ms[0].data.ptr for m in ms], np.int64)))
                      for ms in datas]
                tables = ExpertTables(at[0], at[1], at[2], gate_up_stride=strides[0].pop(),
                                      down_stride=strides[2].pop(), gate_type=WEIGHT_TYPES[g.qtype],
                                      down_type=WEIGHT_TYPES[d.qtype], num_experts=experts.num_experts,
                                      hidden=g.in_features, ffn=g.out_features)
        self._expert_tables_of[id(experts)] = (experts, tables)
        return tables

    def _moe_tables(self, experts: Experts, top_k: int) -> ExpertTables | None:
        """_expert_tables where moe_route's layout takes top_k experts a token (1 to
        min(E, 64)), else None."""
        tb = self._expert_tables(experts)
        return tb if tb is not None and 0 < top_k <= min(tb.num_experts, MOE_TOP_K_MAX) else None

    def _moe_device(self, x: Any, router: Linear, tb: ExpertTables, top_k: int, norm_topk_prob: bool, out: Any,
                    norm: Any = None, eps: float = 0.0, add: bool = False) -> None:
        """_moe_rows over x (T, H) in chunks of as many tokens as moe_route's layout
        (MOE_ENTRIES_MAX entries) and MOE_SCRATCH_BYTES allow, at least a decode step's 64."""
        if int(x.shape[1]) != tb.hidden:
            raise ValueError(f"moe: x has {x.shape[1]} columns, the experts take {tb.hidden}")
        step = max(GEMM_MIN_TOKENS, min(MOE_ENTRIES_MAX // top_k,
                                        MOE_SCRATCH_BYTES // (top_k * (tb.hidden + tb.ffn) * 4)))
        for c in range(0, int(x.shape[0]), step):
            self._moe_rows(x[c:c + step], router, tb, top_k, norm_topk_prob, out[c:c + step], norm, eps, add)

    def _moe_rows(self, x: Any, router: Linear, tb: ExpertTables, top_k: int, norm_topk_prob: bool, out: Any,
                  norm: Any, eps: float, add: bool) -> None:
        """The MoE block for one chunk of tokens without leaving the device, into out (or
        added to it): the router's product (64 tokens at a time: mmv.cu, as in a decode
        step), moe_route (each token's experts, the entries laid out by expert), moe.cu's
        gate/up (each entry reading its token's row of x in place) and down products (each
        chosen expert's rows read once for up to 64 of its tokens) and moe_combine (each
        token's sum in ascending expert id); norm: an RMSNorm of x folded into the router's
        and gate/up's products. Every token's result is its own: the same bits in any batch."""
        T, H, E, F, k = int(x.shape[0]), tb.hidden, tb.num_experts, tb.ffn, top_k
        n, nslots = T * k, min(tb.num_experts, T * k)
        logits = self.scratch("moe_logits", T * E).reshape(T, E)
        for c in range(0, T, GEMM_MIN_TOKENS):
            rows, into = x[c:c + GEMM_MIN_TOKENS], logits[c:c + GEMM_MIN_TOKENS]
            if norm is None:
                self.linear(rows, router, out=into)
            else:
                self.norm_linear_multi(rows, norm, eps, ((router, into),))
        ints = self.scratch("moe_ints", 4 * n + 2 * nslots + 1, np.int32)
        ids, rows, pos = ints[:n], ints[n:2 * n], ints[2 * n:3 * n]
        slots, starts = ints[3 * n:3 * n + nslots], ints[3 * n + nslots:3 * n + 2 * nslots + 1]
        floats = self.scratch("moe_weights", 2 * n)
        wts, wpos = floats[:n], floats[n:]
        self._launch("moe_route_f32", (T,), (MOE_ROUTE_THREADS,),
                     (logits, ids, wts, slots, starts, rows, pos, wpos, self._counters(1, "moe_done"), np.int32(T),
                      np.int32(E), np.int32(k), np.int32(nslots), np.int32(bool(norm_topk_prob))))
        hg = self.scratch("moe_h", n * F)
        yg = self.scratch("moe_y", n * H)
        for name, groups, args in (
                (f"moe_glu_{tb.gate_type}", ceil_div(F, MMV_TASKS),
                 (tb.gate[0], tb.up[0], tb.gate[1], tb.up[1], np.int64(tb.gate_up_stride), slots, starts, rows, x,
                  _NULL if norm is None else norm, np.float32(eps), hg, np.int32(H), np.int32(F))),
                (f"moe_down_{tb.down_type}", ceil_div(H, MMV_ROWS),
                 (*tb.down, np.int64(tb.down_stride), slots, starts, hg, yg, np.int32(F), np.int32(H)))):
            if self.mmv_loop:   # the resident blocks shared among the slots, each walking its groups
                groups = min(groups, max(1, MMV3_RESIDENT[1] * self.num_sms // nslots))
            self._launch(name, (groups, nslots, ceil_div(T, GEMM_MIN_TOKENS)), (MMV_THREADS,), args)
        self._launch("moe_combine_f32", (T,), (ELEMENTWISE_THREADS,),
                     (out, yg, pos, wpos, np.int32(k), np.int32(H), np.int32(add)))

    # -- attention -----------------------------------------------------------------------

    @_on_stream
    def rope_attention(self, q, k, v, positions, seq_ids, block_tables, k_cache, v_cache,
                       inv_freq, interleaved, scale, window=0, softcap_value=0.0, out=None,
                       rope_mscale=1.0, key_limit=None):
        """ops/reference.py rope_attention on the device: q (T, nh, hd), k / v (T, nkv, hd),
        caches (num_blocks, block_size, nkv, hd), block_tables (B, max_blocks) int32;
        key_limit (T,) int32 or None (causal: the kernels then read positions as the limit).
        The kernels trust key_limit >= positions (the engine builds it)."""
        cp = self.cp
        T, nh, hd = (int(s) for s in q.shape)
        nkv, block_size = int(k.shape[1]), int(k_cache.shape[1])
        if hd > HEAD_DIM_MAX or nh % nkv:
            raise ValueError(f"rope_attention on CUDA needs head_dim <= {HEAD_DIM_MAX} and n_heads a "
                             f"multiple of n_kv_heads; got head_dim {hd}, {nh} / {nkv} heads")
        out = cp.empty((T, nh, hd), np.float32) if out is None else out
        if T == 0:
            return out
        n_rot = int(inv_freq.shape[0])
        if n_rot > hd // 2:
            raise ValueError(f"inv_freq has {n_rot} entries, more than head_dim/2 = {hd // 2}")
        max_blocks = int(block_tables.shape[1])
        q = cp.ascontiguousarray(q, dtype=np.float32)
        k = cp.ascontiguousarray(k, dtype=np.float32)
        v = cp.ascontiguousarray(v, dtype=np.float32)
        q_rot = self.scratch("q_rot", T * nh * hd)
        i32, f32 = np.int32, np.float32
        self._launch("rope_kv_write" + _kv_suffix(k_cache, v_cache), (T, nh + nkv), (hd,),
                     (q, k, v, positions, seq_ids, block_tables, i32(max_blocks), q_rot, k_cache, v_cache,
                      inv_freq, i32(n_rot), i32(bool(interleaved)), f32(rope_mscale),
                      i32(nh), i32(nkv), i32(hd), i32(block_size)))
        # the second half: paged_attention (attn_decode for a decode batch: one launch)
        return self.paged_attention(q_rot.reshape(T, nh, hd), positions, seq_ids, block_tables, k_cache, v_cache,
                                    scale, window, softcap_value, key_limit, out)

    @staticmethod
    def _prefill_on_tensor_cores(T: int, hd: int) -> bool:
        return T > GEMM_MIN_TOKENS and hd % 32 == 0 and hd <= FA_HEAD_DIM_MAX

    def _attn_prefill(self, kv: str, q: Any, positions: Any, limit: Any, seq_ids: Any, block_tables: Any,
                      k_cache: Any, v_cache: Any, scale: float, window: int, softcap_value: float,
                      out: Any) -> None:
        """attn_prefill: a warp per 16 tokens of a head, every key they see, on the tensor
        cores (the meaning of attn_partial + attn_combine), FA_WARPS warps a block sharing
        each step's keys and values; above FA_OUT dims a head's output is split over
        blocks of FA_WIDE_WARPS warps, each taking the scores itself (attn_prefill_wide)."""
        T, nh, hd = (int(s) for s in q.shape)
        i32, f32 = np.int32, np.float32
        warps = FA_WIDE_WARPS if hd > FA_OUT else self.fa_warps
        variant = "_wide" if hd > FA_OUT else "_w1" if warps == 1 else ""
        self._launch("attn_prefill" + variant + kv, (nh, ceil_div(T, 16 * warps), ceil_div(hd, FA_OUT)), (32 * warps,),
                     (q, positions, limit, seq_ids, block_tables, i32(int(block_tables.shape[1])), k_cache,
                      v_cache, i32(T), i32(nh), i32(int(k_cache.shape[2])), i32(hd), i32(int(k_cache.shape[1])),
                      f32(scale), i32(window), f32(softcap_value), out))

    # -- fused ops (ops/reference.py FusedByComposition says what each means) -------------

    def layer_stack(self, specs: list[dict], t: int, hidden: int, residual: Any, proj: Any, h_buf: Any,
                    eps: float) -> Any:
        """Every layer of a forward through the fused ops (ops/fused_stack.py), or None
        with ELLM_CUDA_FUSED=0 (the layers then run one op at a time)."""
        if not self.fused:
            return None
        from .fused_stack import fused_layer_stack
        return fused_layer_stack(self, specs, t, hidden, residual, proj, h_buf, eps)

    def _vec_in(self, x: Any) -> Any:
        """x as the kernels read it: C-contiguous float32 starting on a 16-byte boundary."""
        x = self.cp.ascontiguousarray(x, dtype=np.float32)
        return x.copy() if x.data.ptr % 16 else x

    def _fusable(self, x: Any, ws: Sequence[Linear]) -> bool:
        """Decode-sized x and matrices of one type whose rows the fused kernels can read."""
        T, K = int(x.shape[0]), int(x.shape[1])
        return (0 < T <= GEMM_MIN_TOKENS and K % 8 == 0 and len({w.qtype for w in ws}) == 1
                and ws[0].qtype in WEIGHT_TYPES and all(w.in_features == K for w in ws))

    def _key_split(self, T: int, nh: int, max_keys: int, window: int, key_limit: Any) -> tuple[int, int, int]:
        """(chunk, max_chunks, z) of attention.cu's split over keys for T tokens of nh heads
        with tables of max_keys slots: z blocks a (token, head), enough to fill the GPU at
        batch 1 with as many as stay resident (a block's chunks run one after another). A
        shape-only choice (graph-safe); which block takes which chunk changes no result."""
        chunk = DECODE_CHUNK if T <= GEMM_MIN_TOKENS else PREFILL_CHUNK
        max_chunks = ceil_div(max_keys, chunk)
        if window > 0 and key_limit is None:   # keys [p - window + 1, p]: at most this many chunks
            max_chunks = min(max_chunks, (window - 1) // chunk + 1)
        return chunk, max_chunks, max(1, min(max_chunks, ceil_div(ATTN_BLOCKS_PER_SM * self.num_sms, nh * T)))

    def _mmv(self, qtype: GGMLType, K: int) -> bool:
        """Whether decode products of this type and width run on mmv.cu's tensor-core kernels."""
        return self.use_mmv and qtype in MMV_TYPES and K % 32 == 0

    def _mmv_tiles(self, T: int, qtype: GGMLType) -> tuple[str, int]:
        """(kernel name suffix, tiles a block) of mmv.cu's kernels for T tokens of qtype."""
        if self.mmv_x4 and T > MMV_X4_ABOVE and qtype in MMV_X4_TYPES:
            return "x4", 4
        return ("x2", 2) if self.mmv_x2 and T > MMV_X2_ABOVE else ("", 1)

    def _mmv3(self, x: Any, ws: Sequence[Linear], outs: Sequence[Any], ns: Sequence[int], norm: Any,
              eps: float, add: bool = False, greedy: Any = None) -> None:
        """mmv3: up to three matrices (ns[i] == 0: absent) against x (T <= 64 rows, aligned),
        with the norm folded in (norm not None) or the results added to outs (add); greedy
        (int32 (T,), one matrix): each row's argmax_rows answer over its outputs too."""
        T, K = int(x.shape[0]), ws[0].in_features
        if greedy is None:
            greedy_args: tuple = (_NULL, _NULL, _NULL)
        else:
            greedy_args = (self._counters(GEMM_MIN_TOKENS, "greedy_keys", np.uint64),
                           self._counters(1, "greedy_done"), greedy)
        datas = [self._weight(w) for w in ws]
        biases = [_NULL if w.bias is None or n == 0 else w.bias for w, n in zip(ws, ns)]
        sfx, rt = self._mmv_tiles(T, ws[0].qtype)
        groups = ceil_div(sum(ns), MMV_ROWS * rt)
        if self.mmv_loop:
            groups = min(groups, MMV3_RESIDENT[rt] * self.num_sms)
        self._launch(f"mmv3{sfx}_{WEIGHT_TYPES[ws[0].qtype]}", (groups,), (MMV_THREADS,),
                     (*datas, *(np.int64(d.strides[0]) for d in datas), *biases, *outs, x,
                      _NULL if norm is None else norm, np.float32(eps), np.int32(T), np.int32(K),
                      *(np.int32(n) for n in ns), np.int32(bool(add)), *greedy_args))

    def _normed(self, x: Any, norm: Any, eps: float, out: Any = None) -> Any:
        if norm is None:
            return x
        if out is None:
            out = self.scratch("normed", int(x.size)).reshape(x.shape)
        return self.rmsnorm(x, norm, eps, out=out)

    @_on_stream
    def norm_linear_multi(self, x: Any, norm: Any, eps: float, parts: Sequence[tuple],
                          normed: Any = None) -> list[Any]:
        ws = [w for w, _ in parts]
        T = int(x.shape[0])
        outs_fit = all(o is not None and o.flags.c_contiguous and tuple(o.shape) == (T, w.out_features)
                       for w, o in parts)
        groups: dict[GGMLType, list[tuple]] = {}
        for w, o in parts:
            groups.setdefault(w.qtype, []).append((w, o))
        if norm is not None and len(groups) > 1 and outs_fit and \
                all(self._fusable(x, [w for w, _ in g]) for g in groups.values()):
            # q/k and v of different types (a Q4_K_M file's Q6_K v): one launch a type, each
            # with the norm folded in, rather than an rmsnorm and a product a matrix
            for g in groups.values():
                self.norm_linear_multi(x, norm, eps, g)
            return [o for _, o in parts]
        if not (norm is not None and 1 <= len(parts) <= 3 and self._fusable(x, ws) and outs_fit):
            return self.linear_multi(self._normed(x, norm, eps, normed), parts)
        x = self._vec_in(x)
        datas = [self._weight(w) for w in ws]
        outs = [o for _, o in parts]
        ns = [w.out_features for w in ws]
        biases = [_NULL if w.bias is None else w.bias for w in ws]
        while len(datas) < 3:   # absent parts: no rows
            datas, outs, ns, biases = datas + [datas[0]], outs + [outs[0]], ns + [0], biases + [_NULL]
        K = ws[0].in_features
        if self._mmv(ws[0].qtype, K):
            self._mmv3(x, ws + [ws[0]] * (3 - len(ws)), outs, ns, norm, eps)
            return [o for _, o in parts]
        self._launch(f"nmv3_{WEIGHT_TYPES[ws[0].qtype]}", (ceil_div(sum(ns), FUSED_WARPS), ceil_div(T, GEMV_TOKENS)),
                     (32 * FUSED_WARPS,),
                     (*datas, *(np.int64(d.strides[0]) for d in datas), *biases, *outs, x, norm,
                      np.float32(eps), np.int32(T), np.int32(K), *(np.int32(n) for n in ns)))
        return [o for _, o in parts]

    @_on_stream
    def norm_linear_greedy(self, x: Any, norm: Any, eps: float, w: Linear, logits: Any, ids: Any) -> Any:
        """norm_linear_multi of one matrix into logits (T, N), and each row's argmax_rows
        answer into ids (T,) int32: on mmv.cu in the product's own launch (a captured
        decode step's head: no argmax launch, no second pass over the logits), otherwise
        argmax_rows after the product."""
        T, K, N = int(x.shape[0]), w.in_features, w.out_features
        if (self._fusable(x, [w]) and self._mmv(w.qtype, K) and logits.flags.c_contiguous
                and tuple(logits.shape) == (T, N) and ids.flags.c_contiguous and tuple(ids.shape) == (T,)
                and ids.dtype == np.int32):
            self._mmv3(self._vec_in(x), [w, w, w], [logits, logits, logits], [N, 0, 0], norm, eps, greedy=ids)
            return ids
        self.norm_linear_multi(x, norm, eps, ((w, logits),))
        return self.argmax_rows(logits, out=ids)

    @_on_stream
    def norm_linear_glu(self, x: Any, norm: Any, eps: float, gate: Linear, up: Linear, act: str,
                        out: Any = None) -> Any:
        if act not in GLU_ACTS:
            raise ValueError(f"norm_linear_glu: act must be 'silu' or 'gelu_tanh', got {act!r}")
        T, F = int(x.shape[0]), gate.out_features
        out = self.cp.empty((T, F), np.float32) if out is None else out
        if not (self._fusable(x, [gate, up]) and up.out_features == F and out.flags.c_contiguous):
            h = self._normed(x, norm, eps)
            g = self.linear(h, gate, out=self.scratch("glu_gate", T * F).reshape(T, F))
            u = self.linear(h, up, out=self.scratch("glu_up", T * F).reshape(T, F))
            return (self.swiglu if act == "silu" else self.geglu)(g, u, out=out)
        x = self._vec_in(x)
        dg, du = self._weight(gate), self._weight(up)
        mmv = self._mmv(gate.qtype, gate.in_features)
        sfx, rt = self._mmv_tiles(T, gate.qtype)
        groups = ceil_div(F, MMV_TASKS * rt)
        if self.mmv_loop:
            groups = min(groups, MMV3_RESIDENT[rt] * self.num_sms)
        self._launch(f"mmv_glu{sfx}_{WEIGHT_TYPES[gate.qtype]}" if mmv else f"glu_{WEIGHT_TYPES[gate.qtype]}",
                     (groups,) if mmv else (ceil_div(F, FUSED_WARPS), ceil_div(T, GEMV_TOKENS)),
                     (MMV_THREADS,) if mmv else (32 * FUSED_WARPS,),
                     (dg, du, np.int64(dg.strides[0]), np.int64(du.strides[0]),
                      _NULL if gate.bias is None else gate.bias, _NULL if up.bias is None else up.bias,
                      x, _NULL if norm is None else norm, np.float32(eps), out, np.int32(T),
                      np.int32(gate.in_features), np.int32(F), np.int32(GLU_ACTS[act])))
        return out

    @_on_stream
    def linear_add(self, x: Any, w: Linear, residual: Any) -> Any:
        T, N = int(x.shape[0]), w.out_features
        if not (self._fusable(x, [w]) and residual.flags.c_contiguous and tuple(residual.shape) == (T, N)):
            return self.add(residual, self.linear(x, w, out=self.scratch("linear_add", T * N).reshape(T, N)))
        x = self._vec_in(x)
        if self._mmv(w.qtype, w.in_features):
            self._mmv3(x, [w, w, w], [residual] * 3, [N, 0, 0], None, 0.0, add=True)
            return residual
        data = self._weight(w)
        self._launch(f"gemv_add_{WEIGHT_TYPES[w.qtype]}", (ceil_div(N, FUSED_WARPS), ceil_div(T, GEMV_TOKENS)),
                     (32 * FUSED_WARPS,),
                     (data, np.int64(data.strides[0]), x, _NULL if w.bias is None else w.bias, residual,
                      np.int32(T), np.int32(w.in_features), np.int32(N)))
        return residual

    @_on_stream
    def norm_qkv_rope_write(self, x: Any, norm: Any, eps: float, q: Linear, k: Linear, v: Linear,
                            head_dim: int, positions: Any, seq_ids: Any, block_tables: Any, k_cache: Any,
                            v_cache: Any, inv_freq: Any, interleaved: bool, rope_mscale: float = 1.0,
                            q_out: Any = None) -> Any:
        cp = self.cp
        T, hd = int(x.shape[0]), int(head_dim)
        nh, nkv = q.out_features // hd, k.out_features // hd
        block_size, max_blocks = int(k_cache.shape[1]), int(block_tables.shape[1])
        n_rot = int(inv_freq.shape[0])
        if hd > HEAD_DIM_MAX or nh % max(nkv, 1) or n_rot > hd // 2 or v.out_features != nkv * hd:
            raise ValueError(f"norm_qkv_rope_write: head_dim {hd} (<= {HEAD_DIM_MAX}), {nh} / {nkv} heads, "
                             f"{n_rot} rotary pairs (<= head_dim/2) and v of {v.out_features} rows do not fit")
        q_out = cp.empty((T, nh, hd), np.float32) if q_out is None else q_out
        if T == 0:
            return q_out
        kv = _kv_suffix(k_cache, v_cache)
        i32, f32 = np.int32, np.float32
        if not (self._fusable(x, [q, k, v]) and q_out.flags.c_contiguous):
            h = self._normed(x, norm, eps)
            qs = self.scratch("qkv_q", T * nh * hd).reshape(T, nh * hd)
            ks = self.scratch("qkv_k", T * nkv * hd).reshape(T, nkv * hd)
            vs = self.scratch("qkv_v", T * nkv * hd).reshape(T, nkv * hd)
            self.linear_multi(h, [(q, qs), (k, ks), (v, vs)])
            self._launch("rope_kv_write" + kv, (T, nh + nkv), (hd,),
                         (qs, ks, vs, positions, seq_ids, block_tables, i32(max_blocks), q_out, k_cache, v_cache,
                          inv_freq, i32(n_rot), i32(bool(interleaved)), f32(rope_mscale), i32(nh), i32(nkv),
                          i32(hd), i32(block_size)))
            return q_out
        x = self._vec_in(x)
        dq, dk, dv = self._weight(q), self._weight(k), self._weight(v)
        tasks = (nh + nkv) * (hd - n_rot) + nkv * hd
        mmv = self._mmv(q.qtype, q.in_features)
        sfx, rt = self._mmv_tiles(T, q.qtype)
        grid = (ceil_div(tasks, MMV_TASKS * rt),) if mmv else (ceil_div(tasks, FUSED_WARPS), ceil_div(T, GEMV_TOKENS))
        self._launch(f"mmv_qkv_rope{sfx}_{WEIGHT_TYPES[q.qtype]}" if mmv else f"qkv_rope_{WEIGHT_TYPES[q.qtype]}",
                     grid, (MMV_THREADS,) if mmv else (32 * FUSED_WARPS,),
                     (dq, dk, dv, np.int64(dq.strides[0]), np.int64(dk.strides[0]), np.int64(dv.strides[0]),
                      *(_NULL if w.bias is None else w.bias for w in (q, k, v)),
                      x, _NULL if norm is None else norm, f32(eps), positions, seq_ids, block_tables,
                      i32(max_blocks), q_out, k_cache, v_cache, i32(kv == "_bf16"), inv_freq, i32(n_rot),
                      i32(bool(interleaved)), f32(rope_mscale), i32(T), i32(q.in_features), i32(nh), i32(nkv),
                      i32(hd), i32(block_size)))
        return q_out

    @_on_stream
    def qk_norm_rope_write(self, q: Any, k: Any, v: Any, q_norm: Any, k_norm: Any, eps: float, whole: bool,
                           positions: Any, seq_ids: Any, block_tables: Any, k_cache: Any, v_cache: Any,
                           inv_freq: Any, interleaved: bool, rope_mscale: float = 1.0, q_out: Any = None) -> Any:
        """q_norm / k_norm of each head, or of the whole projection, then RoPE and the KV
        write (qk_norm_rope_kv_write: one launch, the plain path's bits)."""
        cp = self.cp
        T, nh, hd = (int(s) for s in q.shape)
        nkv, block_size, max_blocks = int(k.shape[1]), int(k_cache.shape[1]), int(block_tables.shape[1])
        n_rot = int(inv_freq.shape[0])
        if hd > HEAD_DIM_MAX or nh % max(nkv, 1) or n_rot > hd // 2 or tuple(v.shape) != tuple(k.shape):
            raise ValueError(f"qk_norm_rope_write: head_dim {hd} (<= {HEAD_DIM_MAX}), {nh} / {nkv} heads, "
                             f"{n_rot} rotary pairs (<= head_dim/2) and v {tuple(v.shape)} (k's shape) do not fit")
        check_qk_norms(q_norm, k_norm, nh, nkv, hd, whole)
        q_out = cp.empty((T, nh, hd), np.float32) if q_out is None else q_out
        if T == 0:
            return q_out
        i32, f32 = np.int32, np.float32
        q, k, v = (cp.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
        self._launch("qk_norm_rope_kv_write" + _kv_suffix(k_cache, v_cache), (T, nh + nkv), (256,),
                     (q, k, v, q_norm, k_norm, f32(eps), i32(bool(whole)), positions, seq_ids, block_tables,
                      i32(max_blocks), q_out, k_cache, v_cache, inv_freq, i32(n_rot), i32(bool(interleaved)),
                      f32(rope_mscale), i32(nh), i32(nkv), i32(hd), i32(block_size)))
        return q_out

    @_on_stream
    def paged_attention(self, q: Any, positions: Any, seq_ids: Any, block_tables: Any, k_cache: Any,
                        v_cache: Any, scale: float, window: int = 0, softcap_value: float = 0.0,
                        key_limit: Any = None, out: Any = None) -> Any:
        """Decode batches (<= GEMM_MIN_TOKENS tokens): one launch (attn_decode: the split
        over keys and its merge); larger ones attn_partial + attn_combine."""
        cp = self.cp
        T, nh, hd = (int(s) for s in q.shape)
        nkv, block_size = int(k_cache.shape[2]), int(k_cache.shape[1])
        if hd > HEAD_DIM_MAX or nh % nkv:
            raise ValueError(f"paged_attention on CUDA needs head_dim <= {HEAD_DIM_MAX} and n_heads a "
                             f"multiple of n_kv_heads; got head_dim {hd}, {nh} / {nkv} heads")
        out = cp.empty((T, nh, hd), np.float32) if out is None else out
        if T == 0:
            return out
        max_blocks = int(block_tables.shape[1])
        decode = T <= GEMM_MIN_TOKENS
        chunk, max_chunks, z = self._key_split(T, nh, max_blocks * block_size, window, key_limit)
        limit = positions if key_limit is None else key_limit
        q = self._vec_in(q)
        kv = _kv_suffix(k_cache, v_cache)
        if not decode and self._prefill_on_tensor_cores(T, hd):
            self._attn_prefill(kv, q, positions, limit, seq_ids, block_tables, k_cache, v_cache, scale, window,
                               softcap_value, out)
            return out
        part_ml = self.scratch("part_ml", T * nh * max_chunks * 2)
        part_o = self.scratch("part_o", T * nh * max_chunks * hd)
        i32, f32 = np.int32, np.float32
        args = (q, positions, limit, seq_ids, block_tables, i32(max_blocks), k_cache, v_cache, i32(nh), i32(nkv),
                i32(hd), i32(block_size), f32(scale), i32(window), f32(softcap_value), i32(chunk),
                i32(max_chunks), part_ml, part_o)
        if decode:
            self._launch("attn_decode" + kv, (nh, T, z), (128,), (*args, self._counters(T * nh), out))
        else:
            self._launch("attn_partial" + kv, (nh, T, z), (128,), args)
            self._launch("attn_combine", (nh, T), (hd,),
                         (positions, limit, part_ml, part_o, i32(nh), i32(hd), i32(window), i32(chunk),
                          i32(max_chunks), out))
        return out

    # -- sampling on the device ------------------------------------------------------------

    def sample(self, logits: Any, samplers: Sequence[Any],
               masks: Sequence[np.ndarray | None] | None = None,
               rows: Sequence[int] | None = None) -> list[Any] | None:
        """One token per row of logits (B, vocab), chosen on the device (csrc/cuda/sample.cu),
        and the log-probabilities of the rows that ask for them taken there too
        (`logprob_records`): only ids and those records cross the bus, never a row.
        masks: None, or per row a grammar's int32 bitmask row (engine/sampler.py
        apply_mask's layout) or None, applied on the device. -> per row a SampleResult,
        or the error the host's sampler raises for the row (a mask allowing no token, no
        finite maximum for logprobs), to be raised on that row's request alone. Rows are
        independent; a seeded row draws the same tokens whatever its batch (its own seed
        and counter). rows: the rows of logits the samplers take, in order, gathered on the
        device first (None: every row)."""
        from ..engine.sampler import NoAllowedTokenError, SampleResult
        B = len(samplers)
        if B == 0:
            return None
        if rows is not None:
            picked = np.asarray(rows, np.int64)
            if picked.shape != (B,) or picked.min() < 0 or picked.max() >= int(logits.shape[0]):
                raise ValueError(f"sample: rows must be {B} indices below {int(logits.shape[0])}, got {list(rows)}")
        elif int(logits.shape[0]) != B:
            raise ValueError(f"sample: {logits.shape[0]} rows of logits for {B} samplers")
        if masks is not None and len(masks) != B:
            raise ValueError(f"sample: {len(masks)} masks for {B} samplers")
        if not self.device_logprobs and ((masks is not None and any(m is not None for m in masks))
                                         or any(s.params.logprobs is not None for s in samplers)):
            return None   # ELLM_CUDA_LOGPROBS=0: the host samples such a batch
        if rows is not None:   # the named rows, gathered on the stream (no copy when declining above)
            with self.stream:
                logits = self.gather_rows(self.cp.ascontiguousarray(logits, dtype=np.float32),
                                          self._upload_packed({"rows": picked.astype(np.int32)}, None)["rows"])
        with self.stream:
            plan = self.logprobs_before_sampling(logits, samplers, masks=masks)
            ids_dev = self.sample_ids(logits, samplers, masks=masks)
            records = None if plan is None else \
                self.cp.asnumpy(self.logprob_records(plan, ids_dev), stream=self.stream)
            if plan is not None and records is not None and len(plan.want) == B:   # every row's id is in its record
                ids = records[:, LOGPROB_HEAD - 1]
            else:   # B ids: with the records, the only copies back
                ids = self.cp.asnumpy(ids_dev, stream=self.stream)
        results: list[Any] = [SampleResult(int(t), math.nan, None) for t in ids.tolist()]
        if plan is not None and records is not None:
            for b, got in zip(plan.want, read_logprob_records(records, plan.asked)):
                results[b] = got if isinstance(got, Exception) else SampleResult(results[b].token_id, *got)
        V = int(logits.shape[1])
        for b, m in enumerate(masks or ()):
            if m is not None and not mask_allows_any(m, V):
                results[b] = NoAllowedTokenError("the grammar allows no token here")
        return results

    def logprobs_before_sampling(self, logits: Any, samplers: Sequence[Any],
                                 upload: Callable[[np.ndarray], Any] | None = None,
                                 masks: Sequence[np.ndarray | None] | None = None) -> LogprobPlan | None:
        """Where the rows asking for logprobs will have their raw logits once sampled, to be
        called before sample_ids: sample_rows applies a grammar's mask, logit_bias and the
        penalties in place, so the rows it changes are copied first. None when no row
        asks. upload: as sample_ids'."""
        want = [b for b, s in enumerate(samplers) if s.params.logprobs is not None]
        if not want:
            return None
        asked = [int(samplers[b].params.logprobs) for b in want]
        copied = any(samplers[b].modifies_logits or (masks is not None and masks[b] is not None) for b in want)
        logits = self.cp.ascontiguousarray(logits, dtype=np.float32)
        if len(want) == len(samplers):   # every row (one request alone, most often): no indices
            return LogprobPlan(logits.copy() if copied else logits, None, None, want, asked)
        rows = self._upload_packed({"rows": np.asarray(want, np.int32)}, upload)["rows"]
        if copied:
            return LogprobPlan(self.gather_rows(logits, rows), None, rows, want, asked)
        return LogprobPlan(logits, rows, rows, want, asked)

    @_on_stream
    def logprob_records(self, plan: LogprobPlan, ids: Any) -> Any:
        """sample.cu logprob_rows: int32 (R, LOGPROB_HEAD + 2 n) on the device, one record
        a row of plan (read_logprob_records reads them); ids: the batch's chosen tokens
        (B,) on the device."""
        R, n, V = len(plan.want), max(plan.asked), int(plan.src.shape[1])
        chunks = ceil_div(V, ARGMAX_CHUNK)
        out = self.cp.empty((R, LOGPROB_HEAD + 2 * n), np.int32)
        self._launch("logprob_rows", (chunks, R), (ARGMAX_THREADS,),
                     (plan.src, np.int32(V), _NULL if plan.src_rows is None else plan.src_rows,
                      _NULL if plan.id_rows is None else plan.id_rows, ids, np.int32(n),
                      self.scratch("logprob_ms", 2 * R * chunks),
                      self.scratch("logprob_keys", R * chunks * n, np.uint64),
                      self._counters(R, "logprob_counters"), out))
        return out

    def sample_ids(self, logits: Any, samplers: Sequence[Any], out: Any = None,
                   upload: Callable[[np.ndarray], Any] | None = None, pending: Any = None,
                   masks: Sequence[np.ndarray | None] | None = None) -> Any:
        """sample()'s choice left on the device: int32 (B,) (into out when given), each
        sampler's draw counted. upload: how the rows' parameters reach the device (bytes
        -> a device array; default a CuPy copy), e.g. from page-locked memory. pending:
        int32 (B,) on the device, each row's token generated by the step before and not yet
        appended to its sampler (a step launched ahead): the penalties count it too.
        masks: as sample()'s (a row whose mask allows nothing gets some token: sample()
        says so)."""
        done, self.graph_argmax = self.graph_argmax, None
        B, V = len(samplers), int(logits.shape[1])
        masked = masks is not None and any(m is not None for m in masks)
        with self.stream:
            if not masked and all(s.argmax_choice for s in samplers):   # the common case: a bare argmax per row
                if done is not None and done[0] is logits and out is None:   # computed by the replayed graph
                    return done[1]
                return self.argmax_rows(self.cp.ascontiguousarray(logits, dtype=np.float32), out=out)
            out_ids = self.cp.empty(B, np.int32) if out is None else out
            logits = self.cp.ascontiguousarray(logits, dtype=np.float32)
            rows = _SampleRows(B)
            for b, s in enumerate(samplers):
                rows.add(b, s, self._rng_for(s))
            arrays = rows.arrays()
            if masked:
                assert masks is not None
                arrays.update(mask_table(masks))
            dev = self._upload_packed(arrays, upload)
            self._launch("sample_rows", (B,), (1024,),
                         (logits, np.int32(V), dev["inv_temp"], dev["top_k"], dev["top_p"],
                          dev["log_min_p"], dev["rep"], dev["freq"], dev["pres"], dev["bias_off"],
                          dev["bias_ids"], dev["bias_vals"], dev["pen_off"], dev["pen_ids"],
                          dev["pen_counts"], _NULL if pending is None else pending, dev["seeds"],
                          dev["steps"], dev["mask_rows"] if masked else _NULL,
                          dev["masks"] if masked else _NULL,
                          np.int32(arrays["masks"].shape[1] if masked else 0), out_ids))
        for s in samplers:
            if not (s.params.greedy or s.params.top_k == 1):
                self._rng_state[s][1] += 1
        return out_ids

    @_on_stream
    def argmax_rows(self, logits: Any, out: Any = None) -> Any:
        """The first index of each row's maximum (B, V) -> int32 (B,), -inf and NaN never
        chosen (a row of only those -> 0): sample_rows' greedy answer, on B x V / 2048
        blocks (sample.cu argmax_rows)."""
        B, V = int(logits.shape[0]), int(logits.shape[1])
        out = self.cp.empty(B, np.int32) if out is None else out
        if B == 0:
            return out
        chunks = ceil_div(V, ARGMAX_CHUNK)
        self._launch("argmax_rows", (chunks, B), (ARGMAX_THREADS,),
                     (logits, np.int32(V), self.scratch("argmax_partial", B * chunks, np.uint64),
                      self._counters(B, "argmax_counters"), out))
        return out

    def _upload_packed(self, arrays: dict[str, np.ndarray],
                       upload: Callable[[np.ndarray], Any] | None = None) -> dict[str, Any]:
        """The sampler's per-row arrays in one host-to-device copy: packed into one byte
        buffer (each piece 8-byte aligned), then typed views of the device copy."""
        offsets, total = {}, 0
        for name, a in arrays.items():
            offsets[name] = total
            total += -(-a.nbytes // 8) * 8
        host = np.zeros(max(total, 8), np.uint8)
        for name, a in arrays.items():
            host[offsets[name]:offsets[name] + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        dev = upload(host) if upload is not None else self.cp.asarray(host)
        return {name: dev[offsets[name]:offsets[name] + a.nbytes].view(a.dtype) for name, a in arrays.items()}

    def _rng_for(self, sampler: Any) -> list[int]:
        """[seed, draws so far] of a sampler: its request's seed (with the sibling index
        folded in by the sampler's own Generator), or one drawn from that Generator."""
        st = self._rng_state.get(sampler)
        if st is None:
            seed = int(sampler._rng.integers(0, 2**63))
            st = self._rng_state[sampler] = [seed, 0]
        return st


def _kv_suffix(k_cache: Any, v_cache: Any) -> str:
    """The attention kernels' name suffix for the caches' element type ("" f32, "_bf16")."""
    kd, vd = np.dtype(k_cache.dtype), np.dtype(v_cache.dtype)
    if kd != vd or kd not in (np.dtype(np.float32), KV_BF16):
        raise ValueError(f"KV caches of {kd.name} / {vd.name}: the cuda kernels take float32 or bfloat16 "
                         "(uint16 bits) caches, both of one type")
    return "_bf16" if kd == KV_BF16 else ""


class _SampleRows:
    """The per-row arrays sample.cu reads, built on the host from the samplers' state:
    parameters, logit_bias and the penalised ids as offset-indexed lists."""

    def __init__(self, B: int) -> None:
        self.inv_temp = np.zeros(B, np.float32)
        self.top_k = np.zeros(B, np.int32)
        self.top_p = np.zeros(B, np.float32)
        self.log_min_p = np.full(B, -np.inf, np.float32)
        self.rep = np.ones(B, np.float32)
        self.freq = np.zeros(B, np.float32)
        self.pres = np.zeros(B, np.float32)
        self.seeds = np.zeros(B, np.uint64)
        self.steps = np.zeros(B, np.uint64)
        self.bias: list[tuple[np.ndarray, np.ndarray]] = []
        self.pens: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, b: int, s: Any, rng: list[int]) -> None:
        p = s.params
        self.inv_temp[b] = s._inv_t
        self.top_k[b] = 1 if p.top_k == 1 else s._top_k
        self.top_p[b] = s._top_p
        if s._log_min_p is not None:
            self.log_min_p[b] = s._log_min_p
        self.seeds[b], self.steps[b] = rng[0], rng[1]
        if s._bias_ids is not None:
            self.bias.append((s._bias_ids.astype(np.int32), s._bias_vals))
        else:
            self.bias.append((np.empty(0, np.int32), np.empty(0, np.float32)))
        ids, counts = np.empty(0, np.int32), np.empty(0, np.float32)
        if s._rep or s._freq_pres:
            self.rep[b] = p.repetition_penalty
            self.freq[b], self.pres[b] = p.frequency_penalty, p.presence_penalty
            out = s._out
            n_out = len(out)
            if s._rep:   # every id seen (prompt + output), with its output count
                seen = s._seen
                ids = seen.ids[:len(seen)].astype(np.int32)
                counts = np.zeros(len(ids), np.float32)
                if n_out:
                    where = {t: i for i, t in enumerate(ids.tolist())}
                    for t, c in zip(out.ids[:n_out].tolist(), out.counts[:n_out].tolist()):
                        counts[where[t]] = c
            else:
                ids, counts = out.ids[:n_out].astype(np.int32), out.counts[:n_out].astype(np.float32)
        self.pens.append((ids, counts))

    def arrays(self) -> dict[str, np.ndarray]:
        def csr(lists: list[tuple[np.ndarray, np.ndarray]], vdtype: Any) -> tuple[np.ndarray, ...]:
            off = np.zeros(len(lists) + 1, np.int32)
            off[1:] = np.cumsum([len(i) for i, _ in lists])
            ids = np.concatenate([i for i, _ in lists] + [np.zeros(1, np.int32)]).astype(np.int32)
            vals = np.concatenate([v for _, v in lists] + [np.zeros(1, vdtype)]).astype(vdtype)
            return off, ids, vals
        bias_off, bias_ids, bias_vals = csr(self.bias, np.float32)
        pen_off, pen_ids, pen_counts = csr(self.pens, np.float32)
        return dict(inv_temp=self.inv_temp, top_k=self.top_k, top_p=self.top_p, log_min_p=self.log_min_p,
                    rep=self.rep, freq=self.freq, pres=self.pres, bias_off=bias_off, bias_ids=bias_ids,
                    bias_vals=bias_vals, pen_off=pen_off, pen_ids=pen_ids, pen_counts=pen_counts,
                    seeds=self.seeds, steps=self.steps)
