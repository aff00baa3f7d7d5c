"""Metrics and traces end to end: real etcd, the four services as processes with the bundled
model, and a real Prometheus (Debian package ``prometheus``) on loopback scraping every service
each second. After a short load: every metric the services promise exists with its type, every
query of every Grafana dashboard parses and returns data, and one request's spans share one
trace id across gateway, router, prefill (and the KV transfer) and decode."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.services.test_observability import dashboard_exprs, substitute
from tests.stack_probe import metrics_of

# A whole stack with Prometheus beside it (about 30 s): `make test-stack`, which CI runs.
pytestmark = pytest.mark.stack
MODEL = "SmolLM2-135M-Instruct"
NAMESPACE = "tandem-e2e"  # what a Kubernetes scrape would add; the dashboards select on it
LONG = " ".join(
    f"Line {i}: the warehouse shipped {i * 7} crates to dock {i % 5}." for i in range(8)
)

WORKER = {
    "tandem_engine_sequences_running": "gauge",
    "tandem_engine_sequences_waiting": "gauge",
    "tandem_engine_kv_blocks": "gauge",
    "tandem_engine_kv_blocks_capacity": "gauge",
    "tandem_engine_kv_held_requests": "gauge",
    "tandem_engine_prefix_cache_hit_tokens": "counter",
    "tandem_engine_prompt_tokens": "counter",
    "tandem_engine_preemptions": "counter",
    "tandem_engine_spec_decode_drafts": "counter",
    "tandem_engine_spec_decode_draft_tokens": "counter",
    "tandem_engine_spec_decode_accepted_tokens": "counter",
    "tandem_engine_step_duration_seconds": "histogram",
    "tandem_engine_batch_size_sequences": "histogram",
    "tandem_engine_batch_size_tokens": "histogram",
    "tandem_engine_queue_time_seconds": "histogram",
    "tandem_engine_time_to_first_token_seconds": "histogram",
    "tandem_engine_prefill_time_seconds": "histogram",
}
GRPC = {"tandem_grpc_server_handling_seconds": "histogram", "tandem_etcd_errors": "counter"}
ADMISSION = {
    "tandem_admission_pending_tokens": "gauge",
    "tandem_admission_limit_tokens": "gauge",
    "tandem_admission_refused": "counter",
}
EXPECTED = {
    "gateway": {
        **ADMISSION,
        "tandem_gateway_requests": "counter",
        "tandem_gateway_requests_in_flight": "gauge",
        "tandem_gateway_time_to_first_token_seconds": "histogram",
        "tandem_gateway_inter_token_latency_seconds": "histogram",
        "tandem_gateway_time_per_output_token_seconds": "histogram",
        "tandem_gateway_e2e_request_latency_seconds": "histogram",
        "tandem_gateway_input_tokens": "counter",
        "tandem_gateway_output_tokens": "counter",
        "tandem_gateway_goodput_requests": "counter",
        "tandem_gateway_slo_info": "gauge",
    },
    "router": {
        **GRPC,
        "tandem_router_decisions": "counter",
        "tandem_router_retries": "counter",
        "tandem_router_migrations": "counter",
        "tandem_router_live_moves": "counter",
        "tandem_router_decode_legs": "counter",
        "tandem_router_local_refusals": "counter",
        "tandem_router_members": "gauge",
    },
    "prefill-0": {**GRPC, **WORKER, **ADMISSION},
    "decode-0": {
        **GRPC,
        **WORKER,
        **ADMISSION,
        "tandem_kv_transfers": "counter",
        "tandem_kv_transfer_blocks": "counter",
        "tandem_kv_transfer_bytes": "counter",
        "tandem_kv_transfer_failures": "counter",
        "tandem_kv_transfer_duration_seconds": "histogram",
    },
}


class Prometheus:
    """A real Prometheus on a free loopback port with the scrape ``config`` file."""

    def __init__(self, run_dir: Path, config: Path) -> None:
        self.port = free_port()
        run_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(run_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={run_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError("prometheus did not become ready")

    def wait_all_up(self, n: int, timeout: float = 30.0) -> None:
        """Until Prometheus has scraped all ``n`` targets successfully (it starts scraping a few
        seconds after start: target updates are batched every 5 s)."""
        deadline = time.monotonic() + timeout
        while True:
            with urllib.request.urlopen(self.url + "/api/v1/targets", timeout=5) as r:
                active = json.loads(r.read())["data"]["activeTargets"]
            if len(active) == n and all(t["health"] == "up" for t in active):
                return
            assert time.monotonic() < deadline, f"targets not all up: {active}"
            time.sleep(0.5)

    def query(self, expr: str) -> list[dict]:
        """The result vector of an instant query (raises on a PromQL error)."""
        url = f"{self.url}/api/v1/query?query={urllib.parse.quote(expr)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


@dataclass
class Observed:
    stack: Stack
    prometheus: Prometheus
    traced_request_id: str  # a disaggregated request whose spans the trace test follows


def _load(stack: Stack) -> str:
    """Short load covering every path the dashboards show; returns the id of a long request."""
    chat = {"model": MODEL, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    short = {**chat, "messages": [{"role": "user", "content": "Hi"}]}
    long = {**chat, "messages": [{"role": "user", "content": LONG}]}
    with httpx.Client(base_url=stack.url, timeout=120) as client:

        def status(path: str, body: dict) -> int:
            return client.post(path, json=body).status_code

        assert status("/v1/chat/completions", {**short, "stream": True}) == 200
        r = client.post("/v1/chat/completions", json=long)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert status("/v1/chat/completions", long) == 200  # a prefix-cache hit
        completion = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "ignore_eos": True}
        assert status("/v1/completions", completion) == 200
        assert status("/v1/chat/completions", {**short, "temperature": -1}) == 400
        # The pool planner fits decode step times the decode worker reports while it runs
        # streams (every --member-refresh, 3 s): decode until one such report has landed.
        router = stack.scrape_targets()["router"]
        deadline = time.monotonic() + 60
        while "tandem_planner_decode_workers" not in metrics_of(router):
            assert time.monotonic() < deadline, "no decode step report reached the planner"
            assert status("/v1/chat/completions", {**short, "max_tokens": 48}) == 200
    return rid


@pytest.fixture(scope="module")
def observed(smol_dir, tmp_path_factory) -> Iterator[Observed]:
    run = tmp_path_factory.mktemp("observability")
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(run / "stack"),
        port=free_port(),
        decode_only_threshold=48,  # the LONG prompt is prefilled, "Hi" is decode-only
        disagg_mode="length",  # placement by length alone, whatever the load
        trace_files=True,
        # A small host KV tier (off by default on CPU) so the dashboards' tier panels have data.
        worker_args=("--kv-host-cache-gib", "0.05"),
    )
    with Stack(config) as stack:
        targets = stack.scrape_targets()
        assert set(targets) == set(EXPECTED)
        prom_config = stack.write_prometheus_config(namespace=NAMESPACE, interval="1s")
        prometheus = Prometheus(run / "prometheus", prom_config)
        try:
            prometheus.wait_all_up(len(targets))
            rid = _load(stack)
            time.sleep(3)  # at least two scrapes after the last request: rates have data
            yield Observed(stack, prometheus, rid)
        finally:
            prometheus.stop()


def test_every_metric_exists_with_its_type(observed):
    for name, target in observed.stack.scrape_targets().items():
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as r:
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        got = {n: f.type for n, f in families.items() if n in EXPECTED[name]}
        assert got == EXPECTED[name], name
        assert all(n.startswith("tandem_") for n in families), name
        build = families["tandem_build_info"].samples[0].labels
        assert build["component"] == name.split("-")[0] and build["model"] == MODEL
    decisions = observed.prometheus.query("sum by (policy, reason) (tandem_router_decisions_total)")
    reasons = {d["metric"]["reason"] for d in decisions}
    assert len(reasons) >= 2 and any("decode" in r for r in reasons), reasons
    moved = observed.prometheus.query("sum(tandem_kv_transfer_bytes_total)")
    assert float(moved[0]["value"][1]) > 0
    # The gateway streamed every decode call itself: the router was out of the token path.
    legs = observed.prometheus.query("sum by (streamed_by) (tandem_router_decode_legs_total)")
    by_whom = {d["metric"]["streamed_by"]: float(d["value"][1]) for d in legs}
    assert by_whom["gateway"] > 0 and by_whom["router"] == 0, by_whom


def test_prometheus_scrapes_every_service(observed):
    up = observed.prometheus.query(f'up{{namespace="{NAMESPACE}"}}')
    assert len(up) == len(EXPECTED) and all(u["value"][1] == "1" for u in up)
    build = observed.prometheus.query("tandem_build_info")
    assert {b["metric"]["component"] for b in build} == {"gateway", "router", "prefill", "decode"}
    assert all({"namespace", "model", "worker"} <= b["metric"].keys() for b in build)


def test_every_dashboard_query_returns_data(observed):
    empty: list[tuple[str, str, str]] = []
    for board, title, expr in dashboard_exprs():
        deadline = time.monotonic() + 10
        while not observed.prometheus.query(substitute(expr)):
            if time.monotonic() > deadline:
                empty.append((board, title, expr))
                break
            time.sleep(1)
    assert not empty, "queries without data:\n" + "\n".join(map(str, empty))


def _spans(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted((run_dir / "traces").glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def test_one_request_shares_a_trace_across_all_services(observed):
    rid = observed.traced_request_id
    deadline = time.monotonic() + 10
    while True:
        spans = [s for s in _spans(observed.stack.run_dir)
                 if s["attributes"].get("tandem.request_id") == rid]  # fmt: skip
        services = {s["service"] for s in spans}
        if {"tandem-gateway", "tandem-router", "tandem-prefill", "tandem-decode"} <= services:
            break
        assert time.monotonic() < deadline, f"spans of {rid}: {services}"
        time.sleep(0.5)
    assert len({s["trace_id"] for s in spans}) == 1, spans
    names = {s["name"] for s in spans}
    assert {"POST /v1/chat/completions", "tandem.v1.Router/Route", "tandem.v1.Prefill/Prefill",
            "kv.transfer", "tandem.v1.Decode/Generate"} <= names, names  # fmt: skip
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if s["parent_id"] not in by_id]
    assert [r["service"] for r in roots] == ["tandem-gateway"]  # one tree, rooted at the gateway
    # Each hop's share of TTFT: the request's first token and each stream's first message.
    marks = {(s["name"], e): t for s in spans for e, t in s["events"].items()}
    root = roots[0]
    assert root["start_ns"] < marks[root["name"], "first_token"] <= root["end_ns"]
    assert ("tandem.v1.Decode/Generate", "first_response") in marks, marks
    assert ("tandem.v1.Router/Route", "first_response") in marks, marks
    # The router logs its routing plan inside the request: the line names both ids.
    router_log = observed.stack.children["router"].log_path.read_text()
    assert f"[rid={rid} trace={spans[0]['trace_id']}]" in router_log
    for child in observed.stack.children.values():  # spans opened and closed in one context
        assert "Failed to detach context" not in child.log_path.read_text(), child.name
