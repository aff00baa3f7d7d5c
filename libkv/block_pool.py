"""Fixed-size KV blocks with reference counts, an O(1) free list and lazy LRU prefix caching.

Every block is in exactly one of three states::

    used    ref_cnt > 0                    (held by one or more sequences)
    fresh   ref_cnt == 0, no hash          (free; reused first)
    cached  ref_cnt == 0, hash registered  (free, but still holds a reusable prefix)

Allocation takes fresh blocks first and only then evicts cached ones, least recently freed
first. Eviction is lazy: a cached block keeps its contents (and its entry in the hash map)
until the moment it is handed out again. The cached queue is an intrusive doubly linked list
(free, and pulling a cached block back into use on a hit, are O(1)); fresh blocks are kept as
runs of consecutive ids (`libkv.free_extents`, O(log num_blocks) per block at most), so one
allocation gets as few runs as possible: a KV hand-off copies each run once.

Which blocks one allocation gets is the same set as ever (fresh ones, then the least recently
freed cached ones, evicted in that order); only their order in the caller's table changes:
those extending the table's last block first, then the rest ascending, so cached blocks a
finished request freed (leaves first: descending ids) come back as an ascending run.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from libkv.free_extents import FreeExtents
from libkv.hashing import BlockHash

FRESH, CACHED, NONE = 1, 2, 0


class NoFreeBlocksError(RuntimeError):
    """More blocks were requested than are free (callers check ``num_free`` first)."""


class IntegrityError(AssertionError):
    """The bookkeeping broke an invariant (`BlockPool.check_integrity`). Raised explicitly, not by
    ``assert``, so the check also holds under ``python -O``."""


def require(condition: bool, message: str) -> None:
    """Raise IntegrityError(``message``) unless ``condition``."""
    if not condition:
        raise IntegrityError(message)


@dataclass(slots=True, eq=False)
class KVBlock:
    """One block of the pool. ``token_ids`` is kept with the hash to verify every hit.
    ``sealed``: full, its KV computed and its checksum taken (the engine keeps the value); it is
    never written again until ``allocate`` hands it out anew, which clears the flag."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    sealed: bool = False
    queue: int = NONE
    prev: KVBlock | None = None
    next: KVBlock | None = None


class _FreeQueue:
    """Intrusive doubly linked list of blocks: O(1) append, popleft and remove."""

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.head: KVBlock | None = None
        self.tail: KVBlock | None = None
        self.size = 0

    def append(self, block: KVBlock) -> None:
        assert block.queue == NONE
        block.queue, block.prev, block.next = self.tag, self.tail, None
        if self.tail is None:
            self.head = block
        else:
            self.tail.next = block
        self.tail = block
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        assert block.queue == self.tag
        if block.prev is None:
            self.head = block.next
        else:
            block.prev.next = block.next
        if block.next is None:
            self.tail = block.prev
        else:
            block.next.prev = block.prev
        block.queue, block.prev, block.next = NONE, None, None
        self.size -= 1

    def popleft(self) -> KVBlock:
        block = self.head
        if block is None:
            raise NoFreeBlocksError("free queue is empty")
        self.remove(block)
        return block

    def __iter__(self):
        node = self.head
        while node is not None:
            yield node
            node = node.next


