"""Metrics and traces, one layer at a time (no model, no stack): the registry and its constant
labels over HTTP, the collectors, the gRPC interceptors (latency by status, trace context across
a unary and a streaming call, request id attribute), the gateway's request and token metrics,
the engine's step observer, the log filter, and the dashboards (fresh, complete, valid PromQL).
End to end with a real stack and a real Prometheus: tests/stack/test_observability_e2e.py."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.bundled import DEFAULT_DIR
from engine.core.messages import Snapshot
from engine.errors import InvalidRequestError
from engine.llm_engine import EngineStats
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from engine.step_stats import batch_stats
from engine.tokenizer import Tokenizer
from libkv.cluster import etcd_follow
from services.common.grpc_server import start_server
from services.gateway.observe import GatewayMetrics, route_of
from services.gateway.server import create_app
from services.observability import tracing
from services.observability.engine import EngineCollector, StepMetrics
from services.observability.metrics import EtcdErrorsCollector, GrpcServerMetrics, Metrics
from services.router.disagg import Slo
from services.router.metrics import RouterCollector, decision_labels
from services.router.planner import Planner
from tests.services.test_gateway import CONFIG, KEY, TENANT, FakeBackend

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "helm" / "tandem" / "dashboards"


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of everything ``registry`` exposes."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of ``name`` samples whose labels include ``labels``."""
    return sum(
        v
        for (n, ls), v in samples(registry).items()
        if n == name and labels.items() <= dict(ls).items()
    )


# --- registry and collectors --------------------------------------------------------------------


def test_metrics_server_adds_constant_labels_and_parses():
    m = Metrics("decode", "smol", "decode-7")
    GrpcServerMetrics(m.registry).observe("/tandem.v1.Decode/Generate", "OK", 0.02)
    port = m.serve("127.0.0.1", 0)
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    finally:
        m.stop()
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    build = families["tandem_build_info"]  # an Info in the text format: a gauge of value 1
    assert build.type == "gauge" and build.samples[0].value == 1
    assert build.samples[0].labels["worker"] == "decode-7" and build.samples[0].labels["version"]
    hist = families["tandem_grpc_server_handling_seconds"]
    assert hist.type == "histogram"
    count = [s for s in hist.samples if s.name.endswith("_count")]
    assert [s.value for s in count] == [1.0]
    assert count[0].labels == {
        "component": "decode",
        "model": "smol",
        "worker": "decode-7",
        "method": "/tandem.v1.Decode/Generate",
        "code": "OK",
    }
    assert not any(name.endswith("_created") for name in families)


def test_etcd_errors_collector_counts_every_op_from_zero(monkeypatch):
    monkeypatch.setattr(etcd_follow, "ERRORS", Counter({"watch": 2, "register": 1}))
    monkeypatch.setattr("services.observability.metrics.ERRORS", etcd_follow.ERRORS)
    reg = CollectorRegistry()
    reg.register(EtcdErrorsCollector())
    assert value(reg, "tandem_etcd_errors_total", op="watch") == 2
    assert value(reg, "tandem_etcd_errors_total", op="register") == 1
    assert value(reg, "tandem_etcd_errors_total", op="locations") == 0


class _Member:
    def __init__(self, role: str) -> None:
        self.role = role


