"""PNG plots of a ``tandem bench`` run (matplotlib, Agg backend, imported only when plotting)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.report.run import RunReport


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
