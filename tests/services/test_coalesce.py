"""The token path's read-ahead (`services.common.coalesce`): one event per event while the
reader keeps up; merged, in order and losslessly, while it lags."""

from __future__ import annotations

import asyncio

import pytest
from tandem.v1 import common_pb2

from services.common.coalesce import coalesced

LENGTH = common_pb2.FINISH_REASON_LENGTH


def ev(tok: int, index: int = 0, **fields) -> common_pb2.TokenEvent:
    msg = common_pb2.TokenEvent(request_id="r", token_ids=[tok], text=f"<{tok}>", index=index)
    msg.logprobs.add(token_id=tok, logprob=-tok / 10)
    for name, value in fields.items():
        if name == "usage":
            msg.usage.CopyFrom(value)
        elif name == "moved":
            msg.moved.generator_state = value
        else:
            setattr(msg, name, value)
    return msg


async def source(events, pause: float = 0.0, error: Exception | None = None, closed=None):
    try:
        for e in events:
            if pause:
                await asyncio.sleep(pause)
            yield e
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.set()


async def collect(it, lag: float = 0.0) -> list[common_pb2.TokenEvent]:
    out = []
    async for e in it:
        out.append(e)
        await asyncio.sleep(lag)
    return out


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_a_reader_that_keeps_up_gets_every_event_as_it_came() -> None:
    sent = [ev(i) for i in range(6)] + [ev(6, finish_reason=LENGTH)]
    got = asyncio.run(collect(coalesced(source(sent, pause=0.005))))
    assert [list(e.token_ids) for e in got] == [[i] for i in range(7)]
    assert got[-1].finish_reason == LENGTH


def test_a_lagging_reader_gets_the_queued_events_merged_in_order() -> None:
    usage = common_pb2.Usage(prompt_tokens=5, completion_tokens=10, cached_tokens=2)
    sent = [ev(i) for i in range(9)] + [ev(9, finish_reason=LENGTH, stop_reason="", usage=usage)]
    got = asyncio.run(collect(coalesced(source(sent)), lag=0.05))
    assert len(got) < len(sent)  # merged while the reader slept
    assert tokens(got) == list(range(10))
    assert "".join(e.text for e in got) == "".join(f"<{i}>" for i in range(10))
    assert [lp.token_id for e in got for lp in e.logprobs] == list(range(10))
    last = got[-1]
    assert last.finish_reason == LENGTH and last.usage == usage
    assert all(e.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for e in got[:-1])


def test_choices_ends_and_hand_overs_are_never_merged_across() -> None:
    sent = [
        ev(1, index=0), ev(2, index=0), ev(3, index=1), ev(4, index=0, finish_reason=LENGTH),
        ev(5, index=1), ev(6, index=1, finish_reason=LENGTH), ev(7, index=1, moved=b"state"),
    ]  # fmt: skip
    got = asyncio.run(collect(coalesced(source(sent)), lag=0.05))
    assert [(e.index, list(e.token_ids)) for e in got] == [
        (0, [1, 2]), (1, [3]), (0, [4]), (1, [5, 6]), (1, [7]),
    ]  # fmt: skip
    assert got[2].finish_reason == LENGTH and got[3].finish_reason == LENGTH
    assert got[4].moved.generator_state == b"state"


def test_an_error_comes_after_every_event_read_before_it() -> None:
    got: list = []

    async def run() -> None:
        async for e in coalesced(source([ev(1), ev(2)], error=RuntimeError("worker gone"))):
            got.append(e)
            await asyncio.sleep(0.02)

    with pytest.raises(RuntimeError, match="worker gone"):
        asyncio.run(run())
    assert tokens(got) == [1, 2]


def test_closing_the_reader_early_closes_the_source() -> None:
    async def run() -> bool:
        closed = asyncio.Event()
        it = coalesced(source([ev(i) for i in range(100)], pause=0.01, closed=closed))
        async for _ in it:
            break
        await it.aclose()
        await asyncio.wait_for(closed.wait(), 1)
        return closed.is_set()

    assert asyncio.run(run())
