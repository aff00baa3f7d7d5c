"""One ``tandem bench`` run: one workload at one rate against one target, with what is measured
beside the requests (the GPUs' busy time, the processes' CPU cores and, on a local stack, the
workers' prefix-cache stats and every process's metrics before and after)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench import engine_steps, handoff, kv_stats, ttft_hops
from bench.cli_args import BUNDLED_MODEL
from bench.engine_steps import PhaseSteps
from bench.gpu_busy import GpuSampler
from bench.handoff import HandoffReport
from bench.metrics import SLO, summarize
from bench.proc_cpu import CpuMeter, with_engines
from bench.report import RunReport, rate_label
from bench.runner import Endpoint, LoadConfig, RequestOptions, RunResult, run_load
from bench.stacks import StackSpec, running_stack
from bench.workloads import Workload
from services.launcher.options import worker_overrides


@dataclass(frozen=True, slots=True)
class Target:
    """A target ready for load. A plain endpoint has only ``endpoint``; a local stack also the
    means to look inside it, all keyed by process name."""

    endpoint: Endpoint
    workers: dict[str, str] = field(default_factory=dict)  # gRPC addresses (worker Stats)
    scrape: dict[str, str] = field(default_factory=dict)  # /metrics addresses (hand-off, steps)
    pids: dict[str, int] = field(default_factory=dict)  # for CPU time
    run_dir: Path | None = None  # its logs, and its metrics before and after each run
    model_dir: str = ""  # the model it serves (its tokenizer counts the prompts' blocks)


@dataclass(frozen=True, slots=True)
class Measure:
    """How every run is sent and judged: the same for each target, workload and rate."""

    request: RequestOptions
    warmup: int  # unmeasured requests before each run
    slo: SLO
    gpus: str  # the GPUs sampled for busy time ("": every GPU)


@contextlib.contextmanager
def open_target(target: Endpoint | StackSpec, args: argparse.Namespace, i: int) -> Iterator[Target]:
    """The i-th target, ready: an endpoint as it is; a stack started (logs under ``--logs``, a
    temp dir if not given, which is then kept in ``args.logs``) and stopped on leaving."""
    if isinstance(target, Endpoint):
        yield Target(target, scrape=endpoint_metrics(target))
        return
    overrides = worker_overrides(args)
    if args.logs is None:
        args.logs = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    run_dir = args.logs / f"{i}-{target.name.replace(':', '-')}"
    print(f"starting stack {target.name} (logs: {run_dir}/logs) ...", flush=True)
    model = str(model_dir(args))
    with running_stack(target, model, run_dir, **overrides) as (endpoint, stack):
        workers = {
            name: child.address
            for name, child in stack.children.items()
            if name.startswith(("prefill", "decode"))
        }
        pids = {n: c.proc.pid for n, c in stack.children.items() if c.proc is not None}
        yield Target(endpoint, workers, stack.scrape_targets(), with_engines(pids), run_dir, model)


def endpoint_metrics(endpoint: Endpoint) -> dict[str, str]:
    """``{"server": HOST:PORT}`` where the endpoint's server answers ``/metrics`` beside its
    ``/v1`` (vLLM's does: `bench.engine_steps` reads its TTFT parts from it), else empty."""
    url = urllib.parse.urlsplit(endpoint.base_url)
    if url.scheme != "http" or url.path.rstrip("/") not in ("", "/v1"):
        return {}
    try:
        with urllib.request.urlopen(f"http://{url.netloc}/metrics", timeout=5) as r:
            r.read(1)
    except (OSError, ValueError):  # (HTTPError is an OSError)
        return {}
    return {"server": url.netloc}


def gpu_list(args: argparse.Namespace) -> str:
    """The GPUs a run is measured on: the stacks' ``--gpus`` where named, else every GPU."""
    gpus = getattr(args, "gpus", "auto")
    return gpus if gpus not in ("auto", "none", None) else ""


def model_dir(args: argparse.Namespace) -> Path:
    """``--model-dir``; the bundled model is converted first (once: later calls find it)."""
    if args.model_dir == BUNDLED_MODEL:
        from engine.bundled import convert  # converts once; imports torch, so only when needed

        return Path(convert(BUNDLED_MODEL))
    return args.model_dir


def measure(target: Target, workload: Workload, load: LoadConfig, how: Measure) -> RunReport:
    """Send ``workload`` at ``load`` to ``target`` and report it, with what was measured
    beside it (a stack's metrics are saved under its ``run_dir``)."""
    before = _worker_stats(target.workers) if target.workers else None
    was = None
    if target.scrape:
        try:
            was = handoff.stack_metrics(target.scrape)
        except OSError:
            if target.run_dir is not None:  # a stack's metrics are part of its report
                raise
    traced = ttft_hops.offsets(target.run_dir) if target.run_dir is not None else {}
    meter = CpuMeter(target.pids)
    with GpuSampler(gpus=how.gpus) as busy:
        meter.start()
        result = asyncio.run(run_load(target.endpoint, workload, load, how.request, how.warmup))
        cpu = meter.stop(result.duration) if target.pids else None
    # The load generator's own share: near 1.0 it, not the server, sets the pace.
    cpu = {**(cpu or {}), "bench client": result.client_cores}
    cache = None
    if before is not None:  # a local stack: prefix hits and block-location writes
        prompts = kv_stats.prompts_in_order(
            workload, result.records, target.model_dir, how.request.api
        )
        with contextlib.suppress(grpc.RpcError):  # _worker_stats said why
            after = _worker_stats(target.workers, raising=True)
            cache = kv_stats.cache_report_of(before, after, prompts, result.duration)
    hand = steps = compiles = ttft = None
    if was is not None and target.run_dir is not None:  # a local stack: its processes' metrics
        folder = target.run_dir / "metrics"
        folder /= f"{workload.name}-{rate_label(result)}".replace(" ", "-")
        hand, steps, compiles, ttft = _from_metrics(target.scrape, was, result, folder)
    elif was is not None:  # an endpoint that exports its metrics: where its TTFT went
        with contextlib.suppress(OSError):
            now = handoff.stack_metrics(target.scrape)
            ttft = engine_steps.ttft_split(engine_steps.snapshot(was), engine_steps.snapshot(now))
            ttft = ttft or None
    hops = ttft_hops.hops(ttft_hops.new_spans(target.run_dir, traced)) if traced else None
    summary = summarize(result.records, result.duration, how.slo)
    window = busy.result.window(result.started, result.started + result.duration)
    return RunReport(result, summary, cache, hand, window, cpu, steps, compiles, ttft, hops)


def _worker_stats(
    workers: dict[str, str], raising: bool = False
) -> dict[str, kv_stats.WorkerCounters] | None:
    """The workers' Stats counters; when one does not answer, a warning and None (or the error
    with ``raising``): a report without the prefix-cache figures, not a lost run."""
    try:
        return kv_stats.snapshot(workers)
    except grpc.RpcError as e:
        print(f"  warning: a worker's Stats went unanswered ({e.code().name}): no prefix-cache "
              "figures for this run", flush=True)  # fmt: skip
        if raising:
            raise
        return None


def _from_metrics(
    scrape: dict[str, str], was: dict[str, str], result: RunResult, folder: Path
) -> tuple[HandoffReport, dict[str, PhaseSteps], int, dict[str, float]]:
    """A local stack's hand-off, engine steps, kernel compiles and where TTFT went over a run,
    from every process's /metrics before it (``was``) and now; both readings are saved in
    ``folder``."""
    now = handoff.stack_metrics(scrape)
    for when, texts in (("before", was), ("after", now)):
        handoff.save(texts, folder, when)
    hand = handoff.report(handoff.snapshot(was), handoff.snapshot(now), result.records)
    a, b = engine_steps.snapshot(was), engine_steps.snapshot(now)
    steps, ttft = engine_steps.report(a, b), engine_steps.ttft_split(a, b)
    return hand, steps, engine_steps.serving_compiles(a, b), ttft
