"""The gateway's HTTP plumbing: body parsing, the client leaving (``unless_disconnected``), SSE
bodies that close what they stream from (``SSEResponse``), and the error handlers.

The client can leave at three points, and each one aborts the backend request: while a
non-streaming request runs (``unless_disconnected`` watches ``receive``), before a stream's
first event (same), and while streaming (Starlette cancels the body iterator; ``SSEResponse``
closes it in every case)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from services.gateway.core import APIError, internal_error
from services.gateway.edge import error_response, validation_error

log = logging.getLogger(__name__)
GONE: Any = object()  # what unless_disconnected returns when the client went away
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


async def parse(request: Request, model: type[M]) -> M:
    """Validate the body as JSON of ``model`` whatever the Content-Type (curl's -d sends a form
    type); errors go through the RequestValidationError handler like FastAPI's own."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_context=False)) from e


async def unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``, cancelling it if the client disconnects first (then return ``GONE``)."""
    done = False
    with anyio.CancelScope() as scope:

        def on_disconnect(task: asyncio.Task[None]) -> None:
            if not task.cancelled():
                task.exception()  # retrieved: a failing receive also means the client is gone
                if not done:
                    scope.cancel()

        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
        watcher.add_done_callback(on_disconnect)
        try:
            return await aw
        finally:
            done = True
            watcher.cancel()
    return GONE


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def gather_all(aws: list[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels and awaits the others when one fails (or this is
    cancelled), so that none still runs inside a generator that is closed next."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):  # a disconnect's scope cancels again and again
            await asyncio.gather(*tasks, return_exceptions=True)


async def sse_lines(
    request_id: str, chunks: AsyncGenerator[dict[str, Any], None]
) -> AsyncGenerator[str, None]:
    """SSE lines of ``chunks`` (closed at the end). An error after the stream started is sent
    as a ``data: {"error": ...}`` event, then ``[DONE]``."""
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception:
            log.exception("stream of %s failed", request_id)
            yield f"data: {json.dumps(internal_error().body())}\n\n"
    yield "data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that closes its body generator, and every exchange behind it, however
    the response ends (done, disconnect, cancellation), so the generation is aborted and
    settled at once instead of whenever it is collected."""

    def __init__(self, exchanges: list[Any], body: Any, headers: dict[str, str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.exchanges = exchanges

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            for exchange in self.exchanges:
                await exchange.close()


def add_error_handlers(app: FastAPI) -> None:
    """Every failure answers as OpenAI's error JSON."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if exc.status >= 500:
            log.warning("request %s failed: %s", request.state.request_id, exc.message)
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(list(exc.errors())))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err = APIError(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error" if exc.status_code < 500 else "server_error",
        )
        return error_response(err)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
