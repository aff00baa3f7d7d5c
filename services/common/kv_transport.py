"""The gRPC block-stream KV transport (the fallback where NIXL is unavailable or not chosen):
the decode worker streams block bytes from the prefill worker's ``KVTransport.PullBlocks``,
copies them into its pool and then calls ``Prefill.Release``. Also the engine's pool seen as a
`BlockStore` (raw memory region for NIXL, byte copies for this transport)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from engine.llm_engine import LLMEngine
from libkv.transfer import BlockStore, KVSource, KVTransferError, PoolRegion, TransferStats
from services.common.tls import TLSFiles
from services.common.tls import channel as tls_channel
from services.common.tracing import client_interceptors

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024**2),
    ("grpc.max_send_message_length", 64 * 1024**2),
]


class EngineBlockStore:
    """An engine's KV pool as a `BlockStore`: ``kv_cache`` is ``[num_blocks, ...]`` and
    contiguous, so block ``i`` is one range of ``block_bytes`` at ``data_ptr + i * block_bytes``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        cache = engine.runner.kv_cache
        assert cache.is_contiguous()
        block_bytes = engine.runner.block_bytes
        assert cache.numel() * cache.element_size() == cache.shape[0] * block_bytes
        on_gpu = cache.device.type == "cuda"
        self.region = PoolRegion(
            addr=cache.data_ptr(),
            num_blocks=cache.shape[0],
            block_bytes=block_bytes,
            mem_type="VRAM" if on_gpu else "DRAM",
            device_id=(cache.device.index or 0) if on_gpu else 0,
        )

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return self.engine.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        self.engine.write_blocks(block_ids, data)


class GrpcStreamTransport:
    """KVTransport over gRPC, one cached channel per peer address."""

    name = "grpc"

    def __init__(self, store: BlockStore, tls: TLSFiles | None = None) -> None:
        self.store = store
        self.stats = TransferStats()
        self.tls = tls  # mutual TLS towards the prefill workers when set
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = tls_channel(
                address, self.tls, CHANNEL_OPTIONS, interceptors=client_interceptors()
            )
        return self._channels[address]

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        if not src_blocks:
            return self.name
        if self.store.region.mem_type == "VRAM":
            raise KVTransferError(
                "the gRPC stream would carry GPU memory through the host and TCP; this worker "
                "obtains KV only over a GPU-direct path (CUDA IPC, NIXL)"
            )
        t0 = time.monotonic()
        try:
            data = await self._pull(request_id, source, src_blocks, timeout)
        except KVTransferError:
            self.stats.failures += 1
            raise
        self.store.write_blocks(list(dst_blocks), data)
        self.stats.add(len(data), len(data) * source.block_bytes, time.monotonic() - t0)
        return self.name

    async def _pull(self, request_id, source, src_blocks, timeout: float) -> list[bytes]:
        stub = worker_pb2_grpc.KVTransportStub(self._channel(source.address))
        req = worker_pb2.PullBlocksRequest(
            request_id=request_id, incarnation=source.incarnation, block_ids=list(src_blocks)
        )
        out: list[bytes] = []
        try:
            async for chunk in stub.PullBlocks(req, timeout=timeout):
                if len(chunk.data) != source.block_bytes:
                    raise KVTransferError(
                        f"block of {len(chunk.data)} bytes, expected {source.block_bytes}"
                    )
                out.append(chunk.data)
        except grpc.aio.AioRpcError as e:
            raise KVTransferError(
                f"pulling KV of {request_id} from {source.address} failed: "
                f"{e.code().name}: {e.details()}"
            ) from e
        if len(out) != len(src_blocks):
            raise KVTransferError(f"got {len(out)} of {len(src_blocks)} blocks")
        return out

    async def release(self, request_id: str, source: KVSource) -> None:
        stub = worker_pb2_grpc.PrefillStub(self._channel(source.address))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await stub.Release(worker_pb2.ReleaseRequest(request_id=request_id), timeout=5)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
