"""``tandem bench`` / ``python -m bench``: load-test OpenAI-compatible endpoints.

    tandem bench --endpoint http://127.0.0.1:8000/v1 --workload chat --rate 1,2,4
    tandem bench --stack disagg:1p1d --stack colocated:2 --workload prefill-heavy
    tandem bench --stack disagg:2p2d --trace mooncake_synthetic_trace.jsonl --trace-speed 2 \
        --num-requests 200 --max-input-len 3800 --max-output-len 256

Every target (``--endpoint [NAME=]URL`` or ``--stack SPEC``, run one after another; stacks
are started and stopped here) receives the same generated requests for every workload and
rate. Prints a table (and ratios against the first target), and writes ``results.json``
(every request), ``results.md`` and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from bench import engine_steps, extra
from bench.cli_args import add_arguments
from bench.measure import Measure, gpu_list, measure, open_target
from bench.metrics import SLO
from bench.report import (
    RunReport,
    machine_info,
    render_ratios,
    render_table,
    write_json,
    write_markdown,
    write_plots,
)
from bench.sweep import load_config, request_options, run_meta, targets, workload_sweeps
from bench.traces import describe

__all__ = ["add_arguments", "main", "run"]


def run(args: argparse.Namespace, command: str | None = None) -> int:
    """Run every target x workload x rate; print and write the results. ``results.json`` is
    rewritten after every run, so a failure keeps what was measured before it."""
    extra.require(plots=args.plots)
    command = command or "tandem " + shlex.join(sys.argv[1:])
    rates = [r for group in args.rate for r in group]  # none: each workload's default
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    how = Measure(request_options(args), args.warmup, slo, gpu_list(args))
    sweeps = workload_sweeps(args, len(rates) or 1)
    for sweep in sweeps:
        if sweep[0].trace is not None:
            print(describe(sweep[0].trace), flush=True)
    meta = run_meta(args, command, [sweep[0] for sweep in sweeps], slo)
    args.out.mkdir(parents=True, exist_ok=True)
    reports: list[RunReport] = []
    for i, spec in enumerate(targets(args)):
        with open_target(spec, args, i) as target:
            for sweep in sweeps:
                for j, workload in enumerate(sweep):
                    load = load_config(args, rates, j, workload)
                    reports.append(measure(target, workload, load, how))
                    _print_one(reports[-1])
                    meta["loadavg_end"] = machine_info()["loadavg"]
                    write_json(args.out / "results.json", meta, reports)
    _finish(args, meta, reports)
    return 0


def _finish(args: argparse.Namespace, meta: dict, reports: list[RunReport]) -> None:
    """Print the table (and ratios); write ``results.md`` and the plots."""
    table, ratios = render_table(reports), render_ratios(reports)
    print("\n" + table + ("\n\n" + ratios if ratios else ""))
    write_markdown(args.out / "results.md", meta, reports, args.notes)
    written = ["results.json", "results.md"]
    if args.plots:
        written += [p.name for p in write_plots(args.out, reports)]
    print(f"\nwrote {', '.join(written)} to {args.out}")


def _print_one(rep: RunReport) -> None:
    s, r = rep.summary, rep.result
    print(
        f"{r.endpoint} {r.workload} rate={rep.rate_label}: {s.completed}/{s.sent} ok "
        f"in {s.duration:.1f} s, {s.request_throughput:.2f} req/s, "
        f"{s.output_token_throughput:.1f} out tok/s, goodput {s.goodput:.3f} req/s "
        f"({s.slo_attainment:.0%} met the SLOs)",
        flush=True,
    )
    if rep.cache is not None:
        c = rep.cache
        print(
            f"  prefix hit rate {c.hit_rate:.1%} (one shared cache: {c.ideal_hit_rate:.1%} "
            f"unbounded, {c.ideal_pooled_hit_rate:.1%} pooled); {c.location_txns} location "
            f"writes to etcd, {c.location_entries} entries changed "
            f"({c.entries_per_1k_prefilled:.1f} per 1k prefilled tokens)",
            flush=True,
        )
    busy = rep.gpu_busy
    if busy is not None and busy.mean is not None:
        print(f"  GPU busy {busy.mean:.0f}% (p10 {busy.p10:.0f}%)", flush=True)
    if rep.cpu:
        cores = ", ".join(f"{n} {c:.2f}" for n, c in sorted(rep.cpu.items()))
        print(f"  CPU cores: {cores}", flush=True)
    if rep.steps is not None:
        built = "" if rep.compiles is None else f"; kernels compiled while serving {rep.compiles}"
        print(f"  {engine_steps.one_line(rep.steps)}{built}", flush=True)
    if rep.ttft:
        parts = ", ".join(f"{part} {ms:.1f}" for part, ms in rep.ttft.items())
        print(f"  TTFT means, ms: {parts}", flush=True)
    if rep.hops:
        marks = ", ".join(f"{hop} {ms:.1f}" for hop, ms in rep.hops.items() if hop != "requests")
        print(f"  TTFT hop by hop (ms after arrival): {marks}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench``: parse ``argv`` (default: the process's) and run."""
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run(parser.parse_args(argv), "python -m bench " + shlex.join(argv))
