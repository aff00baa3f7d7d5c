"""The disk tier's bookkeeping (no torch): which prefix blocks the disk files hold, in which
slots, below the host tier (``libkv.host_tier``) and under the same index (the hash chain,
tenant and adapter salts included).

Blocks enter it when the host tier evicts them (write-back, as LMCache's local-disk backend
and SGLang HiCache's storage tier take what host memory lets go): the host tier asks ``put``
for a disk slot and queues the write, which ``engine.disk_store``'s writer thread makes from
the host slot, off the step's path. A host entry evicted again while the disk still holds the
same block is not written twice. A prompt's chain, past its device and host hits, continues
here (``HostTier.find`` asks ``get``); such blocks are read back disk -> host staging memory
-> device before the forward pass that reads them.

Slots are evicted leaves first, least recently used among them, as in the host tier, with one
difference: an entry's parent is often not on disk (the host tier drops a chain's tail first,
so a tail reaches the disk before its head), so children are counted by parent hash, whether
or not the parent is an entry yet; an entry that arrives after its children is no leaf.
Slots of queued loads are pinned until the batch is taken (``unpin_all``), so no demotion
queued meanwhile overwrites them; a slot written by a demotion still in flight is read only
after the write (``engine.disk_store`` waits for it).

The index lives in memory only: a restarted worker starts with an empty disk tier (its files
are new, under its new incarnation) -- see docs/engine.md for why files are not reused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from libkv.block_pool import require
from libkv.hashing import BlockHash
from libkv.tier_types import TierStats


@dataclass(slots=True)
class DiskEntry:
    slot: int
    token_ids: tuple[int, ...]
    parent: BlockHash


class DiskTier:
    """``num_slots`` disk blocks of ``block_size`` tokens (``block_bytes`` each, for stats)."""

    def __init__(self, num_slots: int, block_size: int, block_bytes: int = 0) -> None:
        if num_slots < 1 or block_size < 1:
            raise ValueError("num_slots and block_size must be positive")
        self.num_slots, self.block_size = num_slots, block_size
        self.stats = TierStats(num_slots, block_bytes=block_bytes, block_size=block_size)
        self._entries: dict[BlockHash, DiskEntry] = {}
        self._kids: dict[BlockHash, int] = {}  # parent hash -> entries whose parent it is
        self._leaves: OrderedDict[BlockHash, None] = OrderedDict()  # least recent first
        self._free: deque[int] = deque(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._pinned: dict[int, int] = {}  # slot -> queued loads reading it

    def get(self, block_hash: BlockHash, tokens: tuple[int, ...]) -> int | None:
        """The slot holding ``block_hash`` with these tokens (verified), or None."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.token_ids != tokens:
            return None
        return entry.slot

    def put(self, block_hash: BlockHash, tokens: tuple[int, ...], parent: BlockHash) -> int | None:
        """A slot to write ``block_hash`` into, or None when nothing is to be written (the disk
        holds it already, now used; or every slot is pinned by a queued load)."""
        entry = self._entries.get(block_hash)
        if entry is not None and entry.token_ids == tokens:
            self._touch(block_hash)
            return None
        if entry is not None:  # a colliding hash: the newer block wins
            self._drop(block_hash)
        slot = self._take_slot()
        if slot is None:
            return None
        self._entries[block_hash] = DiskEntry(slot, tokens, parent)
        if not self._kids.get(block_hash):
            self._leaves[block_hash] = None
        self._kids[parent] = self._kids.get(parent, 0) + 1
        self._leaves.pop(parent, None)
        self.stats.page_out_blocks += 1
        return slot

    def load(self, block_hash: BlockHash, slot: int) -> None:
        """A queued load reads ``slot`` (``block_hash``'s): keep it until ``unpin_all``."""
        self._touch(block_hash)
        self._pinned[slot] = self._pinned.get(slot, 0) + 1
        self.stats.hit_blocks += 1
        self.stats.page_in_blocks += 1

    def unpin_all(self) -> None:
        """The queued loads were taken (issued): their slots may be evicted again."""
        self._pinned = {}

    def _touch(self, block_hash: BlockHash) -> None:
        if block_hash in self._leaves:
            self._leaves.move_to_end(block_hash)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h in self._leaves:  # least recently used leaf first
            if self._entries[h].slot not in self._pinned:
                self._drop(h)
                return self._free.pop()
        return None

    def _drop(self, block_hash: BlockHash) -> None:
        """Forget an entry; its parent, left without children, is the next leaf to go."""
        entry = self._entries.pop(block_hash)
        self._leaves.pop(block_hash, None)
        self._free.append(entry.slot)
        left = self._kids.get(entry.parent, 0) - 1
        if left > 0:
            self._kids[entry.parent] = left
            return
        self._kids.pop(entry.parent, None)
        if entry.parent in self._entries:
            self._leaves[entry.parent] = None
            self._leaves.move_to_end(entry.parent, last=False)

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def snapshot(self) -> TierStats:
        s = self.stats.copy()
        s.used_blocks = len(self._entries)
        return s

    def check_integrity(self) -> None:
        """Raise IntegrityError unless slots are each free or held by one entry and every
        childless entry can be evicted."""
        held = [e.slot for e in self._entries.values()]
        require(len(set(held)) == len(held), "a disk slot held twice")
        require(not set(held) & set(self._free), "a disk slot both free and held")
        require(len(held) + len(self._free) == self.num_slots, "disk slots lost or doubled")
        require(all(h in self._entries for h in self._leaves), "a disk leaf without its entry")
        childless = {h for h in self._entries if not self._kids.get(h)}
        require(childless == set(self._leaves), "disk leaves are not the childless entries")
