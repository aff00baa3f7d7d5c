"""The router's side of the Route RPC (`services.router.legs`): the router core runs a request
whose decode calls its caller makes, fed the caller's reports by a stand-in of the gateway's
stream (the real path, gateway and router processes: tests/stack/test_e2e_stack.py)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from tandem.v1 import common_pb2, router_pb2

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from services.common.codec import handle_to_pb
from services.router.calls import RouteJob
from services.router.core import RouterCore
from services.router.legs import CallerLegs
from tests.services.test_router_core import HANDLE, Clients, Directory, member


def started() -> router_pb2.RouteReport:
    return router_pb2.RouteReport(started=router_pb2.LegStarted())


def ended(
    tokens: list[int], code: grpc.StatusCode = grpc.StatusCode.OK, **kw
) -> router_pb2.RouteReport:
    end = router_pb2.LegEnded(token_ids=tokens, code=code.value[0], details=code.name, **kw)
    return router_pb2.RouteReport(ended=end)


class Gateway:
    """The caller's end of a Route stream: for each leg the router writes, the reports
    ``script`` holds for its worker, in order."""

    def __init__(self, script: dict[str, list[list[router_pb2.RouteReport]]]) -> None:
        self.script = script
        self.legs: list[router_pb2.DecodeLeg] = []
        self.events: list[common_pb2.TokenEvent] = []
        self.inbox: list[router_pb2.RouteReport] = []

    async def write(self, step: router_pb2.RouteStep) -> None:
        if step.WhichOneof("step") == "decode":
            self.legs.append(step.decode)
            self.inbox.extend(self.script[step.decode.worker_id].pop(0))
        else:
            self.events.append(step.event)

    async def read(self):
        return self.inbox.pop(0) if self.inbox else grpc.aio.EOF


async def run(core: RouterCore, gateway: Gateway, prompt: int, max_tokens: int = 3) -> list:
    legs = CallerLegs(gateway)
    job = RouteJob("r1", list(range(prompt)), SamplingParams(max_tokens=max_tokens), legs=legs)
    delivered = []
    async for ev in core.generate(job):
        if ev.delivered:
            delivered.append(ev)
        else:
            await legs.send(ev)
    return delivered


def decoders(*ids: str) -> Directory:
    return Directory([member(w, "decode", queue=i) for i, w in enumerate(ids)])


async def test_a_leg_that_fails_after_a_token_migrates_to_the_next_leg():
    """d0's leg fails after one token: the router migrates, and d1's leg resumes after it; the
    router relays nothing, and every booking is given back."""
    gateway = Gateway({
        "d0": [[started(), ended([10], grpc.StatusCode.UNAVAILABLE)]],
        "d1": [[started(), ended([11, 12])]],
    })  # fmt: skip
    core = RouterCore(decoders("d0", "d1"), Clients())
    delivered = await run(core, gateway, 10)
    assert [leg.worker_id for leg in gateway.legs] == ["d0", "d1"]
    assert [list(leg.request.resumed_token_ids) for leg in gateway.legs] == [[], [10]]
    assert gateway.legs[1].request.admitted and gateway.legs[0].address == "d0:1"
    assert [ev.token_ids for ev in delivered] == [[], [10], [], [11, 12]]
    assert gateway.events == [] and core.stats.migrations == 1
    assert not +core.inflight  # both legs' bookings given back


async def test_the_prefill_first_token_is_sent_and_the_leg_carries_the_kv():
    gateway = Gateway({"d0": [[started(), ended([8, 9])]]})
    d = Directory([member("p0", "prefill"), member("d0", "decode")])
    clients = Clients()
    core = RouterCore(d, clients)
    await run(core, gateway, 300)
    assert [list(ev.token_ids) for ev in gateway.events] == [[7]]  # the prefill's first token
    (leg,) = gateway.legs
    assert leg.request.kv == handle_to_pb(HANDLE) and list(leg.request.first.token_ids) == [7]
    assert clients.reserved == ["d0"] and clients.released == []


async def test_a_refusal_before_the_first_event_tries_another_decode_worker():
    full = ended([], grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=250, room_tokens=5)
    gateway = Gateway({"d0": [[full]], "d1": [[started(), ended([10, 11, 12])]]})
    core = RouterCore(decoders("d0", "d1"), Clients())
    delivered = await run(core, gateway, 10)
    assert [leg.worker_id for leg in gateway.legs] == ["d0", "d1"]
    assert [ev.token_ids for ev in delivered] == [[], [10, 11, 12]]
    assert core.stats.retries == 1 and core.stats.migrations == 0

    # Every worker full: the refusal reaches the caller with the worker's wait.
    gateway = Gateway({"d0": [[full]], "d1": [[full]]})
    from services.common.errors import ResourceExhausted

    with pytest.raises(ResourceExhausted) as e:
        await run(RouterCore(decoders("d0", "d1"), Clients()), gateway, 10)
    assert e.value.retry_after_ms == 250


async def test_a_hand_over_moves_the_stream_with_its_kv():
    """A draining d0 hands the request over after two tokens: d1's leg takes its KV (the
    prompt and every token but the last) and the last token as its first."""
    moved = common_pb2.MovedKV(kv=handle_to_pb(dataclasses.replace(HANDLE, num_tokens=11)))
    gateway = Gateway({
        "d0": [[started(), ended([10, 11], moved=moved)]],
        "d1": [[started(), ended([12])]],
    })  # fmt: skip
    core = RouterCore(decoders("d0", "d1"), Clients())
    await run(core, gateway, 10)
    second = gateway.legs[1].request
    assert second.kv.num_tokens == 11 and list(second.first.token_ids) == [11]
    assert list(second.resumed_token_ids) == [10, 11]
    assert core.stats.live_moves == 1


async def test_a_leg_reported_out_of_order_is_refused():
    gateway = Gateway({"d0": [[started(), started()]]})
    with pytest.raises(InvalidRequestError, match="started`, then `ended"):
        await run(RouterCore(decoders("d0"), Clients()), gateway, 10)


async def test_route_over_grpc_runs_a_leg_and_the_routers_abort_ends_the_next():
    """The Route RPC on a real grpc.aio server (the router's interceptors): a leg reported
    started and ended finishes the call OK; the router's Abort during a leg sends the abort
    event and ends the call, though the caller never reported the leg's end."""
    from tandem.v1 import router_pb2_grpc

    from services.common.grpc_server import start_server
    from services.router.server import RouterServicer

    core = RouterCore(decoders("d0"), Clients())
    servicer = RouterServicer({"m": (core, None)}, frozenset())  # token-id prompts only
    handle = await start_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, servicer)], ["tandem.v1.Router"],
        "127.0.0.1:0",
    )  # fmt: skip
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    stub = router_pb2_grpc.RouterStub(channel)

    def request(rid: str) -> router_pb2.RouteReport:
        msg = router_pb2.GenerateRequest(
            request_id=rid, model="m", token_ids=router_pb2.TokenIds(ids=list(range(10))),
            sampling=common_pb2.SamplingOptions(max_tokens=3),
        )  # fmt: skip
        return router_pb2.RouteReport(request=msg)

    try:
        call = stub.Route(timeout=30)
        await call.write(request("r1"))
        step = await call.read()
        assert step.decode.worker_id == "d0" and step.decode.request.request_id == "r1"
        await call.write(started())
        await call.write(ended([10, 11, 12]))
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK

        call = stub.Route(timeout=30)
        await call.write(request("r2"))
        assert (await call.read()).WhichOneof("step") == "decode"
        await call.write(started())
        assert (await stub.Abort(common_pb2.AbortRequest(request_id="r2"))).found
        step = await call.read()
        assert step.event.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        assert not +core.inflight  # the aborted leg's booking was given back
    finally:
        await channel.close()
        await handle.server.stop(0)
