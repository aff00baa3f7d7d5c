"""Timing of the lab's KV benches: wall time waited for, and device time by CUDA events."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Median wall seconds of ``fn``, waited for (launches and host round trips included)."""
    times = []
    for _ in range(repeat + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first run warms up


def device_time(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Seconds of device time per call of ``fn`` (CUDA events around ``repeat`` calls in a row,
    so launch latency hides behind the previous call); wall time on CPU."""
    if not device.startswith("cuda"):
        return timed(fn, device, repeat)
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat
