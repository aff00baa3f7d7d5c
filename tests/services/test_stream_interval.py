"""``services.decode.interval.every``: a decode stream's outputs merged into messages of the
interval's tokens, per choice, the first and last at once, other items after what is held, and
closing it closes the engine's stream (which aborts the request there)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.request_output import RequestOutput
from services.common.codec import Moved
from services.decode.core import DecodeCore
from services.decode.interval import every


def outputs(n: int, index: int = 0, start: int = 0) -> list[RequestOutput]:
    """A choice's outputs of one token each (``t{i}``), the last finished."""
    out = []
    for i in range(start, start + n):
        ids = list(range(start + 1)) + list(range(start + 1, i + 1))
        out.append(RequestOutput(
            "r", [1], ids, "".join(f"t{j}" for j in range(i + 1)), [i], f"t{i}", [], None,
            "length" if i == start + n - 1 else None, 0, index=index,
        ))  # fmt: skip
    return out


async def source(items: list, closed: list[bool] | None = None) -> AsyncIterator:
    try:
        for item in items:
            yield item
    finally:
        if closed is not None:
            closed.append(True)


def run(items: list, n: int) -> list:
    async def go():
        return [o async for o in every(source(items), n)]

    return asyncio.run(go())


def test_one_passes_every_output_as_it_comes():
    items = outputs(5)
    assert run(items, 1) == items


def test_a_choice_streams_its_first_token_then_groups_then_the_rest():
    got = run(outputs(7), 3)
    assert [o.new_token_ids for o in got] == [[0], [1, 2, 3], [4, 5, 6]]
    assert [o.new_text for o in got] == ["t0", "t1t2t3", "t4t5t6"]
    assert got[-1].finished and got[-1].token_ids == list(range(7))
    got = run(outputs(6), 4)  # the last, finished, goes with what is held
    assert [o.new_token_ids for o in got] == [[0], [1, 2, 3, 4], [5]]


def test_choices_are_held_apart():
    a, b = outputs(5, index=0), outputs(5, index=1)
    mixed = [x for pair in zip(a, b, strict=True) for x in pair]
    got = run(mixed, 2)
    for index in (0, 1):
        mine = [o.new_token_ids for o in got if o.index == index]
        assert mine == [[0], [1, 2], [3, 4]], (index, mine)


def test_a_move_goes_after_the_tokens_held_back():
    items = outputs(6)[:3]  # not finished: a drain moves it
    moved = Moved(kv=None)  # type: ignore[arg-type]
    got = run([*items, moved], 4)
    assert [getattr(o, "new_token_ids", None) for o in got] == [[0], [1, 2], None]
    assert got[-1] is moved


def test_closing_the_stream_closes_the_engine_s():
    closed: list[bool] = []

    async def go():
        stream = every(source(outputs(9), closed), 4)
        first = await anext(stream)
        await stream.aclose()
        return first

    assert asyncio.run(go()).new_token_ids == [0]
    assert closed == [True]


def test_an_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        DecodeCore(None, None, "w", "i", stream_interval=0)  # type: ignore[arg-type]
