"""Token events read ahead and merged while their reader lags (the token path's hops).

A decode step sends one `TokenEvent` per stream; each hop (decode worker -> router -> gateway)
then pays a message's cost per event: a read, the hop's own layers, a write with its system
call. While a hop keeps up, nothing changes: each event goes on as it came. Once it falls
behind (a saturated event loop, a slow client), the events that arrived meanwhile wait in the
read-ahead queue and leave as one: consecutive events of one choice merged into one message
(tokens, text and logprobs concatenated, the end and usage of the last), so the hop's cost per
token falls as its load rises instead of its queue growing. Nothing is dropped or reordered,
and an event that ends a choice or hands the request over (``moved``) is never merged into a
later one.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

from tandem.v1 import common_pb2

_END = object()


def mergeable(a: common_pb2.TokenEvent, b: common_pb2.TokenEvent) -> bool:
    """Whether ``b`` may be folded into ``a``: the same choice, and ``a`` neither ends it nor
    hands the request over (nor does ``b``: a hand-over is read on its own)."""
    return (
        a.index == b.index
        and a.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        and not a.HasField("moved")
        and not b.HasField("moved")
    )


def merge(a: common_pb2.TokenEvent, b: common_pb2.TokenEvent) -> common_pb2.TokenEvent:
    """``a`` followed by ``b`` as one event (``a`` is changed and returned): ``MergeFrom``
    concatenates the repeated fields and takes ``b``'s set scalars (its end, stop, usage);
    the text is concatenated by hand (``MergeFrom`` would replace it)."""
    text = a.text + b.text
    a.MergeFrom(b)
    a.text = text
    return a


async def coalesced(
    events: AsyncIterator[common_pb2.TokenEvent],
) -> AsyncIterator[common_pb2.TokenEvent]:
    """``events`` read by a task of their own and yielded merged (`merge`) as far as they
    queued up while the consumer was away. An error of ``events`` is raised after every event
    read before it; closing this iterator cancels the reading (and so the call beneath)."""
    queue: collections.deque = collections.deque()
    ready = asyncio.Event()

    async def read() -> None:
        try:
            async for ev in events:
                queue.append(ev)
                ready.set()
            queue.append(_END)
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer, in order
            queue.append(e)
        ready.set()

    reader = asyncio.create_task(read())
    try:
        while True:
            await ready.wait()
            ready.clear()
            while queue:
                item = queue.popleft()
                if item is _END:
                    return
                if isinstance(item, Exception):
                    raise item
                while queue and isinstance(queue[0], common_pb2.TokenEvent):
                    if not mergeable(item, queue[0]):
                        break
                    item = merge(item, queue.popleft())
                yield item
    finally:
        if not reader.done():
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
