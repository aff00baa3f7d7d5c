"""The engine steps of a ``tandem bench --stack`` run, from every worker's metrics.

Each worker's ``/metrics`` is read before and after a run; the difference of the step
histograms (``tandem_engine_step_duration_seconds`` and ``tandem_engine_batch_size_sequences``,
both by ``phase``: ``prefill`` for a step that computed any prompt tokens, a mixed step
included, else ``decode``) gives, per phase, the steps taken, their mean wall time and their
mean batch. That splits a stream's TPOT into what the engine spent per step and how often a
decode shared its step with a prompt chunk: the stack's TPOT against its own decode step is
the services' overhead, and the decode step against an in-process one the engine loop's.
The same reads give the Triton kernels compiled while serving (``tandem_kernel_compiles_total``,
phase ``serving``): each is a stall of the batch that the warm-up should have prevented; and
where a request's TTFT went, in the means of the gateway's TTFT and the engine's part of it
(arrival at the engine to the first token read back), split into queue time and the prompt's
steps: the gateway's less the engine's is the services' part (gateway, router, the hops to the
worker and back; in a disaggregated stack also the hand-off). Against a vLLM endpoint
(``--endpoint``), its server's ``/metrics`` gives the same split: its API server's TTFT in the
gateway's place, its engine's queue time and prefill time (scheduled to first token), whose
sum is its engine's part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DURATION = "tandem_engine_step_duration_seconds"
BATCH = "tandem_engine_batch_size_sequences"
COMPILES = "tandem_kernel_compiles"
# Where TTFT went: each part's histogram (means over the run).
TTFT_PARTS = {
    "gateway": "tandem_gateway_time_to_first_token_seconds",
    "engine": "tandem_engine_time_to_first_token_seconds",
    "queue": "tandem_engine_queue_time_seconds",
    "prompt steps": "tandem_engine_prefill_time_seconds",
}
# The same parts in a vLLM server's metrics ("engine" = queue + prompt steps; vLLM observes
# these two when a request finishes, its TTFT at the first token).
VLLM_TTFT_PARTS = {
    "gateway": "vllm:time_to_first_token_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "prompt steps": "vllm:request_prefill_time_seconds",
}
_FAMILIES = (DURATION, BATCH, COMPILES, *TTFT_PARTS.values(), *VLLM_TTFT_PARTS.values())
PHASES = ("decode", "prefill")

# (metric, phase, "sum" | "count") -> value, summed over workers
Counters = dict[tuple[str, str, str], float]


def parse_metrics(text: str) -> Counters:
    """The step and TTFT histograms' sums and counts, and the kernel compiles counter, in one
    process's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Counters = {}
    for family in text_string_to_metric_families(text):
        if family.name not in _FAMILIES:
            continue
        for s in family.samples:
            kind = s.name.rsplit("_", 1)[-1]
            if kind in ("sum", "count", "total"):
                key = (family.name, s.labels.get("phase", ""), kind)
                out[key] = out.get(key, 0.0) + s.value
    return out


def snapshot(texts: Mapping[str, str]) -> Counters:
    """The counters summed over every worker (name -> its ``/metrics`` text, as
    ``bench.handoff.stack_metrics`` reads them; processes without an engine add nothing)."""
    total: Counters = {}
    for text in texts.values():
        for key, value in parse_metrics(text).items():
            total[key] = total.get(key, 0.0) + value
    return total


@dataclass(frozen=True, slots=True)
class PhaseSteps:
    """One phase's steps in a run: how many, their mean wall time and mean batch (sequences),
    and their share of the steps' summed wall time."""

    steps: int
    mean_ms: float
    mean_batch: float
    time_share: float


