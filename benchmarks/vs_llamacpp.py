"""ellm against llama.cpp (llama-cpp-python) and transformers, side by side on one machine.

Same GGUF file, same prompt token ids, same thread count, greedy. Each engine runs in its
own subprocess (so peak RSS is its own); rounds alternate the engines' order and the
table reports medians over rounds (of a median of 3 prefill calls within each round) and
ratios ellm / peer (above 1 is better for the speeds, below 1 for peak RSS and for the time
to the first token: from the worker's import of the engine, through loading the file, to
the first token of a 16-token prompt, the file already in the page cache).

    python benchmarks/vs_llamacpp.py --models smollm2-135m-instruct gemma-3-270m --rounds 5
    python benchmarks/vs_llamacpp.py --install-llamacpp   # builds llama-cpp-python in benchmarks/.venv-llamacpp
    python benchmarks/vs_llamacpp.py --models ~/.cache/ellm/random/llama-3.2-1b-Q4_K_M.gguf  # any GGUF path

(benchmarks/make_random_gguf.py makes random-weight GGUF files of real 1B-8B shapes.)

transformers (torch CPU) runs on the dequantized f32 folder when --hf-python points at a
Python with transformers and the folder exists (tests/goldens/make.py --folders makes it).

--contexts 500,2000 adds decode speed after prompts of those lengths (32 new tokens each,
ellm and llama.cpp): how the cost per token grows with the context.

--simd avx2 compares the two as on a CPU without AVX-512: ellm runs with ELLM_SIMD=avx2 and
llama.cpp from its own build with this CPU's AVX-512 flags off (--install-llamacpp --simd
avx2 makes it, in benchmarks/.venv-llamacpp-avx2). --simd avx512 runs ellm without its AMX
tiles beside the default build (whose AMX path is off, see llamacpp_cmake_args).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLAMACPP_VENV = HERE / ".venv-llamacpp"
# The x86 flags a build for --simd avx2 may use: those of an AVX2 CPU without AVX-512 or
# AVX-VNNI (Zen 2 and 3, Haswell to Comet Lake), the class ellm's avx2 level is made for
AVX2_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi2"}
LLAMACPP_VERSION = "0.3.36"
TASKS = ("prefill128", "prefill512", "decode128")


# -- workers (run in a subprocess each) ------------------------------------------------

def _peak_rss_mb() -> float:
    """This process's peak resident memory. Linux: VmHWM, which starts afresh at exec;
    ru_maxrss does not (it keeps the parent's resident size at the fork, so a parent that
    holds a 262k-token tokenizer set both workers' figure to its own)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _prefill_rate(prefill, n: int) -> float:
    """Tokens/s of prefilling n tokens, the median of 3 calls (one call is ~0.5 s, and
    a neighbour taking a core for part of it would otherwise decide the round)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        prefill(n)
        times.append(time.perf_counter() - t0)
    return n / statistics.median(times)


def _max_len(contexts: list[int]) -> int:
    return max([2048] + [c + 64 for c in contexts])


def worker_ellm(model: str, threads: int, ids: list[int], contexts: list[int]) -> dict:
    t_start = time.perf_counter()
    import ellm
    from ellm._native import _kernels
    from ellm.sampling_params import SamplingParams
    _kernels.set_num_threads(threads)
    llm = ellm.load(model, progress=False, max_model_len=_max_len(contexts))
    llm.engine.blocks.enable_prefix_caching = False
    greedy1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(ids[:16], greedy1)  # warm-up: pages in the weights
    first_token_s = time.perf_counter() - t_start
    for t in threading.enumerate():  # the steady state: the weights' move onto 2 MiB pages done
        if t.name.startswith("ellm huge pages"):  # (a few seconds at 8B, formats/files.py)
            t.join()
    out = {"first_token_s": first_token_s}
    for n in (128, 512):
        out[f"prefill{n}"] = _prefill_rate(lambda k: llm.generate(ids[:k], greedy1), n)

    def decode(prompt: list[int], new: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new + 1, ignore_eos=True)
        rid = llm.engine.add_request(prompt, params)
        stamps = []
        while llm.engine.has_unfinished():
            for o in llm.engine.step():
                if o.request_id == rid and o.new_token_ids:
                    stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    out["decode128"] = decode(ids[:16], 128)
    out["rss_mb"] = _peak_rss_mb()  # before the long contexts, whose caches are larger
    for c in contexts:
        out[f"decode@{c}"] = decode(ids[:c], 32)
    return out


def worker_llamacpp(model: str, threads: int, ids: list[int], contexts: list[int]) -> dict:
    t_start = time.perf_counter()
    from llama_cpp import Llama
    llm = Llama(model_path=model, n_ctx=_max_len(contexts), n_batch=512, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    sampler = llm._init_sampler(top_k=1, temp=0.0)

    def prefill(toks: list[int]) -> None:
        llm.reset()
        llm.eval(toks)
        sampler.sample(llm._ctx, -1)

    prefill(ids[:16])
    out = {"first_token_s": time.perf_counter() - t_start}
    for n in (128, 512):
        out[f"prefill{n}"] = _prefill_rate(lambda k: prefill(ids[:k]), n)

    def decode(prompt: list[int], new: int) -> float:
        prefill(prompt)
        tok = sampler.sample(llm._ctx, -1)
        t0 = time.perf_counter()
        for _ in range(new):
            llm.eval([tok])
            tok = sampler.sample(llm._ctx, -1)
        return new / (time.perf_counter() - t0)

    out["decode128"] = decode(ids[:16], 128)
    out["rss_mb"] = _peak_rss_mb()  # before the long contexts, whose caches are larger
    for c in contexts:
        out[f"decode@{c}"] = decode(ids[:c], 32)
    return out


def worker_transformers(folder: str, threads: int, ids: list[int], contexts: list[int]) -> dict:
    # (decode at long contexts is not timed here: ~10 tok/s would make a round minutes long)
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    out = {}
    with torch.no_grad():
        model(torch.tensor([ids[:16]]))
        for n in (128, 512):
            out[f"prefill{n}"] = _prefill_rate(lambda k: model(torch.tensor([ids[:k]])), n)
        res = model(torch.tensor([ids[:16]]), use_cache=True)
        past, tok = res.past_key_values, res.logits[0, -1].argmax()
        steps = 32  # transformers decodes ~10 tok/s here: fewer steps keep a round short
        t0 = time.perf_counter()
        for _ in range(steps):
            res = model(tok.view(1, 1), past_key_values=past, use_cache=True)
            past, tok = res.past_key_values, res.logits[0, -1].argmax()
        out["decode128"] = steps / (time.perf_counter() - t0)
    out["rss_mb"] = _peak_rss_mb()
    return out


WORKERS = {"ellm": worker_ellm, "llama.cpp": worker_llamacpp, "transformers": worker_transformers}


# -- driver -------------------------------------------------------------------------------

def cpu_flags() -> set[str]:
    """The flags of /proc/cpuinfo's first processor (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def llamacpp_cmake_args(flags: set[str]) -> str:
    """CMake flags for a llama.cpp that runs on this CPU: each x86 extension it has, named
    (not GGML_NATIVE, whose probe also turns on the AMX path), and AMX always off --
    llama-cpp-python 0.3.36's AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat) on
    the Xeons here with both models, so a native build there cannot be timed at all."""
    wanted = [("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"),
              ("GGML_BMI2", "bmi2"), ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_AVX512", "avx512f"),
              ("GGML_AVX512_VBMI", "avx512vbmi"), ("GGML_AVX512_VNNI", "avx512_vnni"),
              ("GGML_AVX512_BF16", "avx512_bf16")]
    args = ["-DGGML_NATIVE=OFF"] + [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in wanted]
    return " ".join(args + ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def machine_line() -> str:
    """The CPU model and the flags that decide which kernels run (printed with the table)."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    keys = sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_vnni", "avx512_bf16", "avx_vnni")))
    return f"CPU: {model}; flags: {' '.join(keys) or '-'}; load average {loadavg():.1f}"


def llamacpp_venv(simd: str | None) -> Path:
    return HERE / ".venv-llamacpp-avx2" if simd == "avx2" else LLAMACPP_VENV


def install_llamacpp(simd: str | None) -> Path:
    venv = llamacpp_venv(simd)
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    flags = cpu_flags() & AVX2_FLAGS if simd == "avx2" else cpu_flags()
    cmake_args = llamacpp_cmake_args(flags)
    print(f"building llama-cpp-python=={LLAMACPP_VERSION} from source (about 15 minutes on 2 cores)"
          f" with CMAKE_ARGS={cmake_args!r} ...")
    # No wheel cache, so an earlier build with other flags is never reused.
    env = dict(os.environ, CMAKE_ARGS=cmake_args)
    subprocess.run([str(py), "-m", "pip", "install", "--no-cache-dir", "--force-reinstall", "--no-binary",
                    "llama-cpp-python", f"llama-cpp-python=={LLAMACPP_VERSION}"], check=True, env=env)
    return py


def run_worker(python: str, engine: str, model: str, threads: int, ids_file: Path,
               contexts: list[int], simd: str | None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1")
    if simd:
        env["ELLM_SIMD"] = simd
    cmd = [python, str(Path(__file__).resolve()), "--worker", engine, "--model", model,
           "--threads", str(threads), "--ids-file", str(ids_file),
           "--contexts", ",".join(map(str, contexts))]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{engine} worker failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def run_label(name: str) -> str:
    """A file-name-safe label for a model given by name or by path (a GGUF file of any
    shape, e.g. from make_random_gguf.py): the name itself, or the file's stem."""
    from ellm import hub
    if name.strip().lower() in hub.KNOWN_MODELS:
        return name.strip().lower()
    path = Path(name).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def bench_model(name: str, args: argparse.Namespace) -> list[str]:
    import ellm
    from ellm import hub
    from ellm.bench import bench_prompt
    resolved = hub.resolve(name)
    llm = ellm.load(str(resolved.path), progress=False, max_model_len=2048)
    ids = bench_prompt(llm, max([512] + args.contexts))
    del llm
    label = run_label(name)
    ids_file = HERE / f".ids-{label}.json"
    ids_file.write_text(json.dumps(ids))
    engines = {"ellm": (sys.executable, str(resolved.path))}
    if args.llamacpp_python:
        engines["llama.cpp"] = (args.llamacpp_python, str(resolved.path))
    hf_folder = hub.cache_dir() / "hf" / f"{label}-f32"
    if args.hf_python and hf_folder.exists():
        engines["transformers"] = (args.hf_python, str(hf_folder))
    results: dict[str, list[dict]] = {e: [] for e in engines}
    order = list(engines)
    for r in range(args.rounds):
        for engine in (order if r % 2 == 0 else order[::-1]):
            if loadavg() > args.max_load:
                print(f"  (load average {loadavg():.1f}: results of this run may be disturbed)")
            res = run_worker(engines[engine][0], engine, engines[engine][1], args.threads, ids_file,
                             args.contexts, args.simd)
            results[engine].append(res)
            print(f"  round {r + 1} {engine:<12} " + "  ".join(f"{k} {v:.1f}" for k, v in res.items()),
                  flush=True)
    ids_file.unlink()
    med = {e: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for e, runs in results.items()}
    ctx_cols = [f"decode@{c}" for c in args.contexts]
    cols = ["prefill128", "prefill512", "decode128"] + ctx_cols + ["rss_mb", "first_token_s"]
    heads = (["prefill tok/s @128", "prefill tok/s @512", "decode tok/s (128 new)"]
             + [f"decode tok/s at context {c}" for c in args.contexts] + ["peak RSS MB", "first token s"])
    fmt = {"rss_mb": "{:.0f}", "first_token_s": "{:.2f}"}
    level = f", ellm at ELLM_SIMD={args.simd}" if args.simd else ""
    lines = [f"### {label} ({args.threads} threads{level}, medians of {args.rounds} rounds)", "",
             "| engine | " + " | ".join(heads) + " |", "| --- " * (len(heads) + 1) + "|"]
    for e, m in med.items():
        lines.append(f"| {e} | " + " | ".join(fmt.get(k, "{:.1f}").format(m[k]) if k in m else "-" for k in cols)
                     + " |")
    for peer in engines:
        if peer == "ellm":
            continue
        m, p = med["ellm"], med[peer]
        lines.append(f"| ellm / {peer} | " + " | ".join(f"{m[k] / p[k]:.2f}x" if k in p else "-"
                                                        for k in cols) + " |")
    return lines


def context_list(text: str) -> list[int]:
    """'500,2000' -> [500, 2000]; each a prompt length of at least 16 tokens."""
    try:
        contexts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if any(c < 16 for c in contexts):
        raise argparse.ArgumentTypeError(f"context lengths must be at least 16 tokens, got {text!r}")
    return contexts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"],
                    help="known model names or GGUF paths (e.g. benchmarks/make_random_gguf.py's files)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--llamacpp-python", default=None,
                    help=f"a Python with llama-cpp-python (default: {LLAMACPP_VENV}/bin/python if present)")
    ap.add_argument("--install-llamacpp", action="store_true", help="build llama-cpp-python into its own venv")
    ap.add_argument("--hf-python", default=None, help="a Python with torch + transformers")
    ap.add_argument("--max-load", type=float, default=0.5)
    ap.add_argument("--contexts", type=context_list, default=[],
                    help="also time decode after prompts of these lengths, e.g. 500,2000")
    ap.add_argument("--simd", choices=["avx2", "avx512"], default=None,
                    help="run ellm at this SIMD level, and llama.cpp built for it (see above)")
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ids-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        ids = json.loads(Path(args.ids_file).read_text())
        print(json.dumps(WORKERS[args.worker](args.model, args.threads, ids, args.contexts)))
        return 0
    if args.install_llamacpp:
        args.llamacpp_python = str(install_llamacpp(args.simd))
    elif args.llamacpp_python is None and (llamacpp_venv(args.simd) / "bin" / "python").exists():
        args.llamacpp_python = str(llamacpp_venv(args.simd) / "bin" / "python")
    if args.llamacpp_python is None:
        print("llama.cpp not found: pass --llamacpp-python or --install-llamacpp"
              f"{' --simd ' + args.simd if args.simd else ''}; running ellm alone")
    print(machine_line())
    report = []
    for name in args.models:
        print(f"== {name}")
        report += bench_model(name, args) + [""]
    print("\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
