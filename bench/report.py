"""Results of a ``tandem bench`` run: the table, the compare ratios, JSON with every request,
a markdown page, and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.engine_steps import PhaseSteps
from bench.engine_steps import render as render_steps
from bench.gpu_busy import GpuBusy
from bench.handoff import HandoffReport
from bench.handoff import render as render_handoff
from bench.kv_stats import CacheReport, render_cache_table
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

    @property
    def rate_label(self) -> str:
        return rate_label(self.result)


def rate_label(result: RunResult) -> str:
    """How a run's load is named in tables: its rate, the trace's speed, its concurrency."""
    label = "inf" if math.isinf(result.rate) else f"{result.rate:g}"
    if result.trace_speed is not None:  # at the trace's own times
        label = f"trace x{result.trace_speed:g}"
    return label if result.concurrency is None else f"{label} c={result.concurrency}"


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def _s(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}"


TABLE_HEAD = (
    "| endpoint | workload | rate | ok/sent | req/s | out tok/s | TTFT p50/p90/p99 ms "
    "| TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p99 s | goodput req/s | SLO met |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def render_table(reports: Sequence[RunReport]) -> str:
    """A markdown table, one row per run."""
    lines = [TABLE_HEAD]
    for rep in reports:
        s, r = rep.summary, rep.result
        lines.append(
            f"| {r.endpoint} | {r.workload} | {rep.rate_label} | {s.completed}/{s.sent} "
            f"| {_s(s.request_throughput)} | {s.output_token_throughput:.1f} "
            f"| {_ms(s.ttft.p50)}/{_ms(s.ttft.p90)}/{_ms(s.ttft.p99)} "
            f"| {_ms(s.tpot.p50)}/{_ms(s.tpot.p90)}/{_ms(s.tpot.p99)} "
            f"| {_ms(s.itl.p50)}/{_ms(s.itl.p90)}/{_ms(s.itl.p99)} "
            f"| {_s(s.e2e.p50)}/{_s(s.e2e.p99)} | {s.goodput:.3f} | {s.slo_attainment:.0%} |"
        )
    return "\n".join(lines)


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or b == 0:
        return "n/a"
    return f"{a / b:.2f}x"


def render_ratios(reports: Sequence[RunReport]) -> str | None:
    """Each endpoint against the first one, per workload and rate (None with one endpoint).
    Throughputs: higher is better; latencies: lower is better."""
    names = list(dict.fromkeys(rep.result.endpoint for rep in reports))
    if len(names) < 2:
        return None
    by_key = {(rep.result.endpoint, rep.result.workload, rep.rate_label): rep for rep in reports}
    lines = [
        f"Ratios against `{names[0]}` (throughput: higher is better; latency: lower is better)",
        "",
        "| endpoint | workload | rate | goodput | req/s | out tok/s | TTFT p50 | TTFT p99 "
        "| TPOT p50 | TPOT p99 | E2E p50 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for (name, workload, rate), rep in by_key.items():
        base = by_key.get((names[0], workload, rate))
        if name == names[0] or base is None:
            continue
        s, b = rep.summary, base.summary
        cells = [
            _ratio(s.goodput, b.goodput),
            _ratio(s.request_throughput, b.request_throughput),
            _ratio(s.output_token_throughput, b.output_token_throughput),
            _ratio(s.ttft.p50, b.ttft.p50),
            _ratio(s.ttft.p99, b.ttft.p99),
            _ratio(s.tpot.p50, b.tpot.p50),
            _ratio(s.tpot.p99, b.tpot.p99),
            _ratio(s.e2e.p50, b.e2e.p50),
        ]
        lines.append(f"| {name} | {workload} | {rate} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """CPU model, core count, load average and software versions, for the results page."""
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _clean(x):
    """JSON-safe: NaN and infinities become null (strict JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def to_json(meta: dict, reports: Sequence[RunReport]) -> dict:
    runs = []
    for rep in reports:
        r = rep.result
        records = [{**dataclasses.asdict(rec), "tpot": rec.tpot, "ok": rec.ok} for rec in r.records]
        runs.append(
            {
                "endpoint": r.endpoint,
                "workload": r.workload,
                "rate": "inf" if math.isinf(r.rate) else r.rate,
                "concurrency": r.concurrency,
                "not_sent": r.not_sent,
                "seed": r.seed,
                "trace_speed": r.trace_speed,
                "summary": dataclasses.asdict(rep.summary),
                "cache": dataclasses.asdict(rep.cache) if rep.cache else None,
                "handoff": dataclasses.asdict(rep.handoff) if rep.handoff else None,
                "gpu_busy": _busy_json(rep.gpu_busy),
                "cpu_cores": rep.cpu,
                "engine_steps": (
                    {p: dataclasses.asdict(v) for p, v in rep.steps.items()} if rep.steps else None
                ),
                "kernel_compiles_serving": rep.compiles,
                "records": records,
            }
        )
    return _clean({**meta, "runs": runs})


def _busy_json(busy: GpuBusy | None) -> dict | None:
    if busy is None or busy.mean is None:
        return None
    return {"mean": busy.mean, "p10": busy.p10, "samples": busy.samples, "times": busy.times}


def render_resources(reports: Sequence[RunReport]) -> str | None:
    """GPU busy (mean and the quietest tenth of the samples) and each process's CPU cores, per
    run (None when no run measured either)."""
    rows = [r for r in reports if (r.gpu_busy and r.gpu_busy.mean is not None) or r.cpu]
    if not rows:
        return None
    lines = [
        "| endpoint | workload | rate | GPU busy mean / p10 | CPU cores by process |",
        "|---|---|---|---:|---|",
    ]
    for rep in rows:
        b = rep.gpu_busy
        busy = "-"
        if b is not None and b.mean is not None and b.p10 is not None:
            busy = f"{b.mean:.0f}% / {b.p10:.0f}%"
        cpu = ", ".join(f"{n} {c:.2f}" for n, c in sorted((rep.cpu or {}).items())) or "-"
        r = rep.result
        lines.append(f"| {r.endpoint} | {r.workload} | {rep.rate_label} | {busy} | {cpu} |")
    return "\n".join(lines)


def write_json(path: Path, meta: dict, reports: Sequence[RunReport]) -> None:
    path.write_text(json.dumps(to_json(meta, reports), indent=1, allow_nan=False) + "\n")


def write_markdown(path: Path, meta: dict, reports: Sequence[RunReport], notes: str = "") -> None:
    m = meta["machine"]
    lines = [
        "# tandem bench",
        "",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- machine: {m['cpu_model']}, {m['cpu_count']} cores; load average (1/5/15 min) at "
        f"the start {m['loadavg']}, at the end {meta.get('loadavg_end', '?')}",
        f"- SLO: TTFT <= {meta['slo']['ttft'] * 1000:g} ms and TPOT <= "
        f"{meta['slo']['tpot'] * 1000:g} ms; goodput = requests/s meeting both",
        "",
        render_table(reports),
    ]
    ratios = render_ratios(reports)
    if ratios:
        lines += ["", ratios]
    traces = [w for w in meta.get("workloads", []) if w.get("trace")]
    if traces:
        lines += ["", TRACE_INTRO, "", render_traces(traces)]
    caches = [(r.result.endpoint, r.result.workload, r.cache) for r in reports if r.cache]
    if caches:
        lines += ["", "Prefix cache (from worker stats) and block-location writes to etcd", ""]
        lines.append(render_cache_table(caches))
    resources = render_resources(reports)
    if resources:
        lines += ["", "GPU busy (nvidia-smi's utilization.gpu every 100 ms) and CPU cores", ""]
        lines.append(resources)
    handoffs = [
        (r.result.endpoint, r.result.workload, r.rate_label, r.handoff)
        for r in reports
        if r.handoff
    ]
    if handoffs:
        lines += ["", "KV hand-off (from the decode workers' metrics; see bench/handoff.py)", ""]
        lines.append(render_handoff(handoffs))
    steps = [
        (r.result.endpoint, r.result.workload, r.rate_label, r.steps, r.compiles)
        for r in reports
        if r.steps is not None
    ]
    if steps:
        lines += ["", "Engine steps (every worker's metrics; see bench/engine_steps.py)", ""]
        lines.append(render_steps(steps))
    if notes:
        lines += ["", notes]
    path.write_text("\n".join(lines) + "\n")


TRACE_INTRO = (
    "Trace replays: what was sent, and the prefix sharing the trace itself has (tokens in "
    "leading blocks an earlier request of the replay had; compare with the servers' prefix hit "
    "rate). One row per workload: every rate of a sweep replays the same requests with fresh "
    "text; a run at `trace xS` keeps the trace's times divided by S, a `--rate` run replaces "
    "them with Poisson arrivals."
)


def render_traces(workloads: Sequence[dict]) -> str:
    """Markdown table of the trace workloads' stats (``meta["workloads"]`` entries)."""
    lines = [
        "| workload | trace | requests | from s | speed | span s | prompt tokens | over the "
        "input cap | trace reuse (uncut) | blocks (unique) | exact prompts |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for w in workloads:
        t = w["trace"]
        cap = t["max_input_len"]
        over = "no cap" if cap is None else (
            f"{t['cut']} cut to {cap}" if t["overlong"] == "cut" else f"{t['skipped']} skipped"
        )  # fmt: skip
        exact = "yes" if t["exact_prompts"] and not t["inexact_prompts"] else (
            f"no ({t['inexact_prompts']} off)" if t["exact_prompts"] else "no (no tokenizer)"
        )  # fmt: skip
        lines.append(
            f"| {w['name']} | {t['trace']} ({t['format']}) | {t['requests']} | {t['start']:g} "
            f"| {t['speed']:g} | {t['span_s']:.1f} | {t['input_tokens']} | {over} "
            f"| {t['reuse']:.1%} ({t['reuse_uncut']:.1%}) | {t['blocks']} ({t['unique_blocks']}) "
            f"| {exact} |"
        )
    return "\n".join(lines)


def write_plots(out: Path, reports: Sequence[RunReport]) -> list[Path]:
    """``latency_cdf.png`` (TTFT, TPOT, E2E CDFs, one line per run) and ``goodput_vs_rate.png``
    (per workload: goodput solid, request throughput dashed, one colour per endpoint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    paths = [out / "latency_cdf.png", out / "goodput_vs_rate.png"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    metrics = (
        ("TTFT (ms)", 1000.0, lambda r: r.ttft),
        ("TPOT (ms)", 1000.0, lambda r: r.tpot),
        ("E2E latency (s)", 1.0, lambda r: r.e2e),
    )
    for ax, (label, scale, get) in zip(axes, metrics, strict=True):
        for rep in reports:
            xs = sorted(scale * v for r in rep.result.records if (v := get(r)) is not None)
            if xs:
                ys = [0.0] + [(i + 1) / len(xs) for i in range(len(xs))]
                name = f"{rep.result.endpoint} {rep.result.workload} {rep.rate_label}"
                ax.step([xs[0], *xs], ys, where="post", label=name)
        slo = reports[0].summary.slo if reports else None
        if slo and label.startswith(("TTFT", "TPOT")):
            limit = 1000 * (slo.ttft if label.startswith("TTFT") else slo.tpot)
            ax.axvline(limit, color="k", linestyle=":", label="SLO")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on short ranges
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    _plot_goodput(plt, paths[1], reports)
    return paths


def _plot_goodput(plt, path: Path, reports: Sequence[RunReport]) -> None:
    workloads = list(dict.fromkeys(rep.result.workload for rep in reports))
    names = list(dict.fromkeys(rep.result.endpoint for rep in reports))
    rates = list(dict.fromkeys(rep.rate_label for rep in reports))
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        for i, name in enumerate(names):
            runs = {
                rep.rate_label: rep.summary
                for rep in reports
                if rep.result.endpoint == name and rep.result.workload == workload
            }
            xs = [j for j, rate in enumerate(rates) if rate in runs]
            color = f"C{i}"
            ax.plot(xs, [runs[rates[j]].goodput for j in xs], "o-", color=color, label=name)
            ax.plot(
                xs,
                [runs[rates[j]].request_throughput for j in xs],
                "x--",
                color=color,
                label=f"{name} (all completed)",
            )
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("req/s")
        ax.set_title(f"{workload}: goodput (solid) vs throughput (dashed)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
