"""Router's messages <-> core types, and the gRPC clients of the workers (only pb2 user)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from tandem.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

from engine.errors import InvalidRequestError, RequestNotFoundError
from engine.sampling_params import TokenLogprob
from engine.tokenizer import Tokenizer
from libkv.cluster.registry import Member
from services.common import codec as common
from services.common.channels import internal_channel
from services.common.errors import (
    RETRY_AFTER_MS_KEY,
    ROOM_TOKENS_KEY,
    DeadlineExceeded,
    KVTransferFailed,
    ResourceExhausted,
    Unavailable,
)
from services.common.tls import TLSFiles
from services.router.calls import DecodeCall, DecodeCalls, PrefillReply, RouteJob

ADAPTER_TIMEOUT_S = 60.0  # reading an adapter folder into host memory


def job_from_pb(
    req: router_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    rid: str,
    time_left: float | None,
    lora: str = "",
    legs: DecodeCalls | None = None,
) -> RouteJob:
    """The routing job of a request; ``time_left`` is the call's gRPC deadline (None: none);
    ``lora``: the adapter its ``model`` names; ``legs``: who makes its decode calls (None:
    the router)."""
    which = req.WhichOneof("prompt")
    if which == "text":
        prompt = tokenizer.encode_prompt(req.text)
    elif which == "token_ids":
        prompt = list(req.token_ids.ids)
    else:
        raise InvalidRequestError("GenerateRequest needs a prompt: text or token_ids")
    if not prompt:
        raise InvalidRequestError("the prompt is empty")
    return RouteJob(
        rid,
        prompt,
        common.sampling_from_pb(req.sampling),
        req.tenant,
        common.priority_from_pb(req.priority),
        None if time_left is None else time.monotonic() + time_left,
        session=req.session,
        lora=lora,
        slo_ttft_ms=_slo_ms(req.slo.ttft_ms, "slo.ttft_ms"),
        slo_tpot_ms=_slo_ms(req.slo.tpot_ms, "slo.tpot_ms"),
        legs=legs,
    )


def _slo_ms(value: float, name: str) -> float:
    """An objective as given (0: none); INVALID_ARGUMENT for a negative or non-finite one."""
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError(f"{name} must be >= 0 milliseconds (got {value})")
    return value


def map_rpc_error(e: grpc.aio.AioRpcError, who: str) -> Exception:
    """A worker's status as the exception the router core and interceptor understand."""
    trailers = {k: str(v) for k, v in e.trailing_metadata() or ()}
    return map_status(e.code(), e.details() or "", trailers, who)


