"""How the prefix-affinity router behaves at scale (100 replicas, 10,000 clients): a
discrete-event simulation of the routing decision, the replicas' prefix caches and
their queues, with the router's own state class (ellm.server.ray_serve.PrefixTable).

Model. Clients run multi-turn chats back to back (closed loop: think time between
turns); each chat starts with one of `--system-prompts` shared system prompts and sends
its whole history every turn. A replica runs up to `--batch` requests at once; a request
holds a slot for (uncached prompt tokens / prefill rate) + (output tokens x step time).
Each replica's prefix cache is an LRU of KV blocks (`--cache-blocks`); a prompt's hit is
its longest cached leading run of blocks, as in the engine. Routers: "prefix" (the
PrefixTable, imbalance threshold, power-of-two fallback: PrefixAffinityRouter's logic),
"pow2" (Ray Serve's default), "round-robin". Queue lengths are exact here; in Serve they
come from a cache the replicas refresh, so real spills are a little later.

Reported per router: prefix-cache hit rate (tokens), request latency p50/p99, the
busiest replica's mean queue over the mean, and the router's Python cost per decision
(measured: block hashing + table look-up + record) and table size.

    python benchmarks/ray_router_sim.py                       # 100 replicas, 10,000 clients
    python benchmarks/ray_router_sim.py --replicas 10 --clients 1000
"""
from __future__ import annotations

import argparse
import heapq
import random
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from ellm.server.ray_serve import BLOCK_SIZE, PrefixTable, block_hashes


@dataclass
class Replica:
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)
    running: int = 0
    queue: deque = field(default_factory=deque)

    @property
    def load(self) -> int:
        return self.running + len(self.queue)


