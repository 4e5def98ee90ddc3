"""The CUDA kernels' op-level checks with the kernels running on the CPU (tests/cuda_host:
g++ builds csrc/cuda/*.cu against a host runtime, a stand-in for CuPy launches them).

Each check runs in a child process with tests/cuda_host on PYTHONPATH, so the stand-in is
`cupy` there and nowhere else. The op checks are tests/test_cuda.py's and the `cuda` rows
of tests/test_backends.py and tests/test_lora.py (adapters against PEFT), unchanged; the
model-level ones and the sampler's frequency test (minutes here) run with
`bash tests/cuda_host/run.sh --all`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOST = ROOT / "tests" / "cuda_host"
OP_CHECKS = ("(test_cuda and not model_logits and not batched_equals and not sampling_distribution) "
             "or (test_backends and cuda and not runner and not layer_stack) or (test_lora and cuda)")
# tests/test_cuda.py's longest checks here (the real model's trace recordings: ~90 s; the
# speculative step's: ~80 s), run beside the rest of it so the two children take about as long
SECOND_CHILD = "trace_recording or speculative_guesses"


def _ffi_header() -> bool:
    probe = subprocess.run(["g++", "-x", "c++", "-fsyntax-only", "-"], input="#include <ffi.h>\n",
                           capture_output=True, text=True)
    return probe.returncode == 0


needs_host_build = pytest.mark.skipif(
    shutil.which("g++") is None or not _ffi_header(),
    reason="the host build of the CUDA kernels needs g++ and libffi's header (Debian: libffi-dev)")


def _child_env(**extra_env: str) -> dict[str, str]:
    """The environment of a child with the stand-in as its `cupy`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HOST), os.environ.get("PYTHONPATH")])),
                **extra_env)


def _child(args: list[str], timeout: int, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_child_env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


@needs_host_build
def test_cuda_op_checks_pass_with_the_kernels_on_the_cpu() -> None:
    """With the stream's work deferred until the host waits for it (as on a GPU: a host
    buffer rewritten before its queued copy ran changes the results). Two children side
    by side (the stand-in runs a kernel's threads as fibers on one core), about equal
    in time: tests/test_cuda.py's checks but SECOND_CHILD's; those, with the backends'
    and adapters' rows."""
    halves = ((["tests/test_cuda.py"], f"({OP_CHECKS}) and not ({SECOND_CHILD})"),
              (["tests/test_cuda.py", "tests/test_backends.py", "tests/test_lora.py"],
               f"({OP_CHECKS}) and ({SECOND_CHILD} or test_backends or test_lora)"))
    children = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                                  *files, "-k", keys], cwd=ROOT, env=_child_env(ELLM_CUDA_HOST_DEFER="1"),
                                 stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
                for files, keys in halves]
    passed = 0
    try:
        for child in children:
            out, err = child.communicate(timeout=900)
            tail = out[-3000:] + err[-2000:]
            assert child.returncode == 0, tail
            found = re.search(r"(\d+) passed", out)
            assert found and "failed" not in out.splitlines()[-1], tail
            passed += int(found.group(1))
    finally:
        for child in children:
            child.kill()   # (nothing where it has ended)
    assert passed >= 100, f"{passed} op checks passed: the checks ran, not skipped"


