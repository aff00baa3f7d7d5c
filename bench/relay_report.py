"""The report of ``bench.router_relay``: its raw figures as rates, percentiles and a table."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
from typing import Any

from bench.relay_client import Probe


def pct(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]


def ms(values: list[float], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float]:
    """Percentiles of seconds, in milliseconds (keys p50, p90, p99)."""
    return {f"p{round(q * 100)}": round(pct(values, q) * 1000, 3) for q in qs}


def probe_stats(phase: str, probes: list[Probe]) -> dict[str, dict[str, float]]:
    """Percentiles (ms) of the probes' TTFT, router path and its two legs."""
    return {
        f"probe_ttft_{phase}_ms": ms([p.ttft for p in probes]),
        f"probe_path_{phase}_ms": ms([p.path for p in probes]),
        f"probe_inbound_{phase}_ms": ms([p.inbound for p in probes]),
        f"probe_outbound_{phase}_ms": ms([p.outbound for p in probes]),
    }


def git_commit(path: str) -> str:
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def report(
    args: argparse.Namespace,
    raw: dict[str, Any],
    load_before: tuple[float, ...],
    load_after: tuple[float, ...],
) -> dict[str, Any]:
    """Rates and percentiles of a run's raw figures (see ``bench.router_relay.measure``)."""
    window, tally = raw["window_s"], raw["tally"]
    tokens = tally.tokens
    idle, loaded = raw["idle_probes"], raw["loaded_probes"]
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
        },
        "config": {
            k: getattr(args, k)
            for k in (
                "streams",
                "step_ms",
                "tokens",
                "tokens_per_step",
                "seconds",
                "token_path",
                "gateway",
            )
        },
        "window_s": round(window, 3),
        "tokens": tokens,
        "tokens_per_event": round(tokens / tally.events, 3) if tally.events else None,
        "tokens_per_s": round(tokens / window, 1),
        "offered_tokens_per_s": round(args.streams * args.tokens_per_step * 1000 / args.step_ms, 1),
        **{k: v for name in raw["cpu_s"] for k, v in _cpu(raw, name, window, tokens).items()},
        "harness_cores": round(raw["harness_cpu_s"] / window, 3),
        **probe_stats("idle", idle),
        **probe_stats("loaded", loaded),
        "probes": {"idle": len(idle), "loaded": len(loaded)},
        "gap_ms": ms(tally.gaps_s, (0.5, 0.99)),
        "tick_late_ms": ms(raw["late_s"], (0.5, 0.99)),
        "streams_done": tally.streams_done,
        "order_errors": tally.order_errors,
        "stream_errors": tally.stream_errors[:20],
        **{f"{name}_alive": alive for name, alive in raw["alive"].items()},
    }


def _cpu(raw: dict[str, Any], name: str, window: float, tokens: int) -> dict[str, Any]:
    """Process ``name``'s cores over the window, idle, and CPU µs per token less its idle."""
    idle = raw["idle_cores"][name]
    net = raw["cpu_s"][name] - idle * window
    return {
        f"{name}_cores": round(raw["cpu_s"][name] / window, 3),
        f"{name}_idle_cores": round(idle, 3),
        f"{name}_us_per_token": round(net / tokens * 1e6, 1) if tokens else None,
    }


def table(r: dict[str, Any]) -> str:
    """A short human-readable summary of `report`'s output."""

    def q(d: dict[str, float]) -> str:
        return " / ".join(f"{v:.1f}" for v in d.values())

    c = r["config"]
    rows = [
        ("streams x step", f"{c['streams']} x {c['step_ms']:g} ms, {c['tokens']} tokens each"),
        ("tokens/s in", f"{r['tokens_per_s']:.0f} (offered {r['offered_tokens_per_s']:.0f})"),
        ("tokens per event", f"{r['tokens_per_event']}"),
        *[row for name in ("gateway", "router") if f"{name}_cores" in r for row in (
            (f"{name} cores", f"{r[f'{name}_cores']:.3f} (idle {r[f'{name}_idle_cores']:.3f})"),
            (f"{name} us/token", f"{r[f'{name}_us_per_token']}"),
        )],
        ("harness cores (own)", f"{r['harness_cores']:.3f}"),
        ("probe TTFT idle p50/90/99 ms", q(r["probe_ttft_idle_ms"])),
        ("probe TTFT load p50/90/99 ms", q(r["probe_ttft_loaded_ms"])),
        ("router path idle p50/90/99 ms", q(r["probe_path_idle_ms"])),
        ("router path load p50/90/99 ms", q(r["probe_path_loaded_ms"])),
        ("  inbound load p50/90/99 ms", q(r["probe_inbound_loaded_ms"])),
        ("  outbound load p50/90/99 ms", q(r["probe_outbound_loaded_ms"])),
        ("event gap p50/99 ms", q(r["gap_ms"])),
        ("stand-in tick late p50/99 ms", q(r["tick_late_ms"])),
        ("streams done / errors", f"{r['streams_done']} / "
         f"{len(r['order_errors']) + len(r['stream_errors'])}"),
        ("load avg before -> after", f"{r['machine']['loadavg_before'][0]} -> "
         f"{r['machine']['loadavg_after'][0]}"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
