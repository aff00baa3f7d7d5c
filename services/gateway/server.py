"""The FastAPI app: OpenAI routes, SSE streaming, error handlers, and disconnect handling.

Request ids, auth and the body limit live in ``edge.EdgeMiddleware``. The client can leave at
three points, and each one aborts the backend request: while a non-streaming request runs
(``_unless_disconnected`` watches ``receive``), before a stream's first event (same), and while
streaming (Starlette cancels the body iterator; ``_SSEResponse`` closes it in every case).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from services.gateway.batch import merge_responses, merged_chunks
from services.gateway.config import GatewayConfig
from services.gateway.core import (
    APIError,
    Backend,
    BackendEvent,
    BackendRequest,
    Generation,
    TokenLogprob,
    check_event,
    collect,
    internal_error,
    unfinished,
)
from services.gateway.edge import EdgeMiddleware, error_response, validation_error
from services.gateway.embeddings import embedding_inputs, embedding_response
from services.gateway.exchange import Exchange
from services.gateway.limits import Limits
from services.gateway.models import Served
from services.gateway.observe import GatewayMetrics, ObserveMiddleware
from services.gateway.openapi import install_openapi
from services.gateway.prepare import Prepared, RoomCheck, prepare_chat, prepare_completions
from services.gateway.responses import TokenText, full_response
from services.gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from services.gateway.stream import stream_chunks
from services.gateway.tokenize import detokenize as detokenize_ids
from services.gateway.tokenize import tokenize as tokenize_ids

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
SESSION_HEADER = "x-session-id"  # sticky-routing key when the body has no ``user``
_GONE: Any = object()  # what _unless_disconnected returns when the client went away
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def create_app(
    config: GatewayConfig,
    backend: Backend,
    tokenizer: Tokenizer,
    lifespan: Any = None,
    metrics: GatewayMetrics | None = None,
    extra_models: Sequence[tuple[GatewayConfig, Tokenizer]] = (),
) -> FastAPI:
    """The gateway's ASGI app: OpenAI routes over ``backend``, tokenizing with ``tokenizer``.
    ``lifespan`` (optional) is FastAPI's: start-up and shutdown work such as closing channels.
    ``metrics`` (optional) records requests, token timings and goodput. ``extra_models``: the
    config and tokenizer of each further base model (``config.model_configs``); a request's
    ``model`` picks one."""
    app = FastAPI(
        title="Tandem gateway",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        # ObserveMiddleware owns the server span (with the request id) and the request metrics;
        # FastAPI's native OpenTelemetry would add a second, unlinked server span.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.add_middleware(EdgeMiddleware, config=config)
    app.add_middleware(ObserveMiddleware, metrics=metrics)  # outermost: sees every answer
    app.state.metrics = metrics
    served = [Served.of(c, t, backend) for c, t in [(config, tokenizer), *extra_models]]
    by_name = {m.name: m for m in served}
    app.state.limits = Limits.from_config(config, list(by_name))
    _add_error_handlers(app)
    install_openapi(app, config.served_model_name)
    started = int(time.time())
    lanes = anyio.CapacityLimiter(config.tokenizer_threads)

    async def prepare(func: Callable[..., T], *args: Any) -> T:
        """``func(*args)`` (templating, tokenizing: CPU work) in a worker thread, at most
        ``--tokenizer-threads`` at once, first come first served."""
        return await anyio.to_thread.run_sync(functools.partial(func, *args), limiter=lanes)

    async def pick(model: str) -> tuple[Served, bool]:
        """(the base model ``model`` runs on, whether it names an adapter of it); the first
        model for an unknown name, whose checks answer 404."""
        if model in by_name:
            return by_name[model], False
        for m in served:
            if await m.catalog.is_adapter(model):
                return m, True
        return served[0], False

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        rid, tenant = request.state.request_id, request.state.tenant
        m, adapter = await pick(body.model)
        base = body.model_copy(update={"model": m.name}) if adapter else body
        room = _room_check(request, m, body)
        p = await prepare(prepare_chat, m.config, m.tokenizer, base, rid, tenant, m.tools, room)
        return await _respond(request, backend, _for_model(p, body.model), m)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest)
        rid, tenant = request.state.request_id, request.state.tenant
        m, adapter = await pick(body.model)
        base = body.model_copy(update={"model": m.name}) if adapter else body
        room = _room_check(request, m, body)
        ps = await prepare(prepare_completions, m.config, m.tokenizer, base, rid, tenant, room)
        ps = [_for_model(p, body.model) for p in ps]
        if not ps[0].generate:
            return await _respond_prompt_only(request, backend, rid, ps, m)
        if len(ps) == 1:
            return await _respond(request, backend, ps[0], m)
        return await _respond_batch(request, backend, rid, ps, m)

    def model_card(m: Served, name: str) -> dict[str, Any]:
        """OpenAI's model object; an adapter's names its base model as ``parent`` (vLLM)."""
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "tandem",
            "root": m.name,
            "parent": None if name == m.name else m.name,
            "max_model_len": m.config.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = []
        for m in served:
            names = [m.name, *await m.catalog.adapters(refresh=True)]
            data += [model_card(m, n) for n in names]
        return {"object": "list", "data": data}

    async def known(model: str) -> Served:
        """The base model of ``model``; 404 when it is neither a base model nor an adapter."""
        m, adapter = await pick(model)
        if model != m.name and not adapter:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return m

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        return model_card(await known(model), model)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        """OpenAI's embeddings, pooled as ``engine.pooling`` says (last token, L2-normalised,
        for a generative model), computed by prefill workers."""
        body = await _parse(request, EmbeddingRequest)
        m = await known(body.model)
        inputs = await prepare(embedding_inputs, m.config, m.tokenizer, body)
        rid, tenant = request.state.request_id, request.state.tenant
        # Metered like a prompt: the tenant's token budget and the gateway's admission.
        flat = tuple(t for ids in inputs for t in ids)
        metered = BackendRequest(rid, flat, SamplingParams(max_tokens=1), tenant, body.model)
        ticket = request.app.state.limits.admit(metered, m.name)
        try:
            vectors, tokens = await backend.embed(rid, body.model, inputs)
        except BaseException:
            ticket.settle(0)
            raise
        ticket.settle(0, prompt_only=True)
        answer = embedding_response(body.model, vectors, tokens, body.encoding_format)
        return JSONResponse(answer, headers=ticket.headers)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's: the ids of a completions prompt or of chat messages, as a request runs them."""
        body = await _parse(request, TokenizeRequest)
        m = await known(body.model) if body.model is not None else served[0]
        args = (m.config, m.tokenizer, m.tools, m.text_of, body)
        return JSONResponse(await prepare(tokenize_ids, *args))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's: the text of token ids."""
        body = await _parse(request, DetokenizeRequest)
        m = await known(body.model) if body.model is not None else served[0]
        return JSONResponse(await prepare(detokenize_ids, m.tokenizer, body))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: load a PEFT adapter folder on every worker; 400 with the reason when it
        cannot be served. With several base models the name is ``BASE/NAME``."""
        _check_lora_updating(config)
        body = await _parse(request, LoadLoraAdapterRequest)
        if body.lora_name in by_name:
            raise APIError(400, "the adapter name is a base model's", param="lora_name")
        await backend.load_lora(body.lora_name, body.lora_path)
        for m in served:
            m.catalog.forget()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: unload an adapter everywhere (404 when not loaded); requests already
        using it finish first."""
        _check_lora_updating(config)
        body = await _parse(request, UnloadLoraAdapterRequest)
        await backend.unload_lora(body.lora_name)
        for m in served:
            m.catalog.forget()
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health() -> Response:
        """Readiness: 200 once, for every served base model, a router can route to a live
        decode worker of it, else 503 with the reasons (load balancers and Kubernetes send
        traffic only on 200). ``models`` says, per model, ``ready`` or why not."""

        async def one(model: str) -> str | None:
            with anyio.move_on_after(HEALTH_TIMEOUT_S):
                try:
                    return await backend.readiness(model)
                except Exception as e:
                    log.warning("backend health check of %s failed", model, exc_info=True)
                    return f"health check failed: {type(e).__name__}"
            return "no answer from the routers in time"

        names = list(by_name)
        found = dict(zip(names, await asyncio.gather(*map(one, names)), strict=True))
        models = {name: why or "ready" for name, why in found.items()}
        reasons = [why for why in found.values() if why is not None]
        if not reasons:
            return JSONResponse({"status": "ok", "models": models})
        body = {"status": "unavailable", "reason": "; ".join(reasons), "models": models}
        return JSONResponse(body, status_code=503)

    @app.get("/livez")
    async def livez() -> Response:
        """Liveness: the process serves HTTP (restart it when this fails)."""
        return JSONResponse({"status": "ok"})

    return app


