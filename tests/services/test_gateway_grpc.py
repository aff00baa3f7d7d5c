"""The gateway's gRPC side: codec conversions and status mapping, and GrpcBackend against an
in-process grpc.aio Router stand-in (fallback between routers, cancellation, Abort, health).
Skipped until the generated ``tandem.v1`` code is importable."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import AsyncIterator

import grpc
import pytest

pytest.importorskip("tandem.v1.router_pb2")

from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: E402
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

from engine.sampling_params import SamplingParams  # noqa: E402
from services.gateway import codec  # noqa: E402
from services.gateway.core import APIError, BackendRequest, TokenLogprob, Usage  # noqa: E402
from services.gateway.grpc_backend import GrpcBackend  # noqa: E402


def make_request(request_id: str = "chatcmpl-1", **sampling) -> BackendRequest:
    return BackendRequest(request_id, (5, 6, 7), SamplingParams(**sampling), "acme", "smol")


# --- codec --------------------------------------------------------------------------------------


def test_encode_request() -> None:
    req = make_request(max_tokens=9, temperature=0.0, seed=-3, stop=("a",), logprobs=0, top_k=4)
    msg = codec.encode_request(req)
    assert msg.request_id == "chatcmpl-1" and list(msg.token_ids.ids) == [5, 6, 7]
    assert msg.WhichOneof("prompt") == "token_ids"
    assert (msg.tenant, msg.model) == ("acme", "smol")
    s = msg.sampling
    assert (s.max_tokens, s.top_k, list(s.stop)) == (9, 4, ["a"])
    assert s.HasField("temperature") and s.temperature == 0.0
    assert s.HasField("seed") and s.seed == -3
    assert s.HasField("logprobs") and s.logprobs == 0
    plain = codec.encode_request(make_request()).sampling
    assert not plain.HasField("seed") and not plain.HasField("logprobs")


def test_decode_event() -> None:
    pb = common_pb2.TokenEvent(
        request_id="r",
        token_ids=[11, 12],
        text="ab",
        logprobs=[
            common_pb2.TokenLogprob(
                token_id=11, logprob=-0.5, top=[common_pb2.TopLogprob(token_id=11, logprob=-0.5)]
            )
        ],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        stop_reason="",
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1),
    )
    ev = codec.decode_event(pb)
    assert ev.token_ids == (11, 12) and ev.text == "ab"
    assert ev.logprobs == (TokenLogprob(11, -0.5, ((11, -0.5),)),)
    assert (ev.finish_reason, ev.stop_reason, ev.usage) == ("length", None, Usage(3, 2, 1))
    mid = codec.decode_event(common_pb2.TokenEvent(token_ids=[1], text="x"))
    assert mid.finish_reason is None and mid.usage is None


@pytest.mark.parametrize("reason", [None, " 8", 0, 2])
def test_stop_reason_keeps_its_type_through_the_services(reason) -> None:
    """A stop string stays a string and a stop token's id an int (token 0 too), from the
    worker's event to the gateway's; None (EOS, a length) stays None. It used to arrive as
    the string "2" for a stop token, and for the model's EOS too."""
    from services.common.codec import Event, event_from_pb, event_to_pb

    ev = Event("r", [5], "x", finish_reason="stop", stop_reason=reason)
    pb = event_to_pb(ev)
    assert event_from_pb(pb).stop_reason == reason
    assert type(event_from_pb(pb).stop_reason) is type(reason)
    back = codec.decode_event(common_pb2.TokenEvent.FromString(pb.SerializeToString()))
    assert back.stop_reason == reason and type(back.stop_reason) is type(reason)


@pytest.mark.parametrize(
    "code, status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.PERMISSION_DENIED, 403),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_status_mapping(code: grpc.StatusCode, status: int) -> None:
    err = codec.http_error(code, "details from the router")
    assert err.status == status
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    if status == 400:
        assert err.type == "invalid_request_error"
    if status >= 500:
        assert "details" not in err.message  # internal details stay inside
    else:
        assert err.message == "details from the router"


def test_429_carries_retry_after() -> None:
    assert codec.http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy").headers == {
        "Retry-After": "1",
        "retry-after-ms": "1000",
    }
    err = codec.http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", [("retry-after", "7")])
    assert err.headers == {"Retry-After": "7", "retry-after-ms": "7000"}
    # The workers' estimate in ms wins; Retry-After rounds it up to whole seconds (HTTP).
    err = codec.http_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", [("retry-after-ms", "1250")])
    assert err.headers == {"Retry-After": "2", "retry-after-ms": "1250"}
    assert err.status == 429 and err.code == "server_overloaded"


