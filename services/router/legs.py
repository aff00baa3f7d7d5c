"""The decode calls of a Route RPC, made by its caller (the gateway): the router out of the token
path. The caller streams each leg's events to its client itself and reports here when the leg's
first event arrived and how the leg ended. To the router core (`RouteJob.legs`) a leg looks like
`GrpcWorkerClients.decode` whose events were delivered already: one empty event at the leg's
first event (the stream started), one with choice 0's tokens at its end, then the worker's
hand-over or its failure, raised as the router's own call would raise it (`map_status`). So
booking, retries before the first token, migration after it, hand-overs and aborts are the
router's as for Generate, at two messages a leg instead of one a token."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from tandem.v1 import router_pb2

from engine.errors import InvalidRequestError
from libkv.cluster.registry import Member
from services.common.codec import Event, Moved, event_to_pb, handle_from_pb
from services.common.errors import RETRY_AFTER_MS_KEY, ROOM_TOKENS_KEY, Unavailable
from services.router.calls import DecodeCall
from services.router.codec import decode_request, map_status

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class CallerLegs:
    """`DecodeCalls` over a Route call's ``context`` (its caller reads the legs and reports)."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    async def send(self, event: Event) -> None:
        """Stream an event the router has (the prefill's first tokens, an abort's end)."""
        await self.context.write(router_pb2.RouteStep(event=event_to_pb(event)))

    async def _report(self) -> router_pb2.RouteReport:
        msg = await self.context.read()
        if msg is grpc.aio.EOF:
            raise Unavailable("the caller closed its Route stream during a decode leg")
        return msg

    async def decode(self, worker: Member, call: DecodeCall) -> AsyncIterator[Event]:
        rid = call.job.request_id
        leg = router_pb2.DecodeLeg(
            worker_id=worker.worker_id, address=worker.address, request=decode_request(call)
        )
        await self.context.write(router_pb2.RouteStep(decode=leg))
        report = await self._report()
        if report.WhichOneof("report") == "started":
            yield Event(rid, delivered=True)
            report = await self._report()
        if report.WhichOneof("report") != "ended":
            raise InvalidRequestError("Route: a decode leg is reported `started`, then `ended`")
        end = report.ended
        if end.token_ids:
            yield Event(rid, list(end.token_ids), delivered=True)
        if end.HasField("moved"):
            moved = Moved(handle_from_pb(end.moved.kv), end.moved.generator_state)
            yield Event(rid, moved=moved, delivered=True)
            return
        code = _CODES.get(end.code, grpc.StatusCode.UNKNOWN)
        if code != grpc.StatusCode.OK:
            trailers = {}
            if end.HasField("retry_after_ms"):
                trailers[RETRY_AFTER_MS_KEY] = str(end.retry_after_ms)
            if end.HasField("room_tokens"):
                trailers[ROOM_TOKENS_KEY] = str(end.room_tokens)
            raise map_status(code, end.details, trailers, f"decode {worker.worker_id}")
