"""Drives an OpenAI-compatible endpoint with a lean streaming client (``bench.sse_client``).

Arrivals: units (one request, or one multi-turn session whose turns follow each other) start
at Poisson arrival times of the given rate (``inf``: all at once), or at a trace replay's own
times (``LoadConfig.trace_speed``: the workload's ``arrivals``), optionally capped at a
number in flight (``concurrency``; with ``rate=inf`` that is a fixed concurrency). The run
sends every request of the workload, or stops sending once ``time_limit`` seconds have passed;
requests already in flight then finish and count. Times come from ``time.perf_counter``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from dataclasses import dataclass, field
from time import perf_counter, process_time

from bench.metrics import RequestRecord, record_from_trace
from bench.sse_client import StreamClient
from bench.workloads import Message, RequestSpec, Workload


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An OpenAI-compatible server: ``base_url`` ends in ``/v1``; ``model`` None asks
    ``/v1/models`` for the first one."""

    name: str
    base_url: str
    api_key: str = "EMPTY"
    model: str | None = None


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How requests arrive. ``trace_speed`` set: at the workload's own ``arrivals`` (a trace
    replay's, already divided by that speed, which is recorded); ``rate`` is then unused."""

    rate: float = math.inf
    concurrency: int | None = None
    time_limit: float | None = None
    seed: int = 0
    trace_speed: float | None = None


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How each request is sent. ``ignore_eos`` goes in ``extra_body`` (a vLLM extension that
    Tandem's gateway also accepts), making ``max_tokens`` the exact output length; so does
    ``slo_ms`` (TTFT, TPOT objectives in ms: Tandem's per-request ``slo_ttft_ms`` and
    ``slo_tpot_ms``, which its router places prefills by) when given."""

    api: str = "chat"  # or "completions"
    ignore_eos: bool = True
    temperature: float = 0.0
    timeout: float = 600.0
    progress: bool = True
    slo_ms: tuple[float, float] | None = None

    def extra_body(self) -> dict:
        """The fields each request sends beyond OpenAI's."""
        body: dict = {"ignore_eos": True} if self.ignore_eos else {}
        if self.slo_ms is not None:
            body |= {"slo_ttft_ms": self.slo_ms[0], "slo_tpot_ms": self.slo_ms[1]}
        return body


@dataclass(slots=True)
class RunResult:
    endpoint: str
    workload: str
    rate: float
    concurrency: int | None
    duration: float
    records: list[RequestRecord] = field(default_factory=list)
    not_sent: int = 0
    seed: int = 0  # the workload's
    trace_speed: float | None = None  # at a trace's own times (then rate is their mean rate)
    started: float = 0.0  # perf_counter() when the measured requests began (after warm-up)
    client_cores: float = 0.0  # this process's CPU over the measured window, in cores


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Offsets (s) of ``n`` Poisson arrivals at ``rate`` per second, the first at 0. The same
    seed gives the same unit-rate draws at every rate (they are scaled by ``1 / rate``)."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(f"arrivals:{seed}")
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(1.0) / rate
        out.append(t)
    return out


def offered_rate(arrivals: tuple[float, ...]) -> float:
    """Mean arrivals per second over their span (inf when all arrive at once)."""
    span = arrivals[-1] - arrivals[0] if arrivals else 0.0
    return (len(arrivals) - 1) / span if span > 0 else math.inf


def _arrivals(workload: Workload, load: LoadConfig) -> list[float]:
    if load.trace_speed is None:
        return arrival_times(len(workload.units), load.rate, load.seed)
    if workload.arrivals is None:
        raise ValueError(f"{workload.name} has no arrival times of its own (not a trace)")
    return list(workload.arrivals)


def make_client(endpoint: Endpoint, opts: RequestOptions) -> StreamClient:
    """The streaming client (no retries: a failure is a result)."""
    return StreamClient(endpoint.base_url, endpoint.api_key, opts.timeout)


async def resolve_model(client: StreamClient, endpoint: Endpoint) -> str:
    if endpoint.model:
        return endpoint.model
    ids = await client.model_ids()
    if not ids:
        raise RuntimeError(f"{endpoint.base_url}/models lists no model; pass --model")
    return ids[0]


async def send(
    client, model: str, spec: RequestSpec, opts: RequestOptions, t0: float
) -> RequestRecord:
    """Send one streamed request; the record of what happened (errors are recorded, not
    raised)."""
    chat = opts.api == "chat"
    body: dict = {
        "model": model,
        "max_tokens": spec.output_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **opts.extra_body(),
    }
    if chat:
        body["messages"] = [{"role": m.role, "content": m.content} for m in spec.messages]
    else:
        body["prompt"] = spec.prompt
    chunk_times: list[float] = []
    usage = None
    error = None
    sent = perf_counter()
    try:
        async for chunk in client.stream("/chat/completions" if chat else "/completions", body):
            now = perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(_text(choice, chat) for choice in chunk.get("choices") or ()):
                chunk_times.append(now)
    except Exception as e:  # every failure is a recorded outcome, never raised
        error = f"{type(e).__name__}: {str(e)[:300]}"
    end = perf_counter()
    return record_from_trace(
        spec.request_id,
        t0,
        sent,
        chunk_times,
        end,
        usage["prompt_tokens"] if usage else spec.input_tokens,
        usage["completion_tokens"] if usage else len(chunk_times),
        error=error,
        target_input_tokens=spec.input_tokens,
        target_output_tokens=spec.output_tokens,
        session=spec.session,
        turn=spec.turn,
    )


def _text(choice: dict, chat: bool) -> str | None:
    """A streamed choice's new text (a chat chunk's ``delta.content``, else ``text``)."""
    if chat:
        return (choice.get("delta") or {}).get("content")
    return choice.get("text")


async def warm_up(client: StreamClient, model: str, n: int, opts: RequestOptions) -> None:
    """``n`` short requests before measuring (first-request costs: connections, lazy init)."""
    for i in range(n):
        spec = RequestSpec(f"warmup-{i}", (Message("user", "Say hello."),), 3, 4)
        rec = await send(client, model, spec, opts, perf_counter())
        if not rec.ok:
            raise RuntimeError(f"warm-up request failed: {rec.error}")


async def run_load(
    endpoint: Endpoint,
    workload: Workload,
    load: LoadConfig,
    opts: RequestOptions,
    warmup: int = 1,
) -> RunResult:
    """Run ``workload`` against ``endpoint`` under ``load``; every sent request is recorded."""
    from tqdm import tqdm

    client = make_client(endpoint, opts)
    try:
        model = await resolve_model(client, endpoint)
        await warm_up(client, model, warmup, opts)
        rate_value = load.rate
        if load.trace_speed is not None:
            rate_value = offered_rate(tuple(_arrivals(workload, load)))
        result = RunResult(endpoint.name, workload.name, rate_value, load.concurrency, 0.0)
        result.seed, result.trace_speed = workload.config.seed, load.trace_speed
        total = len(workload.requests)
        rate = "inf" if math.isinf(load.rate) else f"{load.rate:g}"
        if load.trace_speed is not None:
            rate = f"trace x{load.trace_speed:g}"
        desc = f"{endpoint.name} {workload.name} rate={rate}"
        with tqdm(total=total, desc=desc, unit="req", disable=not opts.progress) as bar:
            t0 = result.started = perf_counter()
            cpu0 = process_time()
            await _drive(client, model, workload, load, opts, t0, result, bar)
            result.duration = perf_counter() - t0
            result.client_cores = (process_time() - cpu0) / max(result.duration, 1e-9)
        result.records.sort(key=lambda r: r.start)
        result.not_sent = total - len(result.records)
        return result
    finally:
        await client.close()


async def _drive(client, model, workload, load, opts, t0, result, bar) -> None:
    deadline = t0 + load.time_limit if load.time_limit else math.inf
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency else None

    async def unit_task(unit: tuple[RequestSpec, ...]) -> None:
        async with slots if slots is not None else contextlib.nullcontext():
            for spec in unit:
                if perf_counter() >= deadline:
                    return
                rec = await send(client, model, spec, opts, t0)
                result.records.append(rec)
                bar.update(1)
                if not rec.ok:
                    bar.set_postfix(failed=sum(not r.ok for r in result.records))

    tasks = []
    arrivals = _arrivals(workload, load)
    for at, unit in zip(arrivals, workload.units, strict=True):
        when = t0 + at
        if when >= deadline:
            break
        if when > perf_counter():
            await asyncio.sleep(when - perf_counter())
        tasks.append(asyncio.create_task(unit_task(unit)))
    await asyncio.gather(*tasks)
