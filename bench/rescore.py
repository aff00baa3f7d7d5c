"""Re-score a finished ``tandem bench`` run under other SLOs, from its ``results.json`` alone.

    python -m bench.rescore bench/results/serving_cpu/results.json \\
        --slo-ttft-ms 10000 --slo-tpot-ms 1000

Prints the table (and ratios) with goodput and attainment under the given SLOs; the latencies
and throughputs are the recorded ones. ``--append-md FILE`` adds it to a results page,
``--plots DIR`` redraws the plots (goodput under the given SLOs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from bench.metrics import SLO, RequestRecord, summarize
from bench.report import RunReport, render_ratios, render_table, write_plots
from bench.runner import RunResult

_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


def load_reports(path: Path, slo: SLO) -> list[RunReport]:
    """The runs of ``results.json``, summarized under ``slo``."""
    data = json.loads(path.read_text())
    reports = []
    for run in data["runs"]:
        records = [
            RequestRecord(
                **{**{k: v for k, v in r.items() if k in _FIELDS}, "itl": tuple(r["itl"])}
            )
            for r in run["records"]
        ]
        rate = math.inf if run["rate"] == "inf" else float(run["rate"])
        duration = run["summary"]["duration"]
        result = RunResult(run["endpoint"], run["workload"], rate, run["concurrency"], duration)
        result.records, result.not_sent = records, run["not_sent"]
        result.seed, result.trace_speed = run.get("seed", 0), run.get("trace_speed")
        reports.append(RunReport(result, summarize(records, duration, slo)))
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rescore", description=__doc__)
    p.add_argument("results", type=Path, help="a results.json written by tandem bench")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--append-md", type=Path, default=None)
    p.add_argument("--plots", type=Path, default=None, help="write the PNG plots to this folder")
    args = p.parse_args(argv)
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    reports = load_reports(args.results, slo)
    head = f"Re-scored under TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms"
    ratios = render_ratios(reports)
    text = "\n\n".join(x for x in (head, render_table(reports), ratios) if x)
    print(text)
    if args.plots:
        args.plots.mkdir(parents=True, exist_ok=True)
        write_plots(args.plots, reports)
    if args.append_md:
        with args.append_md.open("a") as f:
            f.write("\n" + text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