class Sim:
    def __init__(self, args: argparse.Namespace, router: str) -> None:
        self.a, self.router = args, router
        self.rng = random.Random(args.seed)
        self.replicas = [Replica() for _ in range(args.replicas)]
        self.table = PrefixTable(args.table_blocks)
        self.rr = 0
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.hit_tokens = self.prompt_tokens = 0
        self.latencies: list[float] = []
        self.route_cost: list[float] = []
        self.load_samples: list[tuple[int, float]] = []
        self.next_token = 100_000   # fresh token ids for user turns and replies

    def push(self, t: float, kind: str, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def fresh(self, n: int) -> list[int]:
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def system_prompt(self) -> list[int]:
        k = self.rng.randrange(self.a.system_prompts)
        return [k * 1000 + j for j in range(self.a.system_tokens)]

    # -- routing ------------------------------------------------------------------------
    def route(self, ids: list[int]) -> int:
        t0 = time.perf_counter()
        n = len(self.replicas)
        if self.router == "round-robin":
            self.rr = (self.rr + 1) % n
            choice = self.rr
        else:
            i, j = self.rng.sample(range(n), 2)
            choice = i if self.replicas[i].load <= self.replicas[j].load else j
            if self.router == "prefix":
                owners = self.table.owners_of(ids, range(n))
                if owners:
                    owner = min(owners, key=lambda k: self.replicas[k].load)
                    shortest = min(r.load for r in self.replicas)   # as the router: over all replicas
                    if self.replicas[owner].load - shortest <= self.a.imbalance:
                        choice = owner
                self.table.record(ids, choice)
        self.route_cost.append(time.perf_counter() - t0)
        return choice

    # -- replicas -----------------------------------------------------------------------
    def start(self, t: float, r: int, req: dict) -> None:
        rep = self.replicas[r]
        hashes = block_hashes(req["ids"])
        hit = 0
        for h in hashes:
            if h not in rep.cache:
                break
            rep.cache.move_to_end(h)
            hit += 1
        for h in hashes[hit:]:
            rep.cache[h] = None
        while len(rep.cache) > self.a.cache_blocks:
            rep.cache.popitem(last=False)
        cached = hit * BLOCK_SIZE
        self.hit_tokens += cached
        self.prompt_tokens += len(req["ids"])
        service = (len(req["ids"]) - cached) / self.a.prefill_tps + self.a.output_tokens * self.a.step_s
        rep.running += 1
        self.push(t + service, "done", (r, req))

    def arrive(self, t: float, req: dict) -> None:
        r = self.route(req["ids"])
        req["t0"] = t
        rep = self.replicas[r]
        if rep.running < self.a.batch:
            self.start(t, r, req)
        else:
            rep.queue.append(req)

    def run(self) -> dict[str, float]:
        a = self.a
        for c in range(a.clients):
            conv = {"history": self.system_prompt(), "turn": 0}
            self.push(self.rng.uniform(0, a.think_s), "turn", conv)
        t_end = a.seconds
        next_sample = 0.0
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            if t > t_end:
                break
            if t >= next_sample:
                loads = [r.load for r in self.replicas]
                self.load_samples.append((max(loads), statistics.fmean(loads)))
                next_sample = t + 1.0
            if kind == "turn":
                conv = obj  # type: ignore[assignment]
                conv["history"] = conv["history"] + self.fresh(a.user_tokens)
                self.arrive(t, {"ids": conv["history"], "conv": conv})
            else:
                r, req = obj  # type: ignore[misc]
                rep = self.replicas[r]
                rep.running -= 1
                self.latencies.append(t - req["t0"])
                if rep.queue:
                    self.start(t, r, rep.queue.popleft())
                conv = req["conv"]
                conv["history"] = conv["history"] + self.fresh(a.output_tokens)
                conv["turn"] += 1
                if conv["turn"] >= a.turns:   # a new chat for this client
                    conv["history"], conv["turn"] = self.system_prompt(), 0
                self.push(t + self.rng.expovariate(1 / a.think_s), "turn", conv)
        lat = sorted(self.latencies)
        busiest = statistics.fmean(m for m, _ in self.load_samples) / max(
            1e-9, statistics.fmean(x for _, x in self.load_samples))
        return {"requests": len(lat), "hit_rate": self.hit_tokens / max(1, self.prompt_tokens),
                "p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)], "busiest": busiest,
                "route_us": statistics.median(self.route_cost) * 1e6, "table": len(self.table.owners)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=100)
    p.add_argument("--clients", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=120, help="simulated time")
    p.add_argument("--turns", type=int, default=4, help="user turns per chat")
    p.add_argument("--system-prompts", type=int, default=200, help="distinct shared system prompts")
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--user-tokens", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=120)
    p.add_argument("--think-s", type=float, default=20.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--batch", type=int, default=64, help="requests a replica runs at once")
    p.add_argument("--prefill-tps", type=float, default=8000, help="prompt tokens/s of one replica")
    p.add_argument("--step-s", type=float, default=0.03, help="one decode step of a full batch")
    p.add_argument("--cache-blocks", type=int, default=4096, help="prefix-cache blocks per replica (16 tokens)")
    p.add_argument("--table-blocks", type=int, default=2_000_000, help="PrefixTable entries")
    p.add_argument("--imbalance", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    print(f"{args.replicas} replicas x batch {args.batch}, {args.clients} clients, {args.turns}-turn chats, "
          f"{args.system_prompts} system prompts of {args.system_tokens} tokens, {args.seconds:g} s simulated")
    print("| router      | requests | hit rate | latency p50 / p99 s | busiest / mean load | route us | table |")
    print("| ----------- | -------- | -------- | ------------------- | ------------------- | -------- | ----- |")
    for router in ("prefix", "pow2", "round-robin"):
        r = Sim(args, router).run()
        print(f"| {router:<11} | {r['requests']:>8} | {r['hit_rate']:>8.3f} | {r['p50']:>8.2f} / {r['p99']:>7.2f} "
              f"| {r['busiest']:>19.2f} | {r['route_us']:>8.1f} | {r['table']:>5} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