# --- Running a request ------------------------------------------------------------------------


async def _respond(request: Request, backend: Backend, p: Prepared, m: Served) -> Response:
    """Run ``p`` on the backend for base model ``m`` and answer, top to bottom: admit (429 past
    a limit: the tenant's, or ``m``'s share of the gateway's tokens in flight), then a
    JSON body once every event is in, or an SSE stream once the first event is (so a failure to
    start gets a real HTTP status instead of an error inside a 200). The exchange is closed, and
    so settled, however this ends; the backend is aborted if the client leaves at any point.
    An ``X-Session-Id`` header is the sticky-routing key of a request whose body names no
    ``user``."""
    req = _with_session(p.backend_request, request.headers.get(SESSION_HEADER, ""))
    app = request.app.state
    exchange = Exchange.open(app.limits, backend, req, app.metrics, m.name)
    text_of = m.text_of
    if not p.stream:
        try:
            got = await _unless_disconnected(
                request, _and_scores(collect(exchange.events, req.sampling.n), backend, [p])
            )
        finally:
            await exchange.close()
        if got is _GONE:
            return Response(status_code=499)
        gens, (scored,) = got
        return JSONResponse(full_response(p, gens, text_of, scored), headers=exchange.headers)
    try:
        got = await _unless_disconnected(
            request, _and_scores(anext(exchange.events, None), backend, [p])
        )
        if got is not _GONE:
            first, (scored,) = got
            if first is None:
                raise unfinished()
            check_event(first)
    except BaseException:
        await exchange.close()
        raise
    if got is _GONE:
        await exchange.close()
        return Response(status_code=499)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **exchange.headers}
    return _SSEResponse(
        [exchange], _sse(p, first, exchange.events, text_of, scored),
        media_type="text/event-stream", headers=headers,
    )  # fmt: skip


