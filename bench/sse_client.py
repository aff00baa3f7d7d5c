"""A lean streaming client for OpenAI-compatible endpoints: aiohttp and ``json`` alone.

``tandem bench`` measures servers, so its client must not be the bottleneck. The official
``openai`` client builds a pydantic object for every streamed chunk: on a 16-core GPU host it
topped out near 6,000 chunks/s, below what one H200 decodes at 64 streams (the GPU finished
its work seconds before the client had read it, and every server's TPOT read high by the
same amount). This client reads the server-sent events itself and parses each with
``json.loads``, as vLLM's own benchmark does; a chunk costs it a few tens of microseconds.

Errors keep the shape of the ``openai`` client's: `APIStatusError` carries the HTTP status and
the error body's ``message``; a connection failure or timeout is aiohttp's own exception.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any


class APIStatusError(Exception):
    """The server answered with a status other than 200 (``status``; ``message`` from its
    OpenAI-style error body when it has one)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Error code: {status} - {message}")
        self.status = status
        self.message = message


class StreamClient:
    """One connection pool to ``base_url`` (ending in ``/v1``); no retries: a failure is a
    result. ``connector`` replaces the default TCP connector (tests)."""

    def __init__(
        self, base_url: str, api_key: str, timeout: float, connector: Any | None = None
    ) -> None:
        import aiohttp

        self.base_url = base_url.rstrip("/")
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
            # No per-host cap: every stream of a saturating run is its own connection.
            connector=connector or aiohttp.TCPConnector(limit=0, force_close=False),
        )

    async def model_ids(self) -> list[str]:
        """The ids ``/models`` lists."""
        async with self._session.get(f"{self.base_url}/models") as resp:
            await _raise_for(resp)
            return [m["id"] for m in (await resp.json())["data"]]

    async def stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST ``body`` to ``path`` (``/chat/completions`` or ``/completions``) and yield each
        event's JSON until ``[DONE]`` or the end of the stream. An event the server sent as
        an error (``{"error": ...}``) raises `APIStatusError` with status 500."""
        async with self._session.post(f"{self.base_url}{path}", json=body) as resp:
            await _raise_for(resp)
            async for raw in resp.content:  # aiohttp yields whole lines, however they arrive
                line = raw.rstrip(b"\r\n")
                if not line.startswith(b"data:"):
                    continue  # comments, event names, blank separators
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event and "choices" not in event:
                    raise APIStatusError(500, _message(event))
                yield event

    async def close(self) -> None:
        await self._session.close()


async def _raise_for(resp: Any) -> None:
    if resp.status == 200:
        return
    text = await resp.text()
    try:
        message = _message(json.loads(text))
    except ValueError:
        message = text[:300]
    raise APIStatusError(resp.status, message)


def _message(body: Any) -> str:
    """An OpenAI-style error body's message (``{"error": {"message": ...}}``), else the body."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:300]
