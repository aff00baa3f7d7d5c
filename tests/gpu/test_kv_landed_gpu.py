"""CUDA IPC between two processes (``pytest -m gpu``): the decode side's fetch from a sender
process's exported pool lands every pattern of `tests.landed_cases` in its own pool byte for
byte: the plain copy (up to `cuda_ipc.MEMCPY_RUNS` runs one copy each, more through the
block-copy kernel), the fused copy-and-sum (verify then compares on the device) and the fused
check with the sender's sums on the handle (the count behind the copy). The pool mapped is
the other process's, through `cuda_ipc.open_pool`, as between two workers of one GPU; the
blocks are 2 MiB, a Llama-3-8B block in bfloat16. On CPU: ``tests/libkv/test_kv_landed.py``."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kernels import reference  # noqa: E402
from libkv.kv_layout import KVLayout  # noqa: E402
from libkv.transfer.cuda_ipc import CudaIpcTransport  # noqa: E402
from libkv.transfer.fetch_checks import MASK  # noqa: E402
from services.common.codec import KVHandle  # noqa: E402
from tests import landed_cases as cases  # noqa: E402
from tests.nixl_peer import pool_bytes  # noqa: E402

SEED = 5
LAYOUT = KVLayout(32, 8, 128, 16, "bfloat16", 2)  # Llama-3-8B: 2 MiB blocks
BB = LAYOUT.block_bytes


class Records:
    def __init__(self, extra: dict[str, str]) -> None:
        self.extra_ = extra

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        return self.extra_


@pytest.fixture(scope="module")
def sender():
    """The sender process's member-record fields (its pool exported for CUDA IPC)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=cases.serve_cuda_pool, args=(child, SEED, cases.SENDER_BLOCKS, BB))
    proc.start()
    try:
        assert conn.poll(120), "the sender process did not export its pool"
        yield conn.recv()
    finally:
        if proc.is_alive():
            conn.send("stop")
            proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(10)


@pytest.mark.parametrize("sums", ["off", "copy", "sender"])
def test_cuda_ipc_from_another_process_lands_every_pattern_byte_for_byte(sender, sums) -> None:
    from engine.kv_pool import allocate

    expected = pool_bytes(SEED, cases.SENDER_BLOCKS, BB)
    words = torch.from_numpy(expected.copy()).view(torch.int64).view(cases.SENDER_BLOCKS, -1)
    mine = allocate(LAYOUT, 0, cases.RECEIVER_BLOCKS, torch.bfloat16, torch.device("cuda"))
    t = CudaIpcTransport(mine, BB, Records(sender), sums=sums != "off")
    assert t.can_reach(sender)
    landed = mine.view(torch.uint8).view(cases.RECEIVER_BLOCKS, -1)

    async def run() -> list[int | None]:
        verified = []
        for name, (src, dst) in cases.PATTERNS.items():
            mine.view(torch.uint8).fill_(cases.SENTINEL)
            torch.cuda.synchronize()
            wsum = [s & MASK for s in reference.block_wsum64(words, torch.tensor(src)).tolist()]
            handle = KVHandle(
                worker_id="prefill-0", incarnation="inc-a", address="", block_ids=tuple(src),
                num_tokens=16 * len(src), block_size=16, block_bytes=BB, dtype="bfloat16",
                lease_expires_unix_ms=0, checksum_algorithm="wsum64",
                block_checksums=tuple(wsum) if sums == "sender" else (),
            )  # fmt: skip
            assert await t.fetch(name, handle, src, dst, 30.0) == "cuda-ipc"
            verified.append(await t.verify(name, wsum))
            try:
                cases.check_landed(landed.cpu().numpy(), expected, src, dst)
            except AssertionError as e:
                raise AssertionError(f"{name} ({sums}): {e}") from None
        await t.close()
        return verified

    verified = asyncio.run(run())
    assert verified == [None if sums == "off" else 0] * len(cases.PATTERNS)
    assert t.stats.blocks == sum(len(s) for s, _ in cases.PATTERNS.values())
    assert t.fused_fetches == (0 if sums == "off" else len(cases.PATTERNS))
    assert t.compared_fetches == (len(cases.PATTERNS) if sums == "sender" else 0)
