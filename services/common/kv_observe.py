"""A decode worker's KV transport, observed: each fetch is counted (transfers, blocks, bytes,
failures, duration; `services.common.metrics.KVTransferMetrics`) and traced (a ``kv.transfer``
span inside the decode call), without libkv knowing about either."""

from __future__ import annotations

import time
from collections.abc import Sequence

from libkv.transfer import KVSource, KVTransferError, KVTransport
from services.common import tracing
from services.common.metrics import KVTransferMetrics


class ObservedTransport:
    """A `KVTransport` that forwards to ``inner`` and records each fetch under the path that
    moved it (``transport=`` what ``inner.fetch`` returns: ``cuda-ipc``, ``nixl-read``,
    ``nixl-write`` or ``grpc``; a failure under ``inner.name``)."""

    def __init__(self, inner: KVTransport, metrics: KVTransferMetrics | None) -> None:
        self.inner = inner
        self.name = inner.name
        self.metrics = metrics
        if metrics is not None:
            for name in getattr(inner, "names", [inner.name]):
                metrics.init(name)

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        attributes = {
            tracing.REQUEST_ID_ATTR: request_id,
            "tandem.kv.transport": self.name,
            "tandem.kv.blocks": len(src_blocks),
            "tandem.kv.source": source.worker_id,
        }
        t0 = time.perf_counter()
        with tracing.span("kv.transfer", attributes=attributes):
            try:
                path = await self.inner.fetch(request_id, source, src_blocks, dst_blocks, timeout)
            except KVTransferError:
                if self.metrics is not None:
                    self.metrics.failed(self.name)
                raise
        path = path or self.name
        if self.metrics is not None and src_blocks:
            n = len(src_blocks)
            self.metrics.done(path, n, n * source.block_bytes, time.perf_counter() - t0)
        return path

    async def release(self, request_id: str, source: KVSource) -> None:
        await self.inner.release(request_id, source)

    async def close(self) -> None:
        await self.inner.close()
