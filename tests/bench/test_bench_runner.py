"""bench.runner against a scripted OpenAI-style SSE server (aiohttp, on 127.0.0.1): what it
sends, concurrency caps, the time limit, sequential session turns, recorded failures, and the
streaming client's reading of events split across reads."""

from __future__ import annotations

import asyncio
import json
import math
import sys

import pytest
from aiohttp import web

from bench.runner import Endpoint, LoadConfig, RequestOptions, run_load
from bench.workloads import ApproxCounter, WorkloadConfig, generate

STEP = 0.02  # seconds between scripted chunks


class FakeServer:
    """Streams ``max_tokens`` one-token chat chunks, ``STEP`` apart, then usage and [DONE];
    every ``fail_every``-th request gets a 400 with an OpenAI-style error body. ``split``
    writes each event in two pieces (a read may end inside an event)."""

    def __init__(self, fail_every: int = 0, split: bool = False) -> None:
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.fail_every = fail_every
        self.split = split

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": "fake-model", "object": "model", "created": 0, "owned_by": "me"}
        return web.json_response({"object": "list", "data": [model]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": {"message": "nope", "type": "bad"}}, status=400)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for event in self.events(body):
                if isinstance(event, float):
                    await asyncio.sleep(event)
                elif self.split:
                    await resp.write(event[:7])
                    await asyncio.sleep(0.001)
                    await resp.write(event[7:])
                else:
                    await resp.write(event)
        finally:
            self.in_flight -= 1
        return resp

    def events(self, body: dict):
        head = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}

        def sse(choices, usage=None) -> bytes:
            return f"data: {json.dumps({**head, 'choices': choices, 'usage': usage})}\n\n".encode()

        chat = "messages" in body
        if chat:
            yield sse([{"index": 0, "delta": {"role": "assistant", "content": ""}}])
        else:
            head["object"] = "text_completion"
        n = body["max_tokens"]
        for i in range(n):
            yield STEP
            finish = "length" if i == n - 1 else None
            text = {"delta": {"content": "w "}} if chat else {"text": "w "}
            yield sse([{"index": 0, **text, "finish_reason": finish}])
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        yield sse([], usage)
        yield b"data: [DONE]\n\n"


def run(server: FakeServer, workload, load: LoadConfig, warmup: int = 0, **opts_kw):
    async def go():
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            opts = RequestOptions(progress=False, timeout=30, **opts_kw)
            url = f"http://127.0.0.1:{port}/v1"
            return await run_load(Endpoint("fake", url), workload, load, opts, warmup)
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def workload(kind: str = "decode-heavy", n: int = 6, out: int = 3, **kw):
    cfg = WorkloadConfig(kind, n, input_len=10, output_len=out, output_spread=0.0, **kw)
    return generate(cfg, ApproxCounter())


def test_fixed_concurrency_streams_and_measures():
    server = FakeServer()
    res = run(server, workload(n=6, out=3), LoadConfig(concurrency=2), warmup=1)
    assert server.max_in_flight == 2
    assert len(server.bodies) == 7  # one warm-up, then six measured
    body = server.bodies[1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 3 and body["model"] == "fake-model"
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert len(res.records) == 6 and res.not_sent == 0
    for r in res.records:
        assert r.ok and r.output_tokens == 3 and r.input_tokens == 7
        assert r.ttft >= STEP and len(r.itl) == 2 and all(g >= STEP * 0.9 for g in r.itl)
        assert r.e2e >= r.ttft + 2 * STEP * 0.9
    assert res.duration >= 3 * 3 * STEP  # three waves of two


def test_time_limit_stops_sending():
    server = FakeServer()
    res = run(server, workload(n=20, out=5), LoadConfig(concurrency=1, time_limit=0.25))
    # Each request takes ~0.1 s (more on a loaded machine); sending stops at 0.25 s and the
    # one in flight finishes: no request starts after the limit and most are never sent.
    assert 1 <= len(res.records) <= 4 and res.not_sent == 20 - len(res.records)
    assert all(r.ok and r.start < 0.25 for r in res.records)


def test_poisson_rate_spreads_arrivals():
    res = run(FakeServer(), workload(n=8, out=1), LoadConfig(rate=20.0, seed=1))
    starts = [r.start for r in res.records]
    assert starts == sorted(starts) and starts[-1] > 0.1  # not all at once
    assert not math.isinf(res.rate)


def test_session_turns_run_in_order_and_failures_are_recorded():
    server = FakeServer(fail_every=4)
    res = run(server, workload("multi-turn", n=6, out=2, turns=3), LoadConfig())
    assert len(res.records) == 6
    by_session: dict[int, list] = {}
    for r in res.records:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.start >= prev.start + (prev.e2e or 0)
    failed = [r for r in res.records if not r.ok]
    assert len(failed) == 1 and "400" in failed[0].error and "nope" in failed[0].error
    assert len(server.bodies[3]["messages"]) in (1, 3, 5)  # history grows by 2 per turn


def test_completions_api_without_ignore_eos():
    server = FakeServer()
    wl = workload("shared-prefix", n=2, out=2, prefix_len=20)
    res = run(server, wl, LoadConfig(), api="completions", ignore_eos=False)
    body = server.bodies[0]
    assert "ignore_eos" not in body and "messages" not in body
    assert body["prompt"] == wl.requests[0].prompt  # system prefix, blank line, question
    assert all(r.ok and r.output_tokens == 2 and len(r.itl) == 1 for r in res.records)


def test_trace_replay_keeps_the_traces_times():
    from dataclasses import replace

    wl = replace(workload(n=4, out=1), arrivals=(0.0, 0.0, 0.15, 0.3))
    res = run(FakeServer(), wl, LoadConfig(rate=1000.0, trace_speed=2.0))
    starts = [r.start for r in res.records]
    assert starts[1] < 0.05 and 0.15 <= starts[2] < 0.25 and 0.3 <= starts[3] < 0.4
    assert res.trace_speed == 2.0 and res.rate == 3 / 0.3  # the replay's mean rate
    poisson = run(FakeServer(), wl, LoadConfig(rate=math.inf))  # --rate replaces the times
    assert poisson.trace_speed is None and max(r.start for r in poisson.records) < 0.05
    cut = run(FakeServer(), wl, LoadConfig(time_limit=0.1, trace_speed=1.0))
    assert len(cut.records) == 2 and cut.not_sent == 2  # the time limit still stops sending


@pytest.mark.parametrize("gone,plots", [("tqdm", False), ("matplotlib", True)])
def test_a_missing_extra_is_named_before_anything_runs(monkeypatch, tmp_path, gone, plots):
    """Without a module of the ``bench`` extra, ``tandem bench`` names it and the extra to
    install, and exits before it starts a stack or sends a request (matplotlib only matters
    with plots)."""
    from bench.cli import main

    monkeypatch.setitem(sys.modules, gone, None)  # its import fails, as when not installed
    argv = ["--endpoint", "http://127.0.0.1:9/v1", "--out", str(tmp_path), "--no-progress"]
    with pytest.raises(SystemExit) as exited:
        main(argv + ([] if plots else ["--no-plots"]))
    assert f"needs {gone}" in str(exited.value) and "pip install 'tandem[bench]'" in str(
        exited.value
    )
    assert not list(tmp_path.iterdir())  # nothing written


def test_slos_go_with_every_request_when_asked():
    server = FakeServer()
    run(server, workload(n=2, out=1), LoadConfig(), slo_ms=(500.0, 15.0))
    assert all(b["slo_ttft_ms"] == 500 and b["slo_tpot_ms"] == 15 for b in server.bodies)
    assert all(b["ignore_eos"] is True for b in server.bodies)
    server = FakeServer()
    run(server, workload(n=1, out=1), LoadConfig())
    assert "slo_ttft_ms" not in server.bodies[0]


def test_events_split_across_reads_are_read_whole():
    server = FakeServer(split=True)
    res = run(server, workload(n=3, out=4), LoadConfig(concurrency=3))
    assert all(r.ok and r.output_tokens == 4 and r.input_tokens == 7 for r in res.records)
    assert all(len(r.itl) == 3 for r in res.records)  # one timed chunk per token


def test_a_server_that_is_not_there_is_a_recorded_failure():
    """No server on the port: resolving the model fails loudly (the run cannot start)."""
    import aiohttp

    wl = workload(n=1, out=1)
    opts = RequestOptions(progress=False, timeout=5)
    with pytest.raises(aiohttp.ClientConnectionError):
        asyncio.run(run_load(Endpoint("gone", "http://127.0.0.1:9/v1"), wl, LoadConfig(), opts, 0))
