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
``cudaMemcpy`` for runs). The fetch's one wait covers copy, compare and count; `verify`
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
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
from libkv.transfer.fetch_checks import FetchChecks, Kept, sender_sums, signed64

log = logging.getLogger(__name__)
# The sender's sums of a fetch's blocks (unsigned, in its order), or a function that gives them
# when the check needs them (None: the handle carries none).
Want = Sequence[int] | Callable[[], Sequence[int] | None] | None
MEMCPY_RUNS = 4  # up to this many contiguous runs: cudaMemcpy each; more: one copy kernel
# How long a fetch's wait polls on the event loop before it waits in a thread: the copy's
# bytes at a rate every device copy beats (H100: ~1 TB/s within the GPU, hundreds of GB/s
# between GPUs over NVLink), plus a margin, never longer than the cap.
POLL_RATE = 100e9  # bytes per second
POLL_MARGIN_S = 1e-3
POLL_MAX_S = 0.02
STAGING_MIN = 1024  # entries of the smallest pinned upload buffer and device workspace


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


def pool_record(pool: torch.Tensor, block_bytes: int, export: bool) -> dict[str, str]:
    """A GPU worker's member-record fields for the hand-off (`libkv.transfer.handoff_path`):
    its host, its GPU, the GPUs it can map, and with ``export`` its pool for CUDA IPC."""
    out = {
        HOST_KEY: host_id(),
        DEVICE_KEY: device_uuid(pool.device.index or 0),
        VISIBLE_KEY: ",".join(sorted(visible_devices())),
    }
    if export:
        out[CUDA_IPC_KEY] = export_pool(pool, block_bytes).to_json()
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


