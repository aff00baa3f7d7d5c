"""OpenTelemetry traces: setup per process, W3C trace context in gRPC metadata, and the request
id and trace id on every log line.

Tracing is off unless an OTLP endpoint (production) or a trace file (JSON lines, for tests and
local debugging) is configured; then `span` returns a null context and channels get no
interceptor, so an untraced process pays nothing. The request id travels as the span attribute
``tandem.request_id`` and in the `REQUEST_ID` context variable that the log filter reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

REQUEST_ID: ContextVar[str] = ContextVar("tandem_request_id", default="")
REQUEST_ID_ATTR = "tandem.request_id"
_PROPAGATOR = TraceContextTextMapPropagator()
# The process's tracer, None while tracing is off. Kept here rather than as OpenTelemetry's
# global provider, which can be set only once per process (tests set up and shut down several).
_state: dict[str, Any] = {"tracer": None, "provider": None}


def enabled() -> bool:
    """Whether this process records spans."""
    return _state["tracer"] is not None


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (tests, local debugging)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by shutdown
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans]
        with self._lock:
            self._file.writelines(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as plain JSON-able data (ids in hex, as trace UIs show them)."""
    ctx = span.get_span_context()
    assert ctx is not None
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name", ""),
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent else "",
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": {e.name: e.timestamp for e in span.events},  # name -> ns (the first of each)
    }


@dataclass
class Tracing:
    """This process's tracer provider (None when tracing is off)."""

    provider: TracerProvider | None = None

    def shutdown(self) -> None:
        """Flush spans still buffered, stop the exporters, and turn tracing off."""
        if self.provider is not None:
            self.provider.shutdown()
            if _state["provider"] is self.provider:
                _state.update(tracer=None, provider=None)


def setup_tracing(
    service: str,
    otlp_endpoint: str = "",
    trace_file: str = "",
    exporter: SpanExporter | None = None,
    **attributes: str,
) -> Tracing:
    """Start tracing for a process named ``tandem-<service>``: batched OTLP over gRPC to
    ``otlp_endpoint`` and/or JSON lines appended to ``trace_file`` (and/or ``exporter``, e.g.
    an in-memory one in tests). With none of them, tracing stays off."""
    if not otlp_endpoint and not trace_file and exporter is None:
        return Tracing()
    resource = Resource.create({"service.name": f"tandem-{service}", **attributes})
    provider = TracerProvider(resource=resource)
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    if trace_file:
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(trace_file)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _state.update(tracer=provider.get_tracer("tandem"), provider=provider)
    return Tracing(provider)


def tracer() -> trace.Tracer:
    return _state["tracer"] or trace.get_tracer("tandem")


@contextlib.contextmanager
def span(
    name: str,
    *,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    parent: otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[trace.Span | None]:
    """A current span (None when tracing is off). Exceptions mark it as failed and propagate."""
    if not enabled():
        yield None
        return
    with tracer().start_as_current_span(
        name, context=parent, kind=kind, attributes=dict(attributes or {})
    ) as s:
        yield s


def event(name: str) -> None:
    """Mark ``name`` now on the current span (nothing while tracing is off)."""
    if enabled():
        trace.get_current_span().add_event(name)


def extract(carrier: Mapping[str, str] | Sequence[tuple[str, Any]] | None) -> Any:
    """The trace context a caller sent (W3C ``traceparent``) in headers or gRPC metadata."""
    if not enabled() or not carrier:
        return None
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if isinstance(v, str)}
    return _PROPAGATOR.extract(carrier)


def inject(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """``metadata`` plus the current trace context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [*(metadata or ()), *carrier.items()]


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else ""


def _with_context(d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*inject(tuple(d.metadata or ())))
    return grpc.aio.ClientCallDetails(
        d.method, d.timeout, metadata, d.credentials, d.wait_for_ready
    )


# One class per call type: grpc.aio files an interceptor under the first type it matches only.
class _InjectUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """The caller's trace context goes out as ``traceparent`` metadata (unary calls)."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _InjectStream(grpc.aio.UnaryStreamClientInterceptor):
    """The caller's trace context goes out as ``traceparent`` metadata (server streams)."""

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_context(client_call_details), request)


class _InjectBidi(grpc.aio.StreamStreamClientInterceptor):
    """The caller's trace context goes out as ``traceparent`` metadata (two-way streams)."""

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_context(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a grpc.aio channel: none when tracing is off (no cost per call)."""
    return [_InjectUnary(), _InjectStream(), _InjectBidi()] if enabled() else []


def annotate_request(request_id: str) -> None:
    """Name the request on the current span (a call whose request id came after it began)."""
    trace.get_current_span().set_attribute(REQUEST_ID_ATTR, request_id)


# --- Logs ---------------------------------------------------------------------------------------

LOG_FORMAT = (
    "%(asctime)s {name} %(levelname)s %(name)s [rid=%(request_id)s trace=%(trace_id)s]: %(message)s"
)


class LogContextFilter(logging.Filter):
    """Adds ``request_id`` and ``trace_id`` (empty outside a request) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        record.trace_id = current_trace_id()
        return True


def install_log_context(name: str) -> None:
    """Give every root handler the filter and a format that shows request and trace ids."""
    formatter = logging.Formatter(LOG_FORMAT.format(name=name))
    for handler in logging.getLogger().handlers:
        handler.addFilter(LogContextFilter())
        handler.setFormatter(formatter)


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Sets `REQUEST_ID` for the enclosed code (its logs and the spans it starts)."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):  # reset from another context: nothing to undo
            REQUEST_ID.reset(token)
