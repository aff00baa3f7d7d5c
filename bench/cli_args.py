"""The ``tandem bench`` / ``python -m bench`` flags (``bench.cli`` runs what they ask for)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.trace_workload import add_trace_arguments
from bench.workloads import KINDS, WorkloadConfig, parse_workload
from services.launcher.options import add_worker_options

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
    """The bench flags, on ``p`` (also used by ``tandem bench``). The groups' order is the
    order ``--help`` shows them in."""
    _add_target_arguments(p)
    add_worker_options(p)
    _add_workload_arguments(p)
    add_trace_arguments(p)
    _add_load_arguments(p)
    _add_output_arguments(p)


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_load_arguments(p: argparse.ArgumentParser) -> None:
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


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
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
