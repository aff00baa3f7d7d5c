"""The gRPC block-stream KV transport: the decode worker pulls block bytes from the prefill
worker's ``KVTransport.PullBlocks`` stream and then calls ``Prefill.Release``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import grpc
from tandem.v1 import worker_pb2, worker_pb2_grpc

from libkv.transfer import KVSource, KVTransferError

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024**2),
    ("grpc.max_send_message_length", 64 * 1024**2),
]


class GrpcStreamTransport:
    """KVTransport over gRPC, one cached channel per peer address."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self._channels[address]

    async def pull(
        self, request_id: str, source: KVSource, src_blocks: Sequence[int], timeout: float
    ) -> list[bytes]:
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
