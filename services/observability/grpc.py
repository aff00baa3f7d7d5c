"""The server side of observability for every gRPC service: one interceptor that times each call
(``tandem_grpc_server_handling_seconds{method,code}``), opens its server span as a child of the
caller's trace context (W3C ``traceparent`` metadata) with the request id as an attribute and,
on a streaming call, a ``first_response`` event when its first message leaves (so a trace shows
each hop's share of TTFT), and sets the request id for the handler's log lines.

It sits outside `services.common.grpc_server.ErrorInterceptor`, so it sees the status that
error mapping chose. Health checks and reflection are left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from opentelemetry import trace

from services.observability import tracing
from services.observability.metrics import GrpcServerMetrics

SKIP_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
FIRST_RESPONSE = "first_response"  # event on a streaming call's span at its first message


class _Call:
    """Status of one call, filled in as it ends, and its span (None while tracing is off)."""

    __slots__ = ("code", "span")

    def __init__(self) -> None:
        self.code = "OK"
        self.span: trace.Span | None = None


def _status(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        return code.name
    return "UNKNOWN"


@contextlib.contextmanager
def _observed(
    metrics: GrpcServerMetrics | None, method: str, request: Any, context: grpc.aio.ServicerContext
) -> Iterator[_Call]:
    rid = getattr(request, "request_id", "") or ""
    parent = tracing.extract(context.invocation_metadata())
    attributes = {"rpc.system": "grpc", "rpc.method": method, tracing.REQUEST_ID_ATTR: rid}
    call = _Call()
    t0 = time.perf_counter()
    try:
        with (
            tracing.request_context(rid),
            tracing.span(method.lstrip("/"), kind=trace.SpanKind.SERVER, parent=parent,
                         attributes=attributes) as span,
        ):  # fmt: skip
            call.span = span
            try:
                yield call
            except BaseException as exc:
                call.code = _status(exc, context)
                if span is not None:
                    span.set_attribute("rpc.grpc.status_code", call.code)
                raise
    finally:
        if metrics is not None:
            metrics.observe(method, call.code, time.perf_counter() - t0)


def _wrap_unary(behaviour: Callable[..., Awaitable[Any]], method: str, metrics):
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        with _observed(metrics, method, request, context):
            return await behaviour(request, context)

    return wrapper


def _wrap_stream(behaviour: Callable[..., AsyncIterator[Any]], method: str, metrics):
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        with _observed(metrics, method, request, context) as call:
            responses = behaviour(request, context)
            first = call.span is not None
            async with contextlib.aclosing(responses):
                async for response in responses:
                    if first:  # where the call's first answer left: a hop's share of TTFT
                        first = False
                        call.span.add_event(FIRST_RESPONSE)
                    yield response

    return wrapper


class _MarksFirstWrite:
    """A two-way call's context whose first ``write`` marks its span (`FIRST_RESPONSE`)."""

    def __init__(self, context: grpc.aio.ServicerContext, span: trace.Span) -> None:
        self._context, self._span = context, span

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def write(self, message: Any) -> None:
        if self._span is not None:
            self._span.add_event(FIRST_RESPONSE)
            self._span = None
        await self._context.write(message)


def _wrap_two_way(behaviour: Callable[..., Awaitable[Any]], method: str, metrics):
    async def wrapper(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        with _observed(metrics, method, requests, context) as call:
            if call.span is not None:
                context = _MarksFirstWrite(context, call.span)
            return await behaviour(requests, context)

    return wrapper


class ObserveInterceptor(grpc.aio.ServerInterceptor):
    """Latency histogram, server span and log context for each unary and streaming call."""

    def __init__(self, metrics: GrpcServerMetrics | None = None) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(SKIP_PREFIXES):
            return handler
        serde = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary and inspect.iscoroutinefunction(handler.unary_unary):
            wrapped = _wrap_unary(handler.unary_unary, method, self.metrics)
            return grpc.unary_unary_rpc_method_handler(wrapped, **serde)
        if handler.unary_stream and inspect.isasyncgenfunction(handler.unary_stream):
            wrapped = _wrap_stream(handler.unary_stream, method, self.metrics)
            return grpc.unary_stream_rpc_method_handler(wrapped, **serde)
        if handler.stream_stream and inspect.iscoroutinefunction(handler.stream_stream):
            # Two-way calls that write with context.write() (the router's Route); the handler
            # names its request id once it has read it (`tracing.annotate_request`).
            wrapped = _wrap_two_way(handler.stream_stream, method, self.metrics)
            return grpc.stream_stream_rpc_method_handler(wrapped, **serde)
        return handler
