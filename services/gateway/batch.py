"""A completions request with a batch of prompts (OpenAI's and vLLM's ``prompt`` as a list of
strings or of token-id lists), answered as one response: one backend request per prompt
(`prepare.prepare_completions`), choice ``j`` of prompt ``i`` answered as choice ``i * n + j``,
usage summed over the prompts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import anyio

from services.gateway.responses import usage


def _sum_usage(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return usage(
        sum(u["prompt_tokens"] for u in parts),
        sum(u["completion_tokens"] for u in parts),
        sum(u["prompt_tokens_details"]["cached_tokens"] for u in parts),
    )


def _renumbered(chunk: dict[str, Any], request_id: str, offset: int) -> dict[str, Any]:
    choices = [{**c, "index": c["index"] + offset} for c in chunk["choices"]]
    return {**chunk, "id": request_id, "choices": choices}


def merge_responses(request_id: str, responses: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One ``text_completion`` object for the batch's responses (``n`` choices each, in
    prompt order)."""
    choices = [
        c for i, r in enumerate(responses) for c in _renumbered(r, request_id, i * n)["choices"]
    ]
    return {
        **responses[0],
        "id": request_id,
        "choices": choices,
        "usage": _sum_usage([r["usage"] for r in responses]),
    }


async def merged_chunks(
    request_id: str, parts: list[AsyncGenerator[dict[str, Any], None]], n: int
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunks of every prompt's stream as they come (each read by a task of its own),
    renumbered; the prompts' last usage chunks (``include_usage``) become one, at the end.
    The first failure of any prompt's stream is raised here; closing this closes them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, part: AsyncGenerator[dict[str, Any], None]) -> None:
        try:
            async for chunk in part:
                await queue.put((i, chunk))
            await queue.put((i, done))
        except Exception as e:  # to the reader; a cancel (this closing) ends it quietly
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, part)) for i, part in enumerate(parts)]
    last: list[dict[str, Any]] = []
    try:
        left = len(parts)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            elif not item["choices"] and item.get("usage"):
                last.append(item)
            else:
                yield _renumbered(item, request_id, i * n)
        if last:
            yield {**last[0], "id": request_id, "usage": _sum_usage([c["usage"] for c in last])}
    finally:
        for t in tasks:
            t.cancel()
        # Shielded: under a client's disconnect every await is cancelled again, and a part
        # cannot be closed while its task still runs in it.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for part in parts:
                await part.aclose()
