"""How the ingress picks a replica (Ray Serve RequestRouters; they run inside the process
holding the handle: the ingress). PrefixAffinityRouter sends a prompt where its leading
KV blocks were last sent (that replica's prefix cache holds them) unless that replica is
much busier; PrefixTable is its state, apart from Ray so that it can be simulated at
scale. RoundRobinRouter is the baseline it is measured against."""
from __future__ import annotations

import itertools
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK_SIZE = 16                # the engine's KV block size: the unit a prefix is cached in


def block_hashes(ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained hashes of the prompt's full blocks, in the engine's unit: equal hashes at
    index j mean equal first (j+1) blocks. The last prompt token is left out, as the
    engine never serves the block holding it from the cache."""
    out, prev = [], 0
    usable = (len(ids) - 1) // block_size
    for j in range(usable):
        prev = hash((prev, tuple(ids[j * block_size:(j + 1) * block_size])))
        out.append(prev)
    return out


def _prompt_of(pending: PendingRequest | None) -> list[int] | None:
    """The prompt ids of a `generate` call (its first argument), else None."""
    if pending is None or pending.metadata.call_method != "generate" or not pending.args:
        return None
    ids = pending.args[0]
    return ids if isinstance(ids, list) else None


class PrefixTable:
    """Which replicas were last sent each known prompt prefix, in KV blocks: the state of
    PrefixAffinityRouter, apart from Ray so that it can be simulated at scale
    (benchmarks/ray_router_sim.py). An LRU of block hash -> its last `owners_per_block`
    replicas (most recent last), max_blocks long. Several owners let a hot prefix (a
    shared system prompt) that spilled to other replicas stay a hit on all of them."""

    def __init__(self, max_blocks: int = 200_000, owners_per_block: int = 4) -> None:
        self.max_blocks = max_blocks
        self.owners_per_block = owners_per_block
        self.owners: OrderedDict[int, list[Any]] = OrderedDict()

    def owners_of(self, ids: Sequence[int], alive: Any) -> list[Any]:
        """The replicas (those in `alive`) last sent the longest prefix of ids that any
        living replica was sent, most recent first; [] when none."""
        for h in reversed(block_hashes(ids)):
            found = [r for r in reversed(self.owners.get(h, ())) if r in alive]
            if found:
                return found
        return []

    def owner_of(self, ids: Sequence[int], alive: Any) -> Any:
        """The most recent of owners_of, or None."""
        found = self.owners_of(ids, alive)
        return found[0] if found else None

    def record(self, ids: Sequence[int], replica: Any) -> None:
        for h in block_hashes(ids):
            owners = self.owners.get(h)
            if owners is None:
                self.owners[h] = [replica]
            else:
                if replica in owners:
                    owners.remove(replica)
                owners.append(replica)
                del owners[:-self.owners_per_block]
                self.owners.move_to_end(h)
        while len(self.owners) > self.max_blocks:
            self.owners.popitem(last=False)

    def forget(self, replica: Any) -> None:
        """A replica died: its cache died with it."""
        for h in list(self.owners):
            owners = self.owners[h]
            if replica in owners:
                owners.remove(replica)
                if not owners:
                    del self.owners[h]


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Sends a prompt to the least busy of the replicas last sent its longest known
    prefix (in KV blocks), unless that replica's queue is longer than the shortest one by
    more than `imbalance` requests; otherwise, and for new prefixes, to the less busy of
    two random replicas (Serve probes their queue lengths)."""

    def initialize_state(self, imbalance: int = 8, max_blocks: int = 200_000, **kwargs: Any) -> None:
        self.imbalance = imbalance
        self.table = PrefixTable(max_blocks)
        self.affine_routes = 0       # requests sent to the replica holding their prefix
        self.spilled = 0             # requests whose replica was too busy

    def _queue_len(self, r: RunningReplica) -> int:
        q = self.replica_queue_len_cache.get(r.replica_id)
        return 0 if q is None else q

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True   # every replica is a candidate
        if not candidate_replicas:
            return []
        fallback = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        ids = _prompt_of(pending_request)
        if ids:
            by_id = {r.replica_id: r for r in candidate_replicas}
            owners = [by_id[o] for o in self.table.owners_of(ids, by_id)]
            if owners:
                owner = min(owners, key=self._queue_len)   # of those holding the prefix, the least busy
                shortest = min(self._queue_len(r) for r in candidate_replicas)
                if self._queue_len(owner) - shortest <= self.imbalance:
                    self.affine_routes += 1
                    # Ranked: the owner first; if it is full, the less busy of two others.
                    return [[owner], [r for r in fallback if r is not owner] or fallback]
                self.spilled += 1
        return [fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        ids = _prompt_of(pending_request)
        if ids:
            self.table.record(ids, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn (skipping full ones): the baseline."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        k = next(self._turn) % len(ordered)
        return [[ordered[k]], ordered[k + 1:] + ordered[:k]]

