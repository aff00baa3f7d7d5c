"""The gRPC block stream: the KV transport where NIXL is unavailable or not chosen, between
host-memory pools only. The decode side (`GrpcStreamTransport`) streams block bytes from the
prefill worker's ``KVTransport.PullBlocks`` (`BlockStreamServicer`), copies them into its pool
and then calls ``Prefill.Release``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from libkv.transfer import BlockStore, KVSource, KVTransferError, TransferStats

ChannelFactory = Callable[[str], grpc.aio.Channel]
MAX_MESSAGE_BYTES = 64 * 1024**2


def plain_channel(address: str) -> grpc.aio.Channel:
    """A plaintext channel (benchmarks, tests); services pass their own factory (mutual TLS,
    keepalive, tracing)."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    return grpc.aio.insecure_channel(address, options=options)


class GrpcStreamTransport:
    """KVTransport over gRPC, one cached channel per peer address, made by ``channel``."""

    name = "grpc"

    def __init__(self, store: BlockStore, channel: ChannelFactory = plain_channel) -> None:
        self.store = store
        self.stats = TransferStats()
        self.new_channel = channel
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.new_channel(address)
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
        await self.store.write_blocks(list(dst_blocks), data)
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


class BlockReader(Protocol):
    """The serving (prefill) side of the stream: the bytes of blocks a request holds."""

    async def read_blocks(
        self, request_id: str, incarnation: str, block_ids: list[int]
    ) -> list[bytes]:
        """Raises FailedPrecondition-like errors for stale handles or blocks not held."""
        ...


class BlockStreamServicer(worker_pb2_grpc.KVTransportServicer):
    """``tandem.v1.KVTransport`` of a prefill worker: streams held blocks to decode workers."""

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader

    async def PullBlocks(self, request: Any, context: Any):  # noqa: N802 - generated name
        ids = list(request.block_ids)
        data = await self.reader.read_blocks(request.request_id, request.incarnation, ids)
        for i, raw in enumerate(data):
            yield worker_pb2.BlockChunk(index=i, data=raw)
