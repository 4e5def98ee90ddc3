"""The `ellm` command: run | chat | serve | pull | list | bench | info | trace | inspect, and --version."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .cli_args import add_quantize_argument, device_arg

# `ellm chat`'s reply cap (--max-tokens). The default model's replies that end do so in
# 8-340 tokens (its default, greedy with a repetition penalty of 1.1: 8, 230, 338, 340;
# sampled at temperature 1: 46-270), but some never end: sampled, "Tell me about Paris."
# ran past 1,024 tokens twice; plain greedy loops on a phrase. 512 stops such a reply
# within ~35 s on the slowest path measured (15 tok/s: exact activations, AVX2, one
# thread) and is 1.5x the longest reply that ended. `--max-tokens N` sets another.
CHAT_MAX_TOKENS = 512


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int | None) -> None:
    """Sampling and loading options. Sampling options left out take the model's defaults
    (its generation_config.json or GGUF general.sampling.*, else ellm's)."""
    shown = "until EOS or the end of the context" if max_tokens is None else str(max_tokens)
    p.add_argument("--max-tokens", "-n", type=int, default=max_tokens,
                   help=f"most tokens to generate (default: {shown})")
    p.add_argument("--temperature", "--temp", type=float, default=None, help="0 = greedy (default: the model's)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--system", "-s", default=None, help="a system prompt (uses the chat template)")
    p.add_argument("--ctx-size", "-c", "--max-model-len", dest="ctx_size", type=int, default=None,
                   help="prompt + output tokens per sequence (default 8192, capped by the model's own)")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a Jinja chat template (text or file) to use instead of the model's own")
    p.add_argument("--device", default="cpu", type=device_arg, metavar="{cpu,cuda,reference}")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all this process may use)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",  # [spec]
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="float16 (cpu) / bfloat16 (cuda): K/V stored rounded, half the cache "
                        "(default auto: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--kv-cache-tokens", type=int, default=0, metavar="N",
                   help="KV cache size in tokens, all sequences together (default: max(ctx size, 16384))")
    add_quantize_argument(p)


def _params(args: argparse.Namespace, llm: Any = None) -> Any:
    """The model's defaults with the options given on the command line. Without llm (before
    loading), ellm's fallback defaults: a bad option is refused before the model loads."""
    import dataclasses

    from .sampling_defaults import SamplingDefaults
    defaults = llm.defaults if llm is not None else SamplingDefaults()
    params = defaults.params(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, stop=args.stop)
    # Set apart: None is meaningful here (until EOS or the end of the context).
    return dataclasses.replace(params, max_tokens=args.max_tokens)


def _load(args: argparse.Namespace) -> Any:
    import ellm
    options: dict[str, Any] = {"device": args.device, "threads": getattr(args, "threads", None)}
    if getattr(args, "ctx_size", None) is not None:
        options["max_model_len"] = args.ctx_size
    if getattr(args, "chat_template", None) is not None:
        options["chat_template"] = args.chat_template
    if getattr(args, "speculative_config", None) is not None:  # [spec]
        options["speculative_config"] = args.speculative_config
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "kv_cache_tokens", 0):
        options["kv_cache_tokens"] = args.kv_cache_tokens
    if getattr(args, "quantize", None) is not None:
        options["quantize"] = args.quantize
    return ellm.load(args.model, **options)


def _split_model_prompt(args: argparse.Namespace) -> tuple[str | None, str]:
    """`ellm run [MODEL] PROMPT...` (see cli_args.split_model_prompt); a PROMPT of '-' is read
    from stdin."""
    from .cli_args import split_model_prompt
    model, prompt = split_model_prompt(args.words)
    if prompt == "-":
        prompt = sys.stdin.read()
        if not prompt.strip():
            raise SystemExit("error: no prompt on stdin")
    return model, prompt


def cmd_run(args: argparse.Namespace) -> int:
    args.model, prompt = _split_model_prompt(args)
    if args.raw and args.system:
        print("error: --system needs the chat template; drop --raw", file=sys.stderr)
        return 2
    _params(args)   # bad sampling options fail before the model loads
    llm = _load(args)
    params = _params(args, llm)
    tok = llm.tokenizer
    # A template the model files carry means a chat model; a built-in one may be a base
    # model, so it is used only when asked for (--system, --chat-template).
    chat = not args.raw and tok.chat_template and (
        not tok.chat_template_builtin or args.system or args.chat_template)
    if args.system and not tok.chat_template:
        print(f"error: {args.model or 'the model'} has no chat template, so --system cannot be used",
              file=sys.stderr)
        return 2
    images = args.image or []
    if images and llm.processing is None:   # [vision]
        print(f"error: {args.model or llm.source} takes no images (it has no vision tower); drop --image",
              file=sys.stderr)
        return 2
    if chat:
        content: Any = prompt
        if images:   # the images first, then the question, as the models' own examples do
            content = [{"type": "image", "image": f} for f in images] + [{"type": "text", "text": prompt}]
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": content}]
        pieces = llm.chat_stream(messages, params)
    elif images:
        # raw: the prompt says where the images go; without placeholders they go first
        mark = llm.processing.placeholder
        text = prompt if mark in prompt else mark * len(images) + prompt
        pieces = llm.stream(text, params, images=images)
    else:
        pieces = llm.stream(prompt, params)
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from . import chat_repl, hub
    _params(args)   # bad sampling options fail before the model loads
    llm = _load(args)
    if not llm.tokenizer.chat_template:
        print(f"error: {args.model or 'the model'} has no chat template", file=sys.stderr)
        return 2
    session = chat_repl.ChatSession(llm, _params(args, llm), system=args.system)
    history = None if args.no_history else hub.cache_dir() / "chat_history"
    return chat_repl.run(session, history=history)


