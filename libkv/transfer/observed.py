"""A decode worker's KV transport, observed: each fetch is counted (transfers, blocks, bytes,
failures, duration) and wrapped in a span, through hooks the worker passes in (Prometheus
metrics and OpenTelemetry in services), so this package knows neither."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from libkv.transfer import CopySums, KVSource, KVTransferError, KVTransport

SpanFactory = Callable[[str, dict[str, Any]], AbstractContextManager[Any]]


class TransferMetrics(Protocol):
    """Counters per path (``services.observability.metrics.KVTransferMetrics``)."""

    def init(self, path: str) -> None: ...

    def done(self, path: str, blocks: int, nbytes: int, seconds: float) -> None: ...

    def failed(self, path: str) -> None: ...


def _no_span(name: str, attributes: dict[str, Any]) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


class ObservedTransport:
    """A `KVTransport` that forwards to ``inner`` and records each fetch under the path that
    moved it (what ``inner.fetch`` returns: ``cuda-ipc``, ``nixl-read``, ``nixl-write`` or
    ``grpc``; a failure under ``inner.name``), inside ``span("kv.transfer", attributes)``."""

    def __init__(
        self, inner: KVTransport, metrics: TransferMetrics | None, span: SpanFactory = _no_span
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.metrics = metrics
        self.span = span
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
            "tandem.request_id": request_id,
            "tandem.kv.transport": self.name,
            "tandem.kv.blocks": len(src_blocks),
            "tandem.kv.source": source.worker_id,
        }
        t0 = time.perf_counter()
        with self.span("kv.transfer", attributes):
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

    async def verify(self, request_id: str, expected: Sequence[int]) -> int | None:
        """``inner.verify`` where it has one (`PathTransport`), else None."""
        if isinstance(self.inner, CopySums):
            return await self.inner.verify(request_id, expected)
        return None

    async def release(self, request_id: str, source: KVSource) -> None:
        await self.inner.release(request_id, source)

    async def close(self) -> None:
        await self.inner.close()
