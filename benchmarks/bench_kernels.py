"""Kernel benchmark: ellm._native._quant.linear on SmolLM2-sized matrices.

Prints, per weight type and SIMD level,
  - decode (T=1): microseconds per call and GB/s of weight bytes streamed, and
  - prefill (T=128, or each T of --prefill-tokens 16,128,512): GFLOP/s (2 T N K flops
    per call),
for the shapes (N x K) 576x1536 (ffn_down), 1536x576 (ffn_up/gate) and 49152x576
(the output head; decode only, its prefill is the same kernel at 85x the size), or the
N x K of --shapes (e.g. Gemma 3's 1024x640,640x1024,2048x640,640x2048).
K-quants need K % 256 == 0, so they run on 576x1536 only.

Weights are random but valid blocks, so no model file is needed. The machine reads
memory at ~22 GiB/s (shared/FACTS.md): decode kernels should approach that on the large
matrix, where the weights do not fit in cache. It takes ~15 s:

    python benchmarks/bench_kernels.py [--levels avx2,avx512] [--types Q4_1,Q8_0] [--threads N]

Llama-3.2-1B's matrices (q/o, k/v, gate/up, down, the tied head), decode from DRAM, against
benchmarks/bench_stream.py's figure:

    python benchmarks/bench_kernels.py --types Q4_K,Q6_K,Q8_0 --prefill-tokens 512 --cold-mb 256 \
        --shapes 2048x2048,512x2048,8192x2048,2048x8192,128256x2048 --threads 1

On a machine others are using, wall-clock times (and any multi-thread run) measure the
neighbours; `--threads 1 --cpu-time` times the kernels by this thread's CPU time, which
stays steady under load.

With --model FILE.gguf it instead replays one decode token's matmuls of that model
(every layer's q, k, v, o, gate, up, down and the output head, at T=1, real weights) and
prints the median milliseconds per token, calling linear once per matrix ("separate")
and with q/k/v and gate/up fused through linear_multi ("fused"), then the layers and the
output head apart (with the GB/s of weights they read), e.g.

    python benchmarks/bench_kernels.py --model SmolLM2-135M-Instruct.Q4_1.gguf --threads 2

(--exact: the same through the exact-activation path; --level avx2: at that SIMD level;
--rows 16: a step of 16 sequences decoding at once, T=16).

With --bias it instead prints what the bias epilogue (Qwen2's q/k/v) costs: linear on a
896 x 896 matrix (Qwen2.5-0.5B's q_proj) and on 1536 x 576, at T=1 and T=128, with and
without a bias, calls alternated, medians and their ratio:

    python benchmarks/bench_kernels.py --bias --types Q8_0,Q4_K,BF16 --threads 1 --cpu-time

With --moe it times one Qwen3-30B-A3B-shaped MoE feed-forward (128 experts, top 8,
H=2048, F=768; random Q4_K weights, ~340 MB) through ops.cpu's moe at T=1, 8 and 128
tokens, with the GB/s of the expert weights the call reads (each expert used at least
once counted once), beside the T=1 token's 8 experts as plain linear calls (the same
bytes; what grouping and the weighted sum cost):

    python benchmarks/bench_kernels.py --moe --threads 2
"""
from __future__ import annotations

import argparse
import itertools
import time

import numpy as np

from ellm._native import _core, _quant

TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
         "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
BLOCK = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 10: (256, 84),
         11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
F16_FIELDS = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,),
              12: (0, 2), 13: (0, 2), 14: (208,)}
SHAPES = [(576, 1536), (1536, 576), (49152, 576)]


