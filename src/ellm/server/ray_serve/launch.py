"""`ellm serve MODEL --replicas N`: joins or starts a Ray cluster and deploys the
application on Serve's HTTP proxy until SIGINT/SIGTERM."""
from __future__ import annotations

import logging
from typing import Any

import ray
from ray import serve

from ..hosts import is_loopback, url_host
from .deployment import APP_NAME, build_app

# The object store only carries small messages here (ids, deltas): keep it small.
LOCAL_OBJECT_STORE_BYTES = 200 << 20


def start_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Joins the cluster at address, or starts a local one (no dashboard, a small object
    store) sized for num_cpus. -> whether this process started it (and so stops it)."""
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, logging_level=logging.WARNING)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES,
             logging_level=logging.WARNING)
    return True


def serve_forever(args: Any, api_key: str | None) -> int:
    """`ellm serve MODEL --replicas N`: deploys build_app(...) on Ray Serve with its HTTP
    proxy on --host:--port and serves until SIGINT/SIGTERM; then deletes the app (Serve
    lets running streams finish, up to GRACEFUL_SHUTDOWN_S) and stops what it started."""
    import signal
    import sys
    import threading

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if api_key is None and not is_loopback(args.host):
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use it",
              file=sys.stderr)
    app = build_app(args.model, replicas=args.replicas, threads_per_replica=args.threads_per_replica,
                    router=args.router, api_key=api_key, served_model_name=args.served_model_name,
                    max_queue=args.max_queue, allowed_origins=args.allowed_origins or (), device=args.device,
                    max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                    max_batch_tokens=args.max_batch_tokens, chat_template=args.chat_template,
                    speculative_config=args.speculative_config, kv_cache_dtype=args.kv_cache_dtype,
                    quantize=args.quantize)
    owned = start_ray(args.ray_address, num_cpus=args.replicas * args.threads_per_replica)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        print(f"ellm: serving {args.replicas} replicas on http://{url_host(args.host)}:{args.port}/v1 "
              f"(Ray Serve, router: {args.router})", file=sys.stderr, flush=True)
        stop.wait()
        print("ellm: draining streams and stopping", file=sys.stderr, flush=True)
    finally:
        try:
            serve.delete(APP_NAME)
            if owned:
                serve.shutdown()
        finally:
            if owned:
                ray.shutdown()
    return 0


