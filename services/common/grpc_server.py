"""Start a grpc.aio server the way every Tandem service does, and map errors in one place.

`start_server` adds the service's servicers, `grpc.health.v1` health checking and server
reflection, and installs `ErrorInterceptor`, the only code that turns Python exceptions into
gRPC status codes. Servicers and cores just raise `engine.errors` or `services.common.errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE_NAME
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from engine.errors import (
    AdapterNotFoundError,
    InvalidRequestError,
    KVCapacityError,
    RequestNotFoundError,
)
from services.common import errors
from services.common.tls import TLSFiles, server_credentials
from services.observability.grpc import ObserveInterceptor
from services.observability.metrics import GrpcServerMetrics

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# grpc.health.v1 service name that stays SERVING while the process drains (set_serving(False)
# leaves it alone) and turns NOT_SERVING only at stop: the target of liveness probes, where ""
# (overall) is the readiness target.
LIVENESS_SERVICE = "liveness"

# First match wins (isinstance), so subclasses must come before their bases.
STATUS_BY_ERROR: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestNotFoundError, grpc.StatusCode.NOT_FOUND),
    (AdapterNotFoundError, grpc.StatusCode.NOT_FOUND),
    (KVCapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.KVTransferFailed, grpc.StatusCode.ABORTED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
)

AddServicerFn = Callable[[Any, grpc.aio.Server], None]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code an exception maps to (INTERNAL when it is not a known error)."""
    for error_type, code in STATUS_BY_ERROR:
        if isinstance(exc, error_type):
            return code
    return grpc.StatusCode.INTERNAL


def _message(exc: BaseException) -> str:
    # str() of a KeyError subclass (RequestNotFoundError) is the repr of its argument.
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc)


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """End the RPC with the status `exc` maps to; always raises (AbortError or `exc`)."""
    preset = context.code()
    if preset is not None and preset != grpc.StatusCode.OK:
        # The handler chose a status itself (set_code, then raise): keep its code and details.
        try:
            await context.abort(preset, context.details() or _message(exc))
        except grpc.aio.UsageError:  # abort() was already called: that status stands
            raise exc from None
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("unexpected error in %s", method)
        await context.abort(code, f"internal error: {type(exc).__name__}: {_message(exc)}")
    # A refusal for capacity is an expected answer under load (counted by status in the RPC
    # metrics): logged at debug so an overload does not also flood the log.
    level = logging.DEBUG if code == grpc.StatusCode.RESOURCE_EXHAUSTED else logging.INFO
    logger.log(level, "%s failed with %s: %s", method, code.name, _message(exc))
    trailers = tuple(
        (key, str(value))
        for key, value in (
            (errors.RETRY_AFTER_MS_KEY, getattr(exc, "retry_after_ms", None)),
            (errors.ROOM_TOKENS_KEY, getattr(exc, "room_tokens", None)),
        )
        if value is not None
    )
    await context.abort(code, _message(exc), trailing_metadata=trailers)


