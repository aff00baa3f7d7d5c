"""Simulated prefill workers for the block-location simulator (``bench/location_sim.py``).

Each worker is an LRU prefix cache of ``capacity`` blocks (leaves evicted first, as the block
pool does) and a clock of when it is next idle, prefilling ``rate`` tokens/s. A request goes to
the worker with the lowest estimated time to first token: wait until idle + uncached tokens /
rate, over the holders a lookup reports (at most ``HOLDERS_PER_POSITION`` per chain position)
and the least busy worker. The cache notifies a listener (a real publisher) of every block
cached and evicted, in the order the engine's ``KVCacheManager`` would; or keeps an exact index
of every cached block (the oracle) for routing by what is really cached.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from libkv.hashing import ROOT_HASH, BlockHash

BLOCK = 16  # tokens per block
HOLDERS_PER_POSITION = 32  # holders a route looks at per chain position (the first ones)

Hits = Iterable[tuple[int, Iterable[int]]]  # (depth in blocks, worker indexes), deepest first


class Listener(Protocol):
    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash) -> None: ...

    def evicted(self, block_hash: BlockHash) -> None: ...


@dataclass(slots=True)
class Counters:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")


@dataclass(slots=True)
class Cluster:
    """``n`` simulated workers; ``listeners`` (one per worker) or an exact index (oracle)."""

    n: int
    capacity: int
    rate: float
    listeners: Sequence[Listener] | None = None
    counters: Counters = field(default_factory=Counters)
    _lru: list[OrderedDict[BlockHash, None]] = field(init=False)
    _busy: list[float] = field(init=False)
    _heap: list[tuple[float, int]] = field(init=False)
    _exact: dict[BlockHash, int | set[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._lru = [OrderedDict() for _ in range(self.n)]
        self._busy = [0.0] * self.n
        self._heap = [(0.0, w) for w in range(self.n)]

    # -- routing --------------------------------------------------------------------------------
    def exact_hits(self, chain: Sequence[BlockHash]) -> Hits:
        """What an exact index of every cached block reports (deepest first)."""
        get = self._exact.get
        for i in range(len(chain) - 1, -1, -1):
            v = get(chain[i])
            if v is not None:
                yield i + 1, (v,) if isinstance(v, int) else v

    def _least_busy(self) -> int:
        while True:
            busy, w = self._heap[0]
            if busy == self._busy[w]:
                return w
            heapq.heappop(self._heap)

    def route(self, chain: Sequence[BlockHash], hits: Hits, now: float) -> int:
        """The worker with the lowest estimated time to first token for ``chain``."""
        n, per_block = len(chain), BLOCK / self.rate
        best = self._least_busy()
        best_cost = max(self._busy[best] - now, 0.0) + n * per_block
        seen: set[int] = set()
        busy = self._busy
        for depth, holders in hits:
            miss = (n - depth) * per_block
            for w in islice(holders, HOLDERS_PER_POSITION):
                if w not in seen:  # a holder's deepest position comes first
                    seen.add(w)
                    cost = busy[w] - now
                    cost = (cost if cost > 0.0 else 0.0) + miss
                    if cost < best_cost:
                        best, best_cost = w, cost
        return best

    # -- serving --------------------------------------------------------------------------------
    def serve(self, w: int, chain: Sequence[BlockHash], now: float) -> int:
        """Prefill ``chain`` on worker ``w`` at virtual time ``now``; returns the blocks hit."""
        lru, n = self._lru[w], len(chain)
        d = 0
        while d < n and chain[d] in lru:
            d += 1
        if self.listeners is not None:
            listener = self.listeners[w]
            for i in range(d, n):
                listener.cached(i, chain[i], chain[i - 1] if i else ROOT_HASH)
        for i in range(n - 1, d - 1, -1):  # leaves end up least recently used
            lru[chain[i]] = None
            if self.listeners is None:
                self._link(chain[i], w)
        for i in range(d - 1, -1, -1):
            lru.move_to_end(chain[i])
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            if self.listeners is not None:
                self.listeners[w].evicted(h)
            else:
                self._unlink(h, w)
        self._busy[w] = max(now, self._busy[w]) + (n - d) * BLOCK / self.rate
        heapq.heappush(self._heap, (self._busy[w], w))
        c = self.counters
        c.requests += 1
        c.prompt_tokens += n * BLOCK
        c.hit_tokens += d * BLOCK
        return d

    def _link(self, h: BlockHash, w: int) -> None:
        v = self._exact.get(h)
        if v is None:
            self._exact[h] = w
        elif isinstance(v, int):
            if v != w:
                self._exact[h] = {v, w}
        else:
            v.add(w)

    def _unlink(self, h: BlockHash, w: int) -> None:
        v = self._exact.get(h)
        if isinstance(v, int):
            if v == w:
                del self._exact[h]
        elif v is not None:
            v.discard(w)
            if len(v) == 1:
                self._exact[h] = next(iter(v))

    def cached_blocks(self) -> int:
        return sum(len(lru) for lru in self._lru)