class BlockPool:
    """The pool of ``num_blocks`` blocks of ``block_size`` tokens each.

    ``on_evict`` (optional) is called with the hash of every cached block that is evicted, so a
    publisher of block locations can retract it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        on_evict: Callable[[BlockHash], None] | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._fresh = FreeExtents(num_blocks)
        self._cached = _FreeQueue(CACHED)
        self._by_hash: dict[BlockHash, KVBlock] = {}
        self._on_evict = on_evict
        for block in self.blocks:
            self._free_fresh(block)

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (fresh + cached)."""
        return self._fresh.size + self._cached.size

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._cached.size

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, n: int, after: KVBlock | None = None) -> list[KVBlock]:
        """Take ``n`` blocks: fresh ones first (as few runs of consecutive ids as the free runs
        allow), then the least recently freed cached ones (evicted in that order). Returned
        with the fresh ones right behind ``after`` (the caller's last block) first, then the
        rest by ascending id (rotated to start right behind ``after`` where an evicted block
        is), so a table grows in runs of consecutive ids where it can."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        ids = self._fresh.take(min(n, self._fresh.size), None if after is None else after.block_id)
        lead = 0  # ids continuing ``after``: they stay first
        while lead < len(ids) and after is not None and ids[lead] == after.block_id + 1 + lead:
            lead += 1
        rest = sorted(ids[lead:] + [self._evict_one().block_id for _ in range(n - len(ids))])
        if after is not None and not lead:  # an evicted block may continue the table: first
            cut = bisect.bisect_left(rest, after.block_id + 1)
            if cut < len(rest) and rest[cut] == after.block_id + 1:
                rest = rest[cut:] + rest[:cut]
        out = [self.blocks[i] for i in ids[:lead] + rest]
        for block in out:
            block.queue = NONE
            block.ref_cnt, block.sealed = 1, False  # new contents: any old checksum is stale
        return out

    def _free_fresh(self, block: KVBlock) -> None:
        block.queue = FRESH
        self._fresh.add(block.block_id)

    def _evict_one(self) -> KVBlock:
        block = self._cached.popleft()
        assert block.block_hash is not None
        del self._by_hash[block.block_hash]
        evicted = block.block_hash
        block.block_hash, block.token_ids = None, None
        if self._on_evict is not None:
            self._on_evict(evicted)
        return block

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in order.

        Blocks that reach zero join the tail of their free queue, so the *first* block passed
        is evicted first: free a sequence's table in reverse so leaves go before their parents.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._cached.append(block)
                else:
                    self._free_fresh(block)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found by ``lookup`` (pulling free ones back into use)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._cached.remove(block)
            block.ref_cnt += 1

    # -- prefix cache ---------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block with this hash *and* these tokens, or None."""
        block = self._by_hash.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, computed, in-use block under its hash.

        Returns False (and leaves the block private) when another block already holds the
        hash: the first copy stays the shared one.
        """
        if block.block_hash is not None or block_hash in self._by_hash:
            return False
        if block.ref_cnt <= 0 or len(token_ids) != self.block_size:
            raise RuntimeError("only full blocks in use can be cached")
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._by_hash[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached (free) prefix; used blocks keep their hashes."""
        while self._cached.size:
            self._free_fresh(self._evict_one())

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._by_hash)

    @property
    def on_evict(self) -> Callable[[BlockHash], None] | None:
        return self._on_evict

    def set_on_evict(self, on_evict: Callable[[BlockHash], None] | None) -> None:
        """Replace the eviction callback (a block-location publisher attached after start)."""
        self._on_evict = on_evict

    # -- checks ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + used + cached bookkeeping is consistent (tests call
        it after each case; workers report it in their stats)."""
        fresh = [self.blocks[i] for i in self._fresh]
        cached = list(self._cached)
        for problem in self._fresh.check():
            require(False, problem)
        require(all(b.queue == FRESH for b in fresh), "fresh block not marked fresh")
        require(all(b.queue == CACHED for b in cached), "cached block not marked cached")
        require(len(cached) == self._cached.size, "cached queue size out of step")
        used = [b for b in self.blocks if b.ref_cnt > 0]
        require(len(fresh) + len(cached) + len(used) == self.num_blocks, "blocks lost or doubled")
        require(all(b.ref_cnt == 0 and b.block_hash is None for b in fresh), "bad fresh block")
        require(
            all(b.ref_cnt == 0 and b.block_hash is not None for b in cached), "bad cached block"
        )
        require(all(b.ref_cnt >= 0 for b in self.blocks), "negative reference count")
        for h, b in self._by_hash.items():
            require(b.block_hash == h and b.token_ids is not None, f"hash map entry {h!r} wrong")
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        require(hashed == len(self._by_hash), "hash map out of step with blocks")
