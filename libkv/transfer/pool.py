"""A worker's KV pool as the transports see it: one contiguous tensor of blocks."""

from __future__ import annotations

from typing import Any, Protocol

from libkv.transfer import PoolRegion


class BlockIO(Protocol):
    """Byte copies of whole blocks, done by the pool's owner (the engine, between its steps)."""

    async def read_blocks(self, block_ids: list[int]) -> list[bytes]: ...

    async def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None: ...


class PoolStore:
    """A `BlockStore` over ``cache``, ``[num_blocks, ...]`` and contiguous, so block ``i`` is one
    range of ``block_bytes`` at ``data_ptr + i * block_bytes`` (one NIXL descriptor; CUDA IPC
    maps the whole allocation). Byte copies go through ``owner``. ``exported``: the pool's
    CUDA IPC export (``libkv.transfer.cuda_ipc.IpcPool`` JSON) made by the process that
    allocated it, where ``cache`` is another process's mapping of it (which cannot be
    exported again)."""

    def __init__(self, cache: Any, block_bytes: int, owner: BlockIO, exported: str = "") -> None:
        assert cache.is_contiguous()
        assert cache.numel() * cache.element_size() == cache.shape[0] * block_bytes
        self.cache = cache
        self.block_bytes = block_bytes
        self.owner = owner
        self.exported = exported
        self.device_type: str = cache.device.type
        on_gpu = self.device_type == "cuda"
        self.region = PoolRegion(
            addr=cache.data_ptr(),
            num_blocks=cache.shape[0],
            block_bytes=block_bytes,
            mem_type="VRAM" if on_gpu else "DRAM",
            device_id=(cache.device.index or 0) if on_gpu else 0,
        )

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda"

    async def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return await self.owner.read_blocks(block_ids)

    async def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        await self.owner.write_blocks(block_ids, data)
