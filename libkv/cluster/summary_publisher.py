"""Publishes a worker's cached prefixes as a bounded stream of summaries (the worker side).

What is published: the prefix hashes at every ``granularity``-th position of the chain (``base``
blocks at first) that the prefix cache holds, plus the *leaves*: the deepest position that is a
multiple of ``base`` in every committed run (the end of a prompt, or of a conversation turn,
rounded down to ``base`` blocks), which is where the next turn's chain passes. Shared system
prompts are found by the fixed positions, conversations by their leaves. A leaf stops being
one when the run goes on past its next ``base`` position; an evicted block is retracted (a
prefix whose leaf was evicted keeps only its fixed positions). Every entry sits at a multiple
of ``base``, so routers probe only those positions of a chain.

How it is written (keys and values: ``libkv.cluster.location_summary``): at most one etcd put per
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
import time
from typing import Protocol

from libkv.cluster.etcd_follow import Endpoints, EtcdConnection, backoff, cancel_task
from libkv.cluster.location_summary import SNAPSHOT, delta_key, snapshot_key
from libkv.cluster.summary_state import SummaryConfig, SummaryState, SummaryStats
from libkv.hashing import BlockHash

__all__ = ["SummaryConfig", "SummaryPublisher", "SummaryStats"]

log = logging.getLogger(__name__)


class LeaseHolder(Protocol):
    """What the publisher needs of a `Registration`: its current lease and how many times a
    lease was granted (a change means the old lease, and the entries under it, are gone)."""

    lease_id: int | None
    registered: bool
    registrations: int


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
        self.state = SummaryState(config)
        self._own_etcd = etcd is None
        self._etcd = etcd or EtcdConnection(endpoints, timeout, "locations")
        self._task: asyncio.Task[None] | None = None

    @property
    def stats(self) -> SummaryStats:
        return self.state.stats

    @property
    def num_held(self) -> int:
        """Cached blocks at base positions (each published or not)."""
        return self.state.num_held

    @property
    def granularity(self) -> int:
        return self.state.granularity

    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash) -> None:
        """A block entered the cache (``CacheListener``; engine thread)."""
        self.state.cached(index, block_hash, parent)

    def evicted(self, block_hash: BlockHash) -> None:
        """A cached block was evicted (``CacheListener``; engine thread)."""
        self.state.evicted(block_hash)

    # -- event loop -----------------------------------------------------------------------------
    async def flush(self) -> int:
        """Write what changed as one put (delta or snapshot); returns 1 if it wrote, else 0.

        Does nothing until the registration holds a lease. On failure what it would have
        written is marked to be written again, and the error propagates."""
        lease_id = self.lease.lease_id
        if lease_id is None or not self.lease.registered:
            return 0
        plan = self.state.plan(self.lease.registrations)
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
            self.state.failed(plan)
            raise
        self.state.applied(plan, len(value))
        return 1

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
