"""What a ``tandem bench`` run covers, from its flags: the targets, each workload's requests at
every rate of the sweep, each run's load, and the description ``results.json`` starts with."""

from __future__ import annotations

import argparse
import datetime as dt
import math
from dataclasses import asdict, replace

from bench.cli_args import DEFAULT_ENDPOINT
from bench.metrics import SLO
from bench.report import machine_info
from bench.runner import Endpoint, LoadConfig, RequestOptions
from bench.stacks import StackSpec, parse_stack
from bench.trace_workload import generate_trace, trace_config
from bench.workloads import Workload, WorkloadConfig, generate, make_counter, parse_workload


def targets(args: argparse.Namespace) -> list[Endpoint | StackSpec]:
    """The ``--endpoint`` targets, then the ``--stack`` ones, in the order given (without
    either: the default endpoint)."""
    found: list[Endpoint | StackSpec] = []
    for text in args.endpoint:
        name, _, url = text.partition("=") if "=" in text.split("://")[0] else ("", "", text)
        found.append(Endpoint(name or url, url.rstrip("/"), args.api_key, args.model))
    found += [parse_stack(s) for s in args.stack]
    return found or [Endpoint(DEFAULT_ENDPOINT, DEFAULT_ENDPOINT, args.api_key, args.model)]


def workload_sweeps(args: argparse.Namespace, num_rates: int) -> list[list[Workload]]:
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


def load_config(
    args: argparse.Namespace, rates: list[float], j: int, workload: Workload
) -> LoadConfig:
    """The j-th run's load: the j-th ``--rate``; without one, a trace at its own times
    (divided by ``--trace-speed``) and any other workload all at once."""
    if rates:
        return LoadConfig(rates[j], args.concurrency, args.time_limit, args.seed)
    speed = args.trace_speed if workload.arrivals is not None else None
    return LoadConfig(math.inf, args.concurrency, args.time_limit, args.seed, speed)


def request_options(args: argparse.Namespace) -> RequestOptions:
    """How every request of every run is sent (the SLOs in its body with ``--send-slo``)."""
    return RequestOptions(
        args.api, args.ignore_eos, args.temperature, args.request_timeout, args.progress,
        (args.slo_ttft_ms, args.slo_tpot_ms) if args.send_slo else None,
    )  # fmt: skip


def run_meta(args: argparse.Namespace, command: str, workloads: list[Workload], slo: SLO) -> dict:
    """The head of ``results.json``: date, command, machine, SLOs, workloads and options."""
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
