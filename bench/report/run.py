"""One measured run of ``tandem bench`` and how its load is named."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.engine_steps import PhaseSteps
from bench.gpu_busy import GpuBusy
from bench.handoff import HandoffReport
from bench.kv_stats import CacheReport
from bench.metrics import Summary
from bench.runner import RunResult


@dataclass(frozen=True, slots=True)
class RunReport:
    """One measured run and its aggregates."""

    result: RunResult
    summary: Summary
    cache: CacheReport | None = None  # local stacks: prefix hits and block-location writes
    handoff: HandoffReport | None = None  # local stacks: the KV hand-off (bench.handoff)
    gpu_busy: GpuBusy | None = None  # hosts with nvidia-smi: how busy the GPUs were
    cpu: dict[str, float] | None = None  # local stacks: CPU cores of each process
    steps: dict[str, PhaseSteps] | None = None  # local stacks: engine steps by phase
    compiles: int | None = None  # local stacks: kernels compiled while serving (none expected)
    ttft: dict[str, float] | None = None  # local stacks: where TTFT went (engine_steps.ttft_split)
    hops: dict[str, float] | None = None  # stacks with traces: TTFT hop by hop (bench.ttft_hops)

    @property
    def rate_label(self) -> str:
        return rate_label(self.result)


def rate_label(result: RunResult) -> str:
    """How a run's load is named in tables: its rate, the trace's speed, its concurrency."""
    label = "inf" if math.isinf(result.rate) else f"{result.rate:g}"
    if result.trace_speed is not None:  # at the trace's own times
        label = f"trace x{result.trace_speed:g}"
    return label if result.concurrency is None else f"{label} c={result.concurrency}"
