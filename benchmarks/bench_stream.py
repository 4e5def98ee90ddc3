"""What the cores can read from DRAM, beside what ellm's decode matmuls read.

A decode token of a model whose weights do not fit in the cache is a read of those
weights: its speed limit is the machine's streaming bandwidth. This measures that limit
with a small C read loop (compiled here with the system C compiler, run through ctypes,
one contiguous slice of a large buffer per thread, optionally with software prefetch),
at 1 and 2 threads (or --threads), and then, with --model, times that model's decode
matmuls (benchmarks/bench_kernels.py --model: layers and output head at T=1) in the same
run, alternating with the read loop, and prints each as a fraction of it:

    python benchmarks/bench_stream.py                               # ~10 s
    python benchmarks/bench_stream.py --model ~/.cache/ellm/models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf
    python benchmarks/bench_stream.py --model ... --exact --level avx2   # exact path, AVX2 level

Medians over --rounds; on a shared machine also look at the best (10th percentile)
figures, and at /proc/loadavg, printed first.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

# Each thread reads bytes [t n / threads, (t + 1) n / threads) once, 64 bytes a step, into
# eight vector accumulators (so the loop is bound by memory, never by the adds); with
# prefetch > 0 each step also prefetches `prefetch` bytes ahead. Returns the seconds from
# the first thread's start to the last one's end.
C_SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stddef.h>
#include <time.h>

typedef struct { const uint8_t *p; size_t n; size_t prefetch; uint64_t sink; } job;

static void *reader(void *arg) {
    job *j = (job *)arg;
    __m256i acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_si256();
    const uint8_t *p = j->p, *end = j->p + (j->n & ~(size_t)255);
    for (; p < end; p += 256) {
        if (j->prefetch) {
            _mm_prefetch((const char *)p + j->prefetch, _MM_HINT_T0);
            _mm_prefetch((const char *)p + j->prefetch + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)p + j->prefetch + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)p + j->prefetch + 192, _MM_HINT_T0);
        }
        for (int i = 0; i < 8; i++)
            acc[i] = _mm256_xor_si256(acc[i], _mm256_loadu_si256((const __m256i *)(p + 32 * i)));
    }
    for (int i = 1; i < 8; i++) acc[0] = _mm256_xor_si256(acc[0], acc[i]);
    j->sink = (uint64_t)_mm256_extract_epi64(acc[0], 0);
    return NULL;
}

double stream_read(const uint8_t *p, size_t n, int threads, size_t prefetch) {
    pthread_t tid[64];
    job jobs[64];
    if (threads < 1 || threads > 64) return -1.0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int t = 0; t < threads; t++) {
        size_t a = n / (size_t)threads * (size_t)t, b = t + 1 == threads ? n : n / (size_t)threads * (size_t)(t + 1);
        jobs[t].p = p + a; jobs[t].n = b - a; jobs[t].prefetch = prefetch; jobs[t].sink = 0;
        if (pthread_create(&tid[t], NULL, reader, &jobs[t])) return -1.0;
    }
    for (int t = 0; t < threads; t++) pthread_join(tid[t], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}
"""


def cpu_line() -> str:
    """The CPU model and the SIMD flags that matter here, from /proc/cpuinfo."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keep = ["avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
            "amx_tile", "amx_int8", "amx_bf16"]
    return f"{model}; flags: {' '.join(f for f in keep if f in flags) or 'none of ' + ','.join(keep)}"


def build_c(source: str, name: str, flags: list[str]) -> ctypes.CDLL:
    """Compiles C source with the system compiler ($CC, else cc) and these flags, once per
    source text (cached in the temp folder as ellm_<name>_<hash>.so), and loads it."""
    tag = hashlib.sha256(source.encode()).hexdigest()[:16]
    lib = Path(tempfile.gettempdir()) / f"ellm_{name}_{tag}.so"
    if not lib.exists():
        src = lib.with_suffix(".c")
        src.write_text(source)
        tmp = lib.with_suffix(f".{os.getpid()}.so")
        subprocess.run([os.environ.get("CC", "cc"), *flags, "-shared", "-fPIC", str(src), "-o", str(tmp)],
                       check=True)
        os.replace(tmp, lib)
    return ctypes.CDLL(str(lib))


def build_reader() -> ctypes.CDLL:
    """C_SOURCE compiled and loaded (build_c)."""
    dll = build_c(C_SOURCE, "stream", ["-O2", "-mavx2", "-pthread"])
    dll.stream_read.restype = ctypes.c_double
    dll.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t]
    return dll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=384, help="buffer size (well past the L3)")
    ap.add_argument("--threads", default="1,2", help="thread counts for the read loop")
    ap.add_argument("--prefetch", default="0,512,2048", help="software prefetch distances (bytes)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--model", help="a GGUF: also time its decode matmuls (T=1) on the pool")
    ap.add_argument("--pool-threads", type=int, default=2, help="ellm pool threads with --model")
    ap.add_argument("--exact", action="store_true",
                    help="with --model: the exact-activation path (activations='f32')")
    ap.add_argument("--level", help="with --model: the SIMD level to run (default: the best)")
    args = ap.parse_args()
    print(f"# {cpu_line()}")
    print(f"# loadavg {Path('/proc/loadavg').read_text().split()[:3]}, {os.cpu_count()} CPUs")
    dll = build_reader()
    buf = np.ones(args.mb << 20, np.uint8)  # written once, so every page is really there
    ptr, n = buf.ctypes.data, buf.nbytes
    configs = [(int(t), int(pf)) for t in args.threads.split(",") for pf in args.prefetch.split(",")]

    fns = {}
    if args.model:
        sys.path.insert(0, str(HERE))
        from bench_kernels import model_token_fns  # the same replay of a decode token

        from ellm._native import _core, _kernels, _quant
        _kernels.set_num_threads(args.pool_threads)
        _quant.set_num_threads(args.pool_threads)
        if args.level:
            _core.set_simd_level(args.level)
            _quant.set_simd_level(args.level)
        print(f"# {args.model}: level {_quant.simd_level()}{', exact activations' if args.exact else ''}")
        fns = {k: v for k, v in model_token_fns(args.model, args.exact).items()
               if k in ("layers", "head", "fused")}
        for fn, _ in fns.values():
            fn()

    dll.stream_read(ptr, n, 2, 0)  # warm-up
    times: dict[str, list[float]] = {}
    for _ in range(args.rounds):  # alternate everything, so all see the same neighbours
        for t, pf in configs:
            times.setdefault(f"read t={t} prefetch={pf}", []).append(dll.stream_read(ptr, n, t, pf))
        for name, (fn, _) in fns.items():
            t0 = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t0)

    best2 = 0.0
    print(f"{'what':28} {'bytes':>9} {'median GB/s':>12} {'best GB/s':>10}")
    for name, ts in times.items():
        nbytes = n if name.startswith("read") else fns[name][1]
        if not nbytes:
            print(f"{name:28} {'':>9} {1e3 * statistics.median(ts):9.2f} ms/token (all matmuls of a token)")
            continue
        med, best = nbytes / statistics.median(ts) / 1e9, nbytes / float(np.percentile(ts, 10)) / 1e9
        if name.startswith(f"read t={args.pool_threads} "):
            best2 = max(best2, med)
        share = f"  = {med / best2:.0%} of the read loop at {args.pool_threads} threads" \
            if not name.startswith("read") and best2 else ""
        print(f"{name:28} {nbytes / 1e6:7.0f}MB {med:12.1f} {best:10.1f}{share}")


if __name__ == "__main__":
    main()