def report(before: Counters, after: Counters) -> dict[str, PhaseSteps]:
    """Per phase, the steps between two snapshots (phases with no step are left out)."""

    def delta(metric: str, phase: str, kind: str) -> float:
        key = (metric, phase, kind)
        return after.get(key, 0.0) - before.get(key, 0.0)

    seconds = {p: delta(DURATION, p, "sum") for p in PHASES}
    total = sum(seconds.values())
    out: dict[str, PhaseSteps] = {}
    for p in PHASES:
        n = delta(DURATION, p, "count")
        if n <= 0:
            continue
        out[p] = PhaseSteps(
            steps=round(n),
            mean_ms=seconds[p] / n * 1000,
            mean_batch=delta(BATCH, p, "sum") / max(delta(BATCH, p, "count"), 1.0),
            time_share=seconds[p] / total if total > 0 else math.nan,
        )
    return out


def serving_compiles(before: Counters, after: Counters) -> int:
    """Kernels the workers compiled while serving between two snapshots."""
    key = (COMPILES, "serving", "total")
    return round(after.get(key, 0.0) - before.get(key, 0.0))


def ttft_split(before: Counters, after: Counters) -> dict[str, float]:
    """Mean milliseconds of each part of TTFT between two snapshots (`TTFT_PARTS`, or a vLLM
    server's `VLLM_TTFT_PARTS`; a part with no sample is left out), and ``services``: the
    gateway's mean less the engine's."""

    def means(parts: Mapping[str, str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for part, metric in parts.items():
            n = after.get((metric, "", "count"), 0.0) - before.get((metric, "", "count"), 0.0)
            if n > 0:
                total = after.get((metric, "", "sum"), 0.0) - before.get((metric, "", "sum"), 0.0)
                out[part] = total / n * 1000
        return out

    out = means(TTFT_PARTS)
    if not out:
        out = means(VLLM_TTFT_PARTS)
        if "queue" in out and "prompt steps" in out:
            out["engine"] = out["queue"] + out["prompt steps"]
    if "gateway" in out and "engine" in out:
        out["services"] = out["gateway"] - out["engine"]
    return out


def render_ttft(rows: Sequence[tuple[str, str, str, Mapping[str, float]]]) -> str:
    """Markdown table of `ttft_split` per (endpoint, workload, rate)."""
    parts = [*TTFT_PARTS, "services"]
    lines = [
        "| endpoint | workload | rate | " + " | ".join(f"{p} ms" for p in parts) + " |",
        "|---|---|---|" + "---:|" * len(parts),
    ]
    for endpoint, workload, rate, split in rows:
        cells = [f"{split[p]:.1f}" if p in split else "-" for p in parts]
        lines.append(f"| {endpoint} | {workload} | {rate} | {' | '.join(cells)} |")
    return "\n".join(lines)


def render(rows: Sequence[tuple[str, str, str, dict[str, PhaseSteps], int | None]]) -> str:
    """Markdown table: one row per (endpoint, workload, rate), with the kernels compiled while
    serving (None: not known)."""
    lines = [
        "| endpoint | workload | rate | decode steps | mean ms | mean batch "
        "| steps with a prompt | mean ms | mean batch | their share of step time "
        "| kernel compiles |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for endpoint, workload, rate, phases, compiles in rows:
        cells = []
        for p in PHASES:
            s = phases.get(p)
            cells += (
                [str(s.steps), f"{s.mean_ms:.2f}", f"{s.mean_batch:.1f}"] if s else ["0", "-", "-"]
            )
        pre = phases.get("prefill")
        share = "-" if pre is None or math.isnan(pre.time_share) else f"{pre.time_share:.0%}"
        built = "-" if compiles is None else str(compiles)
        lines.append(
            f"| {endpoint} | {workload} | {rate} | {' | '.join(cells)} | {share} | {built} |"
        )
    return "\n".join(lines)


def one_line(phases: Mapping[str, PhaseSteps]) -> str:
    """The run's steps in one line for the console."""
    parts = [
        f"{p} {s.steps} x {s.mean_ms:.2f} ms (batch {s.mean_batch:.1f})" for p, s in phases.items()
    ]
    return "engine steps: " + ("; ".join(parts) if parts else "none")