class CudaIpcTransport:
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
        self.behind = False  # the compare goes behind the copy (the warm-up: on)
        self.behind_fetches = 0  # fetches checked that way (tests, bench)
        self.run_fetches = 0  # of those, a few contiguous runs with nothing uploaded
        self.mapped_count = False  # the fused check writes its count into pinned memory
        self.fused_fetches = 0  # fetches whose sums came from the copy (tests, bench)
        self.compared_fetches = 0  # of those, compared in the copy (verify waits for none)
        self.device_verifies = 0  # verifies that compared on the device themselves
        self.thread_waits = 0  # waits that outlasted their polling and went to a thread
        self.launch_ns = 0  # host time in `_launch`, all fetches (bench)
        if sums and self._cuda:
            self._warm_up()

    def _warm_up(self) -> None:
        """Compile the fused kernels now, not in the first hand-off's path (a scratch block
        of the pool's size: the same kernel variants), and find out whether the fused check
        can store its count straight into pinned host memory (mapped into the device's
        address space by CUDA's unified addressing): a scratch block of zeros whose expected
        sum is 1 must count 1 there. If not, its count comes back by an 8-byte copy. If the
        kernels cannot run here the decode worker sums the arrived blocks itself, as over the
        network."""
        try:
            torch.cuda.set_device(self.device)  # where Triton launches
            self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):  # the workspace lives on the fetches' stream
                self._try_kernels()
            self._counts.append(torch.empty((), dtype=torch.int64, pin_memory=True))
        except Exception as e:  # a kernel that does not compile or run here: any kind
            log.warning("the fused CUDA IPC copy-and-sum cannot run (%s): checked apart", e)
            self.sums = False

    def _try_kernels(self) -> None:
        scratch = torch.zeros(1, self.block_bytes, dtype=torch.uint8, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        sums = kernels.copy_sum_blocks_between(scratch, scratch, zero, zero)
        kernels.count_mismatches(sums, sums)
        one = torch.ones(1, dtype=torch.int64, device=self.device)
        work = self._workspace(1)
        host = torch.full((), -1, dtype=torch.int64, pin_memory=True)
        for out in (host, torch.empty((), dtype=torch.int64, device=self.device)):
            try:
                kernels.copy_sum_check_blocks_between(
                    scratch, scratch, zero, zero, zero.clone(), one, work[1:], work[:1], out
                )
                torch.cuda.synchronize(self.device)
            except (RuntimeError, ValueError) as e:  # Triton refused the host pointer
                if out is not host:
                    raise
                log.info("the fused check cannot store into pinned memory (%s)", e)
                continue
            if int(work.count_nonzero()):
                raise RuntimeError("the fused check left its workspace dirty")
            if int(out) == 1:
                self.mapped_count = out is host
                break
            if out is not host:
                raise RuntimeError(f"the fused check counted {int(out)} of 1 in a test")
            log.info("the fused check's store into pinned memory did not arrive")
        # Once more as a fetch launches it (the vectors packed in one upload), which now goes
        # straight to the compiled kernel (`kernels.triton_launch.FastLaunch`; if that fails
        # here it says so once and every launch takes Triton's usual path).
        up = torch.tensor([0, 0, 1, 0], dtype=torch.int64, device=self.device)
        out.fill_(-1)
        kernels.copy_sum_check_packed(scratch, scratch, up, 1, work, out)
        torch.cuda.synchronize(self.device)
        if int(out) != 1 or int(work.count_nonzero()):
            raise RuntimeError(f"the fused check counted {int(out)} of 1 in a second test")
        if self.mapped_count:
            self._try_behind(scratch)

    def _try_behind(self, scratch: torch.Tensor) -> None:
        """Whether the compare behind the copy works here: it reads the sender's sums from
        pinned memory and writes its count there, both by the host address (the device's under
        unified addressing). A zero block whose expected sum is 1, twice (compiled, then
        launched straight), must count 1 each time and leave the sums zero: copied as a run,
        then by ids, then as a run with the fault hook if it is on (all compiled now, not in a
        fetch)."""
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        try:
            for kind, fault in [("runs", False), ("packed", False)] + (
                [("runs", True)] if self.fault else []
            ):
                sums = self._sums_buffer(1)
                if kind == "runs":
                    copy = functools.partial(
                        kernels.runs_copy_sum(scratch, scratch, sums, fault), [(0, 0, 1)]
                    )
                else:
                    packed = kernels.packed_copy_sum(scratch, scratch, sums)
                    copy = functools.partial(packed, ids, 1)
                for _ in range(2):  # (a flipped bit: a zero block never sums to 1 either)
                    host[0], host[1] = 1, -1
                    copy()
                    kernels.compare_sums(sums, host, 1)
                    torch.cuda.synchronize(self.device)
                    if int(host[1]) != 1:
                        raise RuntimeError(f"counted {int(host[1])} of 1")
                    if int(sums.count_nonzero()):
                        raise RuntimeError("left its sums dirty")
        except (RuntimeError, ValueError) as e:  # any way it fails here: the upload path
            log.warning("the compare behind the copy cannot read pinned memory (%s)", e)
            return
        self.behind = True

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
            if self.sums:  # one kernel that copies, sums and compares (nothing read again)
                sums, count, staged = self._copy_sum(src, src_blocks, dst_blocks, want)
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

    def _staging(self, size: int) -> torch.Tensor:
        """A host int64 buffer of at least ``size`` entries for one fetch's upload (and its
        count): pinned and reused on CUDA (it goes back once the fetch's wait is over), a new
        one on CPU (the tests: there the "upload" is the buffer itself)."""
        if not self._cuda:
            return torch.empty(size, dtype=torch.int64)
        for i, b in enumerate(self._staged):
            if b.numel() >= size:
                return self._staged.pop(i)
        return torch.empty(max(size, STAGING_MIN), dtype=torch.int64, pin_memory=True)

    def _workspace(self, n: int) -> torch.Tensor:
        """The fused check's zeroed device words (the blocks-done-and-mismatches word, then
        one ticket per block), kept zero by every kernel that uses them: one per transport,
        shared by every fetch on its one stream (which runs them one after another)."""
        if self._work is None or self._work.numel() < n + 1:
            self._work = torch.zeros(max(n + 1, STAGING_MIN), dtype=torch.int64, device=self.device)
            self._checkers.clear()  # bound to the old workspace
        return self._work

    def _sums_buffer(self, n: int) -> torch.Tensor:
        """The sums of a copy with the compare behind it (device int64, zero, one per block;
        the compare leaves them zero)."""
        if self._run_sums is None or self._run_sums.numel() < n:
            self._run_sums = torch.zeros(max(n, STAGING_MIN), dtype=torch.int64, device=self.device)
            self._copiers.clear()  # bound to the old buffer
        return self._run_sums

    def _copier(self, kind: str, src: torch.Tensor, n: int) -> Any:
        """The copy and sum of up to ``n`` blocks from ``src`` into this pool, of a few runs
        (``kind`` "runs") or scattered ("packed"): one per kind, source pool and sums buffer,
        made on its first fetch."""
        sums = self._sums_buffer(n)
        kept = self._copiers.get((kind, id(src)))
        if kept is None or kept[0] is not src:
            copy: Any
            if kind == "runs":
                copy = kernels.runs_copy_sum(self.pool, src, sums, self.fault == "corrupt")
            else:
                copy = kernels.packed_copy_sum(self.pool, src, sums)
            kept = (src, copy)
            self._copiers[(kind, id(src))] = kept
        return kept[1]

    def _checker(self, src: torch.Tensor, n: int) -> Any:
        """The fused check from ``src`` into this pool for up to ``n`` blocks (one per source
        pool and workspace, made on its first fetch)."""
        work = self._workspace(n)
        kept = self._checkers.get(id(src))
        if kept is None or kept[0] is not src:
            kept = (src, kernels.packed_check(self.pool, src, work))
            self._checkers[id(src)] = kept
        return kept[1]

    def _copy_sum(
        self,
        src: torch.Tensor,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        want: Want = None,
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """The fused copy-and-sum of every block (on the current stream), and with ``want``
        (the sender's sums, unsigned, one per block) the compare in the same kernel: returns
        the sums (int64 on the device), the 0-dim host int64 that holds how many blocks' sums
        differ once the stream's work is done (None without ``want``), and the staging buffer
        it lives in. One upload before the copy: block ids, the sender's sums and the zeroed
        sums, from pinned memory. The kernel writes the count straight into the pinned buffer
        where the warm-up found the device can (``mapped_count``), else into the device and
        8 bytes come back behind it. With the fault hook the first block is read from a
        scratch copy with one bit flipped (see the module). ``want`` may also be a function
        that gives them (or None), called once. Where the warm-up found the device reads
        pinned memory (``behind``) the compare goes behind the copy instead (`_check_runs`,
        `_check_scattered`): with the sender's sums, no sums are returned (None)."""
        n = len(src_blocks)
        if self.behind:
            runs = block_runs(src_blocks, dst_blocks)
            if len(runs) <= MEMCPY_RUNS:
                return self._check_runs(src, runs, n, want)
            return self._check_scattered(src, src_blocks, dst_blocks, want)
        if callable(want):
            want = want()
        if want is None:
            staged = self._staging(2 * n)
            rows = staged.numpy()
            rows[:n], rows[n : 2 * n] = src_blocks, dst_blocks
            idx = staged[: 2 * n].to(self.device, non_blocking=True)
            si, di = idx[:n], idx[n:]
            if self.fault != "corrupt":
                return kernels.copy_sum_blocks_between(self.pool, src, si, di), None, staged
            flipped = self._flipped(src, src_blocks[0])
            head = kernels.copy_sum_blocks_between(self.pool, flipped, si[:1] * 0, di[:1])
            rest = kernels.copy_sum_blocks_between(self.pool, src, si[1:], di[1:])
            return torch.cat([head, rest]), None, staged
        staged = self._staging(4 * n + 1)
        rows = staged.numpy()
        rows[:n], rows[n : 2 * n] = src_blocks, dst_blocks
        rows.view(np.uint64)[2 * n : 3 * n] = want  # as int64: the same bits
        rows[3 * n : 4 * n] = 0  # the sums, added to by the kernel
        up = staged[: 4 * n + 1].to(self.device, non_blocking=True)
        host = staged[4 * n]
        out = host if self.mapped_count or not self._cuda else up[4 * n]
        if self.fault != "corrupt":  # launched with no views of ``up`` made before it
            self._checker(src, n)(up, n, out)
        else:  # two launches, one count: the first block from the damaged scratch copy
            work = self._workspace(n)
            si, di, expected = up[:n], up[n : 2 * n], up[2 * n : 3 * n]
            sums, state, tickets = up[3 * n : 4 * n], work[:1], work[1:]
            check = kernels.copy_sum_check_blocks_between
            flipped = self._flipped(src, src_blocks[0])
            check(self.pool, flipped, si[:1] * 0, di[:1], sums[:1], expected[:1], tickets,
                  state, out, n)  # fmt: skip
            check(self.pool, src, si[1:], di[1:], sums[1:], expected[1:], tickets[1:], state,
                  out, n)  # fmt: skip
        if out is not host:  # 8 bytes back behind the kernel, into the pinned buffer
            host.copy_(out, non_blocking=True)
        return up[3 * n : 4 * n], host, staged

    def _check_runs(
        self, src: torch.Tensor, runs: list[tuple[int, int, int]], n: int, want: Want
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """`_copy_sum` for a few contiguous runs, with nothing uploaded and nothing allocated
        on the device: the copy and sum is queued first (the runs as scalars, the sums into a
        reused zeroed buffer); then, while it runs, the sender's sums are written into a
        reused pinned buffer and the compare queued behind it, which reads them in place,
        writes the count behind them (returned as a 0-dim view of it) and zeroes the sums: not
        kept (`verify` compares nothing later: the count answers). Without the sender's sums
        the copy's are kept (a device copy of them; the buffer zeroed) for `verify`. With the
        fault hook the copy flips one bit of the first block on its way (see the module)."""
        sums = self._sums_buffer(n)
        self._copier("runs", src, n)(runs)
        self.run_fetches += 1
        return self._compare_behind(sums, n, want, self._staging(n + 1), 0)

    def _check_scattered(
        self, src: torch.Tensor, src_blocks: Sequence[int], dst_blocks: Sequence[int], want: Want
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """`_copy_sum` for scattered blocks with the compare behind the copy: the block ids go
        up from a reused pinned buffer (as the plain copy's do), the copy and sum is queued
        (`kernels.packed_copy_sum`, its sums into the reused zeroed buffer), then the rest as
        `_check_runs` does, the sender's sums written behind the ids. With the fault hook the
        first block is copied from a scratch copy with one bit flipped (see the module)."""
        n = len(src_blocks)
        staged = self._staging(3 * n + 1)
        rows = staged.numpy()
        rows[:n], rows[n : 2 * n] = src_blocks, dst_blocks
        up = staged[: 2 * n].to(self.device, non_blocking=True)
        sums = self._sums_buffer(n)
        if self.fault != "corrupt":
            self._copier("packed", src, n)(up, n)
        else:  # two launches: the first block from the damaged scratch copy
            flipped = self._flipped(src, src_blocks[0])
            copy = kernels.copy_sum_blocks_between
            copy(self.pool, flipped, up[:1] * 0, up[n : n + 1], out=sums[:1])
            copy(self.pool, src, up[1:n], up[n + 1 : 2 * n], out=sums[1:n])
        return self._compare_behind(sums, n, want, staged, 2 * n)

    def _compare_behind(
        self, sums: torch.Tensor, n: int, want: Want, staged: torch.Tensor, at: int
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor]:
        """While the queued copy runs: the sender's sums into ``staged[at : at + n]`` and the
        compare queued behind the copy, its count landing at ``staged[at + n]`` (returned as a
        0-dim view of it), the sums zeroed by it. Without the sender's sums, the copy's sums
        (a device copy of them; the buffer zeroed) for `verify`."""
        self.behind_fetches += 1
        got = want() if callable(want) else want  # host work while the copy runs
        if got is None:
            kept = sums[:n].clone()
            sums[:n].zero_()
            return kept, None, staged
        rows = staged.numpy()
        rows.view(np.uint64)[at : at + n] = got  # as int64: the same bits
        kernels.compare_sums(sums, staged[at:] if at else staged, n)
        return None, rows[at + n, ...], staged

    @staticmethod
    def _flipped(src: torch.Tensor, block: int) -> torch.Tensor:
        """The fault hook's scratch copy of ``src``'s ``block`` with one bit flipped in the
        middle (the peer's pool stays intact)."""
        flipped = src[block : block + 1].clone()
        flipped[0, flipped.shape[1] // 2] ^= 1
        return flipped

    def _pinned_count(self) -> torch.Tensor:
        """A pinned int64 scalar for a count (kept for reuse: pinning one costs more than the
        whole check)."""
        return (
            self._counts.pop() if self._counts else torch.empty((), dtype=torch.int64).pin_memory()
        )

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
        if self._stream is not None:
            await asyncio.to_thread(self._stream.synchronize)
        self._peers.clear()
        self._current.clear()
        self._checkers.clear()
        self._copiers.clear()