def make_weights(qtype: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    if qtype == 0:
        return rng.standard_normal((n, k), dtype=np.float32)
    if qtype in (1, 30):
        return rng.integers(0x3000, 0x3c00, size=(n, k), dtype=np.uint16)  # small finite halves
    blk, size = BLOCK[qtype]
    blocks = rng.integers(0, 256, size=(n * k // blk, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        blocks[:, off:off + 2] = (rng.uniform(-1, 1, blocks.shape[0]).astype(np.float16)
                                  * np.float16(0.02)).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def time_call(fn, budget_s: float, min_reps: int = 3, clock=time.perf_counter) -> float:
    """Median seconds per call, repeating for about budget_s (one warm-up call first)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) >= 2000:
            break
    return float(np.median(times))


def model_token_fns(path: str, exact: bool = False, rows: int = 1) -> dict[str, tuple[object, int]]:
    """One decode step's matmuls of a GGUF llama / gemma3 model, as callables, each with
    the weight bytes it reads (0: not reported). exact: through the exact-activation path
    (linear_multi_exact, what ellm.load(..., activations="f32") runs) instead. rows: the
    step's tokens (1: one sequence; 16: a batched decode step of 16 sequences)."""
    from ellm.formats.gguf import GGUFFile

    f = GGUFFile(path)
    mover = f.move_onto_huge_pages()   # as ellm.load on the CPU: the weights on 2 MiB pages
    if mover is not None:
        mover.join()
    rng = np.random.default_rng(1)
    xs: dict[int, np.ndarray] = {}

    def mat(name: str) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
        info = f.tensors[name]
        n, k = info.shape
        q = int(info.qtype)
        w = f.raw(name) if q not in (0, 1, 30) else f.array(name)
        if k not in xs:  # one input per width, reused: values do not change the timing
            xs[k] = rng.standard_normal((rows, k), dtype=np.float32)
        return w, q, xs[k], np.empty((rows, n), np.float32)

    layers = []
    i = 0
    while f"blk.{i}.attn_q.weight" in f.tensors:
        layers.append({m: mat(f"blk.{i}.{m}.weight") for m in
                       ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                        "ffn_down")})
        i += 1
    head = mat("output.weight" if "output.weight" in f.tensors else "token_embd.weight")
    multi = _quant.linear_multi_exact if exact else _quant.linear_multi

    def lin(x: np.ndarray, w: np.ndarray, q: int, y: np.ndarray) -> None:
        multi(x, [(w, q, y)])

    if not exact:
        lin = _quant.linear  # noqa: F811 (the plain call, as the engine makes it)

    def separate() -> None:
        for L in layers:
            for w, q, x, y in L.values():
                lin(x, w, q, y)
        lin(head[2], head[0], head[1], head[3])

    def fused() -> None:
        for L in layers:
            multi(L["attn_q"][2], [(L[m][0], L[m][1], L[m][3]) for m in ("attn_q", "attn_k", "attn_v")])
            w, q, x, y = L["attn_output"]
            lin(x, w, q, y)
            multi(L["ffn_gate"][2], [(L[m][0], L[m][1], L[m][3]) for m in ("ffn_gate", "ffn_up")])
            w, q, x, y = L["ffn_down"]
            lin(x, w, q, y)
        lin(head[2], head[0], head[1], head[3])

    def layers_only() -> None:
        for L in layers:
            for w, q, x, y in L.values():
                lin(x, w, q, y)

    def head_only() -> None:
        lin(head[2], head[0], head[1], head[3])

    fns: dict[str, tuple[object, int]] = {"separate": (separate, 0), "fused": (fused, 0)}
    fns["layers"] = (layers_only, sum(v[0].nbytes for L in layers for v in L.values()))
    fns["head"] = (head_only, head[0].nbytes)
    return fns


def bench_model(path: str, tokens: int, clock, exact: bool = False, rows: int = 1) -> None:
    fns = model_token_fns(path, exact, rows)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn, _ in fns.values():
        fn()  # warm-up
    for _ in range(tokens):  # alternate, so both modes see the same neighbours
        for name, (fn, _) in fns.items():
            t0 = clock()
            fn()
            times[name].append(clock() - t0)
    for name, ts in times.items():
        # on a busy machine the low percentile is the run that kept its cores
        med, nbytes = float(np.median(ts)), fns[name][1]
        rate = f", {nbytes / 1e6:.0f} MB at {nbytes / 1e9 / med:.1f} GB/s" if nbytes else ""
        print(f"{name:9} {1e3 * med:8.2f} ms/token median of {tokens}, "
              f"{1e3 * float(np.percentile(ts, 10)):.2f} 10th percentile{rate}", flush=True)


def bench_bias(types: list[str], levels: list[str], rounds: int, clock) -> None:
    rng = np.random.default_rng(2)
    print(f"{'type':5} {'N x K':>11} {'level':>7} {'T':>4} {'no bias us':>11} {'bias us':>9} {'ratio':>6}")
    for tname in types:
        qtype = TYPES[tname]
        blk = BLOCK.get(qtype, (1, 0))[0]
        for n, k in [(896, 896), (576, 1536)]:
            if k % blk:
                continue
            w = make_weights(qtype, n, k, rng)
            bias = rng.standard_normal(n, dtype=np.float32)
            for level in levels:
                _core.set_simd_level(level)
                _quant.set_simd_level(level)
                for T in (1, 128):
                    x = rng.standard_normal((T, k), dtype=np.float32)
                    y = np.empty((T, n), np.float32)
                    plain: list[float] = []
                    biased: list[float] = []
                    for _ in range(rounds):  # alternate, so both see the same neighbours
                        plain.append(time_call(lambda: _quant.linear(x, w, qtype, y), 0.005, clock=clock))
                        biased.append(time_call(lambda: _quant.linear(x, w, qtype, y, bias), 0.005,
                                                clock=clock))
                    a, b = float(np.median(plain)), float(np.median(biased))
                    print(f"{tname:5} {f'{n}x{k}':>11} {level:>7} {T:>4} {1e6 * a:11.1f} {1e6 * b:9.1f} "
                          f"{b / a:6.3f}", flush=True)


def bench_moe(types: list[str], rounds: int, clock) -> None:
    from ellm._native import _moe

    E, k, H, F = 128, 8, 2048, 768
    rng = np.random.default_rng(3)
    for tname in types:
        qtype = TYPES[tname]
        blk = BLOCK.get(qtype, (1, 0))[0]
        if H % blk or F % blk:
            continue
        gate = [make_weights(qtype, F, H, rng) for _ in range(E)]
        up = [make_weights(qtype, F, H, rng) for _ in range(E)]
        down = [make_weights(qtype, H, F, rng) for _ in range(E)]
        stacks = (_moe.ExpertStack(gate, qtype, H), _moe.ExpertStack(up, qtype, H), _moe.ExpertStack(down, qtype, F))
        per_expert = gate[0].nbytes + up[0].nbytes + down[0].nbytes
        print(f"# {tname}: {E} experts x {per_expert / 1e6:.2f} MB, top {k}")
        picked = None
        for T in (1, 8, 128):
            x = rng.standard_normal((T, H), dtype=np.float32)
            ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int32)
            w = rng.dirichlet(np.ones(k), size=T).astype(np.float32)
            out = np.empty((T, H), np.float32)
            ts = [time_call(lambda: _moe.experts(x, ids, w, *stacks, out), 0.02, clock=clock) for _ in range(rounds)]
            med = float(np.median(ts))
            used = len(np.unique(ids)) * per_expert
            picked = ids[0] if picked is None else picked
            print(f"moe   T={T:4} {1e3 * med:8.3f} ms  {len(np.unique(ids)):3} experts read, "
                  f"{used / 1e9 / med:6.1f} GB/s", flush=True)
        x = rng.standard_normal((1, H), dtype=np.float32)
        g, u, d = np.empty((1, F), np.float32), np.empty((1, F), np.float32), np.empty((1, H), np.float32)

        def plain_calls() -> None:
            for e in picked:
                _quant.linear_multi(x, [(gate[e], qtype, g), (up[e], qtype, u)])
                _quant.linear(g, down[e], qtype, d)
        med = float(np.median([time_call(plain_calls, 0.02, clock=clock) for _ in range(rounds)]))
        print(f"linear T=1 {1e3 * med:8.3f} ms  {len(picked)} experts as plain calls, "
              f"{len(picked) * per_expert / 1e9 / med:6.1f} GB/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default=",".join(_core.supported_simd_levels()))
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,F32,F16,BF16")
    ap.add_argument("--prefill-tokens", default="128",
                    help="token counts T for the prefill columns, e.g. 16,128,512")
    ap.add_argument("--threads", type=int, default=0, help="pool threads (0: leave as is)")
    ap.add_argument("--budget", type=float, default=0.05, help="seconds per measurement")
    ap.add_argument("--all-scalar", action="store_true",
                    help="also run the scalar level on the 49152-row matrix (slow)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by this thread's CPU time (with --threads 1: steadier on a "
                         "machine others are using)")
    ap.add_argument("--model", help="a GGUF file: time one decode token's matmuls instead")
    ap.add_argument("--tokens", type=int, default=30, help="tokens timed with --model")
    ap.add_argument("--rows", type=int, default=1,
                    help="with --model: tokens per step (16: a decode step of 16 sequences)")
    ap.add_argument("--exact", action="store_true",
                    help="with --model: the exact-activation path (activations='f32')")
    ap.add_argument("--level", help="with --model: the SIMD level to run (default: the best)")
    ap.add_argument("--moe", action="store_true",
                    help="time a Qwen3-30B-A3B-shaped MoE feed-forward instead (--types: Q4_K by default)")
    ap.add_argument("--bias", action="store_true",
                    help="time linear with and without the bias epilogue instead")
    ap.add_argument("--shapes", default=None,
                    help="N x K matrices instead of SmolLM2's, e.g. 1024x640,640x2048 (Gemma 3)")
    ap.add_argument("--cold-mb", type=float, default=0.0,
                    help="decode from DRAM: cycle each matrix's calls through copies of it "
                         "filling this many MB (past the L3), so no call finds its weights cached")
    args = ap.parse_args()
    clock = time.thread_time if args.cpu_time else time.perf_counter

    if args.threads:
        _quant.set_num_threads(args.threads)
    n_threads = _quant.num_threads()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"# ellm kernel benchmark: threads={n_threads} loadavg={load} "
          f"vnni={_quant.has_vnni()} clock={'thread cpu' if args.cpu_time else 'wall'}")
    if args.model:
        if args.level:
            _core.set_simd_level(args.level)
            _quant.set_simd_level(args.level)
        print(f"# {args.model}: one decode token's matmuls, level {_quant.simd_level()}"
              f"{', exact activations' if args.exact else ''}")
        if args.rows < 1:
            ap.error("--rows must be at least 1")
        bench_model(args.model, args.tokens, clock, args.exact, args.rows)
        return
    if args.moe:
        types = [t for t in args.types.split(",") if t] if args.types != ap.get_default("types") else ["Q4_K"]
        bench_moe(types, 5, clock)
        return
    if args.bias:
        bench_bias([t for t in args.types.split(",") if t], [lv for lv in args.levels.split(",") if lv],
                   21, clock)
        return
    Ts = [int(t) for t in str(args.prefill_tokens).split(",") if t]
    print(f"{'type':5} {'N x K':>11} {'level':>7} {'decode us':>10} {'GB/s':>7} "
          + " ".join(f"{f'GFLOP/s T={T}':>15}" for T in Ts))

    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rng = np.random.default_rng(0)
    levels = [lv for lv in args.levels.split(",") if lv]
    for tname in [t for t in args.types.split(",") if t]:
        qtype = TYPES[tname]
        blk = BLOCK.get(qtype, (1, 0))[0]
        for n, k in shapes:
            if k % blk:
                continue
            w = make_weights(qtype, n, k, rng)
            # --cold-mb: copies (rows rotated, so no two share bytes) that the decode calls take in turn
            copies = [w] + [np.roll(w, i + 1, axis=0) for i in range(int(args.cold_mb * 1e6 // w.nbytes))]
            turn = itertools.count()
            x1 = rng.standard_normal((1, k), dtype=np.float32)
            y1 = np.empty((1, n), np.float32)
            xps = {T: rng.standard_normal((T, k), dtype=np.float32) for T in Ts}
            yps = {T: np.empty((T, n), np.float32) for T in Ts}
            for level in levels:
                if level == "scalar" and n > 10000 and not args.all_scalar:
                    continue  # seconds per call, and says nothing the small shapes don't
                _core.set_simd_level(level)
                _quant.set_simd_level(level)  # the kernels' own copy of the level
                dec = time_call(lambda: _quant.linear(x1, copies[next(turn) % len(copies)], qtype, y1),
                                args.budget, 3, clock)
                gbs = w.nbytes / dec / 1e9
                cols = []
                for T in Ts:
                    pre_s = "-"
                    if n < 10000:
                        xp, yp = xps[T], yps[T]
                        pre = time_call(lambda: _quant.linear(xp, w, qtype, yp), args.budget, 2, clock)
                        pre_s = f"{2 * T * n * k / pre / 1e9:.1f}"
                    cols.append(f"{pre_s:>15}")
                print(f"{tname:5} {f'{n}x{k}':>11} {level:>7} {dec * 1e6:10.1f} {gbs:7.2f} "
                      + " ".join(cols), flush=True)
    _core.set_simd_level(_core.simd_best())
    _quant.set_simd_level(_core.simd_best())


if __name__ == "__main__":
    main()
