"""Publishes a worker's cached prefixes as a bounded stream of summaries (the worker side).

What is published: the prefix hashes at every ``granularity``-th position of the chain (``base``
blocks at first) that the prefix cache holds, plus the *leaves*: the deepest position that is a
multiple of ``base`` in every committed run (the end of a prompt, or of a conversation turn,
rounded down to ``base`` blocks), which is where the next turn's chain passes. Shared system
prompts are found by the fixed positions, conversations by their leaves. A leaf stops being
one when the run goes on past its next ``base`` position; an evicted block is retracted (a
prefix whose leaf was evicted keeps only its fixed positions). Every entry sits at a multiple
of ``base``, so routers probe only those positions of a chain.

How it is written (keys and values: ``libkv.location_summary``): at most one etcd put per
``interval``, a delta of the entries added and removed since the last write, or a snapshot of
all of them (first write of a lease, a changed granularity, before the delta ring wraps, or
when the deltas since the last snapshot outweigh it). So a worker writes at most
``1 / interval`` keys per second whatever its prefill rate.

Granularity adapts to ``budget`` (entry changes per second): a write that would carry more
than ``budget * interval`` changes doubles the granularity instead (half the fixed positions
go, in one snapshot); ``patience`` writes in a row under a quarter of the budget halve it
again, down to ``base``. At the coarsest granularity a delta carries at most the budget
(removals first) and the rest waits for the next write.

All keys live under the worker's member lease (``LeaseHolder``): a dead worker's summary
vanishes with it; a new lease starts a new epoch with a full snapshot. The incarnation in the
keys keeps a restarted worker's empty cache apart from its predecessor's keys.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from libkv.etcd_follow import Endpoints, EtcdConnection, backoff, cancel_task
from libkv.hashing import BlockHash
from libkv.location_summary import (
    DELTA,
    RING,
    SNAPSHOT,
    Summary,
    delta_key,
    entry_key,
    snapshot_key,
)
from libkv.locations import LeaseHolder

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SummaryConfig:
    """Granularity and write bounds of a `SummaryPublisher`."""

    base: int = 4  # finest granularity: every base-th block of the chain (plus leaves)
    interval: float = 1.0  # seconds between writes, at least
    budget: int = 256  # entry changes per second before the granularity is coarsened
    max_granularity: int = 1024
    max_entries: int = 65536  # entries of one snapshot (~512 KiB), coarsened beyond
    patience: int = 10  # quiet writes before the granularity is refined
    granularity: int = 0  # to start with (a multiple of base); 0: base

    def __post_init__(self) -> None:
        if self.base < 1 or self.interval <= 0 or self.budget < 1:
            raise ValueError(f"bad summary config {self}")
        if self.granularity % self.base:
            raise ValueError(f"granularity must be a multiple of base: {self}")
        if self.max_granularity < self.base or self.max_entries < 1 or self.patience < 1:
            raise ValueError(f"bad summary config {self}")

    @property
    def per_write(self) -> int:
        """Entry changes one delta may carry."""
        return max(1, int(self.budget * self.interval))


@dataclass(slots=True)
class SummaryStats:
    """What reached etcd. ``txns`` are etcd writes (one put each); ``puts`` and ``deletes``
    count entries announced and retracted (a snapshot's entries count as announced)."""

    txns: int = 0
    puts: int = 0
    deletes: int = 0
    snapshots: int = 0
    bytes: int = 0
    republished: int = 0  # new epochs after the first (a new lease)
    failures: int = 0
    granularity: int = 0


@dataclass(slots=True)
class _Plan:
    """One write, decided under the lock and applied when etcd acknowledged it."""

    summary: Summary
    adds: list[BlockHash]
    removes: list[BlockHash]
    snapshot: set[BlockHash] = field(default_factory=set)


class SummaryPublisher:
    """Publishes a worker's cached prefixes; attach it with ``KVCacheManager.set_listener``
    (``cached``/``evicted`` run on the engine thread, ``flush`` in the event loop).

    ``etcd``: a connection to share (many simulated workers in one process); by default the
    publisher opens its own on ``endpoints``."""

    def __init__(
        self,
        endpoints: Endpoints,
        worker_id: str,
        incarnation: str,
        lease: LeaseHolder,
        config: SummaryConfig = SummaryConfig(),  # noqa: B008 - frozen
        timeout: float = 2.0,
        etcd: EtcdConnection | None = None,
    ) -> None:
        if not worker_id or not incarnation or "/" in worker_id + incarnation:
            raise ValueError("worker_id and incarnation must be non-empty, without '/'")
        self.worker_id, self.incarnation = worker_id, incarnation
        self.lease = lease
        self.config = config
        self.stats = SummaryStats(granularity=config.granularity or config.base)
        self._lock = threading.Lock()
        self._held: dict[BlockHash, int] = {}  # cached blocks at base positions -> depth
        self._tails: dict[BlockHash, BlockHash] = {}  # last block of a run -> its last anchor
        self._leaves: set[BlockHash] = set()
        self._dirty: set[BlockHash] = set()  # entries whose published state may be stale
        self._published: set[BlockHash] = set()  # what etcd holds (this epoch)
        self._epoch = -1  # lease registrations the published set belongs to
        self._seq = -1  # of the last write in this epoch
        self._snap_seq = 0
        self._since_snapshot = 0  # entries in the deltas written after the last snapshot
        self._quiet = 0
        self._granularity = config.granularity or config.base
        self._need_snapshot = True  # the next write is a snapshot (new epoch, failed snapshot)
        self._own_etcd = etcd is None
        self._etcd = etcd or EtcdConnection(endpoints, timeout, "locations")
        self._task: asyncio.Task[None] | None = None

    # -- engine thread ----------------------------------------------------------------------
    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash) -> None:
        """The block at chain position ``index`` entered the cache, after ``parent`` (see
        ``CacheListener``)."""
        with self._lock:
            # The run's last base position so far: the parent itself, or what its run passed on.
            anchor = parent if parent in self._held else self._tails.pop(parent, None)
            if (index + 1) % self.config.base:
                if anchor is not None:
                    self._tails[block_hash] = anchor
                return
            if anchor is not None and anchor in self._leaves:  # the run went on past it
                self._leaves.discard(anchor)
                self._dirty.add(anchor)
            if block_hash not in self._held:
                self._held[block_hash] = index + 1
                self._leaves.add(block_hash)
                self._dirty.add(block_hash)

    def evicted(self, block_hash: BlockHash) -> None:
        """A cached block was evicted: retract it if it was published."""
        with self._lock:
            self._tails.pop(block_hash, None)
            if self._held.pop(block_hash, None) is not None:
                self._leaves.discard(block_hash)
                self._dirty.add(block_hash)

    @property
    def num_held(self) -> int:
        """Fixed positions (at the base granularity) and leaves cached now."""
        with self._lock:
            return len(self._held)

    @property
    def granularity(self) -> int:
        return self._granularity

    # -- deciding a write (under the lock) --------------------------------------------------------
    def _wanted(self, h: BlockHash, granularity: int) -> bool:
        depth = self._held.get(h)
        return depth is not None and (depth % granularity == 0 or h in self._leaves)

    def _target(self, granularity: int) -> set[BlockHash]:
        return {h for h, d in self._held.items() if d % granularity == 0 or h in self._leaves}

    def _changes(self) -> tuple[list[BlockHash], list[BlockHash]]:
        adds, removes = [], []
        for h in self._dirty:
            want, have = self._wanted(h, self._granularity), h in self._published
            if want and not have:
                adds.append(h)
            elif have and not want:
                removes.append(h)
        self._dirty.clear()
        return adds, removes

    def _new_epoch(self) -> bool:
        if self.lease.registrations == self._epoch:
            return False
        if self._epoch >= 0:
            self.stats.republished += 1
        self._epoch = self.lease.registrations
        self._published.clear()
        self._seq = -1
        self._need_snapshot = True
        return True

    def _adapt(self, changes: int) -> int:
        """Granularity for this write, given how many entry changes it would carry."""
        c, g = self.config, self._granularity
        if changes > c.per_write and g < c.max_granularity:
            self._quiet = 0
            return min(g * 2, c.max_granularity)
        self._quiet = self._quiet + 1 if changes <= c.per_write // 4 else 0
        if self._quiet >= c.patience and g > c.base:
            self._quiet = 0
            return max(g // 2, c.base)
        return g

    def _plan(self) -> _Plan | None:
        with self._lock:
            fresh = self._new_epoch() or self._need_snapshot
            adds, removes = self._changes()
            if not (fresh or adds or removes):
                return None
            granularity = self._adapt(len(adds) + len(removes))
            seq = self._seq + 1
            size = len(self._published) + len(adds) - len(removes)
            if (fresh or granularity != self._granularity or seq - self._snap_seq > RING
                    or self._since_snapshot + len(adds) + len(removes) > size):  # fmt: skip
                return self._snapshot_plan(seq, granularity)
            per_write = self.config.per_write
            if len(adds) + len(removes) > per_write:  # at the coarsest: the rest waits
                ordered = removes + adds
                self._dirty.update(ordered[per_write:])
                removes = ordered[: min(len(removes), per_write)]
                adds = ordered[len(removes) : per_write]
            added, removed = [entry_key(h) for h in adds], [entry_key(h) for h in removes]
            summary = Summary(DELTA, self._epoch, seq, granularity, self.config.base, added,
                              removed)  # fmt: skip
            return _Plan(summary, adds, removes)

    def _snapshot_plan(self, seq: int, granularity: int) -> _Plan:
        target = self._target(granularity)
        while len(target) > self.config.max_entries and granularity < self.config.max_granularity:
            granularity *= 2
            target = self._target(granularity)
        if len(target) > self.config.max_entries:  # leaves alone exceed it: keep the deepest
            deepest = sorted(target, key=self._held.__getitem__, reverse=True)
            target = set(deepest[: self.config.max_entries])
        entries = [entry_key(h) for h in target]
        summary = Summary(SNAPSHOT, self._epoch, seq, granularity, self.config.base, entries)
        return _Plan(summary, [], [], target)

    # -- event loop -----------------------------------------------------------------------------
    async def flush(self) -> int:
        """Write what changed as one put (delta or snapshot); returns 1 if it wrote, else 0.

        Does nothing until the registration holds a lease. On failure what it would have
        written is marked to be written again, and the error propagates."""
        lease_id = self.lease.lease_id
        if lease_id is None or not self.lease.registered:
            return 0
        plan = self._plan()
        if plan is None:
            return 0
        s = plan.summary
        key = (
            snapshot_key(self.worker_id, self.incarnation)
            if s.kind == SNAPSHOT
            else delta_key(self.worker_id, self.incarnation, s.seq)
        )
        value = s.encode()
        try:
            await self._etcd.client.put(key, value, lease=lease_id)
        except BaseException:
            with self._lock:
                self._dirty.update(plan.adds, plan.removes)
                self._need_snapshot |= s.kind == SNAPSHOT
            raise
        self._applied(plan, len(value))
        return 1

    def _applied(self, plan: _Plan, size: int) -> None:
        s = plan.summary
        with self._lock:
            if s.epoch != self._epoch:  # a new lease meanwhile: that write is moot
                return
            self._seq, self._granularity = s.seq, s.granularity
            if s.kind == SNAPSHOT:
                self._published = plan.snapshot
                self._snap_seq, self._since_snapshot = s.seq, 0
                self._need_snapshot = False
                self.stats.snapshots += 1
            else:
                self._published.update(plan.adds)
                self._published.difference_update(plan.removes)
                self._since_snapshot += len(s.added) + len(s.removed)
        self.stats.txns += 1
        self.stats.puts += len(s.added)
        self.stats.deletes += len(s.removed)
        self.stats.bytes += size
        self.stats.granularity = s.granularity

    def start(self) -> None:
        """Write in a background task (at most once per ``interval``) until ``stop``."""
        self._task = asyncio.create_task(self._run(), name=f"locations-{self.worker_id}")

    async def _run(self) -> None:
        failures, last = 0, float("-inf")
        poll = min(0.1, self.config.interval / 4)  # a change after a quiet spell goes out soon
        while True:
            try:
                await asyncio.sleep(poll if not failures else backoff(failures, 2.0))
                if time.monotonic() - last < self.config.interval:
                    continue
                if await self.flush():
                    last = time.monotonic()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                failures += 1
                self.stats.failures += 1
                log.warning("publishing block locations failed (%d): %r", failures, e)
                await self._etcd.reset()

    async def stop(self) -> None:
        """Stop writing. The keys stay until the worker's lease is revoked or expires."""
        await cancel_task(self._task)
        self._task = None
        if self._own_etcd:
            await self._etcd.close()
