"""Block locations in etcd, one key per published block: the first design (publishing side).

Services now publish bounded summaries instead (``libkv.cluster.summary_publisher``); this design is
kept as the baseline that ``bench/location_sim.py`` measures against, and for its key helpers.

Key layout (one key per published prefix and worker, under that worker's member lease)::

    /tandem/v1/blocks/<worker_id>/<incarnation>/<hash hex>  ->  b"<depth in blocks>"

``hash`` is the prefix hash chain of ``libkv.hashing`` (sha256, tenant-salted), so the hash of
block ``i`` names the whole prefix of blocks ``0..i`` of one tenant. Routing granularity: a
worker publishes only every ``every``-th block of the chain (chain positions ``every - 1``,
``2 * every - 1``, ...), so a prefix is routed in steps of ``every * block_size`` tokens and
etcd sees at most one put per ``every`` newly cached blocks, plus one delete when that block
is evicted. Evictions go leaves first (the block pool frees a table in reverse), so a published
block's ancestors stay cached at least as long as it does.

Writes are batched: changes collect in memory (a put and a later delete of the same key cancel
out) and are flushed in one etcd transaction at most every ``interval`` seconds, of at most
``max_ops`` operations (etcd's default ``--max-txn-ops``); the rest waits for the next flush.
So one worker writes at most ``1 / interval`` transactions and ``max_ops / interval`` keys per
second, whatever its prefill rate.

Entries live under the lease of the worker's `Registration`: a worker that dies loses them
with its lease. When the registration had to grant a new lease (etcd restarted, lease expired
during an outage), everything still cached is published again under the new one. The
incarnation in the key keeps a restarted worker's (empty) cache from being confused with the
entries its previous process left until their lease ran out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from libkv.cluster.etcd_follow import Endpoints, EtcdConnection, backoff, cancel_task
from libkv.hashing import HASH_BYTES, BlockHash

log = logging.getLogger(__name__)

LOCATIONS_PREFIX = "/tandem/v1/blocks/"


def location_prefix(worker_id: str, incarnation: str = "") -> bytes:
    """Prefix of a worker's keys (of one incarnation when given)."""
    tail = f"{incarnation}/" if incarnation else ""
    return f"{LOCATIONS_PREFIX}{worker_id}/{tail}".encode()


def location_key(worker_id: str, incarnation: str, block_hash: BlockHash) -> bytes:
    """The key announcing that ``worker_id`` (this ``incarnation``) caches ``block_hash``."""
    return location_prefix(worker_id, incarnation) + block_hash.hex().encode()


class Location(NamedTuple):
    """A parsed location key."""

    worker_id: str
    incarnation: str
    block_hash: BlockHash


def parse_location_key(key: bytes) -> Location | None:
    """``Location`` of a key under ``LOCATIONS_PREFIX``, or None when it is not one."""
    try:
        rest = key.decode().removeprefix(LOCATIONS_PREFIX)
        worker_id, incarnation, hex_hash = rest.split("/")
        block_hash = bytes.fromhex(hex_hash)
    except ValueError:
        return None
    if len(block_hash) != HASH_BYTES or not worker_id or not incarnation:
        return None
    return Location(worker_id, incarnation, block_hash)


