"""Follow an etcd key prefix into an in-memory view: range read, then watch, resync on failure.

A range read gives the view at revision R; a watch from R+1 keeps it current with no gap. When
the watch fails (etcd restarted, network gone), the last view is kept, and once etcd answers
again a fresh range read replaces it (entries deleted meanwhile, e.g. by an expired lease,
drop out) before watching again. aetcd does not resume watches itself; this loop does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, Self

import aetcd

log = logging.getLogger(__name__)

Endpoints = str | Sequence[str]

# gRPC retries a dead connection with exponential backoff up to 120 s by default; cap it so
# a restarted etcd is found within a second.
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    # A watch event or a page of a range read may carry summaries of many workers.
    "grpc.max_receive_message_length": 256 * 1024 * 1024,
}
RANGE_PAGE = 1000  # keys per range request when reading a whole prefix


# Failed etcd operations of this process by what the connection serves ("register", "watch",
# "locations"): every failure resets its connection, so `EtcdConnection.reset` counts them here.
# Services export it as tandem_etcd_errors_total{op}.
ERRORS: Counter[str] = Counter()

# What EtcdConnection builds its clients with (keyword arguments host, port, timeout, options).
# A service with TLS or authentication towards etcd replaces it once at start-up
# (services.common.security.apply); libkv itself knows nothing of certificates.
client_factory: Callable[..., aetcd.Client] = aetcd.Client


class EtcdConnection:
    """An aetcd client on one of several endpoints, replaced (next endpoint) after an error.
    ``op`` names what it serves in `ERRORS`."""

    def __init__(self, endpoints: Endpoints, timeout: float, op: str = "etcd") -> None:
        self.op = op
        if isinstance(endpoints, str):
            endpoints = endpoints.split(",")
        self._targets = [_parse_endpoint(e) for e in endpoints if e.strip()]
        if not self._targets:
            raise ValueError("no etcd endpoint given")
        self.timeout = timeout
        self._next = 0
        self._client: aetcd.Client | None = None

    @property
    def client(self) -> aetcd.Client:
        if self._client is None:
            host, port = self._targets[self._next % len(self._targets)]
            self._client = client_factory(
                host=host, port=port, timeout=self.timeout, options=_CHANNEL_OPTIONS
            )
        return self._client

    async def reset(self) -> None:
        """Drop the current client (its channel may be stuck) and move to the next endpoint;
        called after each failed operation, so it counts one error."""
        ERRORS[self.op] += 1
        await self.close()
        self._next += 1

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), self.timeout)


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    endpoint = endpoint.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
    host, _, port = endpoint.rpartition(":")
    return (host or "127.0.0.1"), int(port)


def backoff(failures: int, cap: float) -> float:
    """Seconds to wait after ``failures`` consecutive failures: 0.1 s doubling, up to ``cap``."""
    return min(cap, 0.05 * 2**failures)


async def cancel_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def read_prefix(
    etcd: EtcdConnection, prefix: bytes, page: int = RANGE_PAGE
) -> tuple[list[tuple[bytes, bytes]], int]:
    """Every (key, value) under ``prefix`` at one revision, and that revision: read in pages of
    ``page`` keys, each page pinned to the revision of the first (aetcd has no paged read)."""
    client = etcd.client
    await client.connect()
    start, end = prefix, aetcd.utils.prefix_range_end(prefix)
    items: list[tuple[bytes, bytes]] = []
    revision = 0
    while True:
        request = aetcd.rpc.RangeRequest(key=start, range_end=end, limit=page, revision=revision)
        reply = await client.kvstub.Range(request, timeout=etcd.timeout, metadata=client.metadata)
        revision = revision or reply.header.revision
        items.extend((kv.key, kv.value) for kv in reply.kvs)
        if not reply.more or not reply.kvs:
            return items, revision
        start = reply.kvs[-1].key + b"\0"


async def poll_until(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate()`` every 10 ms until it holds; False if it still does not after
    ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.01)
    return True


class Followed:
    """Start, readiness, polling and stop of a view that a `PrefixFollower` keeps current
    (``self.follower``, made by the subclass's ``__init__(endpoints, timeout)``)."""

    follower: PrefixFollower

    @classmethod
    async def start(cls, endpoints: Endpoints, timeout: float = 2.0) -> Self:
        """Read the whole prefix (if etcd answers) and follow changes in a task."""
        self = cls(endpoints, timeout)  # type: ignore[call-arg]  # the subclass's __init__
        await self.follower.start()
        return self

    @property
    def synced(self) -> bool:
        return self.follower.synced

    async def wait_for(self, predicate: Callable[[Self], bool], timeout: float) -> bool:
        """Poll ``predicate(self)`` until it holds; False if it still does not after timeout."""
        return await poll_until(lambda: predicate(self), timeout)

    async def stop(self) -> None:
        await self.follower.stop()


class FollowerSink(Protocol):
    """Receives the view of a `PrefixFollower` (called in the event loop)."""

    def reset(self, items: list[tuple[bytes, bytes]]) -> None:
        """Replace the whole view by ``items`` (key, value)."""

    def put(self, key: bytes, value: bytes) -> None:
        """A key was created or changed."""

    def delete(self, key: bytes) -> None:
        """A key was deleted (or expired with its lease)."""


class PrefixFollower:
    """Keeps ``sink`` in step with the keys under ``prefix``; see the module docstring."""

    def __init__(
        self,
        endpoints: Endpoints,
        prefix: bytes,
        sink: FollowerSink,
        timeout: float = 2.0,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.prefix = prefix
        self.sink = sink
        self.revision = 0  # etcd revision the view reflects
        self.synced = False  # a range read has succeeded at least once
        self.watching = False  # a watch is established right now
        self.resyncs = 0  # range reads done (1 after a clean start)
        self.on_change = on_change  # awaited after every change of the view
        self._etcd = EtcdConnection(endpoints, timeout, "watch")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> PrefixFollower:
        """Read the current view (if etcd answers) and follow changes in a task."""
        try:
            await self._resync()
        except Exception as e:
            log.warning("initial read of %r failed, will retry: %r", self.prefix, e)
            await self._etcd.reset()
        self._task = asyncio.create_task(self._run(), name=f"follow-{self.prefix.decode()}")
        return self

    async def _resync(self) -> None:
        items, self.revision = await read_prefix(self._etcd, self.prefix)
        self.sink.reset(items)
        self.synced = True
        self.resyncs += 1
        await self._changed()

    async def _run(self) -> None:
        failures = 0
        need_resync = not self.synced
        while True:
            try:
                if need_resync:
                    await self._resync()
                    need_resync = False
                watch = await self._etcd.client.watch_prefix(
                    self.prefix, start_revision=self.revision + 1
                )
                self.watching = True
                failures = 0
                async for event in watch:
                    self._apply(event)
                    await self._changed()
                raise ConnectionError("watch ended")  # only a closed client ends it cleanly
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.watching = False
                need_resync = True
                failures += 1
                log.warning("watch of %r failed (%d), keeping last view: %r", self.prefix,
                            failures, e)  # fmt: skip
                await self._etcd.reset()
                await asyncio.sleep(backoff(failures, 1.0))

    def _apply(self, event: Any) -> None:
        kv = event.kv
        if event.kind == "PUT":
            self.sink.put(kv.key, kv.value)
        else:
            self.sink.delete(kv.key)
        self.revision = max(self.revision, kv.mod_revision)

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()

    async def stop(self) -> None:
        await cancel_task(self._task)
        self._task = None
        self.watching = False
        await self._etcd.close()
