"""The `ellm` command: run | chat | serve | pull | list | bench | info | trace | inspect."""
from __future__ import annotations

import argparse
import sys
from typing import Any


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default for run)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "reference"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all this process may use)")


def _params(args: argparse.Namespace, default_temperature: float) -> Any:
    from .sampling_params import SamplingParams
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=default_temperature if args.temperature is None else args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop)


def _load(args: argparse.Namespace) -> Any:
    import ellm
    if getattr(args, "threads", 0):
        from ._native import _kernels
        _kernels.set_num_threads(args.threads)
    return ellm.load(args.model, device=args.device)


def _split_model_prompt(args: argparse.Namespace) -> tuple[str | None, str]:
    """`ellm run PROMPT` or `ellm run MODEL PROMPT`."""
    if len(args.words) == 1:
        return None, args.words[0]
    if len(args.words) == 2:
        return args.words[0], args.words[1]
    raise SystemExit("usage: ellm run [MODEL] PROMPT")


def cmd_run(args: argparse.Namespace) -> int:
    args.model, prompt = _split_model_prompt(args)
    llm = _load(args)
    params = _params(args, 0.0)
    # a template the model files carry means a chat model; a built-in one may be a base model
    if llm.tokenizer.chat_template and not llm.tokenizer.chat_template_builtin and not args.raw:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        bos = llm.tokenizer.bos_token_id
        if llm.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        source: Any = ids
    else:
        source = prompt
    for piece in llm.stream(source, params):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _load(args)
    if not llm.tokenizer.chat_template:
        print(f"error: {args.model or 'the model'} has no chat template", file=sys.stderr)
        return 2
    params = _params(args, 0.7)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        reply = []
        for piece in llm.stream(ids, params):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_pull(args: argparse.Namespace) -> int:
    from . import hub
    path = hub.pull(args.model, force=args.force)
    print(path)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from . import hub
    from .models import supported_model_types
    for m in hub.list_models():
        state = "pulled" if m.get("pulled") else "not pulled"
        print(f"{m['name']:<24} {str(m.get('architecture') or ''):<12} {state:<11} {m.get('path') or ''}")
    print(f"architectures (model_type): {', '.join(supported_model_types())}")
    return 0


def _print_architecture(model: str) -> None:
    """What `model` is and what ellm chose for it, from its config alone (no weights read)."""
    from . import hub
    from .config import ModelConfig
    from .models import family_of
    resolved = hub.resolve(model, progress=True)
    if resolved.kind == "gguf":
        from .formats.gguf import GGUFFile
        config = ModelConfig.from_gguf(GGUFFile(resolved.path))
    else:
        config = ModelConfig.from_folder(resolved.path)
    family = family_of(config)
    print(f"model: {resolved.path} ({resolved.kind})")
    print(f"architecture: {config.model_type} (family module ellm.models.{family.__name__.rsplit('.', 1)[-1]})")
    for key, value in config.describe().items():
        print(f"  {key}: {value}")


def _token_counts(text: str) -> tuple[int, ...]:
    """'100,500' -> (100, 500), for --contexts."""
    try:
        counts = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"token counts must be at least 1, got {text!r}")
    return counts


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    llm = _load(args)
    run_bench(llm, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, repeats=args.repeats,
              contexts=args.contexts)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import platform

    from . import __version__
    from ._native import _core
    if args.model:
        _print_architecture(args.model)
    print(f"ellm {__version__} on {platform.machine()} / Python {platform.python_version()}")
    print(f"native module: {_core.__file__}")
    print(f"SIMD kernels: {_core.simd_level()} (CPU supports: {', '.join(_core.supported_simd_levels())})")
    try:
        from ._native import _kernels
        print(f"threads: {_kernels.num_threads()}")
    except ImportError:
        pass
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ellm", description="Run LLMs on the CPU (and GPU) without PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="generate from a prompt (streams)")
    r.add_argument("words", nargs="+", metavar="[MODEL] PROMPT")
    r.add_argument("--raw", action="store_true",
                   help="do not apply the chat template (models without one in their files run raw)")
    _add_sampling(r)
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("chat", help="interactive chat with the model's template")
    c.add_argument("model", nargs="?", default=None)
    c.add_argument("--system", default=None)
    _add_sampling(c)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from .server import cli as server_cli
        server_cli.add_arguments(s)
        s.set_defaults(func=server_cli.main)
    except ImportError:
        s.set_defaults(func=lambda a: _missing_server())
    pl = sub.add_parser("pull", help="download a known model into the cache")
    pl.add_argument("model")
    pl.add_argument("--force", action="store_true")
    pl.set_defaults(func=cmd_pull)
    ls = sub.add_parser("list", help="known and pulled models")
    ls.set_defaults(func=cmd_list)
    b = sub.add_parser("bench", help="prefill and decode tokens/s, peak memory")
    b.add_argument("model", nargs="?", default=None)
    b.add_argument("--prompt-tokens", type=int, default=512)
    b.add_argument("--new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--contexts", type=_token_counts, default=(), metavar="N,N,...",
                   help="also time decode after prompts of these lengths (e.g. 100,500,1000,2000)")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda", "reference"])
    b.add_argument("--threads", type=int, default=0)
    b.set_defaults(func=cmd_bench)
    i = sub.add_parser("info", help="version, native kernels chosen, threads; with MODEL, its architecture")
    i.add_argument("model", nargs="?", default=None)
    i.set_defaults(func=cmd_info)
    # -- trace / inspect (ellm/trace/cli.py) --
    from .trace import cli as trace_cli
    t = sub.add_parser("trace", help="diff every layer's ops against a reference; name the first that goes wrong")
    trace_cli.add_trace_arguments(t)
    t.set_defaults(func=trace_cli.cmd_trace)
    ins = sub.add_parser("inspect", help="a local web page showing the model's layers at work")
    trace_cli.add_inspect_arguments(ins)
    ins.set_defaults(func=trace_cli.cmd_inspect)
    return p


def _missing_server() -> int:
    print("error: `ellm serve` needs the server extra: pip install 'ellm[server]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
