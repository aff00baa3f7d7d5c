"""The routers' index of block locations, rebuilt from the workers' summaries in etcd alone.

Every router follows ``/tandem/v1/locations/`` (``libkv.location_summary``) with a range read
plus a watch from its revision (``PrefixFollower``), so replicas that have seen the same
revision hold the same index, and a restarted router is complete once its read returns: per
worker incarnation, the snapshot and then the deltas after it that the ring holds, in order.
A delta is applied only on top of its predecessor of the same epoch (a gap, which a
well-behaved publisher never leaves, is counted and waits for the next snapshot); a deleted
snapshot key (lease expired or revoked) drops that incarnation's entries at once.

Lookups take a prompt's hash chain and return, per worker incarnation, the depth (in blocks)
of the deepest chain position it published, as a lazy mapping: positions shared by many
workers (a popular system prompt) are not expanded per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from libkv.etcd_follow import Endpoints, PrefixFollower, poll_until
from libkv.hashing import BlockHash
from libkv.location_summary import LOCATIONS_PREFIX, Summary, entry_key, parse_summary_key

Holder = tuple[str, str]  # (worker_id, incarnation)
_Value = Holder | set[Holder]  # one holder (the common case), or several


@dataclass(slots=True)
class _Worker:
    """One worker incarnation as the index knows it."""

    holder: Holder
    epoch: int
    seq: int
    granularity: int
    entries: set[int]


@dataclass(slots=True)
class IndexStats:
    snapshots: int = 0
    deltas: int = 0
    gaps: int = 0  # deltas not following their predecessor (ignored until the next snapshot)
    stale: int = 0  # summaries of an older epoch or sequence (ignored)


class PrefixMatch(Mapping[Holder, int]):
    """holder -> depth of its deepest published prefix of the chain; valid until the index
    changes next (routing uses it at once; ``dict(match)`` keeps a copy)."""

    def __init__(self, hits: list[tuple[int, _Value]]) -> None:
        self._hits = hits  # (depth, holders), deepest first

    def get(self, holder: Holder, default: int = 0) -> int:  # type: ignore[override]
        for depth, v in self._hits:
            if (holder in v) if isinstance(v, set) else (holder == v):
                return depth
        return default

    def __getitem__(self, holder: Holder) -> int:
        depth = self.get(holder, -1)
        if depth < 0:
            raise KeyError(holder)
        return depth

    def _expanded(self) -> dict[Holder, int]:
        out: dict[Holder, int] = {}
        for depth, v in reversed(self._hits):
            out.update(dict.fromkeys(v if isinstance(v, set) else (v,), depth))
        return out

    def __iter__(self) -> Iterator[Holder]:
        return iter(self._expanded())

    def __len__(self) -> int:
        return len(self._expanded())


class SummaryIndex:
    """entry -> the worker incarnations that published it. A ``FollowerSink``."""

    def __init__(self) -> None:
        self._by_entry: dict[int, _Value] = {}
        self._workers: dict[Holder, _Worker] = {}
        self.stats = IndexStats()

    # -- FollowerSink -------------------------------------------------------------------------
    def reset(self, items: list[tuple[bytes, bytes]]) -> None:
        self._by_entry.clear()
        self._workers.clear()
        deltas: list[tuple[bytes, bytes]] = []
        for key, value in items:  # snapshots first, then the deltas in sequence order
            k = parse_summary_key(key)
            if k is not None and k.slot is None:
                self.put(key, value)
            elif k is not None:
                deltas.append((key, value))
        decoded = [(s.seq, key, s) for key, v in deltas if (s := Summary.decode(v)) is not None]
        for _, key, s in sorted(decoded, key=lambda d: d[0]):
            self._apply(key, s)

    def put(self, key: bytes, value: bytes) -> None:
        summary = Summary.decode(value)
        if summary is not None:
            self._apply(key, summary)

    def delete(self, key: bytes) -> None:
        k = parse_summary_key(key)
        if k is None or k.slot is not None:
            return  # a delta slot goes with its snapshot (same lease)
        w = self._workers.pop((k.worker_id, k.incarnation), None)
        if w is not None:
            for e in w.entries:
                self._unlink(e, w.holder)

    # -- applying summaries -----------------------------------------------------------------------
    def _apply(self, key: bytes, s: Summary) -> None:
        k = parse_summary_key(key)
        if k is None or (k.slot is None) != (s.kind == 0):
            return
        holder = (k.worker_id, k.incarnation)
        w = self._workers.get(holder)
        if k.slot is None:
            self._snapshot(w, holder, s)
        elif w is None or s.epoch != w.epoch or s.seq <= w.seq:
            self.stats.stale += 1
        elif s.seq != w.seq + 1:
            self.stats.gaps += 1
        else:
            self.stats.deltas += 1
            w.seq, w.granularity = s.seq, s.granularity
            for e in s.removed:
                if e in w.entries:
                    w.entries.discard(e)
                    self._unlink(e, w.holder)
            for e in s.added:
                if e not in w.entries:
                    w.entries.add(e)
                    self._link(e, w.holder)

    def _snapshot(self, w: _Worker | None, holder: Holder, s: Summary) -> None:
        if w is not None and (s.epoch, s.seq) <= (w.epoch, w.seq):
            self.stats.stale += 1
            return
        self.stats.snapshots += 1
        new = set(s.added)
        if w is None:
            w = self._workers[holder] = _Worker(holder, s.epoch, s.seq, s.granularity, set())
        for e in w.entries - new:
            self._unlink(e, w.holder)
        for e in new - w.entries:
            self._link(e, w.holder)
        w.entries, w.epoch, w.seq, w.granularity = new, s.epoch, s.seq, s.granularity

    def _link(self, e: int, holder: Holder) -> None:
        v = self._by_entry.get(e)
        if v is None:
            self._by_entry[e] = holder
        elif isinstance(v, set):
            v.add(holder)
        elif v != holder:
            self._by_entry[e] = {v, holder}

    def _unlink(self, e: int, holder: Holder) -> None:
        v = self._by_entry.get(e)
        if v is None:
            return
        if not isinstance(v, set):
            if v == holder:
                del self._by_entry[e]
            return
        v.discard(holder)
        if len(v) == 1:
            self._by_entry[e] = next(iter(v))

    # -- lookups ------------------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> PrefixMatch:
        """For each holder of any prefix of the chain ``hashes``: its deepest one, in blocks.

        A chain hash names its whole prefix, so the deepest published position is the match."""
        get = self._by_entry.get
        hits = []
        for i in range(len(hashes) - 1, -1, -1):
            v = get(int.from_bytes(hashes[i][:8], "little"))
            if v is not None:
                hits.append((i + 1, v))
        return PrefixMatch(hits)

    def entries(self, worker_id: str | None = None) -> int:
        """Published entries in the index (of one worker's incarnations when given)."""
        return sum(len(w.entries) for (wid, _), w in self._workers.items()
                   if worker_id is None or wid == worker_id)  # fmt: skip

    def holders(self, block_hash: BlockHash) -> set[Holder]:
        v = self._by_entry.get(entry_key(block_hash))
        return set() if v is None else (set(v) if isinstance(v, set) else {v})

    def granularity(self, holder: Holder) -> int:
        """The granularity ``holder`` publishes at (0 when unknown)."""
        w = self._workers.get(holder)
        return w.granularity if w is not None else 0

    def __len__(self) -> int:
        """Distinct entries (chain positions) in the index."""
        return len(self._by_entry)


class LocationIndex(SummaryIndex):
    """A `SummaryIndex` kept current from etcd by a `PrefixFollower`."""

    def __init__(self, endpoints: Endpoints, timeout: float = 2.0) -> None:
        super().__init__()
        self.follower = PrefixFollower(endpoints, LOCATIONS_PREFIX.encode(), self, timeout)

    @classmethod
    async def start(cls, endpoints: Endpoints, timeout: float = 2.0) -> LocationIndex:
        """Read all summaries (if etcd answers) and follow changes in a task."""
        self = cls(endpoints, timeout)
        await self.follower.start()
        return self

    @property
    def synced(self) -> bool:
        return self.follower.synced

    async def wait_for(self, predicate: Callable[[LocationIndex], bool], timeout: float) -> bool:
        """Poll ``predicate(self)`` until it holds; False if it still does not after timeout."""
        return await poll_until(lambda: predicate(self), timeout)

    async def stop(self) -> None:
        await self.follower.stop()
