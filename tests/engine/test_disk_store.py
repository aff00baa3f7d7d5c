"""The disk tier's file and I/O on CPU (``engine.disk_store``): blocks written from host slots
read back byte-exact, a host slot reused in the same batch is written only after its demotion
read it, the file is preallocated and removed on close, and a failed write is raised on the
engine's thread instead of leaving a slot to be read back stale."""

from __future__ import annotations

import os

import pytest
import torch

from engine.disk_store import DiskStore, disk_slots
from engine.host_store import HostStore

SHAPE = (2, 4, 16, 8)  # a block: K/V, heads, tokens, head size


def make(tmp_path, num_blocks: int = 12, host: int = 4, disk: int = 8):
    torch.manual_seed(0)
    pool = torch.randn((num_blocks, *SHAPE), dtype=torch.bfloat16)
    store = HostStore(pool, host)
    store.disk = DiskStore(str(tmp_path), 0, disk, store.host, pool)
    return pool, store


def test_demoted_blocks_read_back_byte_exact_through_staging(tmp_path) -> None:
    pool, store = make(tmp_path)
    original = pool.clone()
    store.copy([0, 1, 2, 3], [0, 1, 2, 3], [], [])  # page-outs
    # demote slots 0, 1 to disk and reuse slot 0 at once for block 4's page-out
    store.copy([4], [0], [], [], (), [0, 1], [5, 6])
    assert torch.equal(store.host[0], original[4])
    store.copy([], [], [], [], (), (), (), [6, 5], [9, 8])  # loads, reversed order
    assert torch.equal(pool[8], original[0]) and torch.equal(pool[9], original[1])
    store.synchronize()
    assert store.disk.out_seconds > 0 and store.disk.in_seconds > 0


def test_loads_longer_than_the_staging_buffer(tmp_path) -> None:
    pool, store = make(tmp_path, num_blocks=80, host=40, disk=40)
    original = pool.clone()
    store.copy(list(range(40)), list(range(40)), [], [])
    store.copy([], [], [], [], (), list(range(40)), list(range(39, -1, -1)))
    store.copy([], [], [], [], (), (), (), list(range(40)), list(range(40, 80)))
    assert torch.equal(pool[40:80], original[:40].flip(0))


def test_the_file_is_preallocated_and_removed_on_close(tmp_path) -> None:
    pool, store = make(tmp_path, disk=8)
    disk = store.disk
    assert os.path.getsize(disk.path) == 8 * pool[0].numel() * pool.element_size()
    disk.close()
    assert not os.path.exists(disk.path)
    assert disk_slots(1.0, 1 << 20, str(tmp_path)) == 1024
    assert disk_slots(None, 1 << 20, str(tmp_path)) > 0  # half the free space


def test_a_failed_write_is_raised_on_the_engines_thread(tmp_path) -> None:
    pool, store = make(tmp_path)
    store.copy([0], [0], [], [])
    writable, store.disk._w.fd = store.disk._w.fd, os.open(store.disk.path, os.O_RDONLY)
    os.close(writable)  # the file turns read-only under the writer
    store.copy([], [], [], [], (), [0], [0])
    with pytest.raises(RuntimeError, match="disk tier I/O failed"):
        store.disk.synchronize()
    store.disk.close()