@needs_host_build
def test_the_host_runtime_refuses_what_a_gpu_would_get_wrong() -> None:
    """A kernel whose threads wait at barriers of different kinds (its warp's, its block's),
    or at different __syncthreads (an if's two branches; a loop some warps leave before the
    others), or whose lanes meet at different shuffles of a full warp, is reported, naming
    the lines, not hung or run with the barriers paired wrongly, and so is a vector load
    at an address a GPU would fault on (misaligned); a grid a GPU would not launch and a
    block over its kernel's __launch_bounds__ are refused; shared memory a block has not
    written holds NaN bits, not what an earlier block left. Threads that have returned,
    and barriers every thread meets, are fine. A Python int as a kernel argument
    and a host-side write while a graph is captured are refused."""
    script = textwrap.dedent('''
        import numpy as np, cupy
        mod = cupy.RawModule(code=r"""
            extern "C" __global__ void uneven(float* x) {
                float v = x[threadIdx.x];
                // lane 0 waits for its warp at a shuffle, the others for the block: a hang
                if (threadIdx.x == 0) v = __shfl_xor_sync(0xffffffffu, v, 1);
                else __syncthreads();
                x[threadIdx.x] = v;
            }
            extern "C" __global__ void two_sites(float* x) {
                if (threadIdx.x < 32) { x[threadIdx.x] += 1.0f; __syncthreads(); }
                else { __syncthreads(); }   // on a GPU: undefined (a hang, or paired with the other)
            }
            extern "C" __global__ void ragged_loop(float* x) {
                for (unsigned i = 0; i <= threadIdx.x / 32; i++) { x[threadIdx.x] += 1.0f; __syncthreads(); }
                __syncthreads();   // warp 0 comes here while warp 1 waits in the loop
            }
            extern "C" __global__ void split_shuffle(float* x) {
                float v = x[threadIdx.x];
                // half the warp shuffles here, half there: a full mask asks the same shuffle of every lane
                if ((threadIdx.x & 31) < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
                else v -= __shfl_xor_sync(0xffffffffu, v, 1);
                x[threadIdx.x] = v;
            }
            extern "C" __global__ void fine(float* x) {
                if (threadIdx.x >= 48) return;   // returned threads no longer count
                for (int i = 0; i < 3; i++) { x[threadIdx.x] += 1.0f; __syncthreads(); }
                __syncthreads();
            }
            extern "C" __global__ void twice(float* x, int n) {
                int i = blockIdx.x * blockDim.x + threadIdx.x;
                if (i < n) x[i] *= 2.0f;
            }
            extern "C" __global__ void half_written(float* x) {
                __shared__ float s[64];
                if (threadIdx.x < 32) s[threadIdx.x] = 1.0f;   // the other half never written
                __syncthreads();
                x[blockIdx.x * 64 + threadIdx.x] = s[threadIdx.x];
            }
            #define HALF 32
            extern "C" __global__ void __launch_bounds__(2 * HALF, 1) bounded(float* x) { x[threadIdx.x] += 1.0f; }
            extern "C" __global__ void vector_load(float* x, int offset) {
                // a float4 at x + offset: a GPU faults unless the address is a multiple of 16
                float4 v = *(const float4*)(x + offset + 4 * threadIdx.x);
                x[32 + threadIdx.x] = v.x + v.y + v.z + v.w;
            }""")
        x = cupy.zeros(64, np.float32)
        try:
            mod.get_function("uneven")((1,), (32,), (x,))
        except RuntimeError as e:
            assert "deadlock" in str(e), e
            print("deadlock reported")
        for name in ("two_sites", "ragged_loop"):
            try:
                mod.get_function(name)((1,), (64,), (x,))
            except RuntimeError as e:
                assert "different __syncthreads" in str(e) and str(e).count("__syncthreads();") == 2, e
                print(name, "reported")
        try:
            mod.get_function("split_shuffle")((1,), (64,), (x,))
        except RuntimeError as e:
            assert "lanes of warp 0 of block (0, 0, 0) meet at different warp exchanges" in str(e), e
            assert str(e).count("__shfl_xor_sync(") == 2, e
            print("split_shuffle reported")
        mod.get_function("vector_load")((1,), (4,), (x, np.int32(4)))   # 16 bytes in: aligned
        try:
            mod.get_function("vector_load")((1,), (4,), (x, np.int32(2)))
        except RuntimeError as e:
            assert "misaligned address: an access to 'const struct float4'" in str(e) and "8 bytes past" in str(e), e
            assert "thread 0 of block (0, 0, 0)" in str(e), e
            print("misaligned load reported")
        x[...] = 0.0
        mod.get_function("fine")((2,), (64,), (x,))
        assert float(x.get().sum()) == 2 * 3 * 48, x.get()
        x[...] = 1.0
        try:
            mod.get_function("twice")((1,), (64,), (x, 64))
        except TypeError as e:
            print("python int refused")
        mod.get_function("twice")((1,), (64,), (x, np.int32(64)))
        assert float(x.get().sum()) == 128.0
        y = cupy.zeros(128, np.float32)
        mod.get_function("half_written")((2,), (64,), (y,))
        got = y.get().reshape(2, 64)
        if (got[:, :32] == 1.0).all() and np.isnan(got[:, 32:]).all():   # in both blocks
            print("unwritten shared memory is garbage")
        mod.get_function("bounded")((1,), (64,), (y,))
        try:
            mod.get_function("bounded")((1,), (65,), (y,))
        except RuntimeError as e:
            assert "65 threads a block, more than its __launch_bounds__ of 64" in str(e), e
            print("block over its bound refused")
        for grid in ((1, 70000), (0,)):
            try:
                mod.get_function("twice")(grid, (64,), (x, np.int32(64)))
            except RuntimeError as e:
                assert "65,535" in str(e), e
                print("grid", grid, "refused")
        s = cupy.cuda.Stream()
        s.begin_capture()
        mod.get_function("twice")((1,), (64,), (x, np.int32(64)))
        try:
            x.fill(0)
        except RuntimeError as e:
            print("write during capture refused")
        g = s.end_capture()
        assert float(x.get().sum()) == 128.0   # a captured launch does not run at capture
        g.launch(s)
        g.launch(s)
        assert float(x.get().sum()) == 512.0
        print("graph replayed")
    ''')
    proc = _child(["-c", script], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for line in ("deadlock reported", "two_sites reported", "ragged_loop reported", "split_shuffle reported",
                 "misaligned load reported", "python int refused", "grid (1, 70000) refused", "grid (0,) refused",
                 "block over its bound refused", "unwritten shared memory is garbage",
                 "write during capture refused", "graph replayed"):
        assert line in proc.stdout, proc.stdout + proc.stderr


@needs_host_build
def test_threads_in_reverse_order_show_a_missing_barrier() -> None:
    """ELLM_CUDA_HOST_ORDER=reverse runs a grid's blocks and a block's threads last to first:
    a value thread 0 puts in shared memory for the others without a barrier reaches them
    in the forward order only; with the barrier, both orders agree."""
    script = textwrap.dedent('''
        import numpy as np, cupy
        mod = cupy.RawModule(code=r"""
            extern "C" __global__ void broadcast(float* x, int sync) {
                __shared__ float s;
                if (threadIdx.x == 0) s = x[blockIdx.x * 64] * 2.0f;
                if (sync) __syncthreads();
                x[blockIdx.x * 64 + threadIdx.x] = s + 0.0f * x[blockIdx.x * 64 + threadIdx.x];
            }""")
        for sync in (0, 1):
            x = cupy.asarray(np.repeat(np.arange(1, 4, dtype=np.float32), 64))
            mod.get_function("broadcast")((3,), (64,), (x, np.int32(sync)))
            print(sync, x.get().reshape(3, 64)[:, 1:].tolist() == [[2.0] * 63, [4.0] * 63, [6.0] * 63])
    ''')
    got = {order: _child(["-c", script], timeout=300, ELLM_CUDA_HOST_ORDER=order) for order in ("forward", "reverse")}
    for proc in got.values():
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert got["forward"].stdout.split() == ["0", "True", "1", "True"]
    assert got["reverse"].stdout.split() == ["0", "False", "1", "True"]   # the race shows


@needs_host_build
def test_deferred_execution_runs_the_stream_when_the_host_waits() -> None:
    """ELLM_CUDA_HOST_DEFER=1: a launch and an asynchronous copy wait in the queue; an
    event's synchronize runs the work before its record and nothing after; a host read
    runs everything first. So a host buffer rewritten before its copy has run is what
    the copy takes, as on a GPU."""
    script = textwrap.dedent('''
        import ctypes
        import numpy as np, cupy
        rt = cupy.cuda.runtime
        mod = cupy.RawModule(code=r"""
            extern "C" __global__ void twice(float* x, int n) {
                int i = blockIdx.x * blockDim.x + threadIdx.x;
                if (i < n) x[i] *= 2.0f;
            }""")
        twice = mod.get_function("twice")
        x = cupy.zeros(4, np.float32)
        host = np.frombuffer(cupy.cuda.alloc_pinned_memory(16), np.float32, 4)
        host[:] = 1.0
        s = cupy.cuda.Stream()
        rt.memcpyAsync(x.data.ptr, host.ctypes.data, 16, rt.memcpyHostToDevice, s.ptr)
        first = cupy.cuda.Event()
        first.record(s)
        twice((1,), (4,), (x, np.int32(4)))
        host[:] = 3.0                                  # before the copy ran: the copy takes it
        assert np.asarray(x.view(np.ndarray)).sum() == 0.0   # nothing ran yet
        first.synchronize()                            # the copy, not the launch
        assert np.asarray(x.view(np.ndarray)).tolist() == [3.0] * 4
        assert x.get().tolist() == [6.0] * 4           # a read on the host runs the rest
        print("deferred as a stream")
    ''')
    proc = _child(["-c", script], timeout=300, ELLM_CUDA_HOST_DEFER="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "deferred as a stream" in proc.stdout, proc.stdout + proc.stderr


@needs_host_build
def test_the_device_checks_prefill_breakdown_runs(tmp_path: Path) -> None:
    """benchmarks/gpu/prefill_parts.py (a step of the device check) at small sizes on the
    stand-in: every part runs, both Gemma-shaped attention kernels and the one-warp
    blocks included, and its table and JSON are written (the times mean nothing here)."""
    proc = _child(["benchmarks/gpu/prefill_parts.py", "--tokens", "80", "--small", "--reps", "1",
                   "--out", str(tmp_path)], timeout=300, ELLM_CUDA_HOST_DEFER="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "prefill_parts.json").read_text())["rows"]
    parts = [r["part"] for r in rows]
    assert parts[:6] == ["q/k/v", "o", "gate + up", "down", "attention, float32 cache", "attention, bfloat16 cache"]
    assert [p.split(": ")[1] for p in parts[6:]] == ["attn_prefill_wide", "attn_partial + attn_combine",
                                                     "a warp a block", "a warp a block"]
    assert parts[8:] == [f"attention, {kv} cache: a warp a block" for kv in ("float32", "bfloat16")]
    assert all(r["us"] > 0 for r in rows) and abs(sum(r.get("share", 0.0) for r in rows) - 1.0) < 1e-9
    assert "attn_prefill_wide" in (tmp_path / "prefill_parts.md").read_text()


@needs_host_build
def test_a_kernel_file_that_does_not_compile_fails_the_load() -> None:
    """CudaOps compiles its kernel files side by side at load; one that does not compile
    fails the load with a CudaUnavailableError naming it -- the first such file in
    KERNELS' order when several fail, whichever thread finished first."""
    script = textwrap.dedent('''
        import ellm.ops.cuda as C
        import ellm.ops.cuda_kernels as K
        real = K.kernel_source
        broken = ("attention.cu", "sample.cu")
        K.kernel_source = lambda f: real(f) + ("\\n#error broken on purpose\\n" if f in broken else "")
        try:
            C.CudaOps()
        except C.CudaUnavailableError as e:
            print("refused:", e)
    ''')
    proc = _child(["-c", script], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused: CuPy could not compile ellm's CUDA kernels (attention.cu: " in proc.stdout, proc.stdout
    assert "broken on purpose" in proc.stdout