def test_router_collector_reads_decisions_and_members():
    class Core:
        class stats:  # noqa: N801 - stands in for RouterStats
            decisions = Counter({("kv", "kv-hit"): 3, ("kv", "load"): 1, "decode_only": 2})
            disagg = Counter({("decode-only", "saturated"): 2, ("disagg", "headroom"): 3})
            retries = 4
            migrations = 5
            live_moves = 2
            legs = Counter({"gateway": 9, "router": 1})

        class admission:  # noqa: N801 - stands in for DecodeAdmission
            local_refusals = 7

        class slo_gate:  # noqa: N801 - stands in for SloGate
            shed = 2

    class Watcher:
        members = {"p0": _Member("prefill"), "d0": _Member("decode"), "d1": _Member("decode")}

    class OtherModel:  # a second base model's core: its counts add to the router's
        class stats:  # noqa: N801
            decisions = Counter({("kv", "kv-hit"): 1})
            disagg = Counter({("disagg", "headroom"): 1})
            retries = 0
            migrations = 1
            live_moves = 0
            legs = Counter({"gateway": 2})

        class admission:  # noqa: N801
            local_refusals = 1

        class slo_gate:  # noqa: N801
            shed = 0

    for core in (Core, OtherModel):  # the pool planner's inputs: no traffic, no rates yet
        core.model, core.planner = core.__name__, Planner()
        core.chooser = SimpleNamespace(disagg=SimpleNamespace(default_slo=Slo(1.0, 0.05)))
        core.workers = staticmethod(lambda: [])
    reg = CollectorRegistry()
    reg.register(RouterCollector([Core(), OtherModel()], Watcher()))
    assert value(reg, "tandem_router_decisions_total", policy="kv", reason="kv-hit") == 4
    assert value(reg, "tandem_router_decisions_total", reason="decode_only") == 2
    assert value(reg, "tandem_router_retries_total") == 4
    assert value(reg, "tandem_router_migrations_total") == 6
    assert value(reg, "tandem_router_live_moves_total") == 2
    assert value(reg, "tandem_router_decode_legs_total", streamed_by="gateway") == 11
    assert value(reg, "tandem_router_decode_legs_total", streamed_by="router") == 1
    assert value(reg, "tandem_router_local_refusals_total") == 8
    disagg = "tandem_router_disagg_decisions_total"
    assert value(reg, disagg, choice="disagg", reason="headroom") == 4
    assert value(reg, disagg, choice="decode-only", reason="saturated") == 2
    assert value(reg, "tandem_router_slo_shed_total") == 2
    assert value(reg, "tandem_planner_prompt_tokens_per_second", base_model="Core") == 0
    names = {n for n, _ in samples(reg)}
    assert "tandem_planner_prefill_workers" not in names  # no measured rate: left out
    assert "tandem_router_role_orders_total" not in names  # no role balancer on this router
    assert value(reg, "tandem_router_members", role="decode") == 2
    assert value(reg, "tandem_router_members", role="router") == 0
    assert decision_labels(("session", "sticky")) == ("session", "sticky")


def test_step_observer_reports_batches_and_queue_time_once():
    params = SamplingParams(max_tokens=4)
    prefill = Sequence("a", [1, 2, 3, 4, 5], params, 0)
    decoding = Sequence("b", [1, 2], params, 1, output_token_ids=[7], num_computed=2)
    decoding.first_scheduled = decoding.arrival_time  # scheduled before: no queue time again
    sched = SchedulerOutput([ScheduledSeq(prefill, 5, [0]), ScheduledSeq(decoding, 1, [1])])
    stats = batch_stats(sched)
    assert (stats.prefill_seqs, stats.prefill_tokens, stats.decode_seqs) == (1, 5, 1)
    assert stats.phase == "prefill" and len(stats.queue_seconds) == 1
    assert batch_stats(sched).queue_seconds == []  # first scheduling is counted once
    reg = CollectorRegistry()
    observe = StepMetrics(reg)
    stats.seconds = 0.03
    observe(stats)
    assert value(reg, "tandem_engine_step_duration_seconds_count", phase="prefill") == 1
    assert value(reg, "tandem_engine_batch_size_tokens_sum", phase="prefill") == 6
    assert value(reg, "tandem_engine_queue_time_seconds_count") == 1
    assert value(reg, "tandem_engine_step_duration_seconds_count", phase="decode") == 0


# --- gRPC: latency by status, trace context, request id -----------------------------------------


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    handle = tracing.setup_tracing("test", exporter=exporter)
    yield exporter
    handle.shutdown()
    assert not tracing.enabled()


class _Req:
    """A request message with a request id (what the interceptor reads)."""

    def __init__(self, raw: bytes) -> None:
        self.request_id = raw.decode()


async def _echo_server(metrics: GrpcServerMetrics):
    async def unary(request, context):
        if request.request_id == "bad":
            raise InvalidRequestError("bad request")
        return b"ok"

    async def stream(request, context):
        for _ in range(3):
            yield b"tok"

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary, request_deserializer=_Req),
        "Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=_Req),
    }
    generic = grpc.method_handlers_generic_handler("t.Echo", handlers)

    def add(_servicer, server):
        server.add_generic_rpc_handlers((generic,))

    return await start_server([(add, None)], ["t.Echo"], "127.0.0.1:0", metrics=metrics)


