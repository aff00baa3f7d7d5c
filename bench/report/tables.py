"""The markdown tables of a ``tandem bench`` run: results, ratios against the first target,
GPU and CPU use, and the trace replays."""

from __future__ import annotations

import math
from collections.abc import Sequence

from bench.report.run import RunReport


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
