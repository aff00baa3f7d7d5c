"""What landed in a receiver's KV pool after a hand-off, compared byte for byte with the
sender's blocks: the patterns every transport test moves (one long run, two and four runs,
more runs than CUDA IPC copies one by one, scattered blocks, no run on either side) and the
check, for the CPU transports (``tests/libkv/test_kv_landed.py``) and CUDA IPC between two processes
(``tests/gpu/test_kv_landed_gpu.py``).

Why bytes: a CUDA IPC copy that left its destination blocks unwritten once passed the serving
GPU tests, which compared greedy tokens and the copy's own checksums but never the blocks.
Before each fetch the receiver's pool is filled with ``SENTINEL``, so a block left unwritten
(or written from the wrong source block, or a block written that was not asked for) fails, even
where an earlier fetch had put the right bytes there. Senders hold `tests.nixl_peer.pool_bytes`
(random, every block different)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

SENTINEL = 0xA5  # every byte of the receiver's pool before a fetch
SENDER_BLOCKS = 80
RECEIVER_BLOCKS = 64  # the patterns use destination blocks below this


def _runs(*spans: tuple[int, int]) -> list[int]:
    return [b for start, stop in spans for b in range(start, stop)]


def _scattered(seed: int, n: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    src = rng.choice(SENDER_BLOCKS, n, replace=False).tolist()
    dst = rng.choice(RECEIVER_BLOCKS, n, replace=False).tolist()
    return src, dst


# name -> (source blocks, destination blocks)
PATTERNS: dict[str, tuple[list[int], list[int]]] = {
    "one-run-of-40": (_runs((10, 50)), _runs((20, 60))),
    "two-runs": (_runs((0, 12), (40, 52)), _runs((30, 42), (2, 14))),
    "four-runs": (
        _runs((0, 6), (10, 16), (20, 26), (30, 36)),
        _runs((58, 64), (40, 46), (20, 26), (0, 6)),
    ),
    # One run more than CUDA IPC copies one by one (`cuda_ipc.MEMCPY_RUNS`): its copy kernel.
    "five-runs": (
        _runs((70, 74), (60, 64), (50, 54), (40, 44), (30, 34)),
        _runs((0, 4), (8, 12), (16, 20), (24, 28), (32, 36)),
    ),
    "scattered": _scattered(3, 24),
    "descending": (list(range(60, 30, -1)), list(range(30))),  # no two blocks form a run
}


def check_landed(
    pool: np.ndarray, sender: np.ndarray, src: Sequence[int], dst: Sequence[int]
) -> None:
    """Assert ``pool`` (the receiver's, ``[N, block_bytes]`` bytes, all ``SENTINEL`` before the
    fetch) holds ``sender[src[i]]`` in ``dst[i]`` byte for byte and nothing else changed;
    the message names each wrong block and what it holds instead."""
    assert pool.dtype == np.uint8 and pool.shape[1] == sender.shape[1], (pool.shape, sender.shape)
    wrong = []
    for s, d in zip(src, dst, strict=True):
        got = pool[d]
        if np.array_equal(got, sender[s]):
            continue
        if (got == SENTINEL).all():
            wrong.append(f"{d} (from {s}): unwritten")
            continue
        others = [i for i in src if np.array_equal(got, sender[i])]
        off = int((got != sender[s]).sum())
        what = f"sender block {others[0]}" if others else f"{off} bytes off"
        wrong.append(f"{d} (from {s}): {what}")
    assert not wrong, f"{len(wrong)} of {len(dst)} blocks landed wrong: {wrong[:8]}"
    untouched = np.setdiff1d(np.arange(pool.shape[0]), np.asarray(dst, dtype=np.int64))
    written = [int(i) for i in untouched if not (pool[i] == SENTINEL).all()]
    assert not written, f"blocks written that no fetch asked for: {written[:8]}"


def member_extras(etcd_endpoint: str) -> dict[str, dict[str, str]]:
    """worker id -> the extra fields of its member record (what peers read to reach its pool)
    of every worker registered in etcd now."""
    from libkv.cluster.registry import MemberWatcher

    async def read() -> dict[str, dict[str, str]]:
        watcher = await MemberWatcher.start([etcd_endpoint])
        try:
            return {
                m.worker_id: dict(m.extra)
                for m in watcher.members.values()
                if m.role in ("prefill", "decode")
            }
        finally:
            await watcher.stop()

    return asyncio.run(read())


def process_blocks(pid: int, extra: dict[str, str]) -> np.ndarray:
    """A worker's whole host-memory KV pool, ``[num_blocks, block_bytes]`` bytes, read out of
    its memory (``/proc/PID/mem``: a process this test started, same user) at the region its
    NIXL agent publishes (``extra``, its member record): not through any transport."""
    from libkv.transfer import AgentInfo

    info = AgentInfo.from_extra(extra)
    assert info is not None, "the worker runs no NIXL agent: its pool's address is unknown"
    region = info.region
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(region.addr)
        raw = f.read(region.nbytes)
    assert len(raw) == region.nbytes
    return np.frombuffer(raw, dtype=np.uint8).reshape(region.num_blocks, region.block_bytes)


def serve_cuda_pool(conn, seed: int, num_blocks: int, block_bytes: int) -> None:
    """Entry point of a spawned sender on CUDA: a pool of ``pool_bytes(seed, ...)`` on its GPU,
    exported for CUDA IPC; sends its member-record fields (`libkv.transfer.cuda_ipc.
    pool_record`), then keeps the pool until it receives anything."""
    import torch

    from libkv.transfer.cuda_ipc import pool_record
    from tests.nixl_peer import pool_bytes

    pool = torch.from_numpy(pool_bytes(seed, num_blocks, block_bytes).copy()).to("cuda")
    torch.cuda.synchronize()
    conn.send(pool_record(pool, block_bytes, export=True))
    conn.recv()
