"""The prefill side of ``bench.kv_transfer``, in its own process: a KV pool (host memory, or GPU
``device``) filled with a known pattern, the real NIXL block server and the real gRPC
``KVTransport`` servicer over it. Driven through a pipe."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from libkv.transfer import PoolRegion, agent_name


def fill_pattern(pool: torch.Tensor) -> None:
    """Byte ``i`` of the pool belongs to int64 word ``i // 8`` whose value is ``i // 8``."""
    words = pool.view(torch.int64)
    words.copy_(torch.arange(words.numel(), dtype=torch.int64, device=pool.device))


def expected_block(block: int, block_bytes: int, device: torch.device) -> torch.Tensor:
    w = block_bytes // 8
    return torch.arange(block * w, (block + 1) * w, dtype=torch.int64, device=device)


def pattern_sums(blocks: list[int], block_bytes: int, device: torch.device) -> list[int]:
    """The sender's ``wsum64`` of each of ``blocks`` of a `fill_pattern` pool (unsigned, as a
    handle carries them)."""
    import kernels
    from libkv.transfer.fetch_checks import MASK

    words = torch.stack([expected_block(b, block_bytes, device) for b in blocks])
    sums = kernels.block_wsum64(words, torch.arange(len(blocks), device=device))
    return [s & MASK for s in sums.tolist()]


def region(pool: torch.Tensor, block_bytes: int) -> PoolRegion:
    on_gpu = pool.device.type == "cuda"
    return PoolRegion(
        addr=pool.data_ptr(),
        num_blocks=pool.numel() // block_bytes,
        block_bytes=block_bytes,
        mem_type="VRAM" if on_gpu else "DRAM",
        device_id=(pool.device.index or 0) if on_gpu else 0,
    )


class StaticRecords:
    """`libkv.transfer.cuda_ipc.PeerRecords` over fixed member-record fields (worker -> extra)."""

    def __init__(self, records: dict[str, dict[str, str]]) -> None:
        self.records = records

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        return self.records[worker_id]


class AlwaysHeld:
    """Block bookkeeping of the bench: every block counts as held by every request."""

    def __init__(self) -> None:
        self.released = 0

    def held_blocks(self, request_id: str, incarnation: str, block_ids: Sequence[int]) -> None:
        return None

    def release(self, request_id: str) -> bool:
        self.released += 1
        return True


class PoolReader:
    """What ``BlockStreamServicer`` needs of a prefill core: bytes of blocks."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self.block_bytes = 0

    async def read_blocks(
        self, request_id: str, incarnation: str, block_ids: list[int]
    ) -> list[bytes]:
        blocks = self.pool.view(-1, self.block_bytes)[torch.tensor(block_ids)].cpu()
        return [b.numpy().tobytes() for b in blocks]


def serve(conn, device: str, total_bytes: int) -> None:
    asyncio.run(_serve(conn, device, total_bytes))


async def _serve(conn, device: str, total_bytes: int) -> None:
    from tandem.v1 import worker_pb2_grpc

    from libkv.transfer.grpc_stream import BlockStreamServicer
    from libkv.transfer.nixl import NixlBlockServer
    from libkv.transfer.nixl_agent import NixlEndpoint
    from services.common.grpc_server import start_server

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    pool = torch.empty(total_bytes, dtype=torch.uint8, device=device)
    fill_pattern(pool)
    reader = PoolReader(pool)
    grpc_server = await start_server(
        [(worker_pb2_grpc.add_KVTransportServicer_to_server, BlockStreamServicer(reader))],
        ["tandem.v1.KVTransport"],
        "127.0.0.1:0",
    )
    holder = AlwaysHeld()
    server: NixlBlockServer | None = None
    conn.send(f"127.0.0.1:{grpc_server.port}")
    while True:
        if not conn.poll():
            await asyncio.sleep(0.002)
            continue
        cmd, *args = conn.recv()
        if cmd == "setup":  # a new agent over the same memory, cut into blocks of args[0]
            block_bytes = args[0]
            if server is not None:
                await server.close()
            reader.block_bytes = block_bytes
            name = agent_name("peer", f"bs{block_bytes}")
            endpoint = await NixlEndpoint.start(name, region(pool, block_bytes))
            server = NixlBlockServer(endpoint, holder, busy=lambda: True)
            assert endpoint.info is not None
            extra = endpoint.info.to_extra()
            if pool.device.type == "cuda":  # also offered over CUDA IPC
                from libkv.transfer.cuda_ipc import pool_record

                extra.update(pool_record(pool.view(-1, block_bytes), block_bytes, export=True))
            conn.send(extra)
        elif cmd == "stop":
            if server is not None:
                await server.close()
            await grpc_server.stop(None)
            conn.send(holder.released)
            return


def export(conn, device: str, num_blocks: int, block_bytes: int) -> None:
    """A prefill worker's pool and nothing else, in its own process: ``num_blocks`` blocks on
    GPU ``device``, filled with `fill_pattern`, exported over CUDA IPC as a GPU prefill
    worker exports its pool (`libkv.transfer.cuda_ipc.pool_record`). Sends its member-record
    fields, then holds the pool until told ``stop``."""
    from libkv.transfer.cuda_ipc import pool_record

    torch.cuda.set_device(torch.device(device))
    pool = torch.empty(num_blocks, block_bytes, dtype=torch.uint8, device=device)
    fill_pattern(pool.view(-1))
    torch.cuda.synchronize()
    conn.send(pool_record(pool, block_bytes, export=True))
    while conn.recv() != "stop":
        pass
    conn.send("stopped")