# --- GrpcBackend against a stand-in router ------------------------------------------------------


class FakeRouter(router_pb2_grpc.RouterServicer):
    """Streams three tokens then finishes, or hangs, or fails, as ``mode`` says: itself
    (Generate), or from its stand-in decode worker (`FakeDecode`, same server) in the decode
    leg its Route names, whose reports it keeps. Mode "migrate": the first leg fails after one
    token, and a second leg continues after it."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.address = ""
        self.requests: list[router_pb2.GenerateRequest] = []
        self.aborts: list[str] = []
        self.reports: list[router_pb2.RouteReport] = []
        self.legs: list[worker_pb2.DecodeRequest] = []
        self.cancelled = asyncio.Event()
        self.health: health.aio.HealthServicer | None = None

    async def _refuse(self, context) -> None:
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no decode workers")
        if self.mode == "busy":
            context.set_trailing_metadata((("retry-after", "7"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")

    async def tokens(
        self, rid: str, context, skip: int = 0
    ) -> AsyncIterator[common_pb2.TokenEvent]:
        done = False
        try:
            for i in range(skip, 3):
                yield common_pb2.TokenEvent(request_id=rid, token_ids=[10 + i])
                if self.mode in ("slow", "abort"):
                    await asyncio.sleep(0.15)
                if self.mode == "migrate" and not skip:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")
            if self.mode == "hang":
                await asyncio.sleep(3600)
            yield common_pb2.TokenEvent(
                request_id=rid,
                finish_reason=common_pb2.FINISH_REASON_STOP,
                usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=3),
            )
            done = True
        finally:  # cancelled (CancelledError) or closed (GeneratorExit) by grpc
            if not done:
                self.cancelled.set()

    async def Generate(self, request, context) -> AsyncIterator[common_pb2.TokenEvent]:
        self.requests.append(request)
        await self._refuse(context)
        async for ev in self.tokens(request.request_id, context):
            yield ev

    async def Route(self, request_iterator, context) -> None:
        first = await context.read()
        request = first.request
        self.requests.append(request)
        await self._refuse(context)
        try:
            resumed: list[int] = []
            while True:
                call = worker_pb2.DecodeRequest(
                    request_id=request.request_id, resumed_token_ids=resumed
                )
                leg = router_pb2.DecodeLeg(worker_id="d0", address=self.address, request=call)
                await context.write(router_pb2.RouteStep(decode=leg))
                if self.mode == "abort":  # the router's Abort came: its event, then its end
                    await asyncio.sleep(0.1)
                    abort = common_pb2.TokenEvent(finish_reason=common_pb2.FINISH_REASON_ABORT)
                    await context.write(router_pb2.RouteStep(event=abort))
                    return
                while (report := await context.read()) is not grpc.aio.EOF:
                    self.reports.append(report)
                    if report.WhichOneof("report") == "ended":
                        break
                if report is grpc.aio.EOF or report.ended.code == 0:
                    return
                resumed += list(report.ended.token_ids)
        finally:
            if self.mode == "hang":
                self.cancelled.set()

    async def Abort(self, request, context) -> common_pb2.AbortResponse:
        self.aborts.append(request.request_id)
        return common_pb2.AbortResponse(found=True)


class FakeDecode(worker_pb2_grpc.DecodeServicer):
    """The decode worker a `FakeRouter`'s legs name: its tokens, after those already sent."""

    def __init__(self, router: FakeRouter) -> None:
        self.router = router

    async def Generate(self, request, context) -> AsyncIterator[common_pb2.TokenEvent]:
        self.router.legs.append(request)
        skip = len(request.resumed_token_ids)
        async for ev in self.router.tokens(request.request_id, context, skip):
            yield ev


async def serve_fake_router(
    decode: grpc.aio.Server | None = None,
) -> tuple[FakeRouter, str, grpc.aio.Server]:
    """A `FakeRouter` and its `FakeDecode` on one server (or the decode worker on ``decode``)."""
    server = grpc.aio.server()
    fake = FakeRouter()
    router_pb2_grpc.add_RouterServicer_to_server(fake, server)
    worker_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(fake), decode or server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("model:m", health_pb2.HealthCheckResponse.SERVING)
    fake.health = health_servicer
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fake.address = f"127.0.0.1:{port}"
    if decode is not None:
        fake.address = f"127.0.0.1:{decode.add_insecure_port('127.0.0.1:0')}"
        await decode.start()
    return fake, f"127.0.0.1:{port}", server


@pytest.fixture(params=[True, False], ids=["direct", "relay"])
def direct(request) -> bool:
    """Whether the backend streams from the decode worker itself (Route) or the router relays."""
    return request.param


