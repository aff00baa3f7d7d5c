"""How late a thread wakes while another runs Python, by the interpreter's switch interval.

    python -m bench.gil_handoff --out bench/results/gil_handoff_cpu.json

The cost that ``engine.gil.quick_handoffs`` takes off the token path: one thread runs
Python without pause (as an engine loop planning and launching a step, or an event loop
streaming), another sleeps 2 ms and wakes (as a thread whose pipe read or queue item arrived):
how late it runs again, over ``--wakes`` wake-ups. Then two threads that both run Python: their
work per second (what the extra switches cost). Each at CPython's default (5 ms) and at
``SWITCH_INTERVAL_S``. Prints a table and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.gil import SWITCH_INTERVAL_S

DEFAULT_S = 0.005  # CPython's


def _python_work() -> None:
    sum(range(200))


def wake_late_ms(interval: float, wakes: int, nap: float = 0.002) -> list[float]:
    """Milliseconds past ``nap`` that a sleeping thread runs again, while another runs Python."""
    sys.setswitchinterval(interval)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            _python_work()

    other = threading.Thread(target=busy, daemon=True)
    other.start()
    late = []
    try:
        for _ in range(wakes):
            t0 = time.perf_counter()
            time.sleep(nap)
            late.append((time.perf_counter() - t0 - nap) * 1e3)
    finally:
        stop.set()
        other.join()
    return late


def busy_rate(interval: float, seconds: float) -> float:
    """Units of Python work per second by two threads that both run Python all along."""
    sys.setswitchinterval(interval)
    counts = [0, 0]
    stop = threading.Event()

    def busy(i: int) -> None:
        while not stop.is_set():
            _python_work()
            counts[i] += 1

    threads = [threading.Thread(target=busy, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def measure(wakes: int, seconds: float) -> list[dict]:
    before = sys.getswitchinterval()
    rows = []
    try:
        for interval in (DEFAULT_S, SWITCH_INTERVAL_S):
            late = sorted(wake_late_ms(interval, wakes))
            rows.append({
                "interval_ms": interval * 1e3,
                "wake_late_p50_ms": statistics.median(late),
                "wake_late_p90_ms": late[int(0.9 * (len(late) - 1))],
                "wake_late_max_ms": late[-1],
                "two_busy_threads_work_per_s": busy_rate(interval, seconds),
            })  # fmt: skip
    finally:
        sys.setswitchinterval(before)
    return rows


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wakes", type=int, default=200)
    p.add_argument("--seconds", type=float, default=2.0, help="per busy-rate measurement")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    rows = measure(args.wakes, args.seconds)
    print("| switch interval | wake late p50 / p90 / max ms | two busy threads, work/s |")
    print("|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['interval_ms']:.1f} ms | {r['wake_late_p50_ms']:.2f} / "
            f"{r['wake_late_p90_ms']:.2f} / {r['wake_late_max_ms']:.2f} | "
            f"{r['two_busy_threads_work_per_s'] / 1e3:.0f}k |"
        )
    if args.out is not None:
        record = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": "python -m bench.gil_handoff " + " ".join(argv or sys.argv[1:]),
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
            "python": sys.version.split()[0],
            "commit": _commit(),
            "rows": rows,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
