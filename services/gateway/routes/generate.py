"""``/v1/chat/completions`` and ``/v1/completions``: prepare (template, tokenize, check), admit,
run on the backend, and answer as JSON once every event is in, or as an SSE stream once the
first one is (so a failure to start gets a real HTTP status, not an error inside a 200).

Every exchange is closed, and so settled, however a request ends; the backend is aborted if
the client leaves at any point. An ``X-Session-Id`` header is the sticky-routing key of a
request whose body names no ``user``; its latency objectives come from its body, headers,
tenant or the gateway's defaults (`services.gateway.slo`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncGenerator, Awaitable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from engine.sampling_params import SamplingParams
from services.gateway.batch import merge_responses, merged_chunks
from services.gateway.core import (
    BackendEvent,
    BackendRequest,
    Generation,
    TokenLogprob,
    check_event,
    collect,
    unfinished,
)
from services.gateway.exchange import Exchange
from services.gateway.http import (
    GONE,
    SSE_HEADERS,
    SSEResponse,
    gather_all,
    parse,
    sse_lines,
    unless_disconnected,
)
from services.gateway.models import Served
from services.gateway.prepare import Prepared, RoomCheck, prepare_chat, prepare_completions
from services.gateway.responses import full_response
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.slo import Slo, request_slo
from services.gateway.state import Gateway, gateway
from services.gateway.stream import stream_chunks
from services.observability import tracing

SESSION_HEADER = "x-session-id"  # sticky-routing key when the body has no ``user``
PREPARED = "prepared"  # event on a request's span: templated, tokenized and checked
T = TypeVar("T")
Scores = list[Sequence[TokenLogprob] | None]
router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    g = gateway(request)
    body = await parse(request, ChatCompletionRequest)
    slo = _slo(request, g, body)
    m, base = await _base(g, body)
    rid, tenant, room = request.state.request_id, request.state.tenant, _room(g, m, body)
    p = await g.prepare(prepare_chat, m.config, m.tokenizer, base, rid, tenant, m.tools, room)
    tracing.event(PREPARED)
    return await _respond(request, g, [_for_model(p, body.model)], m, slo)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    g = gateway(request)
    body = await parse(request, CompletionRequest)
    slo = _slo(request, g, body)
    m, base = await _base(g, body)
    rid, tenant, room = request.state.request_id, request.state.tenant, _room(g, m, body)
    ps = await g.prepare(prepare_completions, m.config, m.tokenizer, base, rid, tenant, room)
    tracing.event(PREPARED)
    ps = [_for_model(p, body.model) for p in ps]
    if not ps[0].generate:
        return await _respond_prompt_only(request, g, ps, m)
    return await _respond(request, g, ps, m, slo)


async def _base(g: Gateway, body: Any) -> tuple[Served, Any]:
    """The base model of ``body.model`` and the body as that model prepares it."""
    m, adapter = await g.pick(body.model)
    return m, body.model_copy(update={"model": m.name}) if adapter else body


async def _respond(
    request: Request, g: Gateway, ps: list[Prepared], m: Served, slo: Slo
) -> Response:
    """Run the prompts ``ps`` (one, or a batch: `services.gateway.batch`) for base model ``m``
    under the objectives ``slo``: every prompt admitted before any runs (a refusal closes
    those admitted and answers with it: 429 past a limit), then a JSON body or an event
    stream."""
    session = request.headers.get(SESSION_HEADER, "")
    exchanges: list[Exchange] = []
    try:
        for p in ps:
            req = _with_session(p.backend_request, session)
            req = dataclasses.replace(req, slo_ttft_ms=slo.ttft_ms, slo_tpot_ms=slo.tpot_ms)
            exchanges.append(Exchange.open(g.limits, g.backend, req, g.metrics, m.name))
    except BaseException:
        await _close_all(exchanges)
        raise
    headers = exchanges[-1].headers  # the rate-limit headers after the last admission
    if ps[0].stream:
        return await _stream(request, g, exchanges, ps, m, headers)
    return await _json(request, g, exchanges, ps, m, headers)


async def _json(
    request: Request, g: Gateway, exchanges: list[Exchange], ps: list[Prepared], m: Served,
    headers: dict[str, str],
) -> Response:  # fmt: skip
    pairs = zip(exchanges, ps, strict=True)
    runs = [collect(e.events, p.backend_request.sampling.n) for e, p in pairs]
    try:
        got = await unless_disconnected(request, _and_scores(gather_all(runs), g, ps))
    finally:
        await _close_all(exchanges)
    if got is GONE:
        return Response(status_code=499)
    all_gens, scores = got
    answers = [
        full_response(p, gens, m.text_of, scored)
        for p, gens, scored in zip(ps, all_gens, scores, strict=True)
    ]
    rid = request.state.request_id  # a batch's prompts run as rid-0, rid-1, ...
    body = answers[0] if len(ps) == 1 else merge_responses(rid, answers, ps[0].n)
    return JSONResponse(body, headers=headers)


async def _stream(
    request: Request, g: Gateway, exchanges: list[Exchange], ps: list[Prepared], m: Served,
    headers: dict[str, str],
) -> Response:  # fmt: skip
    firsts = [anext(e.events, None) for e in exchanges]
    try:
        got = await unless_disconnected(request, _and_scores(gather_all(firsts), g, ps))
        if got is not GONE:
            for first in got[0]:
                if first is None:
                    raise unfinished()
                check_event(first)
    except BaseException:
        await _close_all(exchanges)
        raise
    if got is GONE:
        await _close_all(exchanges)
        return Response(status_code=499)
    events, scores = got
    parts = [
        stream_chunks(p, e.events, m.text_of, first, scored)
        for p, e, first, scored in zip(ps, exchanges, events, scores, strict=True)
    ]
    if len(ps) == 1:
        body = _sse(ps[0].request_id, exchanges[0].events, parts[0])
    else:
        rid = request.state.request_id  # a batch's prompts run as rid-0, rid-1, ...
        body = sse_lines(rid, merged_chunks(rid, parts, ps[0].n))
    return SSEResponse(exchanges, body, {**SSE_HEADERS, **headers})


async def _sse(
    request_id: str,
    events: AsyncGenerator[BackendEvent, None],
    chunks: AsyncGenerator[dict[str, Any], None],
) -> AsyncGenerator[str, None]:
    """SSE lines of one prompt's ``chunks``, closing its backend ``events`` too."""
    async with aclosing(events), aclosing(sse_lines(request_id, chunks)) as lines:
        async for line in lines:
            yield line


