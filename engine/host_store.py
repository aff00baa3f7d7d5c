"""The host tier's memory and copies (one rank's): a pool of host blocks beside the device pool,
filled by page-outs and read by page-ins that ``libkv.host_tier`` plans.

Host blocks have the device pool's block layout and dtype (head-major, ``engine.kv_pool``), so
every copy is of whole contiguous blocks, merged into runs where ids are consecutive: on CUDA
each run is one DMA copy (``cudaMemcpyAsync`` from or to pinned memory), which vLLM found to
disturb the forward pass less than a gather kernel.

Streams on CUDA, and why they are ordered right:

- page-outs run on a side stream, so a step never waits for them: the side stream first waits
  for the work queued on the engine's stream so far (the blocks it reads are computed; the
  page-ins queued before it that read the same host slots are done);
- page-ins run on the engine's stream itself, just before the step's forward pass: that pass
  reads them anyway, and the engine's one-stream invariant (``engine.step_loop``) orders them
  after the step in flight, which may still write a block freed under it;
- a block that a page-out in flight still reads may have been evicted and handed out again
  since: before the engine's stream writes blocks (a step, a page-in, a block write) it waits
  on the event of every unfinished page-out batch that reads one of them (``guard``, a
  device-side wait, free when the copy is done, as it nearly always is one step later);
  writers off the engine's stream (NIXL into reserved blocks) wait on the host (``settle``).

Off CUDA the same calls are plain synchronous copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.tier_sizing import (  # noqa: F401 -- re-exported: the sizing was defined here
    CGROUP_FILES,
    GIB,
    HOST_MEMORY_SHARE,
    HOST_POOL_RATIO,
    _available_memory,
    _cgroup_room,
    _meminfo_available,
    host_slots,
)
from libkv.disk_tier import DiskTier
from libkv.host_tier import HostTier, TierStats
from libkv.tier_types import runs

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.disk_store import DiskStore
    from engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class _Batch:
    """A page-out batch on the side stream: the device blocks it reads and its events."""

    blocks: frozenset[int]
    start: torch.cuda.Event
    done: torch.cuda.Event


class HostStore:
    """``num_slots`` host blocks shaped like ``pool``'s blocks (pinned on CUDA)."""

    def __init__(self, pool: torch.Tensor, num_slots: int) -> None:
        self.pool = pool
        self.device = pool.device
        on_cuda = self.device.type == "cuda"
        # Not zeroed: a slot is always written (paged out) before it is read.
        self.host = torch.empty((num_slots, *pool.shape[1:]), dtype=pool.dtype, pin_memory=on_cuda)
        self.stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._batches: list[_Batch] = []  # page-outs issued and maybe not finished
        self._timed: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.out_seconds = 0.0
        self.in_seconds = 0.0
        self.disk: DiskStore | None = None  # the disk tier below, set by its owner

    @property
    def num_slots(self) -> int:
        return int(self.host.shape[0])

    def copy(
        self,
        out_blocks: Sequence[int],
        out_slots: Sequence[int],
        in_slots: Sequence[int],
        in_blocks: Sequence[int],
        written: Iterable[int] = (),
        demote_slots: Sequence[int] = (),
        demote_disk: Sequence[int] = (),
        load_disk: Sequence[int] = (),
        load_blocks: Sequence[int] = (),
    ) -> None:
        """Queue demotions (host slot -> disk slot, on the disk store's writer thread), issue
        page-outs (device block -> host slot), make the engine's stream safe to write
        ``written`` and the blocks paged in (``guard``), then page-ins (host slot -> device
        block) and loads (disk slot -> device block). A host slot is written only after the
        demotion reading it (``DiskStore.wait_host``)."""
        disk = self.disk
        if demote_slots:
            assert disk is not None
            disk.demote(demote_slots, demote_disk, self._issued())
        if disk is not None and out_slots:
            disk.wait_host(out_slots)
        if self.stream is None:
            if out_blocks:
                self.host[list(out_slots)] = self.pool[list(out_blocks)]
            if in_blocks:
                self.pool[list(in_blocks)] = self.host[list(in_slots)]
        else:
            self._collect()
            if out_blocks:
                self._page_out(out_blocks, out_slots)
            self.guard([*written, *in_blocks, *load_blocks])
            if in_blocks:
                start, done = _timing_events()
                start.record()
                for s, b, n in runs(in_slots, in_blocks):
                    self.pool[b : b + n].copy_(self.host[s : s + n], non_blocking=True)
                done.record()
                self._timed.append(("in", start, done))
        if load_blocks:
            assert disk is not None
            disk.load(load_disk, load_blocks)

    def _issued(self) -> torch.cuda.Event | None:
        """An event after every page-out issued so far (None off CUDA: they are done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _page_out(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        assert self.stream is not None
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        start, done = _timing_events()
        with torch.cuda.stream(self.stream):
            start.record()
            for b, s, n in runs(blocks, slots):
                self.host[s : s + n].copy_(self.pool[b : b + n], non_blocking=True)
            done.record()
        self._batches.append(_Batch(frozenset(blocks), start, done))
        self._timed.append(("out", start, done))

    def guard(self, blocks: Iterable[int]) -> None:
        """Make the engine's stream wait (on the device) for unfinished page-outs reading any
        of ``blocks`` before it writes them."""
        if not self._batches:
            return
        wanted = set(blocks)
        main = torch.cuda.current_stream(self.device)
        for batch in self._batches:
            if not batch.blocks.isdisjoint(wanted):
                main.wait_event(batch.done)

    def settle(self, blocks: Iterable[int]) -> None:
        """Wait on the host until no page-out reads ``blocks`` (before a writer that is not on
        the engine's stream, a NIXL transfer into reserved blocks, writes them)."""
        wanted = set(blocks)
        for batch in self._batches:
            if not batch.blocks.isdisjoint(wanted):
                batch.done.synchronize()
        self._collect()

    def _collect(self) -> None:
        """Forget finished page-out batches and add up the copy times of finished copies."""
        self._batches = [b for b in self._batches if not b.done.query()]
        pending = []
        for kind, start, done in self._timed:
            if not done.query():
                pending.append((kind, start, done))
                continue
            seconds = start.elapsed_time(done) / 1000.0
            if kind == "out":
                self.out_seconds += seconds
            else:
                self.in_seconds += seconds
        self._timed = pending

    def synchronize(self) -> None:
        """Wait until every copy issued so far has finished (tests, benchmarks)."""
        if self.stream is not None:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
            self._collect()
        if self.disk is not None:
            self.disk.synchronize()


def _timing_events() -> tuple[torch.cuda.Event, torch.cuda.Event]:
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def written_blocks(sched: SchedulerOutput, block_size: int) -> list[int]:
    """Device blocks a step writes: each chunk's token slots, and the copy-on-write copies'
    targets (what ``HostStore.guard`` must see before the step)."""
    out = [c.dst for c in sched.copies]
    for s in sched.scheduled:
        first = s.seq.num_computed // block_size
        last = (s.seq.num_computed + s.num_new - 1) // block_size
        out.extend(s.block_ids[first : last + 1])
    return out


def make_tier(config: EngineConfig, store: HostStore | None, block_bytes: int) -> HostTier | None:
    """The bookkeeping of ``store``'s blocks, and of its disk store's (None without a store or
    a prefix cache)."""
    if store is None or not config.enable_prefix_caching:
        return None
    tier = HostTier(store.num_slots, config.block_size, block_bytes, config.kv_swap_min_tokens)
    if store.disk is not None:
        tier.disk = DiskTier(store.disk.num_slots, config.block_size, block_bytes)
    return tier


def tier_stats(tier: HostTier | None, store: HostStore | None) -> TierStats | None:
    """The tier's counters with the copy times ``store`` measured (None without a tier)."""
    if tier is None:
        return None
    stats = tier.snapshot()
    if store is not None:
        stats.page_out_seconds, stats.page_in_seconds = store.out_seconds, store.in_seconds
    return stats


def disk_tier_stats(tier: HostTier | None, store: HostStore | None) -> TierStats | None:
    """The disk tier's counters with the I/O times its store measured (None without one)."""
    if tier is None or tier.disk is None:
        return None
    stats = tier.disk.snapshot()
    if store is not None and store.disk is not None:
        stats.page_out_seconds = store.disk.out_seconds
        stats.page_in_seconds = store.disk.in_seconds
    return stats