def map_status(
    code: grpc.StatusCode, details: str, trailers: Mapping[str, str], who: str
) -> Exception:
    """A worker call's end (its status, details and trailers) as the router's exception."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequestError(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return RequestNotFoundError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        wait, room = (trailers.get(k, "") for k in (RETRY_AFTER_MS_KEY, ROOM_TOKENS_KEY))
        return ResourceExhausted(
            f"{who}: {details}",
            int(wait) if wait.isdigit() else None,
            int(room) if room.isdigit() else None,
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"{who}: {details}")
    if code == grpc.StatusCode.ABORTED:
        return KVTransferFailed(f"{who}: {details}")
    return Unavailable(f"{who} failed: {code.name}: {details}")


RESERVE_TIMEOUT_S = 5.0  # a Reserve is a bookkeeping call: a worker this slow is as good as down


def _slo(job: RouteJob) -> common_pb2.Slo:
    """The request's objectives as it carried them (0: none given), for the workers' SLO
    admission (`services.worker.slo_gate`)."""
    return common_pb2.Slo(ttft_ms=job.slo_ttft_ms, tpot_ms=job.slo_tpot_ms)


def decode_request(call: DecodeCall) -> worker_pb2.DecodeRequest:
    """The decode worker's call for ``call`` (Decode.Generate's request)."""
    job = call.job
    req = worker_pb2.DecodeRequest(
        request_id=job.request_id,
        token_ids=job.prompt,
        sampling=common.sampling_to_pb(job.params),
        tenant=job.tenant,
        generator_state=call.generator_state,
        cached_tokens=call.cached_tokens,
        priority=common.PRIORITY_TO_PB[job.priority],
        lora=job.lora,
        admitted=call.admitted,
        resumed_token_ids=call.resumed,
        slo=_slo(job),
    )
    if call.handle is not None and call.first is not None:
        req.kv.CopyFrom(common.handle_to_pb(call.handle))
        req.first.CopyFrom(common.event_to_pb(call.first))
        for c in call.others:
            start = req.other_choices.add(generator_state=c.generator_state)
            start.first.CopyFrom(common.event_to_pb(c.first))
    return req


class GrpcWorkerClients:
    """WorkerClients over grpc.aio, one channel per worker address. Channels keep alive with
    HTTP/2 pings (`services.common.channels`): a worker that goes silent fails its calls with
    UNAVAILABLE within seconds, and the router moves them as on any worker failure."""

    def __init__(self, prefill_timeout: float = 300.0, tls: TLSFiles | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.prefill_timeout = prefill_timeout
        self.tls = tls  # mutual TLS towards the workers when set

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = internal_channel(address, self.tls)
        return self._channels[address]

    async def prefill(self, worker: Member, job: RouteJob) -> PrefillReply:
        stub = worker_pb2_grpc.PrefillStub(self._channel(worker.address))
        req = worker_pb2.PrefillRequest(
            request_id=job.request_id,
            token_ids=job.prompt,
            sampling=common.sampling_to_pb(job.params),
            tenant=job.tenant,
            priority=common.PRIORITY_TO_PB[job.priority],
            lora=job.lora,
            slo=_slo(job),
        )
        try:
            resp = await stub.Prefill(req, timeout=job.time_left(self.prefill_timeout))
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, f"prefill {worker.worker_id}") from e
        handle = common.handle_from_pb(resp.kv) if resp.HasField("kv") else None
        others = [
            common.ChoiceStart(common.event_from_pb(c.first), c.generator_state)
            for c in resp.other_choices
        ]
        return PrefillReply(
            common.event_from_pb(resp.first),
            handle,
            resp.generator_state,
            resp.cached_tokens,
            others,
        )

    async def decode(self, worker: Member, call: DecodeCall) -> AsyncIterator[common.Event]:
        stub = worker_pb2_grpc.DecodeStub(self._channel(worker.address))
        job = call.job
        req = decode_request(call)
        stream = stub.Generate(req, timeout=job.time_left())
        try:
            async for msg in stream:
                yield common.event_from_pb(msg)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, f"decode {worker.worker_id}") from e
        finally:
            stream.cancel()  # no-op when finished; frees the decode side on early exit

    async def load_lora(self, worker: Member, name: str, path: str) -> None:
        stub = worker_pb2_grpc.AdaptersStub(self._channel(worker.address))
        req = common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        try:
            await stub.LoadLoraAdapter(req, timeout=ADAPTER_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, f"worker {worker.worker_id}") from e

    async def unload_lora(self, worker: Member, name: str) -> None:
        stub = worker_pb2_grpc.AdaptersStub(self._channel(worker.address))
        req = common_pb2.UnloadLoraAdapterRequest(lora_name=name)
        try:
            await stub.UnloadLoraAdapter(req, timeout=ADAPTER_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, f"worker {worker.worker_id}") from e

    async def embed(
        self, worker: Member, request_id: str, inputs: list[list[int]], lora: str
    ) -> tuple[list[list[float]], int]:
        req = common_pb2.EmbedRequest(request_id=request_id, model=lora)
        for ids in inputs:
            req.inputs.add(token_ids=ids)
        reply = await self._prompt_rpc(worker, "Embed", req)
        return [list(e.values) for e in reply.embeddings], reply.prompt_tokens

    async def prompt_logprobs(
        self, worker: Member, request_id: str, inputs: list[list[int]], k: int, lora: str
    ) -> tuple[list[list[TokenLogprob]], int]:
        req = common_pb2.PromptLogprobsRequest(request_id=request_id, model=lora, top_logprobs=k)
        for ids in inputs:
            req.inputs.add(token_ids=ids)
        reply = await self._prompt_rpc(worker, "PromptLogprobs", req)
        scored = [[common.logprob_from_pb(lp) for lp in p.tokens] for p in reply.prompts]
        return scored, reply.prompt_tokens

    async def _prompt_rpc(self, worker: Member, method: str, req: Any) -> Any:
        """Prefill-only work (``method`` of the Prefill or Decode service, by the worker's role)."""
        channel = self._channel(worker.address)
        stub = (
            worker_pb2_grpc.PrefillStub(channel)
            if worker.role == "prefill"
            else worker_pb2_grpc.DecodeStub(channel)
        )
        try:
            return await getattr(stub, method)(req, timeout=self.prefill_timeout)
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, f"{worker.role} {worker.worker_id}") from e

    async def reserve(self, worker: Member, job: RouteJob, lease: float) -> None:
        stub = worker_pb2_grpc.DecodeStub(self._channel(worker.address))
        req = worker_pb2.ReserveRequest(
            request_id=job.request_id,
            tokens=job.cost,
            priority=common.PRIORITY_TO_PB[job.priority],
            lease_ms=int(lease * 1000),
            slo=_slo(job),
        )
        try:
            await stub.Reserve(req, timeout=job.time_left(RESERVE_TIMEOUT_S))
        except grpc.aio.AioRpcError as e:
            raise map_rpc_error(e, f"decode {worker.worker_id}") from e

    async def unreserve(self, worker: Member, request_id: str) -> None:
        stub = worker_pb2_grpc.DecodeStub(self._channel(worker.address))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await stub.Unreserve(worker_pb2.UnreserveRequest(request_id=request_id), timeout=5)

    async def release(self, handle: common.KVHandle, request_id: str) -> None:
        stub = worker_pb2_grpc.PrefillStub(self._channel(handle.address))
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await stub.Release(worker_pb2.ReleaseRequest(request_id=request_id), timeout=5)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