async def test_grpc_calls_are_timed_by_status_and_carry_the_trace(spans):
    reg = CollectorRegistry()
    server = await _echo_server(GrpcServerMetrics(reg))
    channel = grpc.aio.insecure_channel(server.address, interceptors=tracing.client_interceptors())
    try:
        with tracing.span("caller") as root:
            assert await channel.unary_unary("/t.Echo/Unary")(b"req-1") == b"ok"
            got = [m async for m in channel.unary_stream("/t.Echo/Stream")(b"req-2")]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary("/t.Echo/Unary")(b"bad")
        assert got == [b"tok"] * 3 and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await channel.close()
        await server.stop(None)
    hist = "tandem_grpc_server_handling_seconds_count"
    assert value(reg, hist, method="/t.Echo/Unary", code="OK") == 1
    assert value(reg, hist, method="/t.Echo/Unary", code="INVALID_ARGUMENT") == 1
    assert value(reg, hist, method="/t.Echo/Stream", code="OK") == 1
    assert value(reg, hist, method="/grpc.health.v1.Health/Check") == 0
    assert root is not None
    trace_id = root.get_span_context().trace_id
    server_spans = {s.attributes[tracing.REQUEST_ID_ATTR]: s for s in spans.get_finished_spans()
                    if s.name.startswith("t.Echo/")}  # fmt: skip
    assert set(server_spans) == {"req-1", "req-2", "bad"}
    for s in server_spans.values():
        assert s.context.trace_id == trace_id
        assert s.parent is not None and s.parent.span_id == root.get_span_context().span_id
    assert server_spans["bad"].attributes["rpc.grpc.status_code"] == "INVALID_ARGUMENT"
    # A streaming call marks its first message (a hop's share of TTFT); a unary one does not.
    first = [e for e in server_spans["req-2"].events if e.name == "first_response"]
    assert len(first) == 1
    assert server_spans["req-2"].start_time <= first[0].timestamp <= server_spans["req-2"].end_time
    assert not server_spans["req-1"].events


def test_tracing_off_costs_no_interceptor_and_no_span():
    assert not tracing.enabled()
    assert tracing.client_interceptors() == []
    with tracing.span("nothing") as s:
        assert s is None


def test_log_lines_carry_request_and_trace_id(spans, caplog):
    log = logging.getLogger("tandem.test")
    caplog.handler.addFilter(tracing.LogContextFilter())
    with tracing.request_context("req-42"), tracing.span("work") as s:
        log.warning("inside")
    log.warning("outside")
    inside, outside = caplog.records[-2:]
    assert s is not None
    assert inside.request_id == "req-42"
    assert inside.trace_id == f"{s.get_span_context().trace_id:032x}"
    assert (outside.request_id, outside.trace_id) == ("", "")


# --- the gateway --------------------------------------------------------------------------------


@pytest.fixture
async def gateway_metrics():
    tok = Tokenizer(DEFAULT_DIR)
    reg = CollectorRegistry()
    metrics = GatewayMetrics(reg, slo_ttft_s=10.0, slo_tpot_s=10.0)
    app = create_app(CONFIG, FakeBackend(tok), tok, metrics=metrics)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        yield client, reg, tok


async def test_gateway_counts_requests_tokens_latency_and_goodput(gateway_metrics):
    client, reg, tok = gateway_metrics
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}]}
    r1 = await client.post("/v1/chat/completions", json=body, headers=auth)
    r2 = await client.post("/v1/chat/completions", json={**body, "stream": True}, headers=auth)
    r3 = await client.post("/v1/chat/completions", json={**body, "n": -1}, headers=auth)
    r4 = await client.post("/v1/chat/completions", json=body)  # no key
    assert (r1.status_code, r2.status_code, r3.status_code, r4.status_code) == (200, 200, 400, 401)
    route = "/v1/chat/completions"
    ok = {"route": route, "status": "200", "finish_reason": "stop", "tenant": TENANT}
    assert value(reg, "tandem_gateway_requests_total", **ok) == 2
    assert value(reg, "tandem_gateway_requests_total", status="400", finish_reason="none") == 1
    assert value(reg, "tandem_gateway_requests_total", status="401", tenant="default") == 1
    n_out = len(FakeBackend(tok).reply_ids())
    assert value(reg, "tandem_gateway_output_tokens_total", tenant=TENANT) == 2 * n_out
    assert value(reg, "tandem_gateway_input_tokens_total", tenant=TENANT) > 0
    assert value(reg, "tandem_gateway_time_to_first_token_seconds_count") == 2
    assert value(reg, "tandem_gateway_inter_token_latency_seconds_count") == 2 * (n_out - 1)
    assert value(reg, "tandem_gateway_time_per_output_token_seconds_count") == 2
    assert value(reg, "tandem_gateway_e2e_request_latency_seconds_count", tenant=TENANT) == 2
    assert value(reg, "tandem_gateway_goodput_requests_total") == 2  # generous SLOs
    assert value(reg, "tandem_gateway_slo_info", ttft_seconds="10.0", tpot_seconds="10.0") == 1
    assert value(reg, "tandem_gateway_requests_in_flight") == 0
    # A request's own objective counts for its goodput: a microsecond TTFT is missed.
    tight = {**body, "slo_ttft_ms": 0.001}
    assert (await client.post(route, json=tight, headers=auth)).status_code == 200
    assert value(reg, "tandem_gateway_goodput_requests_total") == 2