@pytest.fixture
async def router() -> AsyncIterator[tuple[FakeRouter, str]]:
    fake, address, server = await serve_fake_router()
    yield fake, address
    await server.stop(0)


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_generate_falls_back_to_the_next_router(router, direct) -> None:
    fake, address = router
    backend = GrpcBackend([dead_address(), address], model="m", direct=direct)
    events = [ev async for ev in backend.generate(make_request(seed=1))]
    assert [ev.token_ids for ev in events] == [(10,), (11,), (12,), ()]
    assert events[-1].finish_reason == "stop" and events[-1].usage == Usage(3, 3, 0)
    assert fake.requests[0].sampling.seed == 1
    assert fake.aborts == []
    if direct:  # the tokens came from the decode worker; the router heard two reports
        for _ in range(100):  # the last after the client's last event
            if len(fake.reports) == 2:
                break
            await asyncio.sleep(0.02)
        assert [r.WhichOneof("report") for r in fake.reports] == ["started", "ended"]
        assert list(fake.reports[-1].ended.token_ids) == [10, 11, 12]
        assert fake.reports[-1].ended.code == 0
    assert await backend.readiness() is None
    await backend.close()


async def test_readiness_says_why_no_router_can_route(router) -> None:
    """Ready while some router has a live decode worker of the model (its ``model:NAME``
    health service); otherwise the reason names each router."""
    fake, address = router
    dead = dead_address()
    backend = GrpcBackend([dead, address], model="m")
    assert await backend.readiness() is None
    assert fake.health is not None
    await fake.health.set("model:m", health_pb2.HealthCheckResponse.NOT_SERVING)
    reason = await backend.readiness()
    assert reason is not None
    assert f"router {address}: no live decode worker for model m" in reason
    assert f"router {dead}: unreachable" in reason
    other = GrpcBackend([address], model="other")
    assert await other.readiness() == f"router {address}: serves another model than other"
    await backend.close()
    await other.close()


async def test_closing_the_stream_cancels_the_call_and_aborts(router, direct) -> None:
    fake, address = router
    fake.mode = "hang"
    backend = GrpcBackend([address], direct=direct)
    stream = backend.generate(make_request("cmpl-9"))
    assert (await anext(stream)).token_ids == (10,)
    await stream.aclose()
    await asyncio.wait_for(fake.cancelled.wait(), 1.0)
    assert fake.aborts == ["cmpl-9"]
    await backend.abort("cmpl-9")  # idempotent: no second RPC
    assert fake.aborts == ["cmpl-9"]
    await backend.close()


async def test_cancelling_the_task_aborts(router, direct) -> None:
    fake, address = router
    fake.mode = "hang"
    backend = GrpcBackend([address], direct=direct)

    async def consume() -> None:
        async for _ in backend.generate(make_request("cmpl-10")):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(fake.cancelled.wait(), 1.0)
    assert fake.aborts == ["cmpl-10"]
    await backend.close()


@pytest.mark.parametrize("mode, status", [("unavailable", 503), ("busy", 429)])
async def test_router_errors_become_http_errors(router, direct, mode: str, status: int) -> None:
    fake, address = router
    fake.mode = mode
    backend = GrpcBackend([address], direct=direct)
    with pytest.raises(APIError) as e:
        async for _ in backend.generate(make_request()):
            pass
    assert e.value.status == status
    if status == 429:
        assert e.value.headers["Retry-After"] == "7"
    else:
        assert "no capacity" in e.value.message
    await backend.close()


async def test_a_request_past_its_deadline_is_a_timeout(router, direct) -> None:
    """A request whose deadline passes mid-stream fails with 504 ``timeout``, every time. Direct,
    the Route call and its leg share the deadline: a leg's report written to the Route call as
    the deadline struck ended that call INTERNAL ("Internal error from Core", a 500) in some
    tries (4 of 30 in one count; test_e2e_protection's streamed deadline got it too)."""
    fake, address = router
    fake.mode = "hang"
    backend = GrpcBackend([address], direct=direct)
    answers = []
    for k in range(32):
        req = dataclasses.replace(make_request(f"cmpl-t{k}"), deadline=time.monotonic() + 0.1)
        with pytest.raises(APIError) as e:
            async for _ in backend.generate(req):
                pass
        answers.append((e.value.status, e.value.code))
    assert set(answers) == {(504, "timeout")}, answers
    await backend.close()


async def test_all_routers_down() -> None:
    backend = GrpcBackend([dead_address(), dead_address()])
    with pytest.raises(APIError) as e:
        async for _ in backend.generate(make_request()):
            pass
    assert e.value.status == 503
    assert await backend.readiness() is not None
    await backend.close()


