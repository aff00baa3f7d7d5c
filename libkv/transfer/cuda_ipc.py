"""The device-local KV hand-off: a peer's KV pool mapped through CUDA IPC, blocks moved by
device copies.

Between two workers on one GPU (or on two GPUs of one host that can reach each other over
NVLink/PCIe peer access) nothing needs a network stack: the prefill worker exports its pool
once (``export_pool``: a CUDA IPC handle of the allocation, published in its etcd member
record), the decode worker opens it once per peer incarnation (``open_pool``) and copies the
blocks it needs on a side stream of its own, one ``cudaMemcpyAsync`` per run of contiguous
blocks. NIXL/UCX between two processes of one device picked a TCP emulation at 12 MB/s here
(bench/results/serving_gpu_*), a device copy moves hundreds of GB/s.

Ordering: the prefill worker hands a request over only after sampling its first token, which
waits for the step's kernels, so the blocks' KV is complete in device memory before the
handle leaves the worker; the decode worker waits for its copies before the request joins its
batch. The pool allocation outlives every transfer: a worker's pool lives as long as the
process, and an opened mapping keeps the memory alive until it is closed, so a dead peer's
mapping only ever yields blocks that a lease check refuses (`StalePeerError`).

Checked KV (``sums=True``, a decode worker with ``--kv-checksums`` whose pool holds whole
canonical blocks): every fetch runs a fused copy-and-sum kernel, which takes each moved block's
``wsum64`` from the words as the copy writes them, so checking what arrived costs no second
read of the blocks. Where the handle carries the sender's ``wsum64`` of the fetched blocks
(`fetch_checks.sender_sums`), they are compared on the device with no host round trip, and
the check's host work runs while the copy does (``behind``, where the warm-up finds the
device reads pinned host memory, which CUDA's unified addressing maps): the copy and sum is
queued first, into a reused zeroed device buffer (a few contiguous runs, at most
``MEMCPY_RUNS`` as `block_runs` finds them, the common case in a fresh stack: the runs as
scalar arguments, nothing uploaded, ``kernels.runs_copy_sum``; scattered blocks: their ids up
from a reused pinned buffer, as the plain copy's go, ``kernels.packed_copy_sum``); then the
host reads the sender's sums off the handle into a reused pinned buffer and queues the compare
behind the copy (``kernels.compare_sums``: one program that reads them where they lie, writes
the count behind them and leaves the sums zero). No device allocation, and a hand-off's
critical path gains only the copy kernel's launch over the unchecked copy's (a
``cudaMemcpy`` for runs). A few runs from a pool on another GPU are not copied by the SMs:
between two GPUs the link bounds the copy, which the copy engines drive faster than an SM
copy does, while this GPU reads what landed about ten times faster than the link brings it;
so they go by ``cudaMemcpy`` in chunks, each chunk summed from this GPU's memory on a side
stream once it has landed (``kernels.run_wsum64``), the compare behind the last sum
(`_check_peer_runs`). The fetch's one wait covers copy, compare and count; `verify`
answers from the kept count with no device work and no wait of its own; its sums are not
kept, so a `verify` with other sums than those compared returns None (the caller checks the
blocks). The caller recomputes on a mismatch. Where the device cannot read pinned memory, one
fused kernel copies, sums and compares, with the ids, the sender's sums and the zeroed sums
uploaded before it (``kernels.copy_sum_check_blocks_between``: the last program to finish a
block, by a ticket per block as split-K takes one, compares its sum, and the last block to
finish stores the count: into pinned memory where the device can, else brought back by an
8-byte copy). Without the sender's sums on the
handle the copy's sums stay on the device and `verify` compares them with what it is given
(``kernels.count_mismatches``, one more wait).

The fetch's wait polls the copy's event on the event loop for as long as the copy should take
(its bytes at ``POLL_RATE``, plus a margin), so a normal hand-off never pays a hop to a thread;
only a copy that outlasts that is waited for in one (``thread_waits``).

The test-only fault hook (``fault="corrupt"``, ``--kv-fault corrupt``) damages data in transit
on this path: the first block is read not from the peer's pool but from a scratch copy of it
with one bit flipped (a bad read or a flipped bit between the sender's memory and this copy),
and the copy writes and sums the damaged words; on the runs path the copy flips the same bit
of the first block in its registers, between its read and its write. The sender's pool is never
touched, and the check sees exactly what landed in the destination block.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

import kernels
from libkv.transfer import (
    CUDA_IPC_KEY,
    DEVICE_KEY,
    HOST_KEY,
    VISIBLE_KEY,
    KVSource,
    KVTransferError,
    TransferStats,
    agent_name,
    block_runs,
)
from libkv.transfer.cuda_ipc_checks import MEMCPY_RUNS, CopyChecks, Want
from libkv.transfer.fetch_checks import FetchChecks, Kept, sender_sums, signed64

log = logging.getLogger(__name__)
# How long a fetch's wait polls on the event loop before it waits in a thread: the copy's
# bytes at a rate every device copy beats (H100: ~1 TB/s within the GPU, hundreds of GB/s
# between GPUs over NVLink), plus a margin, never longer than the cap.
POLL_RATE = 100e9  # bytes per second
POLL_MARGIN_S = 1e-3
POLL_MAX_S = 0.02


def host_id() -> str:
    """This host's identity as processes on it see it (the kernel's boot id)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket

        return socket.gethostname()


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_devices() -> list[str]:
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@dataclass(frozen=True, slots=True)
class IpcPool:
    """An exported KV pool: what ``torch.UntypedStorage._share_cuda_`` returns for its
    allocation, plus the pool's layout and its GPU."""

    device_uuid: str
    handle: str  # base64 of the CUDA IPC memory handle
    size: int  # bytes of the storage
    offset: int  # bytes of the storage inside the allocation
    ref_counter_handle: str  # base64
    ref_counter_offset: int
    event_handle: str  # base64
    event_sync_required: bool
    num_blocks: int
    block_bytes: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> IpcPool:
        return cls(**json.loads(text))


