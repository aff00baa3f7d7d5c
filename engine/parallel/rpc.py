"""Calls from rank 0 into another rank's process, off that rank's step loop.

``RpcClient.call(fn, *args)`` pickles ``fn`` (by reference: a module-level function) and its
arguments to the rank, which runs ``fn(context, *args)`` on an asyncio loop of its own
(awaiting it when it is a coroutine function) and sends back the result or the exception. The
rank's step loop is never involved, so a long call (a KV transfer) overlaps its steps. This is
how services reach each rank's shard of the KV pool (NIXL agent, CUDA IPC export, pulls).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger(__name__)


class RankCallError(RuntimeError):
    """A call into a rank raised; the message carries the rank's exception."""


class RpcClient:
    """Rank 0's end of one rank's call pipe."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank = rank
        self.conn = conn
        self._ids = itertools.count()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"rank{rank}-rpc", daemon=True)

    def start(self) -> None:
        self._reader.start()

    def call(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._ids)
        self._pending[call_id] = fut
        try:
            with self._send_lock:
                self.conn.send((call_id, fn, args))
        except (OSError, ValueError) as e:
            self._pending.pop(call_id, None)
            fut.set_exception(RankCallError(f"rank {self.rank} is gone: {e!r}"))
        return fut

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            fut = self._pending.pop(call_id, None)
            if fut is None:
                continue
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(RankCallError(f"rank {self.rank}: {value}"))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(RankCallError(f"rank {self.rank} is gone"))
        self._pending.clear()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.close()


class RpcServer:
    """A rank's end: a thread reading calls and an asyncio loop (thread) running them."""

    def __init__(self, conn: Connection, context: Any) -> None:
        self.conn = conn
        self.context = context
        self.loop = asyncio.new_event_loop()
        self._send_lock = threading.Lock()

    def start(self) -> None:
        threading.Thread(target=self.loop.run_forever, name="rank-loop", daemon=True).start()
        threading.Thread(target=self._read, name="rank-rpc", daemon=True).start()

    def ready(self) -> None:
        """Tell rank 0 this rank is up (it waits for that before the process group forms)."""
        self.conn.send("up")

    def _read(self) -> None:
        while True:
            try:
                call_id, fn, args = self.conn.recv()
            except (EOFError, OSError):
                return
            asyncio.run_coroutine_threadsafe(self._run(call_id, fn, args), self.loop)

    async def _run(self, call_id: int, fn: Callable[..., Any], args: tuple) -> None:
        try:
            result = fn(self.context, *args)
            if inspect.isawaitable(result):
                result = await result
            reply = (call_id, True, result)
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller
            log.warning("call %s failed: %r", getattr(fn, "__name__", fn), e)
            reply = (call_id, False, f"{type(e).__name__}: {e}")
        try:
            with self._send_lock:
                self.conn.send(reply)
        except (OSError, ValueError):
            pass
