"""Asyncio front of the engine: the step loop runs on its own thread, off the event loop.

Services call ``generate`` (an async iterator of ``RequestOutput``) and ``abort`` from their
event loop; the engine thread steps whenever there is work and hands each output to the
request's asyncio queue with ``call_soon_threadsafe``. Leaving the iterator early (client gone,
task cancelled) aborts the request, which frees its blocks at once.

The engine holds its lock for a whole model step, so nothing on the event loop takes it: adds
run in a worker thread (awaited), and the abort of an abandoned iterator is queued for the step
thread, which applies it before its next step. The loop keeps serving other streams, health
checks and lease refreshes while a long prefill step runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from engine.errors import RequestNotFoundError
from engine.llm_engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class _Moved:
    """The last item of a stream whose request moved out (``AsyncEngine.move_out``)."""

    held: Any


class AsyncEngine:
    """Runs ``LLMEngine.step`` in a daemon thread and streams outputs to asyncio callers."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._failure: BaseException | None = None
        self._deferred: collections.deque[Callable[[], object]] = collections.deque()
        self.steps = 0

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The step thread runs (a worker whose step thread died is not live)."""
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the step thread, then the engine's tensor-parallel ranks (if any)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()

    # -- request API (event loop side) -----------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int], params: Any, **kw: Any):
        """Queue a request and yield its outputs (every choice's) until it finishes (or hands its
        KV off)."""
        queue = self._open(request_id)
        await self._add(
            request_id, functools.partial(self.engine.add_request, request_id, prompt, params, **kw)
        )
        self._wake.set()
        async for out in self._drain(request_id, queue):
            yield out

    async def follow(self, request_id: str, add: Any) -> AsyncIterator[RequestOutput]:
        """Like ``generate`` for a request added by ``add()`` (e.g. ``add_prefilled``)."""
        queue = self._open(request_id)
        await self._add(request_id, add)
        self._wake.set()
        async for out in self._drain(request_id, queue):
            yield out

    async def move_out(self, request_id: str, hold: Callable[[str], Any]) -> Any:
        """Run ``hold(request_id)`` on the step thread between two steps (after the last step's
        outputs are queued); when it returns something (the request left the engine with its
        KV held, ``LLMEngine.hold_for_move``), the request's stream yields it last and ends."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                moved = hold(request_id)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller
                loop.call_soon_threadsafe(fut.set_exception, exc)
                return
            entry = self._queues.pop(request_id, None) if moved is not None else None
            if entry is not None:
                entry[0].call_soon_threadsafe(entry[1].put_nowait, _Moved(moved))
            loop.call_soon_threadsafe(fut.set_result, moved)

        self._later(run)
        return await fut

    def abort(self, request_id: str) -> bool:
        """Abort a live request (or drop held/reserved blocks). False if unknown."""
        try:
            self.engine.abort(request_id)
        except RequestNotFoundError:
            return False
        self._close(request_id)
        return True

    async def run(
        self, fn: Callable[..., T], *args: Any, undo: Callable[[T], None] | None = None
    ) -> T:
        """``fn(*args)`` in a worker thread: for engine calls that take the engine lock (adds,
        stats, block reads, reservations), which would stall the event loop for a model step.

        A call cannot be interrupted once it runs. With ``undo``, if the caller is cancelled
        meanwhile, ``undo(result)`` runs on the step thread once ``fn`` has succeeded (an added
        request is aborted, reserved blocks are released), so cancellation never leaks."""
        fut = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
        if undo is None:
            return await fut
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: self._undo_later(f, undo))
            raise

    def _undo_later(self, fut: asyncio.Future, undo: Callable[[Any], None]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._later(functools.partial(undo, fut.result()))

    def _later(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the step thread before its next step."""
        self._deferred.append(fn)
        self._wake.set()

    def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(RequestNotFoundError):
            self.engine.abort(request_id)

    async def _add(self, request_id: str, add: Callable[[], object]) -> None:
        try:
            await self.run(add, undo=lambda _: self._abort_quietly(request_id))
        except BaseException:
            self._queues.pop(request_id, None)
            raise

    def _open(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def _close(self, request_id: str) -> None:
        entry = self._queues.pop(request_id, None)
        if entry is not None:
            loop, queue = entry
            loop.call_soon_threadsafe(queue.put_nowait, None)

    async def _drain(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        done = False
        try:
            while True:
                item = await queue.get()
                if item is None:  # aborted elsewhere
                    return
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Moved):  # left the engine with its KV held
                    done = True
                    yield item.held
                    return
                done = (item.finished or item.kv_held) and not item.others_pending
                yield item
                if done:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not done:  # the step thread aborts it before its next step
                self._later(functools.partial(self._abort_quietly, request_id))

    # -- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_deferred()
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # noqa: BLE001 - fail every waiter, keep the loop alive
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            self.steps += 1
            for out in outputs:
                entry = self._queues.get(out.request_id)
                if entry is not None:
                    loop, queue = entry
                    loop.call_soon_threadsafe(queue.put_nowait, out)

    def _apply_deferred(self) -> None:
        while self._deferred:
            try:
                self._deferred.popleft()()
            except Exception:  # noqa: BLE001 - one failed clean-up must not stop the loop
                log.exception("deferred engine call failed")

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._queues):
            with contextlib.suppress(RequestNotFoundError):
                self.engine.abort(rid)
            loop, queue = self._queues.pop(rid)
            loop.call_soon_threadsafe(queue.put_nowait, RuntimeError(f"engine step failed: {exc}"))
