"""Checked KV on the CUDA IPC path (``pytest -m gpu``): the transport's fused copy-and-sum
takes each block's ``wsum64`` as it copies it, `CudaIpcTransport.verify` compares the sums with
the sender's on the device; the test-only fault hook flips one bit in transit, which the check
catches, and a stack with ``--kv-fault corrupt`` recomputes the prompt and serves the clean
greedy text. The peer's pool is a pool of this process here (CUDA IPC cannot map its own
allocation); the mapping between two processes is covered by ``tests/test_serving_gpu.py``."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kernels import reference  # noqa: E402
from libkv.transfer import CUDA_IPC_KEY, DEVICE_KEY, HOST_KEY  # noqa: E402
from libkv.transfer.cuda_ipc import CudaIpcTransport, device_uuid, export_pool, host_id  # noqa: E402

BLOCK_BYTES = 64 * 1024
BLOCKS = 12


@dataclass(frozen=True)
class Source:
    worker_id: str = "p0"
    address: str = ""
    incarnation: str = "i1"
    block_ids: tuple[int, ...] = ()
    block_bytes: int = BLOCK_BYTES
    lease_expires_unix_ms: int = 0


class Records:
    def __init__(self, peer: torch.Tensor) -> None:
        self.extra_ = {
            HOST_KEY: host_id(),
            DEVICE_KEY: device_uuid(0),
            CUDA_IPC_KEY: export_pool(peer, BLOCK_BYTES).to_json(),
        }

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        return self.extra_


def transport(peer: torch.Tensor, fault: str = "") -> tuple[CudaIpcTransport, torch.Tensor]:
    mine = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    t = CudaIpcTransport(mine, BLOCK_BYTES, Records(peer), sums=True, fault=fault)
    t._mapped = lambda name, info: peer  # type: ignore[method-assign]  # same process
    return t, mine


def sender_sums(peer: torch.Tensor, blocks: list[int]) -> list[int]:
    idx = torch.tensor(blocks, device=peer.device)
    return [
        s & ((1 << 64) - 1) for s in reference.block_wsum64(peer.view(torch.int64), idx).tolist()
    ]


@pytest.fixture
def peer() -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    return torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda",
                         generator=g)  # fmt: skip


@pytest.mark.parametrize("src", [[3, 4, 5], [9, 1, 7, 2, 11, 0]])  # runs / scattered
def test_a_clean_cuda_ipc_fetch_is_checked_by_the_sums_its_copy_took(peer, src) -> None:
    t, mine = transport(peer)
    dst = [10 - i for i in range(len(src))]

    async def go() -> int | None:
        await t.fetch("r", Source(block_ids=tuple(src)), src, dst, 5.0)
        return await t.verify("r", sender_sums(peer, src))

    assert asyncio.run(go()) == 0
    assert t.fused_fetches == 1
    assert torch.equal(mine[dst], peer[src])
    assert asyncio.run(t.verify("r", [1])) is None  # the sums were used up


def test_a_bit_flipped_in_transit_is_caught_and_the_sender_is_untouched(peer) -> None:
    before = peer.clone()
    t, mine = transport(peer, fault="corrupt")
    src, dst = [2, 6, 7], [0, 1, 5]

    async def go() -> int | None:
        await t.fetch("r", Source(block_ids=tuple(src)), src, dst, 5.0)
        return await t.verify("r", sender_sums(peer, src))

    assert asyncio.run(go()) == 1  # exactly the damaged block
    assert torch.equal(peer, before)
    assert (mine[0] != peer[2]).sum().item() == 1  # one byte (one bit) differs
    assert torch.equal(mine[[1, 5]], peer[[6, 7]])
