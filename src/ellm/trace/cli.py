"""The `ellm trace` and `ellm inspect` commands (ellm/cli.py registers them)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..cli_args import device_arg


def _positions(text: str) -> list[int]:
    """'0,5,-1' -> [0, 5, -1] (negative: from the end)."""
    try:
        out = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positions, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("--positions is empty")
    return out


def add_trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a known name, a .gguf file or a Hugging Face folder")
    p.add_argument("prompt", help="the text to run (tokenized with the model's tokenizer)")
    p.add_argument("--reference", default="transformers", metavar="transformers|reference|FOLDER",
                   help="transformers on the same files (default), ellm's NumPy reference ops, "
                        "or transformers on another folder / GGUF file")
    p.add_argument("--reference-python", default=None, metavar="PYTHON",
                   help="a Python with torch and transformers (default: $ELLM_REF_PYTHON)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON here")
    p.add_argument("--positions", type=_positions, default=None, metavar="P,P,...",
                   help="positions to record and compare (default: all; -1 = the last)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--device", default="cpu", type=device_arg, metavar="{cpu,cuda,reference}")
    p.add_argument("--attention", type=_positions, default=None, metavar="L,L,...",
                   help="also write these layers' attention weights into --json")
    p.add_argument("--quiet", action="store_true", help="print only the verdict, not the table")
    _add_lora_arguments(p)
    p.add_argument("--adapter", default=None, metavar="NAME",
                   help="the adapter of --lora-modules to trace (default: the only one given); the "
                        "reference runs it too (transformers through peft: a PEFT folder)")


def _add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",  # [lora]
                   help="LoRA adapters over the model, as `ellm serve` takes them (PEFT folders, or "
                        "llama.cpp LoRA .gguf files for a .gguf model; docs/lora.md)")


def traced_adapter(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """[lora] (name, path) of the adapter `ellm trace` runs: --adapter among --lora-modules,
    or the only one given; (None, None): the base alone."""
    from ..cli_args import CommandLineError, lora_modules
    adapters = lora_modules(args.lora_modules)
    name = args.adapter
    if name is None:
        if len(adapters) > 1:
            raise CommandLineError(f"--lora-modules gives {len(adapters)} adapters: name the one to trace "
                                   f"with --adapter ({', '.join(adapters)})")
        name = next(iter(adapters), None)
    elif name not in adapters:
        given = ", ".join(adapters) if adapters else "none"
        raise CommandLineError(f"--adapter {name!r} is not among --lora-modules (given: {given})")
    return name, None if name is None else adapters[name]


def prompt_ids(llm: Any, prompt: str, chat: bool) -> list[int]:
    if chat:
        if not llm.tokenizer.chat_template:
            raise ValueError("--chat: this model has no chat template")
        return llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return llm.encode_prompt(prompt)


def cmd_trace(args: argparse.Namespace) -> int:
    """Exit 0 when every op is within tolerance, 1 at a divergence, 2 on bad input."""
    import ellm
    from .. import hub
    from .references import ReferenceError
    from .tracer import make_reference, trace

    adapter, adapter_path = traced_adapter(args)   # checked before the model loads (both None, or both set)
    resolved = hub.resolve(args.model)
    llm = ellm.load(resolved.path, device=args.device, max_num_seqs=1, progress=False,
                    lora_adapters=None if adapter is None or adapter_path is None else {adapter: adapter_path})
    ids = prompt_ids(llm, args.prompt, args.chat)
    try:
        reference = make_reference(args.reference, resolved.path, args.reference_python, adapter=adapter_path)
        result = trace(llm, ids, reference, model_path=resolved.path, positions=args.positions,
                       attention_layers=_layers(args.attention, llm.config.num_hidden_layers), adapter=adapter)
    except ReferenceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = result.table()
    print(text.splitlines()[-1] if args.quiet else text)
    if args.json:
        Path(args.json).write_text(json.dumps(result.as_json()))
    return 0 if result.first is None else 1


def _layers(layers: list[int] | None, n: int) -> list[int]:
    out = []
    for i in layers or []:
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise ValueError(f"--attention: layer {i} is outside 0..{n - 1}")
        out.append(j)
    return out


def add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="a known name, a .gguf file or a folder")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--device", default="cpu", type=device_arg, metavar="{cpu,cuda,reference}")
    p.add_argument("--max-tokens", type=int, default=256, help="longest prompt the page may trace")
    _add_lora_arguments(p)


def cmd_inspect(args: argparse.Namespace) -> int:
    try:
        from .inspect.app import serve
    except ImportError as e:
        print(f"error: `ellm inspect` needs the server extra: pip install 'ellm-engine[server]' ({e})", file=sys.stderr)
        return 2
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    from ..cli_args import lora_modules
    serve(args.model, host=args.host, port=args.port, device=args.device, max_tokens=args.max_tokens,
          lora_adapters=lora_modules(args.lora_modules))
    return 0