async def _respond_batch(
    request: Request, backend: Backend, request_id: str, ps: list[Prepared], m: Served
) -> Response:
    """`_respond` for a batch of prompts (`services.gateway.batch`): every prompt is admitted
    before any runs (a refusal closes those admitted and answers with it), they run at once,
    and a stream starts once each prompt's first event is in."""
    app = request.app.state
    session = request.headers.get(SESSION_HEADER, "")
    exchanges: list[Exchange] = []

    async def close_all() -> None:
        for e in exchanges:
            await e.close()

    try:
        for p in ps:
            req = _with_session(p.backend_request, session)
            exchanges.append(Exchange.open(app.limits, backend, req, app.metrics, m.name))
    except BaseException:
        await close_all()
        raise
    headers = exchanges[-1].headers  # the rate-limit headers after the last admission
    n = ps[0].n
    if not ps[0].stream:
        try:
            runs = [
                collect(e.events, p.backend_request.sampling.n)
                for e, p in zip(exchanges, ps, strict=True)
            ]
            got = await _unless_disconnected(request, _and_scores(_all(runs), backend, ps))
        finally:
            await close_all()
        if got is _GONE:
            return Response(status_code=499)
        all_gens, scores = got
        answers = [
            full_response(p, gens, m.text_of, scored)
            for p, gens, scored in zip(ps, all_gens, scores, strict=True)
        ]
        return JSONResponse(merge_responses(request_id, answers, n), headers=headers)
    try:
        got = await _unless_disconnected(
            request, _and_scores(_all([anext(e.events, None) for e in exchanges]), backend, ps)
        )
        if got is not _GONE:
            firsts, scores = got
            for first in firsts:
                if first is None:
                    raise unfinished()
                check_event(first)
    except BaseException:
        await close_all()
        raise
    if got is _GONE:
        await close_all()
        return Response(status_code=499)
    parts = [
        stream_chunks(p, e.events, m.text_of, first, scored)
        for p, e, first, scored in zip(ps, exchanges, firsts, scores, strict=True)
    ]
    chunks = merged_chunks(request_id, parts, n)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
    return _SSEResponse(
        exchanges, _sse_lines(request_id, chunks), media_type="text/event-stream",
        headers=headers,
    )  # fmt: skip


async def _respond_prompt_only(
    request: Request, backend: Backend, request_id: str, ps: list[Prepared], m: Served
) -> Response:
    """Completions' ``echo`` with ``max_tokens`` 0: each prompt answered alone, with its
    tokens' logprobs where asked (one scoring pass of every prompt), metered like embeddings
    (a prompt with no completion)."""
    req = ps[0].backend_request
    flat = tuple(t for p in ps for t in p.backend_request.token_ids)
    metered = BackendRequest(request_id, flat, SamplingParams(max_tokens=1), req.tenant, req.model)
    ticket = request.app.state.limits.admit(metered, m.name)
    try:
        scores = await _unless_disconnected(request, _prompt_scores(backend, ps))
    except BaseException:
        ticket.settle(0)
        raise
    ticket.settle(0, prompt_only=True)
    if scores is _GONE:
        return Response(status_code=499)
    answers = [
        full_response(
            p, [Generation(finish_reason="length") for _ in range(p.n)], m.text_of, scored
        )
        for p, scored in zip(ps, scores, strict=True)
    ]
    body = answers[0] if len(ps) == 1 else merge_responses(request_id, answers, ps[0].n)
    return JSONResponse(body, headers=ticket.headers)


