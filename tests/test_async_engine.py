"""AsyncEngine: the event loop never waits on the engine lock, and cancellation never leaks.

A fake engine stands in for LLMEngine (this tests the asyncio front alone): it holds its lock
for a whole "model step" like the real one and records which requests are live."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.errors import RequestNotFoundError
from engine.llm_engine import RequestOutput


class SlowEngine:
    """Holds its lock for ``step_seconds`` per step; ``add_seconds`` per add (under the lock)."""

    def __init__(self, step_seconds: float = 0.3, add_seconds: float = 0.0) -> None:
        self._lock = threading.RLock()
        self.step_seconds = step_seconds
        self.add_seconds = add_seconds
        self.live: dict[str, int] = {}  # request id -> tokens produced
        self.max_tokens = 3

    def add_request(self, request_id: str, prompt: list[int], params: object, **_: object) -> None:
        with self._lock:
            time.sleep(self.add_seconds)
            self.live[request_id] = 0

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self.live.pop(request_id, None) is None:
                raise RequestNotFoundError(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self.live)

    def close(self) -> None:  # AsyncEngine.stop() ends with it (an engine's tensor-parallel ranks)
        self.closed = True

    def stats(self) -> int:
        with self._lock:
            return len(self.live)

    def step(self) -> list[RequestOutput]:
        with self._lock:
            time.sleep(self.step_seconds)
            outs = []
            for rid in list(self.live):
                self.live[rid] += 1
                done = self.live[rid] >= self.max_tokens
                if done:
                    del self.live[rid]
                outs.append(self._out(rid, done))
            return outs

    @staticmethod
    def _out(rid: str, done: bool) -> RequestOutput:
        return RequestOutput(
            request_id=rid, prompt_token_ids=[1], token_ids=[2], text="x", new_token_ids=[2],
            new_text="x", new_logprobs=[], logprobs=None,
            finish_reason="length" if done else None, num_cached_tokens=0,
        )  # fmt: skip


@pytest.fixture
def slow():
    fake = SlowEngine()
    front = AsyncEngine(fake)  # type: ignore[arg-type]
    front.start()
    yield fake, front
    front.stop()


async def _longest_stall(work, tick: float = 0.01) -> float:
    """Run ``work`` while measuring the longest gap between event-loop ticks."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(tick)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = asyncio.create_task(ticker())
    try:
        await work
    finally:
        stop.set()
        await t
    return max(gaps)


async def test_stream_and_engine_calls_never_stall_the_loop(slow) -> None:
    fake, front = slow

    async def work() -> None:
        outs = [o async for o in front.generate("a", [1], None)]
        assert len(outs) == fake.max_tokens and outs[-1].finished
        # a second request added while a step holds the lock, then a locked call
        gen = front.generate("b", [1], None)
        await gen.__anext__()
        assert await front.run(fake.stats) in (0, 1)
        await gen.aclose()

    stall = await _longest_stall(work())
    # every step holds the lock for 0.3 s; a loop that waited on it would stall that long
    assert stall < 0.2, stall


async def test_abandoned_stream_is_aborted_by_the_step_thread(slow) -> None:
    fake, front = slow
    gen = front.generate("a", [1], None)
    await gen.__anext__()
    await gen.aclose()
    for _ in range(100):
        if "a" not in fake.live:
            break
        await asyncio.sleep(0.02)
    assert "a" not in fake.live


async def test_cancel_during_add_does_not_leak_the_request() -> None:
    fake = SlowEngine(step_seconds=0.01, add_seconds=0.3)
    fake.max_tokens = 10**9  # the request would live forever unless aborted
    front = AsyncEngine(fake)  # type: ignore[arg-type]
    front.start()
    try:

        async def consume() -> None:
            async for _ in front.generate("a", [1], None):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)  # the add is running in its thread, under the lock
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.02)
            if "a" not in fake.live and not front._deferred:
                break
        assert "a" not in fake.live
        assert "a" not in front._queues
    finally:
        front.stop()


async def test_run_with_undo_releases_what_a_cancelled_call_took(slow) -> None:
    fake, front = slow
    taken: list[str] = []
    released: list[str] = []

    def take() -> str:
        time.sleep(0.2)
        taken.append("blocks")
        return "blocks"

    task = asyncio.create_task(front.run(take, undo=released.append))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if released:
            break
        await asyncio.sleep(0.02)
    assert taken == ["blocks"] and released == ["blocks"]
