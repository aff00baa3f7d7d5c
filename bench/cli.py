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
import asyncio
import contextlib
import datetime as dt
import math
import shlex
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

from bench import engine_steps, extra, handoff, kv_stats
from bench.engine_steps import PhaseSteps
from bench.gpu_busy import GpuSampler
from bench.handoff import HandoffReport
from bench.metrics import SLO, summarize
from bench.proc_cpu import CpuMeter, with_engines
from bench.report import (
    RunReport,
    machine_info,
    rate_label,
    render_ratios,
    render_table,
    write_json,
    write_markdown,
    write_plots,
)
from bench.runner import Endpoint, LoadConfig, RequestOptions, RunResult, run_load
from bench.stacks import StackSpec, parse_stack, running_stack
from bench.trace_workload import add_trace_arguments, generate_trace, trace_config
from bench.traces import describe
from bench.workloads import (
    KINDS,
    Workload,
    WorkloadConfig,
    generate,
    make_counter,
    parse_workload,
)
from services.launcher.options import add_worker_options, worker_overrides

BUNDLED_MODEL = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
DEFAULT_ENDPOINT = "http://127.0.0.1:8000/v1"


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]  # float("inf") parses "inf"


def _workload_spec(text: str) -> str:
    try:
        parse_workload(text, WorkloadConfig("random", 1))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench flags, on ``p`` (also used by ``tandem bench``)."""
    t = p.add_argument_group("targets (default: one endpoint at " + DEFAULT_ENDPOINT + ")")
    t.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an OpenAI-compatible base URL ending in /v1 (repeatable)",
    )
    t.add_argument(
        "--stack",
        action="append",
        default=[],
        metavar="SPEC",
        help="start a local stack: disagg:XpYd[:threshold=N][:mode=slo|length][:tokens=N]... or "
        "colocated:N[:tokens=N] (repeatable; tokens: this stack's step token budget)",
    )
    t.add_argument("--model", default=None, help="served model name (default: ask /v1/models)")
    t.add_argument("--api-key", default="EMPTY")
    t.add_argument(
        "--model-dir",
        type=Path,
        default=BUNDLED_MODEL,
        help="model folder that --stack serves (default: the bundled SmolLM2)",
    )
    t.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|none",
        help="folder with tokenizer.json for exact prompt lengths (default: "
        "--model-dir when it has one; 'none': approximate)",
    )
    add_worker_options(p)
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        action="append",
        type=_workload_spec,
        default=[],
        metavar="KIND[:key=value,...]",
        help=f"one of {', '.join(KINDS)}; keys override the length flags for this workload: "
        "input, input_spread, output, output_spread, prefix, prefixes, turns (repeatable; "
        "default: random)",
    )
    w.add_argument(
        "--num-requests", type=int, default=50, help="per workload and rate (a trace: its first N)"
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--input-len", type=int, default=None, help="mean input tokens")
    w.add_argument(
        "--input-spread",
        type=float,
        default=None,
        help="relative half-width (uniform) or log sigma (chat)",
    )
    w.add_argument("--output-len", type=int, default=None, help="mean output tokens")
    w.add_argument("--output-spread", type=float, default=None)
    w.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: its length")
    w.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: how many")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per session")
    add_trace_arguments(p)
    ld = p.add_argument_group("load")
    ld.add_argument(
        "--rate",
        action="append",
        type=_rates,
        default=[],
        metavar="R[,R...]",
        help="Poisson arrivals per second; several = a sweep; inf = all at once (default)",
    )
    ld.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    ld.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stop sending after this many seconds per run",
    )
    ld.add_argument("--warmup", type=int, default=1, help="unmeasured requests before each run")
    ld.add_argument("--api", choices=("chat", "completions"), default="chat")
    ld.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (servers that reject it); outputs may be "
        "shorter than --output-len",
    )
    ld.add_argument("--temperature", type=float, default=0.0)
    ld.add_argument("--request-timeout", type=float, default=600.0)
    o = p.add_argument_group("SLOs and output")
    o.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    o.add_argument("--slo-tpot-ms", type=float, default=50.0)
    o.add_argument(
        "--send-slo",
        action="store_true",
        help="send the SLOs with every request (slo_ttft_ms, slo_tpot_ms: Tandem's router "
        "places each prefill to meet them; other servers may ignore or refuse the fields)",
    )
    o.add_argument("--out", type=Path, default=Path("bench/results/serving"))
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    o.add_argument("--notes", default="", help="text appended to results.md")
    o.add_argument("--logs", type=Path, default=None, help="--stack logs (default: a temp dir)")


def _targets(args: argparse.Namespace) -> list[Endpoint | StackSpec]:
    targets: list[Endpoint | StackSpec] = []
    for text in args.endpoint:
        name, _, url = text.partition("=") if "=" in text.split("://")[0] else ("", "", text)
        targets.append(Endpoint(name or url, url.rstrip("/"), args.api_key, args.model))
    targets += [parse_stack(s) for s in args.stack]
    return targets or [Endpoint(DEFAULT_ENDPOINT, DEFAULT_ENDPOINT, args.api_key, args.model)]


@contextlib.contextmanager
def _open(
    target: Endpoint | StackSpec, args: argparse.Namespace, i: int
) -> Iterator[tuple[Endpoint, dict[str, str], dict[str, str], dict[str, int]]]:
    """The endpoint, and for a stack the gRPC addresses of its workers (for their Stats), the
    /metrics addresses of its processes (for the hand-off) and their pids (for CPU time)."""
    if isinstance(target, Endpoint):
        yield target, {}, {}, {}
        return
    overrides = worker_overrides(args)
    if args.logs is None:
        args.logs = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    run_dir = _run_dir(args, target, i)
    print(f"starting stack {target.name} (logs: {run_dir}/logs) ...", flush=True)
    with running_stack(target, str(_model_dir(args)), run_dir, **overrides) as (endpoint, stack):
        workers = {
            name: child.address
            for name, child in stack.children.items()
            if name.startswith(("prefill", "decode"))
        }
        pids = {n: c.proc.pid for n, c in stack.children.items() if c.proc is not None}
        yield endpoint, workers, stack.scrape_targets(), with_engines(pids)


def _run_dir(args: argparse.Namespace, target: StackSpec, i: int) -> Path:
    """The folder of the i-th target's logs (and its processes' metrics, before and after each
    run)."""
    return args.logs / f"{i}-{target.name.replace(':', '-')}"


def _gpu_list(args: argparse.Namespace) -> str:
    """The GPUs a run is measured on: the stacks' ``--gpus`` where named, else every GPU."""
    gpus = getattr(args, "gpus", "auto")
    return gpus if gpus not in ("auto", "none", None) else ""


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir == BUNDLED_MODEL:
        from engine.bundled import convert  # converts once; imports torch, so only when needed

        return Path(convert(BUNDLED_MODEL))
    return args.model_dir