class LeaseHolder(Protocol):
    """What the publisher needs of a `Registration`: its current lease and how many times a
    lease was granted (a change means the old lease, and the entries under it, are gone)."""

    lease_id: int | None
    registered: bool
    registrations: int


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Routing granularity and write bounds of a `LocationPublisher`."""

    every: int = 4  # publish every ``every``-th block of the hash chain
    interval: float = 0.25  # seconds between transactions (at most)
    max_ops: int = 128  # operations per transaction (etcd's default --max-txn-ops)

    def __post_init__(self) -> None:
        if self.every < 1 or self.interval <= 0 or self.max_ops < 1:
            raise ValueError(f"bad publisher config {self}")


@dataclass(slots=True)
class PublisherStats:
    """Counters of what reached etcd (for the write-rate measurement)."""

    txns: int = 0
    puts: int = 0
    deletes: int = 0
    republished: int = 0  # times everything was re-published under a new lease
    failures: int = 0


class LocationPublisher:
    """Publishes a worker's cached prefixes; attach it to the cache with
    ``KVCacheManager.set_listener`` (``cached``/``evicted`` run on the engine thread)."""

    def __init__(
        self,
        endpoints: Endpoints,
        worker_id: str,
        incarnation: str,
        lease: LeaseHolder,
        config: PublisherConfig = PublisherConfig(),  # noqa: B008 - frozen
        timeout: float = 2.0,
        etcd: EtcdConnection | None = None,
    ) -> None:
        if not worker_id or not incarnation or "/" in worker_id + incarnation:
            raise ValueError("worker_id and incarnation must be non-empty, without '/'")
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.lease = lease
        self.config = config
        self.stats = PublisherStats()
        self._lock = threading.Lock()
        self._held: dict[BlockHash, int] = {}  # published-granularity hashes cached now -> depth
        self._pending: dict[BlockHash, bool] = {}  # hash -> True: put, False: delete
        self._published: set[BlockHash] = set()  # what etcd holds under the current lease
        self._registrations = -1  # lease grant the published set belongs to
        self._own_etcd = etcd is None  # else shared (many simulated workers in one process)
        self._etcd = etcd or EtcdConnection(endpoints, timeout, "locations")
        self._task: asyncio.Task[None] | None = None

    # -- engine thread ----------------------------------------------------------------------
    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash | None = None) -> None:
        """A block entered the prefix cache (see ``CacheListener``; ``parent`` is not used)."""
        if (index + 1) % self.config.every:
            return
        with self._lock:
            if block_hash not in self._held:
                self._held[block_hash] = index + 1
                self._pending[block_hash] = True

    def evicted(self, block_hash: BlockHash) -> None:
        """A cached block was evicted: retract it if it was published."""
        with self._lock:
            if self._held.pop(block_hash, None) is not None:
                self._pending[block_hash] = False

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- event loop ---------------------------------------------------------------------------
    def start(self) -> None:
        """Flush in a background task every ``interval`` seconds until ``stop``."""
        self._task = asyncio.create_task(self._run(), name=f"locations-{self.worker_id}")

    async def _run(self) -> None:
        failures = 0
        while True:
            try:
                await asyncio.sleep(
                    self.config.interval if not failures else backoff(failures, 2.0)
                )
                await self.flush()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                self.stats.failures += 1
                log.warning("publishing block locations failed (%d): %r", failures, e)
                await self._etcd.reset()

    def _take_batch(self) -> tuple[list[tuple[BlockHash, bool]], dict[BlockHash, int]]:
        """Up to ``max_ops`` pending changes (deletes first), removed from the pending set."""
        with self._lock:
            if self.lease.registrations != self._registrations:  # a new lease: start over
                if self._registrations >= 0:
                    self.stats.republished += 1
                self._registrations = self.lease.registrations
                self._published.clear()
                self._pending = dict.fromkeys(self._held, True)
            # A delete of what etcd never got is a no-op; drop it without writing.
            unwritten = [h for h, put in self._pending.items() if not (put or h in self._published)]
            for h in unwritten:
                del self._pending[h]
            ordered = sorted(self._pending.items(), key=lambda kv: kv[1])  # deletes first
            batch = ordered[: self.config.max_ops]
            for h, _ in batch:
                del self._pending[h]
            depths = {h: self._held.get(h, 0) for h, put in batch if put}
        return batch, depths

    async def flush(self) -> int:
        """Write pending changes in one transaction; returns how many operations it held.

        Does nothing until the registration holds a lease. On failure the changes go back to
        the pending set (unless newer ones replaced them) and the error propagates."""
        lease_id = self.lease.lease_id
        if lease_id is None or not self.lease.registered:
            return 0
        batch, depths = self._take_batch()
        if not batch:
            return 0
        client = self._etcd.client
        ops = [
            client.transactions.put(
                location_key(self.worker_id, self.incarnation, h),
                str(depths[h]).encode(),
                lease=lease_id,
            )
            if put
            else client.transactions.delete(location_key(self.worker_id, self.incarnation, h))
            for h, put in batch
        ]
        try:
            await client.transaction(compare=[], success=ops, failure=[])
        except BaseException:
            with self._lock:
                for h, put in batch:
                    self._pending.setdefault(h, put)
            raise
        with self._lock:
            for h, put in batch:
                (self._published.add if put else self._published.discard)(h)
        self.stats.txns += 1
        self.stats.puts += len(depths)
        self.stats.deletes += len(batch) - len(depths)
        return len(batch)

    async def stop(self) -> None:
        """Stop flushing. The entries stay until the worker's lease is revoked or expires."""
        await cancel_task(self._task)
        self._task = None
        if self._own_etcd:
            await self._etcd.close()
