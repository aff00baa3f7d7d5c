"""The CUDA IPC hand-off between two processes, on one GPU and across two (``pytest -m gpu``;
the two-GPU cases are skipped with one): a child process exports a pool as a GPU prefill
worker does (`bench.kv_peer.export`), and this process maps it through `CudaIpcTransport`
as a decode worker does. Runs and scattered blocks land byte for byte with sums off and on;
with sums on, a clean fetch counts no mismatch and a bit flipped in transit (the test-only
fault hook) is counted, while the sender's pool stays as it was.
(The check's cost: ``lab.kv_check_peer``, run small by ``lab/tests``.)"""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from bench import kv_peer  # noqa: E402
from libkv.transfer.cuda_ipc import CudaIpcTransport  # noqa: E402
from libkv.transfer.fetch_checks import WSUM64  # noqa: E402
from services.common.codec import KVHandle  # noqa: E402

BLOCK_BYTES = 256 * 1024
PEER_BLOCKS = 24
TWO = torch.cuda.device_count() > 1
DEVICES = ["cuda:0", pytest.param("cuda:1", marks=pytest.mark.skipif(not TWO, reason="one GPU"))]


@pytest.fixture(scope="module")
def exporters():
    """Per GPU of this process: the member-record fields of a pool that another process
    exported from GPU 0, one exporter per GPU (torch keeps one mapping per handle and
    process, opened on the first GPU that asked: a decode worker has one GPU)."""
    ctx = mp.get_context("spawn")
    running: dict[str, tuple] = {}

    def get(device: str) -> dict[str, str]:
        if device not in running:
            conn, child = ctx.Pipe()
            args = (child, "cuda:0", PEER_BLOCKS, BLOCK_BYTES)
            proc = ctx.Process(target=kv_peer.export, args=args, daemon=True)
            proc.start()
            running[device] = (conn, proc, conn.recv())
        return running[device][2]

    yield get
    for conn, proc, _ in running.values():
        conn.send("stop")
        assert conn.recv() == "stopped"
        proc.join(10)


@pytest.fixture(params=DEVICES)
def peer(request, exporters) -> tuple[dict[str, str], str]:
    """(the exported pool's record fields, this process's GPU that maps it)."""
    return exporters(request.param), request.param


def handle(blocks: list[int], sums: list[int]) -> KVHandle:
    return KVHandle(
        worker_id="p0", incarnation="i1", address="", block_ids=tuple(blocks),
        num_tokens=16 * len(blocks), block_size=16, block_bytes=BLOCK_BYTES, dtype="uint8",
        lease_expires_unix_ms=0, block_checksums=tuple(sums), checksum_algorithm=WSUM64,
    )  # fmt: skip


def fetch(peer, src: list[int], dst: list[int], sums: bool, fault: str = ""):
    """One fetch + verify of ``src`` into ``dst`` of a fresh pool on ``device``: the pool and
    what verify said."""
    exported, device = peer
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    pool = torch.zeros(16, BLOCK_BYTES, dtype=torch.uint8, device=dev)
    t = CudaIpcTransport(pool, BLOCK_BYTES, kv_peer.StaticRecords({"p0": exported}), sums=sums,
                         fault=fault)  # fmt: skip
    assert t.can_reach(exported)
    h = handle(src, kv_peer.pattern_sums(src, BLOCK_BYTES, dev))

    async def go() -> int | None:
        assert await t.fetch("r", h, src, dst, 10.0) == "cuda-ipc"
        bad = await t.verify("r", h.block_checksums)
        await t.close()
        return bad

    bad = asyncio.run(go())
    return pool, bad, t


def landed(pool: torch.Tensor, src: list[int], dst: list[int]) -> bool:
    return all(
        torch.equal(pool[d].view(torch.int64), kv_peer.expected_block(s, BLOCK_BYTES, pool.device))
        for s, d in zip(src, dst, strict=True)
    )


CASES = [([5, 6, 7, 8], [0, 1, 2, 3]), ([20, 3, 11, 0, 17, 9], [4, 9, 1, 15, 7, 2])]


@pytest.mark.parametrize("src,dst", CASES, ids=["run", "scattered"])
@pytest.mark.parametrize("sums", [False, True], ids=["sums-off", "sums-on"])
def test_blocks_land_from_another_process(peer, src, dst, sums) -> None:
    """Scattered blocks (six runs here) take the copy kernels, runs the copy engines or,
    checked on one GPU, the SM copy that sums."""
    pool, bad, t = fetch(peer, src, dst, sums)
    assert landed(pool, src, dst)
    untouched = [b for b in range(16) if b not in dst]
    assert int(pool[untouched].count_nonzero()) == 0
    assert bad == (0 if sums else None)
    if sums:
        assert t.compared_fetches == 1 and t.device_verifies == 0
        # Runs from another GPU go by the copy engines, summed where they landed; on one GPU
        # by the SM copy that sums on its way.
        runs = (0, 0) if len(src) > 4 else ((1, 0) if peer[1] != "cuda:0" else (0, 1))
        assert (t.peer_run_fetches, t.run_fetches) == runs


@pytest.mark.parametrize("src,dst", CASES, ids=["run", "scattered"])
def test_a_bit_flipped_in_transit_is_counted_and_the_sender_is_untouched(peer, src, dst) -> None:
    pool, bad, _ = fetch(peer, src, dst, sums=True, fault="corrupt")
    assert bad == 1
    assert not landed(pool, src[:1], dst[:1])  # the damaged block is the first one
    assert landed(pool, src[1:], dst[1:])
    again, bad, _ = fetch(peer, src, dst, sums=True)  # the sender's pool as it was
    assert bad == 0 and landed(again, src, dst)