async def _prompt_scores(
    backend: Backend, ps: list[Prepared]
) -> list[Sequence[TokenLogprob] | None]:
    """Each prompt's scoring pass (``Prepared.score_k``; None where none is needed), all in one
    backend call."""
    k = ps[0].score_k
    if k is None:
        return [None] * len(ps)
    req = ps[0].backend_request
    inputs = [list(p.backend_request.token_ids) for p in ps]
    scored, _ = await backend.prompt_logprobs(req.request_id, req.model, inputs, k)
    return list(scored)


async def _and_scores(
    aw: Awaitable[T], backend: Backend, ps: list[Prepared]
) -> tuple[T, list[Sequence[TokenLogprob] | None]]:
    """``aw`` and, at the same time, the prompts' scoring pass (`_prompt_scores`)."""
    if ps[0].score_k is None:
        return await aw, [None] * len(ps)
    got, scores = await _all([aw, _prompt_scores(backend, ps)])
    return got, scores  # type: ignore[return-value]


async def _all(aws: list[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels and awaits the others when one fails (or this is
    cancelled), so that none still runs inside a generator that is closed next."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):  # a disconnect's scope cancels again and again
            await asyncio.gather(*tasks, return_exceptions=True)


def _check_lora_updating(config: GatewayConfig) -> None:
    if not config.allow_runtime_lora_updating:
        raise APIError(
            403,
            "loading and unloading LoRA adapters at run time is off on this gateway "
            "(--allow-runtime-lora-updating)",
            "permission_error",
        )


def _for_model(p: Prepared, model: str) -> Prepared:
    """``p`` running on ``model`` (an adapter name, or the base model's unchanged)."""
    if model == p.backend_request.model:
        return p
    return dataclasses.replace(
        p, backend_request=dataclasses.replace(p.backend_request, model=model)
    )


def _room_check(
    request: Request, m: Served, body: ChatCompletionRequest | CompletionRequest
) -> RoomCheck:
    """The check ``prepare`` runs before templating and tokenizing (in the worker thread, when
    it gets there): 429 when the routers just refused requests at least as large."""
    limits: Limits = request.app.state.limits
    return functools.partial(limits.check_room, m.name, body.model, body.priority or "interactive")


def _with_session(req: BackendRequest, session: str) -> BackendRequest:
    session = session[:256]
    return dataclasses.replace(req, session=session) if session and not req.session else req


async def _sse(
    p: Prepared,
    first: BackendEvent,
    events: AsyncGenerator[BackendEvent, None],
    text_of: TokenText,
    scored: Sequence[TokenLogprob] | None = None,
) -> AsyncGenerator[str, None]:
    """SSE lines of a streamed response (`_sse_lines`)."""
    chunks = stream_chunks(p, events, text_of, first, scored)
    async with aclosing(events), aclosing(_sse_lines(p.request_id, chunks)) as lines:
        async for line in lines:
            yield line


async def _sse_lines(
    request_id: str, chunks: AsyncGenerator[dict[str, Any], None]
) -> AsyncGenerator[str, None]:
    """SSE lines of ``chunks`` (closed at the end). An error after the stream started is sent
    as a ``data: {"error": ...}`` event, then ``[DONE]``."""
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception:
            log.exception("stream of %s failed", request_id)
            yield f"data: {json.dumps(internal_error().body())}\n\n"
    yield "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """Closes its body generator and the exchange behind it however the response ends (done,
    disconnect, cancellation), so the generation is aborted and settled at once instead of
    whenever it is collected."""

    def __init__(self, exchanges: list[Exchange], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.exchanges = exchanges

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _close(self.body_iterator)  # type: ignore[arg-type]
            for exchange in self.exchanges:
                await exchange.close()


async def _close(gen: Any) -> None:
    with anyio.CancelScope(shield=True):
        await gen.aclose()


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await ``aw``, cancelling it if the client disconnects first (then return ``_GONE``)."""
    done = False
    with anyio.CancelScope() as scope:

        def on_disconnect(task: asyncio.Task[None]) -> None:
            if not task.cancelled():
                task.exception()  # retrieved: a failing receive also means the client is gone
                if not done:
                    scope.cancel()

        watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
        watcher.add_done_callback(on_disconnect)
        try:
            return await aw
        finally:
            done = True
            watcher.cancel()
    return _GONE


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _parse(request: Request, model: type[M]) -> M:
    """Validate the body as JSON of ``model`` whatever the Content-Type (curl's -d sends a form
    type); errors go through the RequestValidationError handler like FastAPI's own."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_context=False)) from e


# --- Errors -------------------------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        if exc.status >= 500:
            log.warning("request %s failed: %s", request.state.request_id, exc.message)
        return error_response(exc)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(list(exc.errors())))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err = APIError(
            exc.status_code,
            str(exc.detail),
            "invalid_request_error" if exc.status_code < 500 else "server_error",
        )
        return error_response(err)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
