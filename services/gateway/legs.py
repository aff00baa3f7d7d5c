"""The token path with the router out of it: the gateway's side of the router's Route RPC
(`services.router.legs`). The router answers the request with the prefill's first tokens and,
for each decode leg, the decode worker and the call to make there; the gateway makes that call
itself, so each token crosses one hop (decode worker -> gateway) instead of two, and reports to
the router when the leg's first event arrived and how it ended (its tokens, the worker's
hand-over or its failure). Retries, migrations and hand-overs stay the router's: after a leg
fails it sends the next one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from tandem.v1 import router_pb2

from services.gateway import codec
from services.gateway.core import BackendEvent, BackendRequest

log = logging.getLogger(__name__)

SETTLE_TIMEOUT_S = 10.0  # how long a finished request's Route call gets to end at the router


async def routed(
    call: grpc.aio.StreamStreamCall,
    msg: router_pb2.GenerateRequest,
    req: BackendRequest,
    channel_of: Callable[[str], grpc.aio.Channel],
) -> AsyncIterator[BackendEvent]:
    """The events of ``req`` over a Route ``call``: the router's own, then each decode leg's
    (made on the channel ``channel_of`` gives for the worker's address). The router's next
    message is awaited while a leg runs (`_stop_leg`)."""
    pending = set(range(req.sampling.n))
    await call.write(codec.route_request(msg))
    step = _read(call)
    while True:
        got = await step
        if got is grpc.aio.EOF:
            return
        step = _read(call)  # the router's next message, awaited while a leg runs
        if got.WhichOneof("step") == "event":
            event = codec.decode_event(got.event)
            if event.finish_reason is not None:
                pending.discard(event.index)
            yield event
            continue
        leg = got.decode
        name = f"{req.request_id} on {leg.worker_id}"
        log.debug("leg %s (%s): starts after %d tokens", name, leg.address,
                  len(leg.request.resumed_token_ids))  # fmt: skip
        stream = codec.decode_stub(channel_of(leg.address)).Generate(
            leg.request, timeout=req.time_left()
        )
        step.add_done_callback(lambda read, s=stream: _stop_leg(read, s))
        async for event in _leg(call, stream, pending, name):
            yield event


def _stop_leg(read: asyncio.Future, stream: grpc.aio.UnaryStreamCall) -> None:
    """The router spoke during a leg: an abort (its event, then its end) stops the leg. A
    router that failed does not: the leg streams on to its end (the client loses nothing while
    the decode worker lives), and its failure is the request's only if the leg fails too."""
    if not read.cancelled() and read.exception() is None:
        stream.cancel()


def _read(call: grpc.aio.StreamStreamCall) -> asyncio.Future:
    """The router's next message, read in the background. Left pending when the request ends
    (cancelling a read cancels the call: `settle` lets it end instead)."""
    task = asyncio.ensure_future(call.read())
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no warning
    return task


async def _leg(
    call: grpc.aio.StreamStreamCall,
    stream: grpc.aio.UnaryStreamCall,
    pending: set[int],
    name: str,
) -> AsyncIterator[BackendEvent]:
    """One decode leg's events; its end is reported before the event that finishes the request
    (the caller may stop reading there: that event waits for the worker's call to end, right
    after it) and after a hand-over or a failure. A report the router
    can no longer take is dropped: its call's end says why (`routed` reads it next)."""
    tokens: list[int] = []
    moved = error = last = None
    started: asyncio.Task | None = None  # the report of the first event, written beside it

    async def report(what: router_pb2.RouteReport) -> None:
        if started is not None:  # one write at a time on the call
            await started
        await _report(call, what)

    try:
        async for pb in stream:
            if pb.HasField("moved"):  # a draining worker handed the request over
                moved = pb.moved
                break
            if started is None:  # not awaited here: the first token does not wait on the router
                log.debug("leg %s: first event", name)
                started = asyncio.ensure_future(_report(call, codec.leg_started()))
            if pb.index == 0:
                tokens.extend(pb.token_ids)
            event = codec.decode_event(pb)
            if event.finish_reason is not None:
                pending.discard(event.index)
                if not pending:  # the worker's call ends next: read its end, so it ends whole
                    last = event
                    continue
            yield event
        if last is not None:  # the request is done: nothing of the router can change it
            log.debug("leg %s: finished after %d tokens", name, len(tokens))
            await report(codec.leg_ended(tokens, None, None))
            yield last
            return
    except grpc.aio.AioRpcError as e:
        error = e
        if last is not None:  # it failed after its last event: the client has it all
            log.debug("leg %s: finished after %d tokens (then %s)", name, len(tokens), e.code())
            await report(codec.leg_ended(tokens, None, None))
            yield last
            return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not stream.cancelled() or (task is not None and task.cancelling()):
            log.debug("leg %s: cancelled after %d tokens (the client left)", name, len(tokens))
            raise
        log.debug("leg %s: stopped by the router after %d tokens", name, len(tokens))
        return  # `_stop_leg` stopped it: the router ended the request and takes no report
    finally:
        stream.cancel()  # no-op once it ended; frees the decode side when the client left
    how = "handed over" if moved is not None else error.code() if error else "ended early"
    log.debug("leg %s: %s after %d tokens; reported", name, how, len(tokens))
    await report(codec.leg_ended(tokens, moved, error))


async def _report(call: grpc.aio.StreamStreamCall, report: router_pb2.RouteReport) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.write(report)


async def settle(call: grpc.aio.StreamStreamCall) -> None:
    """Let a finished request's Route call end at the router (its last report read), then drop
    it: the client has every event already."""
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError):
        await call.done_writing()
        async with asyncio.timeout(SETTLE_TIMEOUT_S):
            await call.code()
    call.cancel()
