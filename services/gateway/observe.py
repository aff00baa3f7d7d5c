"""What the gateway measures and traces: the request counter by route, status, finish reason
and tenant; TTFT, inter-token latency, TPOT and end-to-end histograms; tokens in and out per
tenant; goodput against the configured SLOs; and one server span per HTTP request, whose trace
context the router call carries on.

`ObserveMiddleware` (outermost ASGI layer) owns the request: its start time, span and the final
counter; `observe_generation` wraps the backend's event stream of one generation and records
the token timings into the same `RequestRecord`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.core import BackendEvent, BackendRequest
from services.observability import tracing
from services.observability.metrics import LATENCY_BUCKETS

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
FINISHED = ("stop", "length")
FIRST_TOKEN = "first_token"  # event on a request's span when its first token arrived


def route_of(path: str) -> str:
    """The route label of a path: one of `ROUTES` (``/v1/models/{id}`` is ``/v1/models``)."""
    for route in ROUTES:
        if path == route or path.startswith(route + "/"):
            return route
    return "other"


def tenant_label(tenant: str) -> str:
    return tenant or "default"


class GatewayMetrics:
    """The gateway's metrics on ``registry``; SLOs in seconds decide goodput."""

    def __init__(self, registry: CollectorRegistry, slo_ttft_s: float, slo_tpot_s: float) -> None:
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        Info("tandem_gateway_slo", "SLO thresholds that goodput is counted against (value 1).",
             registry=registry).info({"ttft_seconds": str(slo_ttft_s),
                                      "tpot_seconds": str(slo_tpot_s)})  # fmt: skip

        def hist(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=registry)

        self.requests = Counter(
            "tandem_gateway_requests",
            "HTTP requests answered, by route, status, finish reason (none when no generation "
            "finished) and tenant.",
            ["route", "status", "finish_reason", "tenant"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "tandem_gateway_requests_in_flight", "HTTP requests being served.", registry=registry
        )
        self.ttft = hist(
            "tandem_gateway_time_to_first_token_seconds",
            "Time from the request's arrival to its first token.",
        )
        self.itl = hist(
            "tandem_gateway_inter_token_latency_seconds",
            "Time between consecutive token events of a generation.",
        )
        self.tpot = hist(
            "tandem_gateway_time_per_output_token_seconds",
            "(end to end - TTFT) / (output tokens - 1) of finished generations.",
        )
        self.e2e = hist(
            "tandem_gateway_e2e_request_latency_seconds",
            "Arrival to last token of finished generations, by tenant.",
            ("tenant",),
        )
        self.input_tokens = Counter(
            "tandem_gateway_input_tokens", "Prompt tokens by tenant.", ["tenant"], registry=registry
        )
        self.output_tokens = Counter(
            "tandem_gateway_output_tokens",
            "Generated tokens by tenant.",
            ["tenant"],
            registry=registry,
        )
        self.goodput = Counter(
            "tandem_gateway_goodput_requests",
            "Finished generations that met both their SLOs (TTFT and TPOT: the request's own, "
            "its tenant's, or the defaults of tandem_gateway_slo_info).",
            registry=registry,
        )  # fmt: skip


@dataclass(slots=True)
class RequestRecord:
    """One HTTP request as the middleware and the generation wrapper see it."""

    start: float
    finish_reason: str = "none"


_RECORD: ContextVar[RequestRecord | None] = ContextVar("tandem_gateway_request", default=None)


class ObserveMiddleware:
    """Outermost pure ASGI middleware for ``/v1/`` requests: server span (continuing a caller's
    W3C ``traceparent``) and the request counter, recorded once the response has ended."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        route = route_of(scope["path"])
        record = RequestRecord(time.monotonic())
        token = _RECORD.set(record)
        status = 500  # what the client gets if nothing is sent

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        parent = tracing.extract(dict(Headers(scope=scope))) if tracing.enabled() else None
        name = f"{scope['method']} {route}"
        attrs = {"http.request.method": scope["method"], "http.route": route}
        if self.metrics is not None:
            self.metrics.in_flight.inc()
        try:
            with tracing.span(
                name, kind=trace.SpanKind.SERVER, parent=parent, attributes=attrs
            ) as s:
                try:
                    await self.app(scope, receive, send_status)
                finally:
                    state = scope.get("state", {})
                    if s is not None:
                        s.set_attribute(tracing.REQUEST_ID_ATTR, state.get("request_id", ""))
                        s.set_attribute("http.response.status_code", status)
        finally:
            _RECORD.reset(token)
            if self.metrics is not None:
                self.metrics.in_flight.dec()
                tenant = tenant_label(scope.get("state", {}).get("tenant", ""))
                self.metrics.requests.labels(route, str(status), record.finish_reason, tenant).inc()


async def observe_generation(
    events: AsyncGenerator[BackendEvent, None], req: BackendRequest, metrics: GatewayMetrics | None
) -> AsyncGenerator[BackendEvent, None]:
    """``events`` unchanged, timed: TTFT from the request's arrival, the gap before each later
    token event, and at the end tokens per tenant, TPOT, end to end and goodput."""
    record = _RECORD.get() or RequestRecord(time.monotonic())
    first = last = 0.0
    n_out = 0
    with tracing.request_context(req.request_id):
        try:
            async with aclosing(events):
                async for ev in events:
                    if ev.token_ids and n_out == 0:
                        tracing.event(FIRST_TOKEN)  # the request's span: where TTFT ended
                    if ev.token_ids and metrics is not None:
                        now = time.monotonic()
                        if n_out == 0:
                            first = now
                            metrics.ttft.observe(now - record.start)
                        else:
                            metrics.itl.observe(now - last)
                        last = now
                    n_out += len(ev.token_ids)
                    if ev.finish_reason is not None:
                        record.finish_reason = ev.finish_reason
                    yield ev
        finally:  # also when the client left: the tokens were generated all the same
            if metrics is not None:
                _finished(metrics, record, req, n_out, first, last)


def _finished(
    m: GatewayMetrics, record: RequestRecord, req: BackendRequest, n_out: int, first: float,
    last: float,
) -> None:  # fmt: skip
    tenant = tenant_label(req.tenant)
    m.input_tokens.labels(tenant).inc(len(req.token_ids))
    m.output_tokens.labels(tenant).inc(n_out)
    if record.finish_reason not in FINISHED or n_out == 0:
        return
    ttft = first - record.start
    m.e2e.labels(tenant).observe(last - record.start)
    tpot = (last - first) / (n_out - 1) if n_out > 1 else 0.0
    if n_out > 1:
        m.tpot.observe(tpot)
    slo_ttft = req.slo_ttft_ms / 1000 if req.slo_ttft_ms > 0 else m.slo_ttft_s
    slo_tpot = req.slo_tpot_ms / 1000 if req.slo_tpot_ms > 0 else m.slo_tpot_s
    if ttft <= slo_ttft and tpot <= slo_tpot:
        m.goodput.inc()
