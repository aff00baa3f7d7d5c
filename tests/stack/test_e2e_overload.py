"""Admission that never breaks a started stream, end to end: a bounded overload of concurrent
streams through prefill and decode workers with small admission bounds. Every request gets
either a 429 with Retry-After before any byte of a stream, or a 200 followed by its whole
answer; none ends in an error event or a 5xx. The 429 latency is measured (``OVERLOAD_OUT``:
append the figures as one JSON line to that file)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import httpx
import pytest

from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_e2e_stack import MODEL, assert_all_free

CONCURRENT = 24
MAX_TOKENS = 24
PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 8  # ~100 tokens
PENDING = 500  # each worker's admission bound in tokens: about 4 requests of ~124 on decode


@dataclass(slots=True)
class Outcome:
    status: int = 0
    seconds: float = 0.0  # until the status line (429) or the last byte (200)
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    done: bool = False


def take_line(out: Outcome, line: str) -> None:
    """One SSE line of a streamed answer into ``out``."""
    if line == "data: [DONE]":
        out.done = True
    elif line.startswith("data: "):
        chunk = json.loads(line[6:])
        (out.errors if "error" in chunk else out.chunks).append(chunk)


async def stream_one(
    client: httpx.AsyncClient, url: str, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS
) -> Outcome:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    out = Outcome()
    t0 = time.monotonic()
    async with client.stream("POST", url, json=body) as r:
        out.status, out.headers = r.status_code, dict(r.headers)
        if r.status_code != 200:
            await r.aread()
            out.seconds = time.monotonic() - t0
            return out
        async for line in r.aiter_lines():
            take_line(out, line)
    out.seconds = time.monotonic() - t0
    return out


async def overload(url: str, n: int = CONCURRENT, **body) -> list[Outcome]:
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, url, **body) for _ in range(n)))


def p90(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    config = StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("overload")),
        port=free_port(), num_prefill=1, num_decode=1, kv_transport="grpc",
        decode_only_threshold=16,  # every request goes through the prefill worker
        disagg_mode="length",  # placement by length alone, whatever the load
        worker_args=("--max-pending-tokens", str(PENDING)),
    )  # fmt: skip
    with Stack(config) as s:
        yield s


def check(stack: Stack, outcomes: list[Outcome], p90_bound: float | None) -> dict:
    """No 5xx, every 200 followed by its whole answer, 429s with Retry-After within
    ``p90_bound`` seconds at p90 (None: measured, not asserted); the figures (also appended to
    ``OVERLOAD_OUT``)."""
    by_status: dict[int, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    served = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    assert set(by_status) <= {200, 429}, by_status  # no 5xx, nothing else
    assert served and refused, by_status  # the bound was reached, and work went through
    for o in served:  # a 200 is always followed by the whole answer
        assert not o.errors, o.errors
        assert o.done
        tokens = sum(len(c["choices"][0]["text"]) > 0 for c in o.chunks if c["choices"])
        finish = [c["choices"][0]["finish_reason"] for c in o.chunks if c["choices"]]
        assert finish[-1] == "length" and tokens >= 1
    for o in refused:
        assert int(o.headers["retry-after"]) >= 1 and int(o.headers["retry-after-ms"]) >= 100
    latency = p90([o.seconds for o in refused])
    figures = {"concurrent": len(outcomes), "served": len(served), "refused": len(refused),
               "p90_429_s": round(latency, 3),
               "max_429_s": round(max(o.seconds for o in refused), 3),
               "p90_200_s": round(p90([o.seconds for o in served]), 3)}  # fmt: skip
    print(figures)
    if os.environ.get("OVERLOAD_OUT"):
        with open(os.environ["OVERLOAD_OUT"], "a") as f:
            f.write(json.dumps(figures) + "\n")
    assert_all_free(stack, within=10)
    if p90_bound is not None:
        assert latency <= p90_bound, figures  # fast: refused before any prefill or decode work
    return figures


@pytest.mark.stack  # `make test-stack`
@pytest.mark.timeout(400)
def test_overload_gets_fast_429s_and_every_started_stream_finishes(stack):
    check(stack, asyncio.run(overload(f"{stack.url}/v1/completions")), 1.0)


# Issue 18's scenario: 160 concurrent streams of ~450 prompt tokens against `make serve`'s stack
# (one prefill and one decode worker, their default admission bounds: twice their pools), with
# 16 output tokens instead of 256 so the run stays within minutes on a CPU.
SCENARIO_STREAMS = 160
SCENARIO_PROMPT = "Tell me a long story about a lighthouse keeper and the sea. " * 36


@pytest.fixture(scope="module")
def serve_stack(smol_dir, tmp_path_factory):
    config = StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("overload160")),
        port=free_port(), num_prefill=1, num_decode=1, kv_transport="grpc",
    )  # fmt: skip
    with Stack(config) as s:
        yield s


async def stream_one_lean(session, url: str, prompt: str, max_tokens: int) -> Outcome:
    """``stream_one`` over aiohttp: httpx alone takes ~1 s at p90 to get 160 concurrent
    answers even from a server that answers at once (measured against a bare Starlette app:
    httpx 1.1 s, aiohttp 0.07-0.1 s, raw sockets 0.09 s), which would hide the stack's own
    429 latency at this concurrency."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    out = Outcome()
    t0 = time.monotonic()
    async with session.post(url, json=body) as r:
        out.status, out.headers = r.status, {k.lower(): v for k, v in r.headers.items()}
        if r.status != 200:
            await r.read()
            out.seconds = time.monotonic() - t0
            return out
        async for raw in r.content:
            take_line(out, raw.decode().rstrip("\r\n"))
    out.seconds = time.monotonic() - t0
    return out


async def overload_lean(url: str, n: int, prompt: str, max_tokens: int) -> list[Outcome]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=n + 4)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return await asyncio.gather(
            *(stream_one_lean(session, url, prompt, max_tokens) for _ in range(n))
        )


def router_local_refusals(stack: Stack) -> float:
    """The router's ``tandem_router_local_refusals_total`` (requests it refused with no call)."""
    text = httpx.get(f"http://{stack.scrape_targets()['router']}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("tandem_router_local_refusals_total")]
    return float(lines[0].split()[-1])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_issue_scenario_160_streams(serve_stack):
    """No mid-stream error, no 5xx, every admitted request finishes, and 429s within 250 ms at
    p90 (issue 18's target; 0.08-0.13 s measured on 2 CPU cores at load average 2-3, see
    bench/results/overload_cpu.md): refused by the router with no call to the full decode
    worker, or by the gateway before tokenizing. A burst that lands while another job holds
    the cores misses it (0.3-0.5 s seen on the shared machine, once on a first burst), so a
    first burst warms the stack up: every check holds for it too, and the second burst's p90
    must meet the target (both are reported)."""
    url = f"{serve_stack.url}/v1/completions"
    runs = []
    for _ in range(2):  # warm-up, then measured
        outcomes = asyncio.run(overload_lean(url, SCENARIO_STREAMS, SCENARIO_PROMPT, max_tokens=16))
        runs.append(check(serve_stack, outcomes, None))
    assert runs[-1]["p90_429_s"] <= 0.25, runs
    assert router_local_refusals(serve_stack) > 0, runs