def export_pool(pool: torch.Tensor, block_bytes: int) -> IpcPool:
    """Export ``pool`` (contiguous, ``[num_blocks, ...]``, on a CUDA device) for peers."""
    if pool.device.type != "cuda" or not pool.is_contiguous():
        raise ValueError("only a contiguous CUDA pool can be exported")
    storage = pool.untyped_storage()
    _dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    assert pool.storage_offset() == 0 and size == pool.numel() * pool.element_size()
    return IpcPool(
        device_uuid=device_uuid(pool.device.index or 0),
        handle=_b64(handle),
        size=int(size),
        offset=int(offset),
        ref_counter_handle=_b64(rc_handle),
        ref_counter_offset=int(rc_offset),
        event_handle=_b64(ev_handle or b""),
        event_sync_required=bool(ev_sync),
        num_blocks=pool.shape[0],
        block_bytes=block_bytes,
    )


def open_pool(info: IpcPool, device: torch.device) -> torch.Tensor:
    """Map a peer's pool into this process on ``device`` (the peer's GPU when it is the same
    one, else reached by peer access); returns it as ``[num_blocks, block_bytes]`` bytes."""
    d = base64.b64decode
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index or 0,
            d(info.handle),
            info.size,
            info.offset,
            d(info.ref_counter_handle),
            info.ref_counter_offset,
            d(info.event_handle) or None,
            info.event_sync_required,
        )
        flat = torch.empty(0, dtype=torch.uint8, device=device)
        flat.set_(storage, 0, (info.size,), (1,))
    return flat.view(info.num_blocks, info.block_bytes)


def pool_record(
    pool: torch.Tensor, block_bytes: int, export: bool, exported: str = ""
) -> dict[str, str]:
    """A GPU worker's member-record fields for the hand-off (`libkv.transfer.handoff_path`):
    its host, its GPU, the GPUs it can map, and with ``export`` its pool for CUDA IPC
    (``exported``: the export its allocating process made, when ``pool`` is a mapping)."""
    out = {
        HOST_KEY: host_id(),
        DEVICE_KEY: device_uuid(pool.device.index or 0),
        VISIBLE_KEY: ",".join(sorted(visible_devices())),
    }
    if export:
        out[CUDA_IPC_KEY] = exported or export_pool(pool, block_bytes).to_json()
    return out


