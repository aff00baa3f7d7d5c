"""The gateway's only contact with generated code: core types <-> ``tandem.v1`` messages, router,
decode worker and health stubs, and the one table that turns gRPC status codes into HTTP
errors."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2_grpc

from services.common.codec import PRIORITY_TO_PB, sampling_to_pb, stop_reason_from_pb
from services.common.errors import RETRY_AFTER_MS_KEY, ROOM_TOKENS_KEY
from services.gateway.core import (
    APIError,
    BackendEvent,
    BackendRequest,
    TokenLogprob,
    Usage,
)
from services.gateway.limits import Overloaded

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}

# grpc status -> (HTTP status, OpenAI error type, error code)
STATUS_MAP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error", None),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "server_overloaded"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", None),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
}
_INTERNAL = (500, "server_error", "internal_error")
DEFAULT_RETRY_AFTER_S = "1"
_SERVER_MESSAGES = {
    503: "The service has no capacity for this request right now (no worker or router "
    "available); retry later.",
    504: "The request did not finish in time.",
}


def _overloaded(message: str, metadata: Sequence[tuple[str, str | bytes]]) -> Overloaded:
    """The 429 of a RESOURCE_EXHAUSTED status: its wait from the ``retry-after-ms`` (or
    ``retry-after``, seconds) trailer, 1 s without one; the room left from ``room-tokens``."""
    trailers = {k.lower(): str(v) for k, v in metadata}
    ms, secs = trailers.get(RETRY_AFTER_MS_KEY, ""), trailers.get("retry-after", "")
    secs = secs if secs.isdigit() else DEFAULT_RETRY_AFTER_S
    wait = int(ms) if ms.isdigit() else 1000 * int(secs)
    room = trailers.get(ROOM_TOKENS_KEY, "")
    return Overloaded(message, wait, int(room) if room.isdigit() else None)


def encode_request(req: BackendRequest) -> router_pb2.GenerateRequest:
    """BackendRequest -> GenerateRequest with a token-id prompt."""
    return router_pb2.GenerateRequest(
        request_id=req.request_id,
        token_ids=router_pb2.TokenIds(ids=list(req.token_ids)),
        sampling=sampling_to_pb(req.sampling),
        tenant=req.tenant,
        model=req.model,
        priority=PRIORITY_TO_PB[req.priority],
        session=req.session,
        slo=common_pb2.Slo(ttft_ms=req.slo_ttft_ms, tpot_ms=req.slo_tpot_ms),
    )


def decode_event(ev: common_pb2.TokenEvent) -> BackendEvent:
    """TokenEvent -> BackendEvent (usage only when the event carries it)."""
    usage = None
    if ev.HasField("usage"):
        u = ev.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    return BackendEvent(
        token_ids=tuple(ev.token_ids),
        text=ev.text,
        logprobs=tuple(_logprob(lp) for lp in ev.logprobs),
        finish_reason=_FINISH.get(ev.finish_reason),
        stop_reason=stop_reason_from_pb(ev),
        usage=usage,
        index=ev.index,
    )


def _logprob(lp: common_pb2.TokenLogprob) -> TokenLogprob:
    top = tuple((t.token_id, t.logprob) for t in lp.top)
    return TokenLogprob(lp.token_id, lp.logprob, top, lp.rank)


def abort_request(request_id: str) -> common_pb2.AbortRequest:
    return common_pb2.AbortRequest(request_id=request_id)


def router_stub(channel: grpc.aio.Channel) -> router_pb2_grpc.RouterStub:
    return router_pb2_grpc.RouterStub(channel)


async def health_check(channel: grpc.aio.Channel, service: str, timeout: float) -> str | None:
    """None when the server reports grpc.health.v1 ``service`` SERVING (or has no health
    service at all), else why not: ``not serving``, ``unknown`` (it does not publish that
    service) or ``unreachable``."""
    try:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        return "unknown" if e.code() == grpc.StatusCode.NOT_FOUND else "unreachable"
    return None if resp.status == health_pb2.HealthCheckResponse.SERVING else "not serving"


def http_error(
    code: grpc.StatusCode, details: str | None, metadata: Sequence[tuple[str, str | bytes]] = ()
) -> APIError:
    """The client-facing error for a failed router call. 429 (every worker at capacity) carries
    ``Retry-After`` in seconds and ``retry-after-ms`` (`_overloaded`). Details of 5xx failures
    stay inside."""
    status, type_, err_code = STATUS_MAP.get(code, _INTERNAL)
    if status < 500:  # the client's problem: say what the router said
        message = details or code.name.lower().replace("_", " ")
    else:  # ours: keep internal addresses and state out of the answer (the backend logs it)
        message = _SERVER_MESSAGES.get(status, "internal server error")
    if status == 429:
        return _overloaded(message, metadata)
    return APIError(status, message, type_, code=err_code)


def list_models_request() -> common_pb2.ListModelsRequest:
    return common_pb2.ListModelsRequest()


def adapters_of(reply: common_pb2.ListModelsResponse) -> dict[str, str]:
    """The adapters (models with a parent) of a ListModels reply, with their parents."""
    return {m.id: m.parent for m in reply.models if m.parent}


def load_lora_request(name: str, path: str) -> common_pb2.LoadLoraAdapterRequest:
    return common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)


def unload_lora_request(name: str) -> common_pb2.UnloadLoraAdapterRequest:
    return common_pb2.UnloadLoraAdapterRequest(lora_name=name)


def embed_request(request_id: str, model: str, inputs: list[list[int]]) -> common_pb2.EmbedRequest:
    req = common_pb2.EmbedRequest(request_id=request_id, model=model)
    for ids in inputs:
        req.inputs.add(token_ids=ids)
    return req


def embeddings_of(reply: common_pb2.EmbedResponse) -> tuple[list[list[float]], int]:
    return [list(e.values) for e in reply.embeddings], reply.prompt_tokens


def prompt_logprobs_request(
    request_id: str, model: str, inputs: list[list[int]], k: int
) -> common_pb2.PromptLogprobsRequest:
    req = common_pb2.PromptLogprobsRequest(request_id=request_id, model=model, top_logprobs=k)
    for ids in inputs:
        req.inputs.add(token_ids=ids)
    return req


def prompt_logprobs_of(
    reply: common_pb2.PromptLogprobsResponse,
) -> tuple[list[list[TokenLogprob]], int]:
    return [[_logprob(lp) for lp in p.tokens] for p in reply.prompts], reply.prompt_tokens


def route_request(msg: router_pb2.GenerateRequest) -> router_pb2.RouteReport:
    """The first message of a Route call: the request."""
    return router_pb2.RouteReport(request=msg)


def leg_started() -> router_pb2.RouteReport:
    return router_pb2.RouteReport(started=router_pb2.LegStarted())


def leg_ended(
    token_ids: list[int], moved: common_pb2.MovedKV | None, error: grpc.aio.AioRpcError | None
) -> router_pb2.RouteReport:
    """How a decode leg ended: choice 0's ``token_ids`` it streamed, the worker's hand-over
    (``moved``) or its failure (``error``, with its wait and room when it refused for capacity);
    neither: it finished."""
    end = router_pb2.LegEnded(token_ids=token_ids)
    if moved is not None:
        end.moved.CopyFrom(moved)
    if error is not None:
        end.code, end.details = error.code().value[0], error.details() or ""
        trailers = {k.lower(): str(v) for k, v in error.trailing_metadata() or ()}
        wait, room = (trailers.get(k, "") for k in (RETRY_AFTER_MS_KEY, ROOM_TOKENS_KEY))
        if wait.isdigit():
            end.retry_after_ms = int(wait)
        if room.isdigit():
            end.room_tokens = int(room)
    return router_pb2.RouteReport(ended=end)


def decode_stub(channel: grpc.aio.Channel) -> worker_pb2_grpc.DecodeStub:
    return worker_pb2_grpc.DecodeStub(channel)