# --- The gateway process ------------------------------------------------------------------------


def test_gateway_process_without_a_router(tmp_path) -> None:
    """``python -m services.gateway`` starts, serves /v1/models, and turns an unreachable router
    into 503 on /health and on requests; SIGTERM stops it cleanly."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from engine.bundled import DEFAULT_DIR

    port = int(dead_address().rsplit(":", 1)[1])
    env = {**os.environ, "TANDEM_ROUTERS": dead_address(), "TANDEM_API_KEYS": "k"}
    cmd = [
        sys.executable,
        "-m",
        "services.gateway",
        "--model-dir",
        str(DEFAULT_DIR),
        "--port",
        str(port),
        "--served-model-name",
        "smol",
        "--log-level",
        "warning",
    ]
    log = (tmp_path / "gateway.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k"}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
            try:
                r = httpx.get(f"{url}/v1/models", headers=auth)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "gateway did not start"
                time.sleep(0.2)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "smol"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=10)
        assert r.status_code == 503, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert proc.wait(30) in (0, -signal.SIGTERM)
        log.close()
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()


async def test_requests_spread_over_routers_and_skip_a_dead_one(direct) -> None:
    (a, addr_a, server_a), (b, addr_b, server_b) = [await serve_fake_router() for _ in range(2)]
    backend = GrpcBackend([addr_a, addr_b], direct=direct)
    try:
        for i in range(4):
            events = [ev async for ev in backend.generate(make_request(f"r{i}"))]
            assert events[-1].finish_reason == "stop"
        assert (len(a.requests), len(b.requests)) == (2, 2)
        await server_a.stop(0)  # router a is gone: every request still succeeds, on b
        for i in range(4, 8):
            events = [ev async for ev in backend.generate(make_request(f"r{i}"))]
            assert events[-1].finish_reason == "stop"
        assert len(b.requests) == 6  # a was tried once, then put last while it stays down
    finally:
        await backend.close()
        await server_b.stop(0)


def test_session_key_travels_to_the_router() -> None:
    req = BackendRequest("r", (1, 2), SamplingParams(), "acme", "smol", session="user-7")
    assert codec.encode_request(req).session == "user-7"


async def test_a_leg_that_fails_is_reported_and_the_next_leg_continues(router) -> None:
    """The decode worker fails after one token: the router hears the failure with that token,
    sends the next leg (resumed after it), and the client gets every token once."""
    fake, address = router
    fake.mode = "migrate"
    backend = GrpcBackend([address], direct=True)
    events = [ev async for ev in backend.generate(make_request("cmpl-11"))]
    assert [ev.token_ids for ev in events] == [(10,), (11,), (12,), ()]
    for _ in range(100):  # the last report reaches the router after the client's last event
        ended = [r.ended for r in fake.reports if r.WhichOneof("report") == "ended"]
        if len(ended) == 2:
            break
        await asyncio.sleep(0.02)
    assert ended[0].code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "decode worker died" in ended[0].details and list(ended[0].token_ids) == [10]
    assert (ended[1].code, list(ended[1].token_ids)) == (0, [11, 12])
    assert [list(leg.resumed_token_ids) for leg in fake.legs] == [[], [10]]
    assert fake.aborts == []
    await backend.close()


async def test_a_router_that_dies_during_a_leg_does_not_cut_the_stream() -> None:
    """The decode worker lives: the client gets every token though the router is gone."""
    decode = grpc.aio.server()
    fake, address, server = await serve_fake_router(decode)
    fake.mode = "slow"
    backend = GrpcBackend([address], direct=True)
    try:
        stream = backend.generate(make_request("cmpl-12"))
        first = await anext(stream)
        await server.stop(0)
        rest = [ev async for ev in stream]
        assert [first.token_ids, *(ev.token_ids for ev in rest)] == [(10,), (11,), (12,), ()]
        assert rest[-1].finish_reason == "stop"
    finally:
        await backend.close()
        await decode.stop(0)


async def test_the_routers_abort_stops_the_leg(router) -> None:
    fake, address = router
    fake.mode = "abort"
    backend = GrpcBackend([address], direct=True)
    events = [ev async for ev in backend.generate(make_request("cmpl-13"))]
    assert events[-1].finish_reason == "abort"
    assert sum(len(ev.token_ids) for ev in events) < 3  # the leg stopped before its end
    await asyncio.wait_for(fake.cancelled.wait(), 1.0)  # the decode worker's call was cancelled
    await backend.close()
