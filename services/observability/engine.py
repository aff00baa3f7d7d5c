"""A worker's engine as Prometheus metrics: gauges and counters read at scrape time from the
engine's latest counters (``EngineClient.snapshot``, sent with its steps), and histograms fed
with each step's stats (batch sizes, step times, queue time). The engine itself imports no
metrics library."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core.client import EngineClient
from engine.step_stats import SpecStats, StepStats
from kernels.compile_counter import CompileCounts
from services.observability.metrics import LATENCY_BUCKETS, SIZE_BUCKETS

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats
    from libkv.tier_types import TierStats


class EngineCollector(Collector):
    """Queue lengths, KV blocks, prefix-cache hits and preemptions of one engine."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        snapshot = self.engine.snapshot
        if snapshot is None:
            return
        s = snapshot.stats
        yield _gauge(
            "tandem_engine_sequences_running", "Sequences in the running batch.", s.num_running
        )
        yield _gauge(
            "tandem_engine_sequences_waiting", "Sequences waiting to be scheduled.", s.num_waiting
        )
        yield _gauge(
            "tandem_engine_kv_held_requests",
            "Prefilled requests whose KV blocks are held for a decode worker.",
            snapshot.num_held,
        )
        yield _gauge(
            "tandem_engine_kv_blocks_capacity", "KV cache blocks in the pool.", s.kv_blocks_total
        )
        blocks = GaugeMetricFamily(
            "tandem_engine_kv_blocks",
            "KV cache blocks by state: used (referenced by a request), cached (free but holding "
            "a reusable prefix), free (empty).",
            labels=["state"],
        )
        blocks.add_metric(["used"], s.kv_blocks_used)
        blocks.add_metric(["cached"], s.kv_blocks_cached)
        blocks.add_metric(["free"], s.kv_blocks_total - s.kv_blocks_used - s.kv_blocks_cached)
        yield blocks
        yield _counter(
            "tandem_engine_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache instead of computed.",
            s.prefix_hit_tokens,
        )
        yield _counter(
            "tandem_engine_prompt_tokens",
            "Prompt tokens of requests that started "
            "generating (the denominator of the prefix-cache hit rate).",
            s.prompt_tokens,
        )
        yield _counter("tandem_engine_preemptions", "Sequences preempted (recomputed later) for "
                       "lack of KV blocks.", s.num_preemptions)  # fmt: skip
        yield from _spec_metrics(s.spec)
        yield from _tier_metrics(s)
        yield _compiles(s.kernel_compiles)


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """The KV tiers (``libkv.host_tier``): occupancy and prompt-token hits per tier, bytes and
    copy seconds paged in and out (bandwidth = rate of bytes / rate of seconds), and how
    preempted sequences resumed. Without a host tier only the GPU tier is reported."""
    t = s.tier
    capacity = GaugeMetricFamily(
        "tandem_engine_kv_tier_capacity_blocks", "KV blocks each tier holds at most.",
        labels=["tier"],
    )  # fmt: skip
    used = GaugeMetricFamily(
        "tandem_engine_kv_tier_used_blocks",
        "KV blocks holding data per tier (GPU: used + cached; host: cached prefixes).",
        labels=["tier"],
    )
    hits = CounterMetricFamily(
        "tandem_engine_kv_tier_hit_tokens",
        "Prompt tokens served from each tier's prefix cache instead of computed.",
        labels=["tier"],
    )
    host_tokens = t.hit_blocks * t.block_size if t is not None else 0
    d = s.disk_tier
    disk_tokens = d.hit_blocks * d.block_size if d is not None else 0
    capacity.add_metric(["gpu"], s.kv_blocks_total)
    used.add_metric(["gpu"], s.kv_blocks_used + s.kv_blocks_cached)
    hits.add_metric(["gpu"], max(s.prefix_hit_tokens - host_tokens - disk_tokens, 0))
    if t is None:
        yield from (capacity, used, hits)
        return
    capacity.add_metric(["host"], t.capacity_blocks)
    used.add_metric(["host"], t.used_blocks)
    hits.add_metric(["host"], host_tokens)
    if d is not None:
        capacity.add_metric(["disk"], d.capacity_blocks)
        used.add_metric(["disk"], d.used_blocks)
        hits.add_metric(["disk"], disk_tokens)
        yield from _disk_metrics(d)
    paged = CounterMetricFamily(
        "tandem_engine_kv_tier_page_bytes",
        "Bytes copied between the GPU pool and the host tier: out (write-through of cached "
        "blocks) and in (host hits and swapped-in sequences).",
        labels=["direction"],
    )
    paged.add_metric(["out"], t.page_out_blocks * t.block_bytes)
    paged.add_metric(["in"], t.page_in_blocks * t.block_bytes)
    seconds = CounterMetricFamily(
        "tandem_engine_kv_tier_page_seconds",
        "Device time of the host tier's copies (CUDA events; 0 on CPU), by direction.",
        labels=["direction"],
    )
    seconds.add_metric(["out"], t.page_out_seconds)
    seconds.add_metric(["in"], t.page_in_seconds)
    resumes = CounterMetricFamily(
        "tandem_engine_preemption_resumes",
        "Preempted sequences resumed, by how: swap (KV paged in from the host tier) or recompute.",
        labels=["how"],
    )
    resumes.add_metric(["swap"], t.swaps)
    resumes.add_metric(["recompute"], t.recomputes)
    yield from (capacity, used, hits, paged, seconds, resumes)
    yield _counter("tandem_engine_kv_tier_cancelled_page_outs", "Page-outs dropped because the "
                   "GPU block was evicted before its copy was issued.", t.cancelled)  # fmt: skip