def cmd_pull(args: argparse.Namespace) -> int:
    from . import hub
    if args.model.strip().lower() in hub.KNOWN_MODELS:
        path = hub.pull(args.model, force=args.force)
    elif args.force:
        print("error: --force is for ellm's known models; the Hugging Face cache keeps its own files",
              file=sys.stderr)
        return 2
    else:   # a Hugging Face repo (org/name, org/name:TAG, org/name/FILE.gguf)
        path = hub.resolve(args.model).path
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
    from .models import config_from_folder, config_from_gguf, family_of
    resolved = hub.resolve(model, progress=True)
    if resolved.kind == "gguf":
        from .formats.gguf import GGUFFile
        config = config_from_gguf(GGUFFile(resolved.path))
    else:
        config = config_from_folder(resolved.path)
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
    import ellm
    from .bench import run_bench
    llm = ellm.load(args.model, device=args.device, threads=args.threads, quantize=args.quantize)
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
    level = "+".join([_core.simd_level(), *_core.simd_extensions()])  # aarch64: neon+dotprod+i8mm
    print(f"SIMD kernels: {level} (CPU supports: {', '.join(_core.supported_simd_levels())})")
    try:
        from ._native import _kernels
        print(f"threads: {_kernels.num_threads()}")
    except ImportError:
        pass
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = argparse.ArgumentParser(prog="ellm", description="Run LLMs on the CPU (and GPU) without PyTorch.")
    p.add_argument("--version", "-V", action="version", version=f"ellm {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="generate from a prompt (streams)",
                       description="Generate from PROMPT ('-': read it from stdin). A model whose files carry "
                                   "a chat template gets the prompt as a user message under that template.")
    r.add_argument("words", nargs="+", metavar="[MODEL] PROMPT")
    r.add_argument("--raw", action="store_true",
                   help="do not apply the chat template (models without one in their files run raw)")
    r.add_argument("--image", action="append", metavar="FILE",
                   help="an image for a vision model (repeat for several); with --raw the prompt's "
                        "placeholders (e.g. <image>) say where each goes")
    _add_sampling(r, max_tokens=256)
    r.set_defaults(func=cmd_run)
    c = sub.add_parser("chat", help="interactive chat with the model's template",
                       description="An interactive chat. Ctrl-C stops a reply and keeps the session; a message "
                                   'over several lines goes between """ and """; /help lists the commands.')
    c.add_argument("model", nargs="?", default=None)
    c.add_argument("--no-history", action="store_true", help="keep no line history file")
    _add_sampling(c, max_tokens=CHAT_MAX_TOKENS)
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    try:
        from .server import cli as server_cli
        server_cli.add_arguments(s)
        s.set_defaults(func=lambda a: _serve(a, server_cli.main))
    except ImportError:
        s.set_defaults(func=lambda a: _missing_server())
    pl = sub.add_parser("pull", help="download a known model, or a Hugging Face repo, into the cache")
    pl.add_argument("model", help="a known name, or org/name (safetensors), org/name:TAG (e.g. :Q4_K_M) "
                                  "or org/name/FILE.gguf (GGUF) on the Hugging Face Hub")
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
    b.add_argument("--device", default="cpu", type=device_arg, metavar="{cpu,cuda,reference}")
    b.add_argument("--threads", "-t", type=int, default=None)
    add_quantize_argument(b)
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
    for sub_parser in sub.choices.values():   # errors after parsing show the command's own usage
        sub_parser.set_defaults(command_parser=sub_parser)
    return p


def _serve(args: argparse.Namespace, serve: Any) -> int:
    """`ellm serve`: a port it cannot have is refused before the model loads."""
    from .cli_args import port_problem
    problem = port_problem(args.host, args.port)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return int(serve(args) or 0)


def _missing_server() -> int:
    print("error: `ellm serve` needs the server extra: pip install 'ellm-engine[server]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    from .hub import PullError
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `ellm run MODEL --image FILE PROMPT`: argparse ends the positionals at the first
    # option, so words after the options come back here; they are the rest of [MODEL] PROMPT.
    if extra and args.command == "run" and not any(w.startswith("-") for w in extra):
        args.words += extra
    elif extra:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`ellm info | head -1`): stop quietly, as other tools do;
        # point stdout at /dev/null so the interpreter's final flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by it
    except (FileNotFoundError, ValueError, OSError, PullError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
