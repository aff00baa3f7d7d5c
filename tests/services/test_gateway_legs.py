"""The gateway's side of a decode leg (`services.gateway.legs._leg`), with stand-ins for the
router's Route call and the decode worker's stream: the first token does not wait for the
router to take the leg's `started` report, and the router still reads `started` before
`ended`."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("tandem.v1.router_pb2")

from tandem.v1 import common_pb2  # noqa: E402

from services.gateway import legs  # noqa: E402


class SlowRouterCall:
    """A Route call whose writes finish only when ``flow`` is set (a router slow to read)."""

    def __init__(self) -> None:
        self.flow = asyncio.Event()
        self.written: list[str] = []
        self.writing = False

    async def write(self, report) -> None:
        assert not self.writing, "two writes at once on one call"
        self.writing = True
        try:
            await self.flow.wait()
            self.written.append(report.WhichOneof("report"))
        finally:
            self.writing = False


class WorkerStream:
    """A decode worker's Generate stream: ``events``, then its end."""

    def __init__(self, events: list[common_pb2.TokenEvent]) -> None:
        self.events = events
        self.stopped = False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for ev in self.events:
            yield ev

    def cancel(self) -> bool:
        self.stopped = True
        return True

    def cancelled(self) -> bool:
        return self.stopped


def token(i: int, finish: int = 0) -> common_pb2.TokenEvent:
    return common_pb2.TokenEvent(index=0, token_ids=[i], text=f"t{i}", finish_reason=finish)


async def test_the_first_event_does_not_wait_for_the_routers_started_report():
    call = SlowRouterCall()
    stream = WorkerStream([token(1), token(2), token(3, common_pb2.FINISH_REASON_LENGTH)])
    events = legs._leg(call, stream, {0}, "r1 on d0")
    first = await asyncio.wait_for(events.__anext__(), 1.0)  # the router has taken nothing yet
    assert first.token_ids == (1,) and call.written == [] and call.writing

    rest = asyncio.ensure_future(_drain(events))
    await asyncio.sleep(0.05)
    assert not rest.done()  # the leg's end is reported before its last event: it waits on it
    call.flow.set()
    got = await asyncio.wait_for(rest, 1.0)
    assert [e.token_ids for e in got] == [(2,), (3,)]
    assert call.written == ["started", "ended"]  # in order, one write at a time


async def test_a_leg_that_ends_early_reports_started_then_ended():
    call = SlowRouterCall()
    call.flow.set()
    stream = WorkerStream([token(1)])  # the worker's stream ends with no finish
    got = await asyncio.wait_for(_drain(legs._leg(call, stream, {0}, "r2 on d0")), 1.0)
    assert [e.token_ids for e in got] == [(1,)]
    assert call.written == ["started", "ended"]


async def _drain(events) -> list:
    return [e async for e in events]
