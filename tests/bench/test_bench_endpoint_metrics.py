"""``tandem bench --endpoint`` against a server that exports vLLM's TTFT parts at ``/metrics``
(the scripted SSE server of test_bench_runner, on 127.0.0.1, with vLLM's metric names on a real
prometheus registry): the run reports where the server's TTFT went, as a stack's runs do;
an endpoint without ``/metrics`` runs as before, with no split."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from bench.measure import Measure, Target, endpoint_metrics, measure
from bench.metrics import SLO
from bench.runner import Endpoint, LoadConfig, RequestOptions
from tests.bench.test_bench_runner import FakeServer, workload

# Per request: the API server's TTFT, the engine's queue and prefill times (seconds).
TTFT, QUEUE, PREFILL = 0.050, 0.010, 0.030


class VllmLikeServer(FakeServer):
    """Also serves ``/metrics`` (with ``metrics``) in vLLM's names; each answered request
    observes `TTFT`, `QUEUE` and `PREFILL` once, under a model label as vLLM's are."""

    def __init__(self, metrics: bool = True) -> None:
        super().__init__()
        self.metrics = metrics
        self.registry = CollectorRegistry()
        self.parts = [
            Histogram(name, "a latency", ["model_name"], registry=self.registry)
            for name in (
                "vllm:time_to_first_token_seconds",
                "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds",
            )
        ]

    def app(self) -> web.Application:
        app = super().app()
        if self.metrics:
            app.router.add_get("/metrics", self.scrape)
        return app

    async def scrape(self, request: web.Request) -> web.Response:
        return web.Response(text=generate_latest(self.registry).decode())

    async def complete(self, request: web.Request) -> web.StreamResponse:
        resp = await super().complete(request)
        for h, v in zip(self.parts, (TTFT, QUEUE, PREFILL), strict=True):
            h.labels("fake-model").observe(v)
        return resp


@contextlib.contextmanager
def serving(server: FakeServer) -> Iterator[str]:
    """The server on a loopback port in a thread of its own; yields its ``/v1`` URL."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict = {}

    async def start() -> None:
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"], box["port"] = runner, site._server.sockets[0].getsockname()[1]
        ready.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    assert ready.wait(10)
    try:
        yield f"http://127.0.0.1:{box['port']}/v1"
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def run_once(url: str):
    endpoint = Endpoint("peer", url)
    target = Target(endpoint, scrape=endpoint_metrics(endpoint))
    how = Measure(RequestOptions(progress=False, timeout=30), warmup=0, slo=SLO(), gpus="")
    return target, measure(target, workload(n=4, out=2), LoadConfig(concurrency=2), how)


def test_an_endpoint_with_vllms_metrics_reports_where_its_ttft_went():
    with serving(VllmLikeServer()) as url:
        target, rep = run_once(url)
    assert target.scrape == {"server": url.removeprefix("http://").removesuffix("/v1")}
    assert all(r.ok for r in rep.result.records) and len(rep.result.records) == 4
    assert rep.ttft == pytest.approx(
        {"gateway": 50.0, "queue": 10.0, "prompt steps": 30.0, "engine": 40.0, "services": 10.0}
    )


def test_an_endpoint_without_metrics_runs_without_a_split():
    with serving(VllmLikeServer(metrics=False)) as url:
        target, rep = run_once(url)
    assert target.scrape == {}
    assert len(rep.result.records) == 4 and rep.ttft is None


@pytest.mark.parametrize("url", ["https://127.0.0.1:1/v1", "http://127.0.0.1:1/proxy/v1",
                                 "http://127.0.0.1:1/v1"])  # fmt: skip
def test_no_metrics_are_read_where_the_server_has_none_beside_v1(url):
    """TLS, a path before /v1, or nothing listening: no scrape (and no error)."""
    assert endpoint_metrics(Endpoint("peer", url)) == {}
