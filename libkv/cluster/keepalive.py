"""Keeping a member lease alive from a thread of its own.

A worker's event loop can be held up for seconds: its engine holds a lock for a whole model step
(a prefill chunk on a CPU takes seconds) and the loop waits on that lock to add, read or release
a request. A keepalive that runs only on that loop then misses the TTL, and a live worker drops
out of the member view (measured: a prefill worker lost its 10 s lease 9 times in a 200 s soak).
`LeaseKeeper` refreshes the registration's current lease from a daemon thread with its own event
loop and etcd client. The registration's loop still does everything else: it grants leases,
re-registers when one is gone, and publishes the member record with its load.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from libkv.cluster.etcd_follow import Endpoints, EtcdConnection

log = logging.getLogger(__name__)

_TICK = 0.05  # how often the thread checks for stop while it waits


class LeaseKeeper:
    """Refreshes ``lease_id()`` (None: no lease now) every ``refresh`` seconds until stopped."""

    def __init__(
        self,
        endpoints: Endpoints,
        timeout: float,
        refresh: float,
        lease_id: Callable[[], int | None],
        name: str,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self.refresh = refresh
        self.lease_id = lease_id
        self.refreshes = 0  # successful refreshes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"lease-{name}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing; returns at once (the thread ends within a tick or one etcd call)."""
        self._stop.set()

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        etcd = EtcdConnection(self.endpoints, self.timeout, "keepalive")
        try:
            while await self._wait(self.refresh):
                lease = self.lease_id()
                if lease is None:
                    continue
                try:
                    await asyncio.wait_for(etcd.client.refresh_lease(lease), self.timeout)
                    self.refreshes += 1
                except Exception as e:  # the registration's loop notices and re-registers
                    log.debug("keepalive of lease %x failed: %r", lease, e)
                    await etcd.reset()
        finally:
            await etcd.close()

    async def _wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` in ticks; False once stopped."""
        until = time.monotonic() + seconds
        while not self._stop.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return True
            await asyncio.sleep(min(_TICK, left))
        return False