@dataclass(slots=True)
class Launched:
    """One fetch's queued work: the event behind it, the copy's sums (sums on), the host
    scalar its mismatch count lands in (the sender's sums given), and the pinned buffer its
    upload came from (reused once the event completed)."""

    done: Any  # torch.cuda.Event
    sums: torch.Tensor | None
    count: Any  # a 0-dim int64 in host memory (tensor or array), or None
    staged: torch.Tensor | None
    fused: bool = False  # sums on: the copy took them (``sums`` None where it kept none)


class PeerRecords(Protocol):
    """The member-record fields of a live worker incarnation (etcd in services)."""

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        """Raises StalePeerError / KVTransferError as `libkv.transfer.PeerDirectory` does."""
        ...


class CudaIpcTransport(CopyChecks):
    """`KVTransport` over CUDA IPC for peers on this host whose GPU this process can map.

    ``pool`` is this worker's own pool (``[num_blocks, ...]`` contiguous on its GPU). Copies
    are launched from the event loop on a side stream of their own, so they overlap the
    engine's steps. ``can_reach(extra)`` tells whether a peer's record qualifies; `fetch`
    raises KVTransferError for one that does not (the caller picks another path)."""

    name = "cuda-ipc"

    def __init__(
        self,
        pool: torch.Tensor,
        block_bytes: int,
        records: PeerRecords,
        sums: bool = False,
        fault: str = "",
    ) -> None:
        if fault not in ("", "corrupt"):
            raise ValueError(f"unknown KV fault {fault!r}")
        if sums and block_bytes % 8:
            raise ValueError(f"{block_bytes}-byte blocks are not whole 64-bit words")
        self.device = pool.device
        self._cuda = self.device.type == "cuda"  # off CUDA: the tests' reference path
        self.pool = pool.view(torch.uint8).view(pool.shape[0], block_bytes)
        self.block_bytes = block_bytes
        self.records = records
        self.host = host_id()
        self.visible = set(visible_devices())
        self.stats = TransferStats()
        self._stream: Any = None
        self._peers: dict[str, torch.Tensor] = {}  # agent name (worker@incarnation) -> pool
        self._current: dict[str, str] = {}  # worker id -> agent name of its mapped pool
        self.sums = sums  # fused copy-and-sum, compared with the sender's on the device
        self.fault = fault  # test only, with sums: "corrupt" flips a bit of each first block
        self._checks = FetchChecks()  # request id -> what its last fetch leaves for `verify`
        self._counts: list[torch.Tensor] = []  # pinned scalars a verify's count comes back in
        self._staged: list[torch.Tensor] = []  # pinned upload buffers, free for a fetch
        self._work: torch.Tensor | None = None  # the fused check's zeroed words (device)
        # Per source pool (by identity, the tensor kept with it): the fused check bound to
        # it, this pool and the workspace (`kernels.packed_check`: checked once, not per fetch).
        self._checkers: dict[int, tuple[torch.Tensor, Any]] = {}
        # The copy and sum with the compare behind it (where the warm-up found the device
        # reads pinned memory: ``behind``), by kind ("runs": a few contiguous runs, nothing
        # uploaded, `kernels.runs_copy_sum`; "packed": scattered, `kernels.packed_copy_sum`)
        # and source pool, bound to it and the reused sums buffer.
        self._copiers: dict[tuple[str, int], tuple[torch.Tensor, Any]] = {}
        self._run_sums: torch.Tensor | None = None
        self._side: Any = None  # where a run from another GPU is summed as it lands
        # This GPU's identity: a pool exported from another one is checked behind the copy
        # engines (`_check_peer_runs`), not by an SM copy over the link.
        self.uuid = device_uuid(self.device.index or 0) if self._cuda else ""
        self.behind = False  # the compare goes behind the copy (the warm-up: on)
        self.behind_fetches = 0  # fetches checked that way (tests, bench)
        self.run_fetches = 0  # of those, a few contiguous runs with nothing uploaded
        self.peer_run_fetches = 0  # of those, runs from another GPU, summed as they landed
        self.mapped_count = False  # the fused check writes its count into pinned memory
        self.fused_fetches = 0  # fetches whose sums came from the copy (tests, bench)
        self.compared_fetches = 0  # of those, compared in the copy (verify waits for none)
        self.device_verifies = 0  # verifies that compared on the device themselves
        self.thread_waits = 0  # waits that outlasted their polling and went to a thread
        self.launch_ns = 0  # host time in `_launch`, all fetches (bench)
        if sums and self._cuda:
            self._warm_up()

    def can_reach(self, extra: dict[str, str]) -> bool:
        return (
            CUDA_IPC_KEY in extra
            and extra.get(HOST_KEY) == self.host
            and extra.get(DEVICE_KEY) in self.visible
        )

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        if len(src_blocks) != len(dst_blocks):
            raise ValueError("src_blocks and dst_blocks differ in length")
        if not src_blocks:
            return self.name
        t0 = time.monotonic()
        extra = await self.records.extra(source.worker_id, source.incarnation, timeout)
        if not self.can_reach(extra):
            raise KVTransferError(f"{source.worker_id}'s pool is not reachable by CUDA IPC")
        info = IpcPool.from_json(extra[CUDA_IPC_KEY])
        if info.block_bytes != source.block_bytes or info.block_bytes != self.block_bytes:
            raise KVTransferError(
                f"{source.worker_id} has {info.block_bytes}-byte blocks, this worker "
                f"{self.block_bytes}, the handle says {source.block_bytes}"
            )
        name = agent_name(source.worker_id, source.incarnation)
        self._checks.drop(request_id)
        # The sender's sums, read off the handle when the check needs them (on the runs path
        # while the copy runs), once.
        want = functools.cache(lambda: sender_sums(source, src_blocks)) if self.sums else None
        n = len(src_blocks)
        try:
            t1 = time.perf_counter_ns()
            launched = self._launch(name, info, src_blocks, dst_blocks, want)
            self.launch_ns += time.perf_counter_ns() - t1
            # The copy, with its compare and count when ``want`` came: one wait for all.
            await self._wait(launched.done, timeout, n * self.block_bytes)
            bad = None if launched.count is None else int(launched.count)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self.stats.failures += 1
            raise KVTransferError(f"CUDA IPC copy from {source.worker_id} failed: {e}") from e
        if launched.staged is not None:  # its upload and count are done: reusable
            self._staged.append(launched.staged)
        if launched.fused:
            self.fused_fetches += 1
            if bad is not None:
                self.compared_fetches += 1
            self._checks.keep(request_id, Kept(launched.sums, n, want() if want else None, bad))
        self.stats.add(n, n * self.block_bytes, time.monotonic() - t0)
        return self.name

    def _launch(
        self,
        name: str,
        info: IpcPool,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        want: Want = None,
    ) -> Launched:
        """Map the peer's pool if new, queue the copy on this transport's stream (it overlaps
        the engine's steps: the destination blocks are reserved, no step touches them), and
        return an event that completes with it; with ``sums`` also each moved block's
        ``wsum64`` (on the device), and with ``want`` (the sender's sums) where the count of
        blocks that differ from them lands (host memory), both complete with the event.
        Launched from the event loop's thread: a few tens of microseconds, less than a hop to
        another thread; no host synchronisation (block ids go up from pinned memory)."""
        torch.cuda.set_device(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        src = self._mapped(name, info)
        with torch.cuda.stream(self._stream):
            sums: torch.Tensor | None = None
            count: torch.Tensor | None = None
            if self.sums:  # copies, sums and compares (on one GPU nothing read again)
                remote = self._cuda and info.device_uuid != self.uuid
                sums, count, staged = self._copy_sum(src, src_blocks, dst_blocks, want, remote)
            else:
                staged = self._copy(src, src_blocks, dst_blocks)
            done = torch.cuda.Event()
            done.record(self._stream)
        return Launched(done, sums, count, staged, self.sums)

    def _copy(
        self, src: torch.Tensor, src_blocks: Sequence[int], dst_blocks: Sequence[int]
    ) -> torch.Tensor | None:
        """The plain copy: a few long runs one DMA copy each, scattered blocks one gather /
        scatter kernel whose ids go up from a pinned buffer (returned: reusable after the
        wait)."""
        runs = block_runs(src_blocks, dst_blocks)
        if len(runs) <= MEMCPY_RUNS:
            for s, d, k in runs:
                self.pool[d : d + k].copy_(src[s : s + k], non_blocking=True)
            return None
        n = len(src_blocks)
        staged = self._staging(2 * n)
        rows = staged.numpy()
        rows[:n], rows[n : 2 * n] = src_blocks, dst_blocks
        idx = staged[: 2 * n].to(self.device, non_blocking=True)
        kernels.copy_blocks_between(self.pool, src, idx[:n], idx[n:])
        return staged

    async def verify(self, request_id: str, expected: Sequence[int]) -> int | None:
        """How many blocks of ``request_id``'s last fetch differ from ``expected`` (the
        sender's ``wsum64`` of each, unsigned, in the fetch's order). Where the fetch compared
        these very sums in its copy (the handle carried them), its count, with no device work
        and no wait; else compared on the device now (the expected sums go up, one count
        comes back). None when that fetch took no sums (not fused, or already verified) or
        ``expected`` is empty (the sender sent no ``wsum64``): the caller checks the arrived
        blocks itself. ValueError when ``expected`` is not one sum per moved block. Always
        drops what the fetch kept."""
        kept = self._checks.take(request_id, expected)
        if not isinstance(kept, Kept):
            return kept
        if kept.sums is None:  # compared in the copy, its sums not kept: checked apart
            return None
        self.device_verifies += 1
        count = self._pinned_count()
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            want = torch.tensor(signed64(expected), dtype=torch.int64, device=self.device)
            count.copy_(kernels.count_mismatches(kept.sums, want), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        try:
            await self._wait(done, 10.0)
            return int(count)
        finally:
            self._counts.append(count)

    async def _wait(self, done: Any, timeout: float, nbytes: int = 0) -> None:
        """Until ``done`` (a CUDA event) completed, within ``timeout`` seconds from now.
        Polled on the event loop (other tasks run between polls) for as long as a copy of
        ``nbytes`` is expected to take at a rate any device copy beats (``POLL_RATE``, plus
        ``POLL_MARGIN_S``, at most ``POLL_MAX_S``): a hop to a thread costs tens to hundreds of
        microseconds, which a normal hand-off never pays. Past that (a copy stuck behind other
        work) it is waited for in a thread (``thread_waits``)."""
        start = time.monotonic()
        poll = min(POLL_MARGIN_S + nbytes / POLL_RATE, POLL_MAX_S, timeout)
        while not done.query():
            elapsed = time.monotonic() - start
            if elapsed > poll:
                self.thread_waits += 1
                try:
                    if elapsed >= timeout:
                        raise TimeoutError
                    await asyncio.wait_for(asyncio.to_thread(done.synchronize), timeout - elapsed)
                except TimeoutError as e:  # never free the destination under a running copy
                    await asyncio.to_thread(done.synchronize)
                    raise KVTransferError(f"CUDA IPC copy took over {timeout:.1f} s") from e
                return
            await asyncio.sleep(0)

    def _mapped(self, name: str, info: IpcPool) -> torch.Tensor:
        worker = name.rpartition("@")[0]
        old = self._current.get(worker)
        if old is not None and old != name:  # the worker restarted: unmap its old pool
            gone = self._peers.pop(old, None)
            if gone is not None:
                self._checkers.pop(id(gone), None)
                for kind in ("runs", "packed"):
                    self._copiers.pop((kind, id(gone)), None)
        if name not in self._peers:
            self._peers[name] = open_pool(info, self.device)
            log.info("mapped the KV pool of %s over CUDA IPC (%d blocks)", name, info.num_blocks)
        self._current[worker] = name
        return self._peers[name]

    async def release(self, request_id: str, source: KVSource) -> None:
        """Nothing to tell over CUDA IPC: the caller releases through its network transport."""

    async def close(self) -> None:
        for stream in (self._stream, self._side):
            if stream is not None:
                await asyncio.to_thread(stream.synchronize)
        self._peers.clear()
        self._current.clear()
        self._checkers.clear()
        self._copiers.clear()
