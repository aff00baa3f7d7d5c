"""The KV transfer interface (no torch, no grpc): how a decode worker obtains prefilled blocks.

Implementations: the gRPC block stream (``services.common.kv_transport``) today; NIXL next.
Services choose one through config only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class KVTransferError(RuntimeError):
    """The blocks could not be obtained (peer gone, stale incarnation, timeout)."""


class KVSource(Protocol):
    """Where a request's blocks live: enough to reach the peer and name the blocks."""

    address: str
    incarnation: str
    block_ids: tuple[int, ...]
    block_bytes: int


class KVTransport(Protocol):
    """Moves whole blocks from a peer's pool into this worker's pool."""

    async def pull(
        self, request_id: str, source: KVSource, src_blocks: Sequence[int], timeout: float
    ) -> list[bytes]:
        """Bytes of ``src_blocks`` (a subset of ``source.block_ids``), in order."""
        ...

    async def release(self, request_id: str, source: KVSource) -> None:
        """Tell the peer it may free the request's blocks (best effort)."""
        ...

    async def close(self) -> None: ...
