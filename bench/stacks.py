"""Local stack configurations that ``tandem bench --stack SPEC`` starts, measures and stops.

SPEC is ``disagg:XpYd`` (X prefill and Y decode workers, the router's decode-only threshold)
optionally followed by ``:threshold=N``, or ``colocated:N`` (N workers doing both phases).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from bench.runner import Endpoint

_DISAGG = re.compile(r"disagg:(\d+)p(\d+)d(?::threshold=(\d+))?")
_COLOCATED = re.compile(r"colocated:(\d+)")


@dataclass(frozen=True, slots=True)
class StackSpec:
    """A topology to start; ``threshold`` None keeps the launcher's default."""

    name: str
    num_prefill: int
    num_decode: int
    colocated: bool = False
    threshold: int | None = None


def parse_stack(text: str) -> StackSpec:
    """``disagg:1p1d``, ``disagg:1p2d:threshold=0`` or ``colocated:2``."""
    if m := _DISAGG.fullmatch(text):
        p, d = int(m[1]), int(m[2])
        if p < 1 or d < 1:
            raise ValueError(f"{text}: a disaggregated stack needs >= 1 prefill and decode worker")
        return StackSpec(text, p, d, threshold=int(m[3]) if m[3] is not None else None)
    if m := _COLOCATED.fullmatch(text):
        if int(m[1]) < 1:
            raise ValueError(f"{text}: needs >= 1 worker")
        return StackSpec(text, 0, int(m[1]), colocated=True)
    raise ValueError(f"bad stack spec {text!r}: use disagg:XpYd[:threshold=N] or colocated:N")


def stack_config(spec: StackSpec, model_dir: str, run_dir: str, **overrides):
    """The launcher's ``StackConfig`` for ``spec`` (on a free loopback port)."""
    from libkv.etcd_server import free_port
    from services.launcher import StackConfig

    common = dict(model_dir=model_dir, run_dir=run_dir, port=free_port(), **overrides)
    if spec.colocated:
        return StackConfig.colocated(spec.num_decode, **common)
    config = StackConfig(num_prefill=spec.num_prefill, num_decode=spec.num_decode, **common)
    if spec.threshold is not None:
        config = replace(config, decode_only_threshold=spec.threshold)
    return config


@contextlib.contextmanager
def running_stack(
    spec: StackSpec, model_dir: str, run_dir: Path, **overrides
) -> Iterator[Endpoint]:
    """Start the stack of ``spec`` (logs under ``run_dir``), yield its endpoint, stop it."""
    from services.launcher import Stack

    config = stack_config(spec, model_dir, str(run_dir), **overrides)
    stack = Stack(config)
    try:
        stack.start()
        yield Endpoint(spec.name, stack.url + "/v1")
    finally:
        stack.stop()
