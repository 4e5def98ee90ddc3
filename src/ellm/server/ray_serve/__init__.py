"""ellm on Ray Serve (extra `ellm-engine[ray]`): N engine replicas behind one OpenAI ingress.

Two deployments make the application:

- `EllmReplica` (N of them): one ellm.LLM each, its own engine thread, KV cache and
  prefix cache. It takes prompt token ids and SamplingParams and streams the engine's
  deltas back (`generate`), embeds (`embed`), and says what it serves (`describe`).
- `EllmIngress`: the single-process server's own FastAPI app (server/app.py: the same
  routes, validation, errors, SSE, tools, /v1/responses, API key) over a `ReplicaPool`
  instead of a local AsyncEngine. It tokenizes and renders templates itself, so every
  replica receives token ids, and the router can see a request's prefix.

The handle from the ingress to the replicas routes with `PrefixAffinityRouter`, a Ray
Serve RequestRouter: a prompt whose leading KV blocks were last sent to a replica goes
there again (its prefix cache holds them), unless that replica is much busier than the
least-loaded one; a prompt nobody has seen goes to the less busy of two random replicas
(Serve's power of two choices). `RoundRobinRouter` is the baseline it is measured against.

Faults: a replica that dies before a request has streamed anything is invisible to the
client (the request is sent again, to a living replica); one that dies mid-stream ends
that stream with an OpenAI error event (`engine_stopped`), never a hang. Serve restarts
the dead replica. Shutdown waits for running streams (graceful_shutdown_timeout_s).

    from ellm.server.ray_serve import build_app
    serve.run(build_app("smollm2-135m-instruct", replicas=4), route_prefix="/")

The modules: messages (what travels between the two), replica (EllmReplica), router
(the RequestRouters and PrefixTable), pool (ReplicaPool: the ingress's engine look-alike),
deployment (EllmIngress and build_app), launch (`ellm serve --replicas N`).
"""
from __future__ import annotations

from .deployment import APP_NAME, ROUTERS, EllmIngress, build_app
from .launch import serve_forever, start_ray
from .messages import ModelSpec
from .pool import ReplicaPool
from .replica import EllmReplica
from .router import BLOCK_SIZE, PrefixAffinityRouter, PrefixTable, RoundRobinRouter, block_hashes

__all__ = ["APP_NAME", "BLOCK_SIZE", "ROUTERS", "EllmIngress", "EllmReplica", "ModelSpec", "PrefixAffinityRouter",
           "PrefixTable", "ReplicaPool", "RoundRobinRouter", "block_hashes", "build_app", "serve_forever", "start_ray"]
