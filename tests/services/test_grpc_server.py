"""The shared gRPC server: health, reflection and the one error interceptor, over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from engine.errors import (
    InvalidRequestError,
    PromptTooLongError,
    RequestNotFoundError,
)
from services.common import errors
from services.common.grpc_server import GrpcServerHandle, start_server

DECODE = worker_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
PREFILL = worker_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name

# Abort(request_id) raises the error named by the id; any other id is not found.
ABORT_ERRORS: dict[str, tuple[Exception, grpc.StatusCode]] = {
    "too-long": (
        PromptTooLongError("prompt has 9000 tokens, limit 8192"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "unavailable": (errors.Unavailable("etcd unreachable"), grpc.StatusCode.UNAVAILABLE),
    "stale": (errors.FailedPrecondition("stale incarnation"), grpc.StatusCode.FAILED_PRECONDITION),
    "full": (errors.ResourceExhausted("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "late": (errors.DeadlineExceeded("lease expired"), grpc.StatusCode.DEADLINE_EXCEEDED),
    "forbidden": (errors.PermissionDenied("tenant may not"), grpc.StatusCode.PERMISSION_DENIED),
    "anon": (errors.Unauthenticated("no api key"), grpc.StatusCode.UNAUTHENTICATED),
    "bug": (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
}


class FakeDecode(worker_pb2_grpc.DecodeServicer):
    """Fixed stats, scripted errors, and a stream that fails after two events."""

    def __init__(self) -> None:
        self.stream_closed = asyncio.Event()

    async def Stats(self, request, context):
        return common_pb2.WorkerStats(worker_id="d0", role="decode", kv_blocks_total=64)

    async def Abort(self, request, context):
        if request.request_id in ABORT_ERRORS:
            raise ABORT_ERRORS[request.request_id][0]
        if request.request_id == "set-code":
            context.set_code(grpc.StatusCode.ABORTED)
            context.set_details("chosen by the handler")
            raise ValueError("ignored")
        raise RequestNotFoundError(f"no request {request.request_id!r}")

    async def Generate(self, request, context) -> AsyncIterator[common_pb2.TokenEvent]:
        try:
            for token in (7, 8):
                yield common_pb2.TokenEvent(request_id=request.request_id, token_ids=[token])
            if request.request_id == "endless":
                await asyncio.Event().wait()
            raise InvalidRequestError("token 9 is out of vocabulary")
        finally:
            self.stream_closed.set()


@pytest.fixture
async def served() -> AsyncIterator[tuple[GrpcServerHandle, FakeDecode, grpc.aio.Channel]]:
    decode = FakeDecode()
    handle = await start_server(
        [
            (worker_pb2_grpc.add_DecodeServicer_to_server, decode),
            (worker_pb2_grpc.add_PrefillServicer_to_server, worker_pb2_grpc.PrefillServicer()),
        ],
        [DECODE, PREFILL],
        "127.0.0.1:0",
    )
    channel = grpc.aio.insecure_channel(handle.address)
    try:
        yield handle, decode, channel
    finally:
        await channel.close()
        await handle.stop(grace=None)


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return reply.status


async def abort(channel: grpc.aio.Channel, request_id: str) -> common_pb2.AbortResponse:
    stub = worker_pb2_grpc.DecodeStub(channel)
    return await stub.Abort(common_pb2.AbortRequest(request_id=request_id))


def generate(channel: grpc.aio.Channel, request_id: str):
    stub = worker_pb2_grpc.DecodeStub(channel)
    return stub.Generate(worker_pb2.DecodeRequest(request_id=request_id))


async def test_binds_a_free_port_and_reports_it(served):
    handle, _, _ = served
    assert handle.port > 0
    assert handle.address == f"127.0.0.1:{handle.port}"


async def test_health_serving_then_not_serving(served):
    handle, _, channel = served
    for service in ("", DECODE, PREFILL):
        assert await health_status(channel, service) == health_pb2.HealthCheckResponse.SERVING
    await handle.set_serving(False)
    for service in ("", DECODE, PREFILL):
        assert await health_status(channel, service) == health_pb2.HealthCheckResponse.NOT_SERVING
    await handle.set_serving(True)
    assert await health_status(channel, DECODE) == health_pb2.HealthCheckResponse.SERVING


async def test_health_unknown_service_is_not_found(served):
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_status(channel, "tandem.v1.Nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_services(served):
    _, _, channel = served
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    replies = [reply async for reply in call]
    names = {s.name for s in replies[0].list_services_response.service}
    assert names == {
        DECODE,
        PREFILL,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


async def test_unary_success(served):
    _, _, channel = served
    stats = await worker_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest())
    assert (stats.worker_id, stats.role, stats.kv_blocks_total) == ("d0", "decode", 64)


async def test_unary_not_found_keeps_message(served):
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await abort(channel, "r1")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no request 'r1'"


@pytest.mark.parametrize("request_id", sorted(ABORT_ERRORS))
async def test_unary_error_mapping(served, request_id):
    _, _, channel = served
    exc, code = ABORT_ERRORS[request_id]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker_pb2_grpc.DecodeStub(channel).Abort(
            common_pb2.AbortRequest(request_id=request_id)
        )
    assert info.value.code() == code
    assert str(exc) in info.value.details()


async def test_unexpected_error_is_internal_and_logged(served, caplog):
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await abort(channel, "bug")
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert info.value.details() == "internal error: RuntimeError: boom"
    assert any(r.exc_info and "boom" in str(r.exc_info[1]) for r in caplog.records)


async def test_status_set_by_handler_is_kept(served):
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker_pb2_grpc.DecodeStub(channel).Abort(
            common_pb2.AbortRequest(request_id="set-code")
        )
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert info.value.details() == "chosen by the handler"


async def test_unimplemented_method_stays_unimplemented(served):
    _, _, channel = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker_pb2_grpc.PrefillStub(channel).Release(
            worker_pb2.ReleaseRequest(request_id="r")
        )
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_stream_error_after_events(served):
    _, decode, channel = served
    call = generate(channel, "s1")
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for event in call:
            received.append(list(event.token_ids))
    assert received == [[7], [8]]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "token 9 is out of vocabulary"
    assert decode.stream_closed.is_set()


async def test_client_cancel_closes_the_stream_at_once(served):
    _, decode, channel = served
    call = worker_pb2_grpc.DecodeStub(channel).Generate(
        worker_pb2.DecodeRequest(request_id="endless")
    )
    events = [await call.read(), await call.read()]
    assert [list(e.token_ids) for e in events] == [[7], [8]]
    call.cancel()
    await asyncio.wait_for(decode.stream_closed.wait(), timeout=5)
    assert call.cancelled()


async def test_stop_reports_not_serving_and_refuses_calls(served):
    handle, _, channel = served
    await handle.stop(grace=None)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=2)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