async def _respond_prompt_only(
    request: Request, g: Gateway, ps: list[Prepared], m: Served
) -> Response:
    """Completions' ``echo`` with ``max_tokens`` 0: each prompt answered alone, with its
    tokens' logprobs where asked (one scoring pass of every prompt), metered like embeddings
    (a prompt with no completion)."""
    req, request_id = ps[0].backend_request, request.state.request_id
    flat = tuple(t for p in ps for t in p.backend_request.token_ids)
    metered = BackendRequest(request_id, flat, SamplingParams(max_tokens=1), req.tenant, req.model)
    ticket = g.limits.admit(metered, m.name)
    try:
        scores = await unless_disconnected(request, _prompt_scores(g, ps))
    except BaseException:
        ticket.settle(0)
        raise
    ticket.settle(0, prompt_only=True)
    if scores is GONE:
        return Response(status_code=499)
    empty = [Generation(finish_reason="length") for _ in range(ps[0].n)]
    answers = [full_response(p, empty, m.text_of, s) for p, s in zip(ps, scores, strict=True)]
    body = answers[0] if len(ps) == 1 else merge_responses(request_id, answers, ps[0].n)
    return JSONResponse(body, headers=ticket.headers)


async def _prompt_scores(g: Gateway, ps: list[Prepared]) -> Scores:
    """Each prompt's scoring pass (``Prepared.score_k``; None where none is needed), all in one
    backend call."""
    k = ps[0].score_k
    if k is None:
        return [None] * len(ps)
    req = ps[0].backend_request
    inputs = [list(p.backend_request.token_ids) for p in ps]
    scored, _ = await g.backend.prompt_logprobs(req.request_id, req.model, inputs, k)
    return list(scored)


async def _and_scores(aw: Awaitable[T], g: Gateway, ps: list[Prepared]) -> tuple[T, Scores]:
    """``aw`` and, at the same time, the prompts' scoring pass (`_prompt_scores`)."""
    if ps[0].score_k is None:
        return await aw, [None] * len(ps)
    got, scores = await gather_all([aw, _prompt_scores(g, ps)])
    return got, scores  # type: ignore[return-value]


async def _close_all(exchanges: list[Exchange]) -> None:
    for e in exchanges:
        await e.close()


def _for_model(p: Prepared, model: str) -> Prepared:
    """``p`` running on ``model`` (an adapter name, or the base model's unchanged)."""
    if model == p.backend_request.model:
        return p
    return dataclasses.replace(
        p, backend_request=dataclasses.replace(p.backend_request, model=model)
    )


def _room(g: Gateway, m: Served, body: ChatCompletionRequest | CompletionRequest) -> RoomCheck:
    """The check ``prepare`` runs before templating and tokenizing (in the worker thread, when
    it gets there): 429 when the routers just refused requests at least as large."""
    priority = body.priority or "interactive"
    return functools.partial(g.limits.check_room, m.name, body.model, priority)


def _slo(request: Request, g: Gateway, body: ChatCompletionRequest | CompletionRequest) -> Slo:
    """The request's objectives (`services.gateway.slo.request_slo`): 400 when invalid."""
    tenant = g.tenant_slos.get(request.state.tenant)
    return request_slo(g.default_slo, tenant, request.headers, body.slo_ttft_ms, body.slo_tpot_ms)


def _with_session(req: BackendRequest, session: str) -> BackendRequest:
    session = session[:256]
    return dataclasses.replace(req, session=session) if session and not req.session else req
