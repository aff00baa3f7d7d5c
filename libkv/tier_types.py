"""The plain records the KV tiers below the device pool pass around (no torch): a lookup's hit,
one batch of copies, and the counters of a tier (``libkv.host_tier``, ``libkv.disk_tier``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from libkv.hashing import BlockHash


@dataclass(slots=True)
class HostHit:
    """Blocks continuing a device hit, in chain order: their hashes, and for each either its
    host slot (``slots[i] >= 0``) or, when only the disk tier holds it, its disk slot
    (``slots[i] == -1``, ``disk[i] >= 0``). ``disk`` is empty without a disk tier."""

    hashes: list[BlockHash] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.slots)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` blocks."""
        del self.hashes[n:], self.slots[n:], self.disk[n:]

    @property
    def num_disk(self) -> int:
        """Blocks of the hit that only the disk tier holds."""
        return sum(1 for s in self.slots if s < 0)


@dataclass(slots=True)
class TierCopies:
    """One batch of copies, in issue order: demotions (host slot -> disk slot, written by the
    disk store's writer thread), page-outs (device block -> host slot), page-ins (host slot ->
    device block), loads (disk slot -> device block, through host staging memory)."""

    out_blocks: list[int] = field(default_factory=list)
    out_slots: list[int] = field(default_factory=list)
    in_slots: list[int] = field(default_factory=list)
    in_blocks: list[int] = field(default_factory=list)
    demote_slots: list[int] = field(default_factory=list)
    demote_disk: list[int] = field(default_factory=list)
    load_disk: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.out_blocks or self.in_blocks or self.demote_slots or self.load_blocks)

    def args(self, written: list[int]) -> tuple[list[int], ...]:
        """``engine.host_store.HostStore.copy``'s arguments, ``written`` among them."""
        return (self.out_blocks, self.out_slots, self.in_slots, self.in_blocks, written,
                self.demote_slots, self.demote_disk, self.load_disk, self.load_blocks)  # fmt: skip


@dataclass(slots=True)
class TierStats:
    """Counters of one tier (blocks; bytes are blocks x ``block_bytes``). For the disk tier,
    page-outs are blocks written from the host tier, page-ins blocks read back."""

    capacity_blocks: int = 0
    used_blocks: int = 0
    block_bytes: int = 0
    block_size: int = 0  # tokens per block
    hit_blocks: int = 0  # prompt blocks served from this tier (paged in)
    short_hits: int = 0  # host hits under ``min_tokens``, recomputed instead
    page_out_blocks: int = 0
    page_in_blocks: int = 0
    cancelled: int = 0  # page-outs dropped because the device block was evicted first
    swaps: int = 0  # preempted sequences resumed by paging their KV in
    recomputes: int = 0  # preempted sequences resumed by recomputing
    page_out_seconds: float = 0.0  # copy time measured by the store (CUDA events; disk: wall)
    page_in_seconds: float = 0.0

    def copy(self) -> TierStats:
        return TierStats(*(getattr(self, f) for f in self.__slots__))  # type: ignore[attr-defined]


def runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both ids go up by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out
