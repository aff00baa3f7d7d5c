"""What a worker publishes of its prefix cache, and how each write is decided (no etcd here;
``libkv.cluster.summary_publisher`` writes it). See that module for the rules; this one keeps the
bookkeeping: cached blocks at base positions, leaves, what etcd holds, and the next write.

Thread-safe: ``cached``/``evicted`` run on the engine thread, ``plan``/``applied``/``failed``
in the event loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from libkv.cluster.location_summary import DELTA, RING, SNAPSHOT, Summary, entry_key
from libkv.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class SummaryConfig:
    """Granularity and write bounds of a `SummaryPublisher`."""

    base: int = 4  # finest granularity: every base-th block of the chain (plus leaves)
    interval: float = 1.0  # seconds between writes, at least
    budget: int = 256  # entry changes per second before the granularity is coarsened
    max_granularity: int = 1024  # granularity doubles from base up to at most this
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
class Plan:
    """One write, decided under the lock and applied when etcd acknowledged it."""

    summary: Summary
    adds: list[BlockHash]
    removes: list[BlockHash]
    snapshot: set[BlockHash] = field(default_factory=set)


class SummaryState:
    """The published set of one worker incarnation and the decisions of its writes."""

    def __init__(self, config: SummaryConfig) -> None:
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
        # In hash order, not the set's: a capped delta then takes the same part of the same
        # dirty set in every process (a set of bytes iterates by the per-process string hash
        # seed and its insertion history), so a failed write is planned again as it was.
        for h in sorted(self._dirty):
            want, have = self._wanted(h, self._granularity), h in self._published
            if want and not have:
                adds.append(h)
            elif have and not want:
                removes.append(h)
        self._dirty.clear()
        return adds, removes

    def _new_epoch(self, epoch: int) -> bool:
        if epoch == self._epoch:
            return False
        if self._epoch >= 0:
            self.stats.republished += 1
        self._epoch = epoch
        self._published.clear()
        self._seq = -1
        self._need_snapshot = True
        return True

    def _adapt(self, changes: int) -> int:
        """Granularity for this write, given how many entry changes it would carry."""
        c, g = self.config, self._granularity
        if changes > c.per_write and g * 2 <= c.max_granularity:
            self._quiet = 0
            return g * 2  # stays a multiple of base
        self._quiet = self._quiet + 1 if changes <= c.per_write // 4 else 0
        if self._quiet >= c.patience and g > c.base:
            self._quiet = 0
            return max(g // 2, c.base)
        return g

    def plan(self, epoch: int) -> Plan | None:
        """The next write under lease grant ``epoch`` (a new one starts over with a
        snapshot), or None when nothing changed. A delta capped at the budget carries the
        first changes in hash order (removals first): deterministic, so after `failed` with
        no new changes the same delta comes again."""
        with self._lock:
            fresh = self._new_epoch(epoch) or self._need_snapshot
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
            return Plan(summary, adds, removes)

    def _snapshot_plan(self, seq: int, granularity: int) -> Plan:
        target = self._target(granularity)
        while (len(target) > self.config.max_entries
               and granularity * 2 <= self.config.max_granularity):  # fmt: skip
            granularity *= 2
            target = self._target(granularity)
        if len(target) > self.config.max_entries:  # leaves alone exceed it: keep the deepest
            deepest = sorted(target, key=self._held.__getitem__, reverse=True)
            target = set(deepest[: self.config.max_entries])
        entries = [entry_key(h) for h in target]
        summary = Summary(SNAPSHOT, self._epoch, seq, granularity, self.config.base, entries)
        return Plan(summary, [], [], target)

    def applied(self, plan: Plan, size: int) -> None:
        """etcd took ``plan`` (``size`` bytes)."""
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

    def failed(self, plan: Plan) -> None:
        """etcd did not take ``plan``: what it carried is to be written again."""
        with self._lock:
            self._dirty.update(plan.adds, plan.removes)
            self._need_snapshot |= plan.summary.kind == SNAPSHOT
