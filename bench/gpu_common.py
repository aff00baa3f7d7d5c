"""Shared pieces of the GPU benchmark: event timing, the measured ceilings, the Llama shape."""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig
from engine.shapes import SHAPES

LLAMA_31_8B = SHAPES["llama-3.1-8b"]


def parse_bench_args(p: argparse.ArgumentParser, module: str, argv: list[str] | None) -> Any:
    """``--dry-run`` and ``--date`` added, ``argv`` parsed, and ``args.command`` the command
    line as the reports print it."""
    p.add_argument("--dry-run", action="store_true", help="off the GPU: tiny shapes, CPU")
    p.add_argument("--date", default=dt.date.today().isoformat())
    args = p.parse_args(argv)
    args.command = f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)
    return args


def llama_config() -> ModelConfig:
    return ModelConfig.from_dict(LLAMA_31_8B)


def time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 20) -> float:
    """Median time of ``fn`` on the GPU in milliseconds (CUDA events around each call; wall
    time where there is no GPU: the benchmarks' dry runs)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        walls = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            walls.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(walls)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_time_ms(fns: list[Callable[[], object]], iters: int = 10) -> float:
    """Median GPU time per call of ``fns``, captured back to back in one CUDA graph (no host
    launch overhead in the number)."""
    if not torch.cuda.is_available():  # a dry run: the calls one after another
        return time_ms(lambda: [fn() for fn in fns], warmup=1, iters=iters) / len(fns)
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    ms = time_ms(graph.replay, warmup=2, iters=iters) / len(fns)
    del graph
    return ms


@dataclass(frozen=True, slots=True)
class Ceilings:
    """Measured in the same run: device-to-device copy (bytes read + written per second) and
    the dense bf16 matrix rate on random data."""

    copy_bytes_per_s: float
    matmul_flops_per_s: float


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _copy_ms(n: int) -> float:
    src = torch.randn(n, device=_device(), dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), warmup=3, iters=20)


def _matmul_ms(m: int) -> float:
    a = torch.randn(m, m, device=_device(), dtype=torch.bfloat16)
    b = torch.randn(m, m, device=_device(), dtype=torch.bfloat16)
    return time_ms(lambda: a @ b, warmup=5, iters=20)


def measure_ceilings(small: bool = False) -> Ceilings:
    """``small``: little buffers, for dry runs off the GPU (the figures mean nothing)."""
    n, m = (1 << 20, 256) if small else (1 << 30, 8192)  # 2 GiB of bf16 per copy buffer
    copy_ms, mm_ms = _copy_ms(n), _matmul_ms(m)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Ceilings(2 * n * 2 / (copy_ms / 1e3), 2 * m**3 / (mm_ms / 1e3))


def table(rows: list[dict], cols: list[str]) -> str:
    """A markdown table of ``rows`` (dicts) in columns ``cols``."""

    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