def test_route_labels_are_bounded():
    assert route_of("/v1/models/some-model") == "/v1/models"
    assert route_of("/v1/chat/completions") == "/v1/chat/completions"
    assert route_of("/v1/anything-else") == "other"


# --- dashboards ---------------------------------------------------------------------------------


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(file, panel title, expr) of every query of every shipped dashboard."""
    out = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def substitute(expr: str) -> str:
    """A dashboard query as Prometheus runs it with every variable at "All"."""
    for var in ("$namespace", "$model", "$worker"):
        expr = expr.replace(var, ".*")
    return expr.replace("$__rate_interval", "1m")


def test_dashboards_are_fresh():
    proc = subprocess.run(
        [sys.executable, str(REPO / "helm" / "generate_dashboards.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_panel_has_title_unit_description_and_the_template_variables():
    files = sorted(DASHBOARDS.glob("*.json"))
    assert {f.stem for f in files} >= {
        "tandem-overview", "tandem-pools", "tandem-kv", "tandem-router", "tandem-tenants"
    }  # fmt: skip
    for path in files:
        board = json.loads(path.read_text())
        names = {v["name"] for v in board["templating"]["list"]}
        assert {"namespace", "model", "worker"} <= names, path.name
        for panel in board["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["title"] and panel["description"], (path.name, panel)
            assert panel["fieldConfig"]["defaults"]["unit"], (path.name, panel["title"])
            for target in panel["targets"]:
                for var in ("$namespace", "$model", "$worker"):
                    assert var in target["expr"], (path.name, panel["title"], var)


def write_rules(path: Path) -> int:
    """Every dashboard query as a recording rule (what ``promtool check rules`` parses)."""
    import yaml

    rules = [
        {"record": f"tandem:dashboard_query_{i}", "expr": substitute(expr)}
        for i, (_, _, expr) in enumerate(dashboard_exprs())
    ]
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    return len(rules)


def test_every_dashboard_query_parses_as_a_recording_rule(tmp_path):
    n = write_rules(tmp_path / "rules.yml")
    proc = subprocess.run(
        ["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {n} rules found" in proc.stdout


def test_spans_are_exported_over_otlp():
    """A real OTLP/gRPC exchange with an in-process collector (what production points
    ``--otlp-endpoint`` at)."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - generated name
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        handle = tracing.setup_tracing("gateway", otlp_endpoint=f"http://127.0.0.1:{port}")
        with tracing.span("work", attributes={tracing.REQUEST_ID_ATTR: "req-7"}):
            pass
        handle.shutdown()  # flushes the batch processor
    finally:
        server.stop(None)
    resources = [rs for req in received for rs in req.resource_spans]
    spans = [s for rs in resources for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["work"]
    attrs = {a.key: a.value.string_value for a in spans[0].attributes}
    assert attrs[tracing.REQUEST_ID_ATTR] == "req-7"
    service = {a.key: a.value.string_value for a in resources[0].resource.attributes}
    assert service["service.name"] == "tandem-gateway"


def test_engine_collector_reads_the_engines_latest_snapshot():
    """A scrape reads what the engine sent with its latest step (``EngineClient.snapshot``):
    it never asks the engine, so it never waits behind a long step."""

    class Client:
        snapshot: Snapshot | None = None

    client = Client()
    reg = CollectorRegistry()
    reg.register(EngineCollector(client))  # type: ignore[arg-type]
    assert value(reg, "tandem_engine_sequences_waiting") == 0  # nothing sent yet: no samples
    client.snapshot = Snapshot(EngineStats(2, 3, 100, 40, 10, 5, 64, 256), num_held=1)
    assert value(reg, "tandem_engine_kv_blocks", state="free") == 50
    assert value(reg, "tandem_engine_sequences_waiting") == 2
    assert value(reg, "tandem_engine_preemptions_total") == 5
    assert value(reg, "tandem_engine_prefix_cache_hit_tokens_total") == 64
    assert value(reg, "tandem_engine_kv_held_requests") == 1
    client.snapshot = Snapshot(EngineStats(0, 0, 100, 0, 0, 7, 64, 256), num_held=0)
    assert value(reg, "tandem_engine_preemptions_total") == 7


async def test_gateway_span_continues_the_callers_trace(spans):
    tok = Tokenizer(DEFAULT_DIR)
    app = create_app(CONFIG, FakeBackend(tok), tok)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {
        "Authorization": f"Bearer {KEY}",
        "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
    }
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        r = await c.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200
    (span,) = [s for s in spans.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert f"{span.context.trace_id:032x}" == trace_id
    assert span.attributes[tracing.REQUEST_ID_ATTR] == r.json()["id"]
    assert span.attributes["http.response.status_code"] == 200
