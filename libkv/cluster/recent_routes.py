"""A router's short memory of where it just sent prompts, on top of the etcd index.

A worker publishes what it cached at most once per summary interval
(``libkv.cluster.summary_publisher``), so for about that long the index does not yet show a
prompt just routed: the next turn of a quick conversation, or a burst of requests with a new
system prompt, would be routed as if nothing were cached. `RecentRoutes` remembers, for
``ttl`` seconds (a couple of intervals, by when the worker's summary has it), every
``every``-th chain position of each routed prompt (16 blocks = 256 tokens: the next turn of a
conversation passes through the deepest of them) and the workers that will cache them.
`HintedIndex` merges both into one lookup.

This is the only routing state a router keeps besides etcd's (like the requests it has in
flight, which the policy already weighs): replicas agree on everything older than ``ttl``,
and a router restarted just now routes by etcd alone.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence

from libkv.cluster.location_summary import chain_entries
from libkv.cluster.summary_index import Holder, PrefixMatch, SummaryIndex, found_deepest_first
from libkv.hashing import BlockHash

_Holders = Holder | frozenset[Holder]


class RecentRoutes:
    """entry -> holder of the prompts routed in the last ``ttl`` seconds."""

    def __init__(
        self,
        ttl: float = 2.0,
        every: int = 16,
        max_entries: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl, self.every = ttl, every
        self.max_entries, self.clock = max_entries, clock
        self._by_entry: dict[int, _Holders] = {}
        # (expiry, entry, the value noted then): a later note of the entry puts a new value
        # object, which the older record then leaves alone.
        self._order: deque[tuple[float, int, _Holders]] = deque()

    def note(
        self, holders: Sequence[Holder], hashes: Sequence[BlockHash], now: float | None = None
    ) -> None:
        """``holders`` were sent the prompt whose chain is ``hashes`` and will cache it (the
        latest route of a chain position replaces an earlier one)."""
        now = self.clock() if now is None else now
        self._expire(now)
        if not hashes or not holders:
            return
        entries = chain_entries(hashes)
        # A new object per note (see _order).
        value: _Holders = (
            (holders[0][0], holders[0][1]) if len(holders) == 1 else frozenset(holders)
        )
        expiry = now + self.ttl
        for i in range(self.every - 1, len(entries), self.every):
            self._by_entry[entries[i]] = value
            self._order.append((expiry, entries[i], value))
        while len(self._order) > self.max_entries:  # bounded whatever the request rate
            self._drop(*self._order.popleft())

    def hits(self, entries: array[int], now: float) -> list[tuple[int, _Holders]]:
        """(depth, holders) of the chain positions routed recently, deepest first."""
        self._expire(now)
        n = self.every
        return found_deepest_first(list(map(self._by_entry.get, entries[n - 1 :: n])), n)

    def _expire(self, now: float) -> None:
        order = self._order
        while order and order[0][0] <= now:
            self._drop(*order.popleft())

    def _drop(self, expiry: float, entry: int, value: _Holders) -> None:
        if self._by_entry.get(entry) is value:
            del self._by_entry[entry]

    def __len__(self) -> int:
        return len(self._by_entry)


class HintedIndex:
    """Lookups in the etcd index and in this router's recent routes, merged (a
    ``LocationLookup`` for the policy)."""

    def __init__(self, index: SummaryIndex, recent: RecentRoutes) -> None:
        self.index, self.recent = index, recent

    def match(self, hashes: Sequence[BlockHash], now: float | None = None) -> PrefixMatch:
        now = self.recent.clock() if now is None else now
        entries = chain_entries(hashes)
        index_hits = self.index.hit_list(entries, self.index.step)
        return PrefixMatch(index_hits, self.recent.hits(entries, now))

    def note(
        self, holders: Sequence[Holder], hashes: Sequence[BlockHash], now: float | None = None
    ) -> None:
        self.recent.note(holders, hashes, now)