def _workloads(args: argparse.Namespace, num_rates: int) -> list[list[Workload]]:
    """``[workload][rate index]``: the j-th rate of a sweep gets requests of seed ``seed + j``,
    so a stack never sees a prompt twice (its prefix cache would flatter the later rates),
    while every target gets the same requests at the same rate."""
    tok = args.tokenizer
    counter = make_counter(None if tok == "none" else (tok or args.model_dir))
    base = WorkloadConfig(
        "random", args.num_requests, args.seed, args.input_len, args.input_spread,
        args.output_len, args.output_spread, args.prefix_len, args.num_prefixes, args.turns,
    )  # fmt: skip
    sweeps = [
        [generate(replace(parse_workload(w, base), seed=args.seed + j), counter)
         for j in range(num_rates)]
        for w in args.workload or ([] if args.trace else ["random"])
    ]  # fmt: skip
    for path in args.trace:
        trace = trace_config(args, path)
        sweeps.append(
            [generate_trace(replace(trace, seed=args.seed + j), counter) for j in range(num_rates)]
        )
    return sweeps


def _load(args: argparse.Namespace, rates: list[float], j: int, workload: Workload) -> LoadConfig:
    """The j-th run's load: the j-th ``--rate``; without one, a trace at its own times
    (divided by ``--trace-speed``) and any other workload all at once."""
    if rates:
        return LoadConfig(rates[j], args.concurrency, args.time_limit, args.seed)
    speed = args.trace_speed if workload.arrivals is not None else None
    return LoadConfig(math.inf, args.concurrency, args.time_limit, args.seed, speed)


