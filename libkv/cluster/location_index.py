"""The routers' index of per-block location keys (``libkv.cluster.locations``): the first
design, kept as the baseline of ``bench/location_sim.py``; routers use
``libkv.cluster.summary_index``.

Every router replica follows ``/tandem/v1/blocks/`` with a range read plus a watch, so replicas
that have seen the same etcd revision hold the same index, and a restarted router is warm as
soon as its first range read returns. Lookups take a prompt's hash chain and return, for each
worker incarnation that published any of its prefixes, the depth (in blocks) of the longest one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from libkv.cluster.etcd_follow import Endpoints, Followed, PrefixFollower
from libkv.cluster.locations import LOCATIONS_PREFIX, parse_location_key
from libkv.hashing import BlockHash

Holder = tuple[str, str]  # (worker_id, incarnation)


class PrefixIndex:
    """block hash -> the worker incarnations that published it. A ``FollowerSink``."""

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, set[Holder]] = {}
        self._per_worker: Counter[str] = Counter()

    # -- FollowerSink -------------------------------------------------------------------------
    def reset(self, items: list[tuple[bytes, bytes]]) -> None:
        self._by_hash.clear()
        self._per_worker.clear()
        for key, value in items:
            self.put(key, value)

    def put(self, key: bytes, value: bytes) -> None:
        loc = parse_location_key(key)
        if loc is None:
            return
        holders = self._by_hash.setdefault(loc.block_hash, set())
        holder = (loc.worker_id, loc.incarnation)
        if holder not in holders:
            holders.add(holder)
            self._per_worker[loc.worker_id] += 1

    def delete(self, key: bytes) -> None:
        loc = parse_location_key(key)
        if loc is None:
            return
        holders = self._by_hash.get(loc.block_hash)
        holder = (loc.worker_id, loc.incarnation)
        if holders is None or holder not in holders:
            return
        holders.discard(holder)
        self._per_worker[loc.worker_id] -= 1
        if not self._per_worker[loc.worker_id]:
            del self._per_worker[loc.worker_id]
        if not holders:
            del self._by_hash[loc.block_hash]

    # -- lookups ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> dict[Holder, int]:
        """For each holder of any prefix of the chain ``hashes``: its deepest one, in blocks.

        A chain hash names its whole prefix, so the deepest published position is the match
        (positions between published ones are not published, by the routing granularity)."""
        depth: dict[Holder, int] = {}
        for i in range(len(hashes) - 1, -1, -1):
            for holder in self._by_hash.get(hashes[i], ()):
                depth.setdefault(holder, i + 1)
        return depth

    def entries(self, worker_id: str | None = None) -> int:
        """Published entries in the index (of one worker when given)."""
        if worker_id is None:
            return sum(self._per_worker.values())
        return self._per_worker.get(worker_id, 0)

    def holders(self, block_hash: BlockHash) -> set[Holder]:
        return set(self._by_hash.get(block_hash, ()))


class LocationIndex(Followed, PrefixIndex):
    """A `PrefixIndex` kept current from etcd by a `PrefixFollower`."""

    def __init__(self, endpoints: Endpoints, timeout: float = 2.0) -> None:
        super().__init__()
        self.follower = PrefixFollower(endpoints, LOCATIONS_PREFIX.encode(), self, timeout)