def _disk_metrics(d: TierStats) -> Iterator[Metric]:
    """The disk tier's I/O (``engine.disk_store``): bytes written (out: blocks the host tier
    evicted) and read (in: disk hits), and the wall time of those writes and reads."""
    nbytes = CounterMetricFamily(
        "tandem_engine_kv_disk_tier_bytes",
        "Bytes written to the disk KV tier (out: blocks the host tier evicted) and read back "
        "(in: prompt blocks found only on disk).",
        labels=["direction"],
    )
    nbytes.add_metric(["out"], d.page_out_blocks * d.block_bytes)
    nbytes.add_metric(["in"], d.page_in_blocks * d.block_bytes)
    seconds = CounterMetricFamily(
        "tandem_engine_kv_disk_tier_seconds",
        "Wall time of the disk KV tier's writes (writer thread) and reads, by direction.",
        labels=["direction"],
    )
    seconds.add_metric(["out"], d.page_out_seconds)
    seconds.add_metric(["in"], d.page_in_seconds)
    yield from (nbytes, seconds)


def _spec_metrics(spec: SpecStats) -> Iterator[Metric]:
    """Speculative decoding: drafts verified, their tokens, and the tokens the model kept (in
    all, and by position in the draft: acceptance rate at position j = per_pos[j] / drafts)."""
    yield _counter(
        "tandem_engine_spec_decode_drafts",
        "Speculative drafts verified (one per sequence and step that had one).",
        spec.drafts,
    )
    yield _counter(
        "tandem_engine_spec_decode_draft_tokens", "Draft tokens verified.", spec.draft_tokens
    )
    yield _counter(
        "tandem_engine_spec_decode_accepted_tokens",
        "Draft tokens the model confirmed (each saves one forward pass).",
        spec.accepted_tokens,
    )
    per_pos = CounterMetricFamily(
        "tandem_engine_spec_decode_accepted_tokens_per_pos",
        "Draft tokens confirmed, by their position in the draft (0: the first).",
        labels=["position"],
    )
    for j, n in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([str(j)], n)
    yield per_pos


def _compiles(counts: CompileCounts) -> CounterMetricFamily:
    """Triton kernel compiles of the engine's process: during the warm-up (before ready), and
    while serving (each a stall of the batch, and a warning in the log: the warm-up missed a
    kernel specialisation). Loads from Triton's on-disk cache count as compiles."""
    family = CounterMetricFamily(
        "tandem_kernel_compiles",
        "Triton kernel specialisations compiled (or loaded from Triton's on-disk cache) by the "
        "engine's process, by phase: warmup (before the worker was ready) or serving (after: "
        "stalls the warm-up should have prevented).",
        labels=["phase"],
    )
    family.add_metric(["warmup"], counts.warmup)
    family.add_metric(["serving"], counts.serving)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class StepMetrics:
    """The engine's ``on_step`` observer: per step, its time and batch, by phase (``prefill``
    when any prompt tokens were computed, else ``decode``), and each request's queue time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "tandem_engine_step_duration_seconds",
            "Wall time of one engine step (schedule, forward pass, sampling), by phase.",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_seqs = Histogram(
            "tandem_engine_batch_size_sequences",
            "Sequences in one engine step, by phase.",
            ["phase"],
            buckets=SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "tandem_engine_batch_size_tokens",
            "Tokens computed in one engine step (prompt chunks, one per decoding sequence, and "
            "speculative draft tokens).",
            ["phase"],
            buckets=SIZE_BUCKETS,
            registry=registry,
        )
        self.queue = Histogram(
            "tandem_engine_queue_time_seconds",
            "Time from a request's arrival at the engine to its first step.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.first_token = Histogram(
            "tandem_engine_time_to_first_token_seconds",
            "Time from a request's arrival at the engine to its first token read back: the "
            "engine's part of its TTFT (queue time plus its prompt's steps; the gateway's TTFT "
            "less this is the services' part).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.prefill = Histogram(
            "tandem_engine_prefill_time_seconds",
            "Time from a request's first step to its first token read back (its prompt's steps).",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        for phase in ("prefill", "decode"):
            for h in (self.duration, self.batch_seqs, self.batch_tokens):
                h.labels(phase)

    def __call__(self, step: StepStats) -> None:
        phase = step.phase
        self.duration.labels(phase).observe(step.seconds)
        self.batch_seqs.labels(phase).observe(step.num_seqs)
        self.batch_tokens.labels(phase).observe(step.num_tokens)
        for q in step.queue_seconds:
            self.queue.observe(q)
        for t in step.first_token_seconds:
            self.first_token.observe(t)
        for t in step.prefill_seconds:
            self.prefill.observe(t)


def observe_engine(engine: EngineClient, registry: CollectorRegistry) -> None:
    """Export ``engine`` on ``registry``: scrape-time collector plus the step observer."""
    registry.register(EngineCollector(engine))
    engine.on_step = StepMetrics(registry)
