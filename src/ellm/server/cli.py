"""`ellm serve`: command-line options and the entry point that loads a model and runs
the server under uvicorn. The main CLI (ellm.cli) calls add_arguments and main."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the serve options to p (a parser or a subparser)."""
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file, a Hugging Face folder or a known model name (default: the default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: the model source)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda", "reference"])
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: all this process may use)")
    p.add_argument("--max-model-len", type=int, default=8192, help="prompt + output tokens per sequence")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per forward pass")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests queued or running before new ones get 429")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def main(args: argparse.Namespace) -> int:
    """Loads the model and serves until interrupted. -> exit status."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        print(f"error: `ellm serve` needs the server extra ({e.name} is missing): "
              "pip install 'ellm[server]'", file=sys.stderr)
        return 2
    if not 0 < args.port < 65536:
        print(f"error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    if args.max_queue < 1:
        print(f"error: --max-queue must be >= 1, got {args.max_queue}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.api_key is None and not _is_loopback(args.host):
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)

    import ellm

    from ..engine.async_engine import AsyncEngine
    from .app import Server, ServerConfig, build_app

    if args.threads:
        from .._native import _kernels  # type: ignore[attr-defined]
        _kernels.set_num_threads(args.threads)
    llm = ellm.load(args.model, device=args.device, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_batch_tokens=args.max_batch_tokens)
    name = args.served_model_name or (args.model if args.model is not None else llm.source)
    cfg = ServerConfig(model_name=name, max_model_len=llm.engine.cfg.max_model_len,
                       vocab_size=llm.config.vocab_size, api_key=args.api_key, source=llm.source)
    server = Server(AsyncEngine(llm.engine, args.max_queue), llm.tokenizer, cfg)
    print(f"ellm: serving {name!r} on http://{_url_host(args.host)}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level=args.log_level,
                access_log=args.log_level == "debug", timeout_graceful_shutdown=5)
    return 0


serve_command = main


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