def _meta(args: argparse.Namespace, command: str, workloads: list[Workload], slo: SLO) -> dict:
    return {
        "benchmark": "tandem bench",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": command,
        "machine": machine_info(),
        "slo": asdict(slo),
        "workloads": [
            {
                "name": w.name,
                **asdict(w.config.resolved()),
                "exact_lengths": w.exact_lengths,
                **({"trace": asdict(w.trace)} if w.trace else {}),
            }
            for w in workloads
        ],
        "options": {
            "api": args.api,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "concurrency": args.concurrency,
            "time_limit": args.time_limit,
            "warmup": args.warmup,
        },
    }


def run(args: argparse.Namespace, command: str | None = None) -> int:
    """Run every target x workload x rate; print and write the results."""
    extra.require(plots=args.plots)
    command = command or "tandem " + shlex.join(sys.argv[1:])
    rates = [r for group in args.rate for r in group]  # none: each workload's default
    slo = SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    opts = RequestOptions(
        args.api, args.ignore_eos, args.temperature, args.request_timeout, args.progress,
        (args.slo_ttft_ms, args.slo_tpot_ms) if args.send_slo else None,
    )  # fmt: skip
    workloads = _workloads(args, len(rates) or 1)
    for sweep in workloads:
        if sweep[0].trace is not None:
            print(describe(sweep[0].trace), flush=True)
    meta = _meta(args, command, [sweep[0] for sweep in workloads], slo)
    args.out.mkdir(parents=True, exist_ok=True)
    reports: list[RunReport] = []
    for i, target in enumerate(_targets(args)):
        with _open(target, args, i) as (endpoint, workers, scrape, pids):
            for sweep in workloads:
                for j, workload in enumerate(sweep):
                    load = _load(args, rates, j, workload)
                    before = kv_stats.snapshot(workers) if workers else {}
                    was = handoff.stack_metrics(scrape) if scrape else None
                    meter = CpuMeter(pids)
                    with GpuSampler(gpus=_gpu_list(args)) as busy:
                        meter.start()
                        result = asyncio.run(run_load(endpoint, workload, load, opts, args.warmup))
                        cpu = meter.stop(result.duration) if pids else None
                    # The load generator's own share: near 1.0 it, not the server, sets the pace.
                    cpu = {**(cpu or {}), "bench client": result.client_cores}
                    cache = None
                    if workers:  # a local stack: prefix hits and block-location writes
                        prompts = kv_stats.prompts_in_order(
                            workload, result.records, str(_model_dir(args)), args.api
                        )
                        cache = kv_stats.measure(workers, before, prompts, result.duration)
                    hand = steps = compiles = None
                    if was is not None:  # a local stack: its processes' metrics
                        folder = _run_dir(args, target, i) / "metrics"
                        folder /= f"{workload.name}-{rate_label(result)}".replace(" ", "-")
                        hand, steps, compiles = _from_metrics(scrape, was, result, folder)
                    summary = summarize(result.records, result.duration, slo)
                    window = busy.result.window(result.started, result.started + result.duration)
                    reports.append(
                        RunReport(result, summary, cache, hand, window, cpu, steps, compiles)
                    )
                    _print_one(reports[-1])
                    meta["loadavg_end"] = machine_info()["loadavg"]
                    write_json(args.out / "results.json", meta, reports)  # partial, kept on failure
    table, ratios = render_table(reports), render_ratios(reports)
    print("\n" + table + ("\n\n" + ratios if ratios else ""))
    write_markdown(args.out / "results.md", meta, reports, args.notes)
    written = ["results.json", "results.md"]
    if args.plots:
        written += [p.name for p in write_plots(args.out, reports)]
    print(f"\nwrote {', '.join(written)} to {args.out}")
    return 0


def _from_metrics(
    scrape: dict[str, str], was: dict[str, str], result: RunResult, folder: Path
) -> tuple[HandoffReport, dict[str, PhaseSteps], int]:
    """A local stack's hand-off, engine steps and kernel compiles over a run, from every
    process's /metrics before it (``was``) and now; both readings are saved in ``folder``."""
    now = handoff.stack_metrics(scrape)
    for when, texts in (("before", was), ("after", now)):
        handoff.save(texts, folder, when)
    hand = handoff.report(handoff.snapshot(was), handoff.snapshot(now), result.records)
    a, b = engine_steps.snapshot(was), engine_steps.snapshot(now)
    return hand, engine_steps.report(a, b), engine_steps.serving_compiles(a, b)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    return run(parser.parse_args(argv), "python -m bench " + shlex.join(argv))