def _wrap_unary_response(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    """Wrap a unary-unary or stream-unary behaviour (also coroutine-style streaming ones)."""

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            result = behaviour(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise  # cancelled by the client, or the handler aborted with its own status
        except Exception as exc:
            await _abort_for(exc, context, method)

    return wrapper


def _wrap_stream_response(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    """Wrap a unary-stream or stream-stream behaviour, mapping errors raised mid-stream."""
    if inspect.iscoroutinefunction(behaviour):
        # Writes with context.write() and returns None (e.g. health Watch): await it.
        return _wrap_unary_response(behaviour, method)

    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            responses = behaviour(request, context)
            if inspect.isawaitable(responses):  # e.g. a partial of a coroutine function
                responses = await responses
            if responses is None:  # it wrote its responses with context.write()
                return
            if inspect.isasyncgen(responses):
                # aclosing: on cancel or disconnect the handler's finally blocks run now,
                # not whenever the abandoned generator is collected (it may hold KV blocks).
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        yield response
            else:
                for response in responses:
                    yield response
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            await _abort_for(exc, context, method)

    return wrapper


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by handlers into gRPC statuses; the only place that does.

    Known errors (see `STATUS_BY_ERROR`) get their code and `str(exc)` as details; anything
    else is logged with its traceback and becomes INTERNAL. Client cancellation, `abort()`
    and statuses the handler set itself pass through untouched.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler  # unknown method: grpc answers UNIMPLEMENTED
        method = handler_call_details.method
        serde = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            wrapped = _wrap_unary_response(handler.unary_unary, method)
            return grpc.unary_unary_rpc_method_handler(wrapped, **serde)
        if handler.unary_stream:
            wrapped = _wrap_stream_response(handler.unary_stream, method)
            return grpc.unary_stream_rpc_method_handler(wrapped, **serde)
        if handler.stream_unary:
            wrapped = _wrap_unary_response(handler.stream_unary, method)
            return grpc.stream_unary_rpc_method_handler(wrapped, **serde)
        wrapped = _wrap_stream_response(handler.stream_stream, method)
        return grpc.stream_stream_rpc_method_handler(wrapped, **serde)


@dataclass
class GrpcServerHandle:
    """A started server: its bound address, health state and shutdown."""

    server: grpc.aio.Server
    health: health_aio.HealthServicer
    service_names: tuple[str, ...]
    host: str
    port: int

    @property
    def address(self) -> str:
        """host:port actually bound (the port is the real one when 0 was asked for)."""
        return f"{self.host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING (readiness) for the server and each of its services."""
        for name in ("", *self.service_names):
            await self.set_status(name, serving)

    async def set_status(self, name: str, serving: bool) -> None:
        """Report health service ``name`` SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.health.set(name, status)

    async def stop(self, grace: float | None) -> None:
        """Report NOT_SERVING for good, then stop; RPCs in flight get `grace` seconds."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        """Block until the server has stopped."""
        await self.server.wait_for_termination()


def _split_host(address: str) -> str:
    host, sep, _ = address.rpartition(":")
    if not sep or not host:
        raise ValueError(f"gRPC address must be host:port, got {address!r}")
    return host


async def start_server(
    servicers: Sequence[tuple[AddServicerFn, Any]],
    service_names: Sequence[str],
    address: str,
    *,
    maximum_concurrent_rpcs: int | None = None,
    metrics: GrpcServerMetrics | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    tls: TLSFiles | None = None,
    ready: bool = True,
) -> GrpcServerHandle:
    """Build, bind and start a grpc.aio server with health, reflection and error mapping.

    `servicers` pairs each generated `add_XServicer_to_server` with its servicer;
    `service_names` are their full names (e.g. "tandem.v1.Decode"), reported SERVING by
    health and listed by reflection. `address` is host:port; port 0 picks a free port,
    which the handle reports. Beyond `maximum_concurrent_rpcs`, calls fail fast with
    RESOURCE_EXHAUSTED instead of queueing. With `tls` the port speaks mutual TLS only.
    With ``ready`` False the server starts NOT_SERVING (live, not yet ready:
    `services.common.health.Health` turns it ready).
    """
    host = _split_host(address)
    server = grpc.aio.server(
        # ObserveInterceptor is outermost: it times and traces the call and sees the status
        # that ErrorInterceptor mapped.
        interceptors=[ObserveInterceptor(metrics), ErrorInterceptor()],
        options=[
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            # Accept the clients' keepalive pings (every 2 s, also between calls and under
            # silent streams: services.common.channels); the default (one per 5 min without
            # data) answers them with GOAWAY "too_many_pings", which drops the connection under
            # streams in flight.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 1_000),
            ("grpc.http2.max_ping_strikes", 0),
        ],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    for add_to_server, servicer in servicers:
        add_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = tuple(service_names)
    reflection.enable_server_reflection(
        (*names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    if tls is None:
        port = server.add_insecure_port(address)
    else:  # mutual TLS: callers must present a certificate signed by tls.ca
        port = server.add_secure_port(address, server_credentials(tls))
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    handle = GrpcServerHandle(server, health, service_names=names, host=host, port=port)
    await handle.set_serving(ready)  # before start, so no check ever sees a service missing
    await health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    return handle
