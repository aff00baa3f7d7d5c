"""The disk tier's files and I/O (one rank's): one preallocated file of fixed-size block slots
below the host tier's pinned blocks (``engine.host_store``), written by a thread and read with
``os.preadv`` before the forward pass that needs the blocks (``libkv.disk_tier`` plans both).

- **Writes (demotions) never run on the step's path**: ``demote`` queues them to a writer
  thread, which first waits for the page-outs issued so far (a CUDA event on the host tier's
  side stream: the host slot holds its block), then ``os.pwrite``s the host slot's bytes.
  The host tier hands a demoted slot out again last, so the only wait on the engine's thread
  is ``wait_host`` before a host slot is written again while its write is still queued (the
  disk is a whole reserve of slots behind: back pressure, never a torn block).
- **Reads (loads)** go disk -> pinned staging memory -> device pool on the engine's stream:
  a load first waits for a queued write of its slot, then reads runs of consecutive slots in
  one call each and copies runs of consecutive blocks in one DMA each; two halves of the
  staging buffer alternate, each reused only after the copy out of it is done.
- **Files**: ``tandem-kv-<pid>-<random>-r<rank>.bin`` in the directory, created under a
  temporary name, locked (``flock``) and then renamed, preallocated (``posix_fallocate``:
  no ENOSPC in the middle of serving). The file is removed on close and at interpreter exit;
  a file whose lock can be taken at start belonged to a worker that died, and is removed.
- A failed write or read raises on the engine's thread at the next call: a slot the index
  thinks is written must never be read back stale.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Sequence

import torch

from libkv.tier_types import runs

PREFIX = "tandem-kv-"
STAGING_BLOCKS = 16  # blocks per half of the staging buffer


def disk_slots(disk_gib: float | None, block_bytes: int, directory: str) -> int:
    """Disk blocks of ``block_bytes`` (a canonical block) for ``disk_gib`` GiB; None means half
    the directory's free space, split over the host's GPUs."""
    if disk_gib is None:
        st = os.statvfs(directory)
        nbytes = 0.5 * st.f_bavail * st.f_frsize / max(torch.cuda.device_count(), 1)
    else:
        nbytes = disk_gib * 1024**3
    return max(int(nbytes // block_bytes), 0)


def remove_stale(directory: str) -> list[str]:
    """Remove the tier files of workers that died (their lock is free); returns their paths."""
    removed = []
    for path in glob.glob(os.path.join(directory, f"{PREFIX}*.bin")):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live worker's
            continue
        os.unlink(path)
        os.close(fd)
        removed.append(path)
    return removed


class _Writer:
    """The file and its writer thread (what a finalizer may close without the store)."""

    def __init__(self, path: str, fd: int, rows, device: torch.device) -> None:
        self.path, self.fd, self.rows, self.device = path, fd, rows, device
        self.jobs: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.done = 0  # jobs finished, in order
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        if self.device.type == "cuda":  # the events it waits on are this device's
            torch.cuda.set_device(self.device)
        while (job := self.jobs.get()) is not None:
            ready, pairs = job
            try:
                if ready is not None:
                    ready.synchronize()
                t0 = time.perf_counter()
                size = self.rows[0].nbytes
                for slot, disk_slot, n in runs([p[0] for p in pairs], [p[1] for p in pairs]):
                    _pwrite_all(self.fd, self.rows[slot : slot + n], disk_slot * size)
                self.seconds += time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 -- reported on the engine's thread
                self.error = e
            with self.cond:
                self.done += 1
                self.cond.notify_all()

    def close(self) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(timeout=60)
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class DiskStore:
    """``num_slots`` blocks shaped like ``host``'s (a HostStore's pinned blocks) in one file
    under ``directory``; ``pool`` is the device pool loads write into."""

    def __init__(
        self, directory: str, rank: int, num_slots: int, host: torch.Tensor, pool: torch.Tensor
    ) -> None:
        os.makedirs(directory, exist_ok=True)
        remove_stale(directory)
        self.host, self.pool, self.num_slots = host, pool, num_slots
        rows = host.view(torch.uint8).reshape(host.shape[0], -1).numpy()
        row_bytes = rows.shape[1]
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-r{rank}"
        tmp = os.path.join(directory, f".{name}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.posix_fallocate(fd, 0, num_slots * row_bytes)
            path = os.path.join(directory, f"{name}.bin")
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        self.path = path
        self._w = _Writer(path, fd, rows, pool.device)
        self._finalizer = weakref.finalize(self, self._w.close)
        pinned = pool.device.type == "cuda"
        shape = (2, STAGING_BLOCKS, *host.shape[1:])
        self.staging = torch.empty(shape, dtype=host.dtype, pin_memory=pinned)
        self._staging_rows = self.staging.view(torch.uint8).reshape(2, STAGING_BLOCKS, -1).numpy()
        self._staged: list[torch.cuda.Event | None] = [None, None]  # copies out of each half
        self._jobs = 0  # jobs queued
        self._host_job: dict[int, int] = {}  # host slot -> last job reading it
        self._disk_job: dict[int, int] = {}  # disk slot -> last job writing it
        self.in_seconds = 0.0

    @property
    def out_seconds(self) -> float:
        return self._w.seconds

    def demote(
        self, slots: Sequence[int], disk_slots: Sequence[int], ready: torch.cuda.Event | None
    ) -> None:
        """Queue writes of host ``slots`` into ``disk_slots``, after ``ready`` (the page-outs
        issued so far) on the writer thread."""
        self._raise()
        if not slots:
            return
        self._jobs += 1
        for s, d in zip(slots, disk_slots, strict=True):
            self._host_job[s] = self._disk_job[d] = self._jobs
        self._w.jobs.put((ready, list(zip(slots, disk_slots, strict=True))))

    def wait_host(self, slots: Sequence[int]) -> None:
        """Wait until no queued write still reads host ``slots`` (before they are written)."""
        self._wait(max((self._host_job.get(s, 0) for s in slots), default=0))

    def _wait(self, job: int) -> None:
        if job > self._w.done:
            with self._w.cond:
                while self._w.done < job:
                    self._w.cond.wait()
        self._raise()
        if self._host_job and self._w.done == self._jobs:  # all written: forget them
            self._host_job, self._disk_job = {}, {}

    def _raise(self) -> None:
        if self._w.error is not None:
            raise RuntimeError(f"KV disk tier I/O failed ({self.path})") from self._w.error

    def load(self, disk_slots: Sequence[int], blocks: Sequence[int]) -> None:
        """Read ``disk_slots`` into device ``blocks`` (same order), on the engine's stream."""
        self._wait(max((self._disk_job.get(d, 0) for d in disk_slots), default=0))
        t0 = time.perf_counter()
        for k, i in enumerate(range(0, len(blocks), STAGING_BLOCKS)):
            half = k % 2
            if (event := self._staged[half]) is not None:
                event.synchronize()  # the copy out of this half is done
            part, dst = disk_slots[i : i + STAGING_BLOCKS], blocks[i : i + STAGING_BLOCKS]
            rows = self._staging_rows[half]
            for d, j, n in runs(part, range(len(part))):
                _pread_all(self._w.fd, rows[j : j + n], d * rows[0].nbytes)
            for j, b, n in runs(range(len(dst)), dst):
                self.pool[b : b + n].copy_(self.staging[half, j : j + n], non_blocking=True)
            if self.pool.device.type == "cuda":
                staged = self._staged[half] = torch.cuda.Event()
                staged.record()
        self.in_seconds += time.perf_counter() - t0

    def synchronize(self) -> None:
        """Wait until every queued write is on disk (tests, benchmarks)."""
        self._wait(self._jobs)

    def close(self) -> None:
        """Stop the writer and remove the file (the tier is unusable after)."""
        self._finalizer()


def _pwrite_all(fd: int, rows, offset: int) -> None:
    view = memoryview(rows.reshape(-1))
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread_all(fd: int, rows, offset: int) -> None:
    view = memoryview(rows.reshape(-1))
    while view:
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise OSError(f"short read at offset {offset} of the KV disk file")
        view, offset = view[n:], offset + n
