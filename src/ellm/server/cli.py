"""`ellm serve`: command-line options and the entry point that loads a model and runs
the server under uvicorn. The main CLI (ellm.cli) calls add_arguments and main."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..cli_args import add_quantize_argument, device_arg
from . import DEFAULT_MAX_QUEUE
from .hosts import is_loopback, url_host

API_KEY_ENV = "ELLM_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the serve options to p (a parser or a subparser)."""
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a Hugging Face folder or a known model name (default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health and /openapi.json "
                        f"(default: ${API_KEY_ENV}; prefer the variable: a key given here shows in the "
                        f"process list)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may send (the first is the one reported; default: the "
                        "model as given). A request without 'model' gets this model")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",  # [lora]
                   help="LoRA adapters served over the base (PEFT folders, or llama.cpp LoRA .gguf files for a "
                        ".gguf base); a request's \"model\": NAME picks one (docs/lora.md)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins allowed to call the API (CORS), e.g. http://localhost:3000, or '*'")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs in chat messages (at most 20 MB and 10 s each; public internet "
                        "addresses only); off: data: URLs only")
    p.add_argument("--allow-image-host", action="append", default=None, metavar="NAME",
                   help="with --allow-image-urls: a host whose images are fetched even at a loopback or private "
                        "address (as written in the URL, e.g. 127.0.0.1 or images.internal; repeatable)")
    p.add_argument("--device", default="cpu", type=device_arg, metavar="{cpu,cuda,reference}")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all this process may use)")
    p.add_argument("--max-model-len", "--ctx-size", "-c", type=int, default=8192,
                   help="prompt + output tokens per sequence (llama.cpp's --ctx-size)")
    p.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a Jinja chat template (text or file) to use instead of the model's own")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per forward pass")
    p.add_argument("--speculative-config", default=None, metavar="JSON",  # [spec]
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="float16 (cpu) / bfloat16 (cuda): K/V stored rounded, half the cache "
                        "(default auto: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--kv-cache-tokens", type=int, default=0, metavar="N",
                   help="KV cache size in tokens, all sequences together (default: max(--max-model-len, 16384))")
    add_quantize_argument(p)
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests queued or running before new ones get 429")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # [ray] scale out: N replicas on Ray Serve behind one ingress (ellm.server.ray_serve)
    p.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve behind one endpoint (needs 'ellm-engine[ray]')")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. 10.0.0.1:6379 or 'auto'); default: start a local one")
    p.add_argument("--threads-per-replica", type=int, default=1, metavar="T",
                   help="kernel threads (and Ray CPUs) of each replica (default: 1)")
    p.add_argument("--router", default="prefix", choices=["prefix", "round-robin", "pow2"],
                   help="how the ingress picks a replica: prefix-cache affinity (default), round robin, or "
                        "Ray Serve's power of two choices")


# Seconds a client has to send a request's headers (see server/timeouts.py).
HEADER_TIMEOUT_S = 10.0


def _usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    """Loads the model and serves until interrupted. -> exit status."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        return _usage_error(f"`ellm serve` needs the server extra ({e.name} is missing): "
                            "pip install 'ellm-engine[server]'")
    if not 0 < args.port < 65536:
        return _usage_error(f"--port must be in 1..65535, got {args.port}")
    if args.max_queue < 1:
        return _usage_error(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        return _usage_error("--served-model-name names must not be empty")
    from ..cli_args import CommandLineError, lora_modules
    try:
        lora_adapters = lora_modules(args.lora_modules)   # [lora] NAME=PATH, as vLLM's --lora-modules
    except CommandLineError as e:
        return _usage_error(str(e))
    if lora_adapters and args.replicas is not None:
        return _usage_error("--lora-modules is not supported with --replicas yet")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if api_key is None and not is_loopback(args.host):
        print(f"warning: serving on {args.host} without an API key (--api-key or ${API_KEY_ENV}): "
              "anyone who can reach it can use it", file=sys.stderr)

    if args.replicas is not None:   # [ray]
        if args.replicas < 1 or args.threads_per_replica < 1:
            return _usage_error("--replicas and --threads-per-replica must be >= 1")
        try:
            from . import ray_serve
        except ImportError as e:
            return _usage_error(f"--replicas needs the ray extra ({e.name} is missing): pip install 'ellm-engine[ray]'")
        return ray_serve.serve_forever(args, api_key)

    import ellm

    from . import create_app

    llm = ellm.load(args.model, device=args.device, max_model_len=args.max_model_len, threads=args.threads,
                    max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens,
                    chat_template=args.chat_template, speculative_config=args.speculative_config,
                    kv_cache_dtype=args.kv_cache_dtype, kv_cache_tokens=args.kv_cache_tokens,
                    lora_adapters=lora_adapters or None, quantize=args.quantize)
    names = args.served_model_name or [args.model if args.model is not None else llm.source]
    app = create_app(llm, served_model_name=names, api_key=api_key, max_queue=args.max_queue,
                     allowed_origins=args.allowed_origins or (), allow_image_urls=args.allow_image_urls,
                     allowed_image_hosts=tuple(args.allow_image_host or ()))
    shown = ", ".join(repr(n) for n in names)
    print(f"ellm: serving {shown} on http://{url_host(args.host)}:{args.port}/v1", file=sys.stderr, flush=True)
    from .timeouts import header_timeout_protocol
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.log_level == "debug", timeout_graceful_shutdown=5,
                http=header_timeout_protocol(HEADER_TIMEOUT_S), timeout_keep_alive=5)
    return 0
