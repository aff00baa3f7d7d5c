"""The production Backend: the Router service over grpc.aio.

By default the router is out of the token path: its Route call says which decode worker to
stream from, and the gateway streams from it itself (`services.gateway.legs`); with
``direct=False`` the router relays every token (its Generate call).

Requests are spread over the routers in turn (every replica sees the same workers and block
locations in etcd, so any of them routes alike). A router that is down (UNAVAILABLE before any
token arrived) passes the request to the next one and is tried last for the next
``DOWN_RETRY_S`` seconds. Stopping the iteration early cancels the gRPC call (the router turns
that into an abort) and also calls the router's Abort RPC. Router addresses are static.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import anyio
import grpc

from services.common.channels import internal_channel
from services.common.health import model_service
from services.common.tls import TLSFiles
from services.gateway import codec, legs
from services.gateway.core import APIError, BackendEvent, BackendRequest, TokenLogprob

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
HEALTH_TIMEOUT_S = 1.0
ADAPTER_TIMEOUT_S = 120.0  # a load reads the adapter on every worker
DOWN_RETRY_S = 5.0  # a router that was unavailable goes last in the order for this long


class GrpcBackend:
    """Backend over one channel per router address. Create it inside the running event loop."""

    def __init__(
        self,
        addresses: Sequence[str],
        tls: TLSFiles | None = None,
        router_api_key: str = "",
        model: str = "",
        direct: bool = True,
    ) -> None:
        if not addresses:
            raise ValueError("at least one router address is needed")
        self._addresses = tuple(addresses)
        self._model = model  # the served model: readiness asks routers for its workers
        # The gateway's own credential for routers that check API keys (internal callers').
        self._metadata = (("authorization", f"Bearer {router_api_key}"),) if router_api_key else ()
        self._channels = {a: internal_channel(a, tls) for a in self._addresses}
        self._stubs = {a: codec.router_stub(ch) for a, ch in self._channels.items()}
        self._tls, self._direct = tls, direct
        self._workers: dict[str, grpc.aio.Channel] = {}  # decode worker address -> channel
        self._settling: set[asyncio.Task] = set()
        self._live: dict[str, str] = {}  # request id -> address of the router running it
        self._turn = 0
        self._down_until: dict[str, float] = {}  # address -> time.monotonic()

    def order(self) -> list[str]:
        """The routers to try for the next request: in turn, the ones seen down lately last."""
        n = len(self._addresses)
        self._turn = (self._turn + 1) % n
        rotated = [self._addresses[(self._turn + i) % n] for i in range(n)]
        now = time.monotonic()
        return sorted(rotated, key=lambda a: self._down_until.get(a, 0.0) > now)

    async def generate(self, req: BackendRequest) -> AsyncIterator[BackendEvent]:
        msg = codec.encode_request(req)
        order = self.order()
        for i, address in enumerate(order):
            # The request's deadline is the call's gRPC deadline, passed on by the router.
            stub, timeout = self._stubs[address], req.time_left()
            if self._direct:
                call = stub.Route(timeout=timeout, metadata=self._metadata)
                events = legs.routed(call, msg, req, self._worker_channel)
            else:
                call = stub.Generate(msg, timeout=timeout, metadata=self._metadata)
                events = _relayed(call)
            self._live[req.request_id] = address
            started = finished = False
            pending = set(range(req.sampling.n))  # choices not finished yet
            try:
                async with contextlib.aclosing(events):  # a leg's call ends with the request
                    async for event in events:
                        started = True
                        if event.finish_reason is not None:
                            pending.discard(event.index)
                        finished = not pending or event.finish_reason == "abort"
                        yield event
                        if finished:
                            if self._direct:
                                self._settle(call)
                            return
                finished = True
                raise APIError(502, "the router ended the stream early", "server_error")
            except grpc.aio.AioRpcError as e:
                finished = True  # the call is over either way
                last, code = i == len(order) - 1, _status(e, req)
                if code == grpc.StatusCode.UNAVAILABLE and not started:
                    self._down_until[address] = time.monotonic() + DOWN_RETRY_S
                if code == grpc.StatusCode.UNAVAILABLE and not started and not last:
                    log.warning("router %s unavailable (%s); trying the next", address, e.details())
                    continue
                # Refusals for capacity are answers (429), frequent under overload: not warnings.
                full = code == grpc.StatusCode.RESOURCE_EXHAUSTED
                log.log(logging.DEBUG if full else logging.WARNING, "router %s: %s %s", address,
                        e.code().name, e.details())  # fmt: skip
                raise codec.http_error(code, e.details(), _trailers(e)) from e
            finally:
                if not finished:
                    call.cancel()
                    await self.abort(req.request_id)
                self._live.pop(req.request_id, None)

    def _worker_channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._workers:
            self._workers[address] = internal_channel(address, self._tls)
        return self._workers[address]

    def _settle(self, call: grpc.aio.StreamStreamCall) -> None:
        task = asyncio.ensure_future(legs.settle(call))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def abort(self, request_id: str) -> None:
        """Ask the router running ``request_id`` to abort it; a no-op once it has ended or been
        aborted, so calling it twice costs nothing."""
        address = self._live.pop(request_id, None)
        if address is None:
            return
        with anyio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            try:
                await self._stubs[address].Abort(
                    codec.abort_request(request_id), metadata=self._metadata
                )
            except grpc.aio.AioRpcError as e:
                log.warning("Abort(%s) on %s failed: %s", request_id, address, e.code())

    async def _unary(self, method: str, msg):
        """One unary call on the first router that answers (in turn, down ones last)."""
        order = self.order()
        for i, address in enumerate(order):
            rpc = getattr(self._stubs[address], method)
            try:
                return await rpc(msg, timeout=ADAPTER_TIMEOUT_S, metadata=self._metadata)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAVAILABLE and i < len(order) - 1:
                    self._down_until[address] = time.monotonic() + DOWN_RETRY_S
                    continue
                raise codec.http_error(e.code(), e.details(), _trailers(e)) from e
        raise AssertionError("no router address")  # GrpcBackend has at least one

    async def adapters(self) -> dict[str, str]:
        reply = await self._unary("ListModels", codec.list_models_request())
        return codec.adapters_of(reply)

    async def load_lora(self, name: str, path: str) -> None:
        await self._unary("LoadLoraAdapter", codec.load_lora_request(name, path))

    async def unload_lora(self, name: str) -> None:
        await self._unary("UnloadLoraAdapter", codec.unload_lora_request(name))

    async def embed(
        self, request_id: str, model: str, inputs: list[list[int]]
    ) -> tuple[list[list[float]], int]:
        reply = await self._unary("Embed", codec.embed_request(request_id, model, inputs))
        return codec.embeddings_of(reply)

    async def prompt_logprobs(
        self, request_id: str, model: str, inputs: list[list[int]], k: int
    ) -> tuple[list[list[TokenLogprob]], int]:
        req = codec.prompt_logprobs_request(request_id, model, inputs, k)
        return codec.prompt_logprobs_of(await self._unary("PromptLogprobs", req))

    async def readiness(self, model: str = "") -> str | None:
        """None when some router can route to a live decode worker of ``model`` (default: the
        first served model; its grpc.health.v1 ``model:NAME`` is SERVING), else why none can."""
        model = model or self._model
        service = model_service(model)
        checks = [
            codec.health_check(ch, service, HEALTH_TIMEOUT_S) for ch in self._channels.values()
        ]
        found = dict(zip(self._addresses, await asyncio.gather(*checks), strict=True))
        if any(why is None for why in found.values()):
            return None
        why = {
            "not serving": f"no live decode worker for model {model}",
            "unknown": f"serves another model than {model}",
            "unreachable": "unreachable",
        }
        return "; ".join(f"router {a}: {why[w]}" for a, w in found.items())

    async def close(self) -> None:
        for task in list(self._settling):
            task.cancel()
        for channel in [*self._channels.values(), *self._workers.values()]:
            await channel.close()


async def _relayed(call: grpc.aio.UnaryStreamCall) -> AsyncIterator[BackendEvent]:
    async for pb in call:
        yield codec.decode_event(pb)


def _status(e: grpc.aio.AioRpcError, req: BackendRequest) -> grpc.StatusCode:
    """The status a failed call of ``req`` answers with: DEADLINE_EXCEEDED once the request's
    deadline has passed, whatever status the call ended with. With the direct token path the
    Route call and the decode leg share that deadline, and a leg's report written to the Route
    call as the deadline strikes fails in gRPC's core, which grpc.aio turns into the call's
    status: INTERNAL "Internal error from Core" (a 500) instead of the deadline's 504."""
    if req.deadline is not None and time.monotonic() >= req.deadline:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return e.code()


def _trailers(e: grpc.aio.AioRpcError) -> list[tuple[str, str | bytes]]:
    return list(e.trailing_metadata() or ())
