"""A decode worker's stream in messages of several tokens (``--stream-interval N``, as vLLM's and
SGLang's ``--stream-interval``): each choice's consecutive outputs are merged until they carry
``N`` new tokens, so every hop to the client (gRPC to the gateway, its SSE chunk) costs per
``N`` tokens; the gateway's cost is per message, not per token
(bench/results/gateway_path_cpu.md). A choice's first output and its last (finished, its KV held
or handed off) go at once, and so does anything that is not an output (a drain's ``Moved``),
after the tokens held back. Tokens wait for at most ``N - 1`` more steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from engine.request_output import RequestOutput, merged

T = TypeVar("T")


async def every(outputs: AsyncIterator[T], n: int) -> AsyncIterator[T | RequestOutput]:
    """``outputs`` with each choice's outputs merged into messages of at least ``n`` new tokens
    (see the module's note); ``n`` <= 1: as they come. Closing this closes ``outputs``."""
    async with contextlib.aclosing(outputs) as items:  # type: ignore[type-var]
        if n <= 1:
            async for item in items:
                yield item
            return
        held: dict[int, RequestOutput] = {}  # choice -> its outputs not sent yet, merged
        started: set[int] = set()  # choices whose first output went
        async for item in items:
            if not isinstance(item, RequestOutput):
                for out in held.values():
                    yield out
                held.clear()
                yield item
                continue
            out = item
            if (before := held.pop(out.index, None)) is not None:
                out = merged(before, out)
            if out.index not in started or out.closes or len(out.new_token_ids) >= n:
                started.add(out.index)
                yield out
            else:
                held[out.index] = out
        for out in held.values():  # (a stream that ended without closing its choices)
            yield out
