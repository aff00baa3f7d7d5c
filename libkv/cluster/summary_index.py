"""The routers' index of block locations, rebuilt from the workers' summaries in etcd alone.

Every router follows ``/tandem/v1/locations/`` (``libkv.cluster.location_summary``) with a range
read plus a watch from its revision (``PrefixFollower``), so replicas that have seen the same
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

import heapq
import math
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import compress
from typing import Any

from libkv.cluster.etcd_follow import Endpoints, Followed, PrefixFollower
from libkv.cluster.location_summary import (
    LOCATIONS_PREFIX,
    Summary,
    chain_entries,
    entry_key,
    parse_summary_key,
)
from libkv.hashing import BlockHash

Holder = tuple[str, str]  # (worker_id, incarnation)
_Entry = Holder | set[Holder]  # holders of an entry in the index: one (the common case), or more
_Value = Holder | set[Holder] | frozenset[Holder]  # in a match: also a route's holders


@dataclass(slots=True)
class _Worker:
    """One worker incarnation as the index knows it."""

    holder: Holder
    epoch: int
    seq: int
    granularity: int
    base: int
    entries: set[int]


@dataclass(slots=True)
class IndexStats:
    snapshots: int = 0
    deltas: int = 0
    gaps: int = 0  # deltas not following their predecessor (ignored until the next snapshot)
    stale: int = 0  # summaries of an older epoch or sequence (ignored)


class PrefixMatch(Mapping[Holder, int]):
    """holder -> depth of its deepest published prefix of the chain; valid until the index
    changes next (routing uses it at once; ``dict(match)`` keeps a copy).

    Made of one or more lists of (depth, holders) hits, each deepest first (the etcd index's,
    a router's recent routes): a holder's depth is its deepest in any of them."""

    def __init__(self, *hits: Sequence[tuple[int, _Value]]) -> None:
        self.hits = hits  # read only

    def get(self, holder: Holder, default: int = 0) -> int:  # type: ignore[override]
        best = None
        for hits in self.hits:
            for depth, v in hits:
                if (holder == v) if isinstance(v, tuple) else (holder in v):
                    best = depth if best is None else max(best, depth)
                    break
        return default if best is None else best

    def __getitem__(self, holder: Holder) -> int:
        depth = self.get(holder, -1)
        if depth < 0:
            raise KeyError(holder)
        return depth

    def positions(self) -> Iterator[tuple[int, Iterable[Holder]]]:
        """(depth, holders) of every published position of the chain, deepest first."""
        for depth, v in heapq.merge(*self.hits, key=_neg_depth):
            yield depth, ((v,) if isinstance(v, tuple) else v)

    def _expanded(self) -> dict[Holder, int]:
        out: dict[Holder, int] = {}
        for depth, holders in self.positions():
            for h in holders:
                out.setdefault(h, depth)
        return out

    def __iter__(self) -> Iterator[Holder]:
        return iter(self._expanded())

    def __len__(self) -> int:
        return len(self._expanded())


def found_deepest_first(found: list[Any], step: int = 1) -> list[tuple[int, Any]]:
    """(depth, value) of the non-None values of ``found`` (one per probed chain position:
    depths ``step``, ``2 * step``, ...), deepest first; in C loops, as lookups walk whole chains."""
    depths = list(compress(range(step, step * len(found) + 1, step), found))
    values = list(compress(found, found))
    depths.reverse()
    values.reverse()
    return list(zip(depths, values, strict=True))


def _neg_depth(hit: tuple[int, _Value]) -> int:
    return -hit[0]


class SummaryIndex:
    """entry -> the worker incarnations that published it. A ``FollowerSink``."""

    def __init__(self) -> None:
        self._by_entry: dict[int, _Entry] = {}
        self._workers: dict[Holder, _Worker] = {}
        self._bases: Counter[int] = Counter()  # workers per base granularity
        self._step = 0  # chain positions a lookup probes (0: to be computed)
        self.stats = IndexStats()

    # -- FollowerSink -------------------------------------------------------------------------
    def reset(self, items: list[tuple[bytes, bytes]]) -> None:
        self._by_entry.clear()
        self._workers.clear()
        self._bases.clear()
        self._step = 0
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
            self._bases[w.base] -= 1
            self._step = 0
            self._unlink_all(w.entries, w.holder)

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
            removed = w.entries.intersection(s.removed)
            w.entries -= removed
            self._unlink_all(removed, w.holder)
            added = set(s.added)
            added -= w.entries
            w.entries |= added
            self._link_all(added, w.holder)

    def _snapshot(self, w: _Worker | None, holder: Holder, s: Summary) -> None:
        if w is not None and (s.epoch, s.seq) <= (w.epoch, w.seq):
            self.stats.stale += 1
            return
        self.stats.snapshots += 1
        new = set(s.added)
        if w is None:
            w = self._workers[holder] = _Worker(holder, s.epoch, s.seq, s.granularity, s.base,
                                                set())  # fmt: skip
            self._bases[s.base] += 1
        elif w.base != s.base:
            self._bases[w.base] -= 1
            self._bases[s.base] += 1
            w.base = s.base
        self._step = 0
        self._unlink_all(w.entries - new, w.holder)
        self._link_all(new - w.entries, w.holder)
        w.entries, w.epoch, w.seq, w.granularity = new, s.epoch, s.seq, s.granularity

    def _link_all(self, entries: set[int], holder: Holder) -> None:
        """`_link` of many entries: those no one else holds in one C-level update (a restarted
        router rebuilds a million entries in a second or so)."""
        shared = set(filter(self._by_entry.__contains__, entries))  # O(entries), not O(index)
        self._by_entry.update(dict.fromkeys(entries - shared if shared else entries, holder))
        for e in shared:
            self._link(e, holder)

    def _unlink_all(self, entries: set[int], holder: Holder) -> None:
        by_entry = self._by_entry
        for e in entries:
            if by_entry.get(e) is holder:  # the common case: held by this worker alone
                del by_entry[e]
            else:
                self._unlink(e, holder)

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
        return self.match_entries(chain_entries(hashes))

    def match_entries(self, entries: array[int]) -> PrefixMatch:
        """`match` of a chain given as its entries (``chain_entries``)."""
        return PrefixMatch(self.hit_list(entries, self.step))

    @property
    def step(self) -> int:
        """Every entry sits at a multiple of this many blocks (the workers' common base)."""
        if not self._step:
            self._step = reduce(math.gcd, (b for b, n in self._bases.items() if n > 0), 0) or 1
        return self._step

    def hit_list(self, entries: array[int], step: int) -> list[tuple[int, _Entry]]:
        """(depth, holders) of the chain positions in the index, deepest first, probing every
        ``step``-th position (a divisor of `step`)."""
        return found_deepest_first(list(map(self._by_entry.get, entries[step - 1 :: step])), step)

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


class LocationIndex(Followed, SummaryIndex):
    """A `SummaryIndex` kept current from etcd by a `PrefixFollower`."""

    def __init__(self, endpoints: Endpoints, timeout: float = 2.0) -> None:
        super().__init__()
        self.follower = PrefixFollower(endpoints, LOCATIONS_PREFIX.encode(), self, timeout)
