"""The host tier's bookkeeping (no torch): which prefix blocks the host pool holds, in which
slots, and the copies between it and the device pool still to be issued.

The KV cache is virtual memory: the device pool's prefix cache is the resident set and this
tier is swap. Blocks enter it *write-through* (SGLang HiCache's default policy; vLLM's
offloading connector stores each computed block the same way): every block that enters the
device prefix cache is queued for a copy to the host (a page-out), and the engine issues the
queued copies as one batch before its next forward pass, off the forward pass's path (a CUDA
side stream, ``engine.host_store``). When the device prefix cache later evicts the block, its
KV is already on the host: eviction stays a pointer move on the device's path.

A prompt's chain continues past its device hit into the host tier (``find``, the same hash
chain, so tenant and adapter salts separate entries here as on the device). The scheduler
allocates device blocks for the host hit and queues page-ins (``page_in``); the engine issues
them before the forward pass that reads them. Hits shorter than ``min_tokens`` are recomputed
instead (a copy has a fixed cost; a few tokens in a batched step cost about nothing).

Why the copies never read stale or half-written bytes:

- every copy runs on one queue in the order ``take`` hands them out (page-outs, then
  page-ins), so a host slot reused by a later page-out is written after every page-in issued
  before it read the slot, and a device block paged out is read before any page-in writes it;
- a page-out still queued (not yet issued) when its device block is evicted is cancelled
  (``evicted``): the block is about to be written with other KV;
- slots of queued page-ins are pinned until ``take``, so no page-out queued meanwhile reuses
  them.

Host slots are evicted leaves first, least recently used among them (an entry is used when
written and when hit): a block whose chain goes on in the tier stays until its descendants
have gone, as in SGLang's radix tree, so the tier never keeps the tail of a chain whose head
it dropped (a plain LRU over a chain written in order would drop the head first).

With a disk tier below (``libkv.disk_tier``), an evicted entry whose page-out was issued is
demoted instead of dropped: ``take`` lists its write (host slot -> disk slot) before the
batch's page-outs, and keeps ``reserve`` slots free by demoting ahead of need, handing those
slots out last. ``find`` continues a chain from the host into the disk; ``page_in`` queues
loads (disk slot -> device block) for the blocks only the disk holds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from libkv.block_pool import require
from libkv.disk_tier import DiskTier
from libkv.hashing import BlockHash, hash_block
from libkv.tier_types import HostHit, TierCopies, TierStats

__all__ = ["HostEntry", "HostHit", "HostTier", "TierCopies", "TierListener", "TierStats"]

# With a disk tier, the host tier keeps this share of its slots free by demoting least
# recently used leaves ahead of need (``take``): a demoted slot is written to disk by a thread
# while a step runs, and is handed out again last, so a page-out seldom waits for the disk.
DISK_RESERVE_SHARE = 1 / 16


class TierListener(Protocol):
    """Told which prefixes enter and leave the host tier (a block-location publisher of the
    host tier); the same calls as ``libkv.kv_manager.CacheListener``."""

    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash) -> None: ...

    def evicted(self, block_hash: BlockHash) -> None: ...


@dataclass(slots=True)
class HostEntry:
    slot: int
    token_ids: tuple[int, ...]
    parent: BlockHash
    children: int = 0  # entries of the tier whose parent this is


class HostTier:
    """``num_slots`` host blocks of ``block_size`` tokens (``block_bytes`` each, for stats)."""

    def __init__(
        self, num_slots: int, block_size: int, block_bytes: int = 0, min_tokens: int = 0
    ) -> None:
        if num_slots < 1 or block_size < 1:
            raise ValueError("num_slots and block_size must be positive")
        self.num_slots, self.block_size, self.min_tokens = num_slots, block_size, min_tokens
        self.stats = TierStats(num_slots, block_bytes=block_bytes, block_size=block_size)
        self._entries: dict[BlockHash, HostEntry] = {}
        self._leaves: OrderedDict[BlockHash, None] = OrderedDict()  # childless, least recent first
        self._free: deque[int] = deque(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._out: dict[BlockHash, tuple[int, int]] = {}  # queued page-outs: (block, slot)
        self._in: list[tuple[int, int]] = []  # queued page-ins: (slot, block)
        self._pinned: dict[int, int] = {}  # slot -> queued page-ins reading it
        self._demote: list[tuple[int, int]] = []  # queued writes to disk: (slot, disk slot)
        self._loads: list[tuple[int, int]] = []  # queued reads from disk: (disk slot, block)
        self.listener: TierListener | None = None
        self.disk: DiskTier | None = None  # the disk tier below this one, if any
        self.reserve = max(1, int(num_slots * DISK_RESERVE_SHARE))

    # -- device prefix cache -> host ----------------------------------------------------------
    def cached(
        self,
        block_id: int,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        index: int = 0,
        parent: BlockHash = b"",
    ) -> None:
        """Device block ``block_id`` entered the prefix cache at chain position ``index``:
        queue its page-out unless the host holds it already (then it is just used)."""
        tokens = tuple(token_ids)
        entry = self._entries.get(block_hash)
        if entry is not None and entry.token_ids == tokens:
            self._touch(block_hash)
            return
        if entry is not None:  # a colliding hash: the newer block wins
            self._drop(block_hash)
        slot = self._take_slot()
        if slot is None:  # every slot is being paged in: skip this one
            return
        self._entries[block_hash] = HostEntry(slot, tokens, parent)
        self._leaves[block_hash] = None
        up = self._entries.get(parent)
        if up is not None:
            up.children += 1
            self._leaves.pop(parent, None)
        self._out[block_hash] = (block_id, slot)
        if self.listener is not None:
            self.listener.cached(index, block_hash, parent)

    def evicted(self, block_hash: BlockHash) -> None:
        """The device prefix cache evicted ``block_hash`` (its block is about to be written):
        a page-out of it not issued yet is cancelled, with its host entry."""
        if block_hash in self._out:
            self._drop(block_hash)
            self.stats.cancelled += 1

    def _touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._leaves:
            self._leaves.move_to_end(block_hash)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._evict_leaf():
            return self._free.pop()
        return None

    def _evict_leaf(self, last: bool = False) -> bool:
        """Evict the least recently used leaf not being paged in, demoting it to the disk tier
        when it holds data (its page-out was issued); its slot is handed out next, or ``last``
        (after every other free slot: the disk write has time to finish; then only a leaf
        holding data is taken). False: none."""
        for h in self._leaves:
            entry = self._entries[h]
            if entry.slot in self._pinned or (last and h in self._out):
                continue
            if self.disk is not None and h not in self._out:
                disk_slot = self.disk.put(h, entry.token_ids, entry.parent)
                if disk_slot is not None:
                    self._demote.append((entry.slot, disk_slot))
            self._drop(h)  # frees its slot
            if last:
                self._free.appendleft(self._free.pop())
            return True
        return False

    def _drop(self, block_hash: BlockHash) -> None:
        """Forget an entry; its parent, left without children, is the next leaf to go."""
        entry = self._entries.pop(block_hash)
        self._leaves.pop(block_hash, None)
        self._out.pop(block_hash, None)
        self._free.append(entry.slot)
        up = self._entries.get(entry.parent)
        if up is not None and up.children > 0:
            up.children -= 1
            if not up.children:
                self._leaves[entry.parent] = None
                self._leaves.move_to_end(entry.parent, last=False)
        if self.listener is not None:
            self.listener.evicted(block_hash)

    # -- host -> device ---------------------------------------------------------------------
    def find(
        self, token_ids: Sequence[int], extra: bytes, start: int, parent: BlockHash
    ) -> HostHit:
        """Host blocks continuing a chain whose first ``start`` blocks end in ``parent``
        (hash and tokens verified, as on the device)."""
        hit, bs = HostHit(), self.block_size
        for i in range(start, len(token_ids) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = hash_block(parent, chunk, extra)
            entry = self._entries.get(h)
            if entry is not None and entry.token_ids == chunk:
                slot, disk_slot = entry.slot, -1
            elif self.disk is not None and (found := self.disk.get(h, chunk)) is not None:
                slot, disk_slot = -1, found
            else:
                break
            hit.hashes.append(h)
            hit.slots.append(slot)
            if self.disk is not None:
                hit.disk.append(disk_slot)
            parent = h
        return hit

    def worth_paging(self, num_tokens: int) -> bool:
        """Whether a host hit of ``num_tokens`` tokens is paged in rather than recomputed."""
        return num_tokens > 0 and num_tokens >= self.min_tokens

    def page_in(self, hit: HostHit, block_ids: Sequence[int]) -> None:
        """Queue copies of ``hit``'s blocks into device blocks ``block_ids`` (same order):
        page-ins from host slots, loads from disk slots."""
        disk = hit.disk or [-1] * len(hit)
        for h, slot, d, block in zip(hit.hashes, hit.slots, disk, block_ids, strict=True):
            if slot < 0:
                assert self.disk is not None
                self.disk.load(h, d)
                self._loads.append((d, block))
                continue
            self._touch(h)
            self._pinned[slot] = self._pinned.get(slot, 0) + 1
            self._in.append((slot, block))
        self.stats.hit_blocks += len(hit) - hit.num_disk

    def take(self) -> TierCopies:
        """The queued copies, in issue order; the queues start empty again."""
        copies = TierCopies()
        if self.disk is not None:  # demote ahead of need (DISK_RESERVE_SHARE)
            while len(self._free) < self.reserve and self._evict_leaf(last=True):
                pass
            for slot, disk_slot in self._demote:
                copies.demote_slots.append(slot)
                copies.demote_disk.append(disk_slot)
            for disk_slot, block in self._loads:
                copies.load_disk.append(disk_slot)
                copies.load_blocks.append(block)
            self.disk.unpin_all()
        for block, slot in self._out.values():
            copies.out_blocks.append(block)
            copies.out_slots.append(slot)
        for slot, block in self._in:
            copies.in_slots.append(slot)
            copies.in_blocks.append(block)
        self.stats.page_out_blocks += len(copies.out_blocks)
        self.stats.page_in_blocks += len(copies.in_blocks)
        self._out, self._in, self._pinned = {}, [], {}
        self._demote, self._loads = [], []
        return copies

    @property
    def pending(self) -> bool:
        """Whether copies are queued (``take`` would return a non-empty batch)."""
        return bool(self._out or self._in or self._demote or self._loads)

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def snapshot(self) -> TierStats:
        s = self.stats.copy()
        s.used_blocks = len(self._entries)
        return s

    def check_integrity(self) -> None:
        """Raise IntegrityError unless slots are each free or held by one entry."""
        held = [e.slot for e in self._entries.values()]
        require(len(set(held)) == len(held), "a host slot held twice")
        require(not set(held) & set(self._free), "a host slot both free and held")
        require(len(held) + len(self._free) == self.num_slots, "host slots lost or doubled")
        require(all(h in self._entries for h in self._out), "a page-out without its entry")
        require(all(h in self._entries for h in self._leaves), "a leaf without its entry")
        childless = {h for h, e in self._entries.items() if not e.children}
        require(childless <= set(self._leaves), "a childless entry that cannot be evicted")
        if self.disk is not None:
            self.disk.check_integrity()
