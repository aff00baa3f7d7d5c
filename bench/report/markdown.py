"""``results.md``: the run's description, the results table and ratios, then a table for each
thing measured beside the requests (only those some run measured), and the notes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench import ttft_hops
from bench.engine_steps import render as render_steps
from bench.engine_steps import render_ttft
from bench.handoff import render as render_handoff
from bench.kv_stats import render_cache_table
from bench.report.run import RunReport
from bench.report.tables import render_ratios, render_resources, render_table, render_traces

TRACE_INTRO = (
    "Trace replays: what was sent, and the prefix sharing the trace itself has (tokens in "
    "leading blocks an earlier request of the replay had; compare with the servers' prefix hit "
    "rate). One row per workload: every rate of a sweep replays the same requests with fresh "
    "text; a run at `trace xS` keeps the trace's times divided by S, a `--rate` run replaces "
    "them with Poisson arrivals."
)


def write_markdown(path: Path, meta: dict, reports: Sequence[RunReport], notes: str = "") -> None:
    """Write the results page of ``reports`` (``meta`` as :func:`bench.sweep.run_meta` makes
    it, with ``loadavg_end``) to ``path``."""
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
    lines += _measured(reports)
    if notes:
        lines += ["", notes]
    path.write_text("\n".join(lines) + "\n")


def _measured(reports: Sequence[RunReport]) -> list[str]:
    """The tables of what local stacks and nvidia-smi measured, each under its caption."""
    lines: list[str] = []
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
    split = [
        (r.result.endpoint, r.result.workload, r.rate_label, r.ttft) for r in reports if r.ttft
    ]
    if split:
        lines += ["", "Where TTFT went: means in ms over each run, from the gateway's and the "
                  "engines' histograms (an endpoint's: its server's, for vLLM its API server's "
                  "TTFT and its engine's queue and prefill times; services = gateway - engine; "
                  "see bench/engine_steps.py)", ""]  # fmt: skip
        lines.append(render_ttft(split))
    hops = [(r.result.endpoint, r.result.workload, r.rate_label, r.hops) for r in reports if r.hops]
    if hops:
        intro = (
            "TTFT hop by hop: mean ms from the gateway's arrival to each mark of a request's "
            "spans (stacks with :traces=1; see bench/ttft_hops.py)"
        )
        lines += ["", intro, ""]
        lines.append(ttft_hops.render(hops))
    return lines
