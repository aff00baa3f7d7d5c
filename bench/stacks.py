"""Local stack configurations that ``tandem bench --stack SPEC`` starts, measures and stops.

SPEC is ``disagg:XpYd`` (X prefill and Y decode workers) optionally followed by options
``:threshold=N`` (the routers' cold-start decode-only threshold: it decides until the
workers report a measured prefill rate, then each request's SLOs do), ``:mode=slo|length``
(the routers' ``--disagg-mode``), ``:policy=NAME`` (routing policy: kv, least-loaded,
round-robin, session) and ``:routers=N`` (router replicas), or ``colocated:N`` (N workers
doing both phases). Either takes ``:tokens=N``, the workers' ``--max-num-batched-tokens`` for
this stack alone (the step's token budget, so the prefill chunk beside the decodes): several
stacks differing only there measure the TTFT/TPOT trade-off of the chunk size in one run.
Either takes ``:path=direct|relay``, the gateway's ``--token-path`` (direct, its default: tokens
stream from the decode worker to the gateway; relay: through the router), so one run compares
the two token paths on the same requests, and ``:graphs=N``, the workers'
``--mixed-graph-max-tokens`` (0: steps with prompt tokens run eagerly), so one run compares the
mixed steps' piecewise CUDA graphs with eager steps. ``:host=GIB`` is the workers'
``--kv-host-cache-gib`` (0: no host KV tier), to measure what the tier costs. ``:spread=0``
gives the workers ``--no-decode-spread-graphs`` (no second decode graphs for batches of spread
lengths; ``:spread=1`` their default, on), to measure them against the same stack with.
``:late=1`` gives the workers ``--late-planning`` (each step planned just before the step in
flight ends). ``:switch=US`` starts every process of the stack with that switch interval
(``TANDEM_SWITCH_INTERVAL_US``; 5000 is CPython's own), to measure ``quick_handoffs``.
``:interval=N`` is the decode workers' ``--stream-interval`` (tokens per
streamed message), to measure the token path's cost per message. ``:traces=1`` has every
process write its spans, from which each run reports where TTFT went hop by hop
(`bench.ttft_hops`).
"""

from __future__ import annotations

import contextlib
import os
import re
import unittest.mock
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bench.runner import Endpoint
from services.router.policy import POLICIES

if TYPE_CHECKING:
    from services.launcher.stack import Stack

_OPTS = r"((?::[a-z]+=[a-z0-9-]+)*)"
_DISAGG = re.compile(r"disagg:(\d+)p(\d+)d" + _OPTS)
_OPTIONS = {
    "threshold": int, "policy": str, "routers": int, "mode": str, "tokens": int, "path": str,
    "graphs": int, "host": int, "traces": int, "spread": int, "late": int, "interval": int,
    "switch": int,
}  # fmt: skip
_COLOCATED = re.compile(r"colocated:(\d+)" + _OPTS)
_COLOCATED_OPTIONS = {
    "tokens": int, "path": str, "graphs": int, "host": int, "traces": int, "spread": int,
    "late": int, "interval": int, "switch": int,
}  # fmt: skip
_MODES = ("slo", "length")
_PATHS = ("direct", "relay")


@dataclass(frozen=True, slots=True)
class StackSpec:
    """A topology to start; ``threshold`` None keeps the launcher's default."""

    name: str
    num_prefill: int
    num_decode: int
    colocated: bool = False
    threshold: int | None = None
    policy: str | None = None  # None: the routers' default
    routers: int = 1
    mode: str | None = None  # the routers' --disagg-mode; None: the launcher's default
    tokens: int | None = None  # the workers' --max-num-batched-tokens; None: the run's
    path: str | None = None  # the gateway's --token-path; None: its default (direct)
    graphs: int | None = None  # the workers' --mixed-graph-max-tokens; None: their default
    host: int | None = None  # the workers' --kv-host-cache-gib; None: their default
    traces: int = 0  # 1: every process writes its spans (bench.ttft_hops reads them)
    spread: int | None = None  # the workers' --[no-]decode-spread-graphs; None: their default
    late: int = 0  # 1: the workers' --late-planning
    interval: int | None = None  # the workers' --stream-interval; None: their default
    switch: int | None = None  # every process's switch interval (us); None: quick_handoffs'


def _options(text: str, spec: str, known: dict[str, type]) -> dict:
    """``:key=value`` options of ``spec`` (the part of ``text`` after the topology)."""
    options: dict = {}
    for item in filter(None, spec.split(":")):
        key, _, value = item.partition("=")
        if key not in known:
            raise ValueError(f"{text}: unknown option {key!r}; one of {', '.join(known)}")
        options[key] = known[key](value)
    for key in ("tokens", "interval", "switch"):
        if options.get(key, 1) < 1:
            raise ValueError(f"{text}: {key} must be >= 1")
    for key in ("graphs", "host"):
        if options.get(key, 0) < 0:
            raise ValueError(f"{text}: {key} must be >= 0")
    if options.get("path", "direct") not in _PATHS:
        raise ValueError(f"{text}: unknown path; one of {', '.join(_PATHS)}")
    return options


def parse_stack(text: str) -> StackSpec:
    """``disagg:1p1d``, ``disagg:1p2d:threshold=0``, ``disagg:2p2d:policy=kv:routers=2`` or
    ``colocated:2``."""
    if m := _DISAGG.fullmatch(text):
        p, d = int(m[1]), int(m[2])
        if p < 1 or d < 1:
            raise ValueError(f"{text}: a disaggregated stack needs >= 1 prefill and decode worker")
        options = _options(text, m[3], _OPTIONS)
        if options.get("policy", "kv") not in POLICIES:
            raise ValueError(f"{text}: unknown policy; one of {', '.join(POLICIES)}")
        if options.get("mode", "slo") not in _MODES:
            raise ValueError(f"{text}: unknown mode; one of {', '.join(_MODES)}")
        return StackSpec(text, p, d, **options)
    if m := _COLOCATED.fullmatch(text):
        if int(m[1]) < 1:
            raise ValueError(f"{text}: needs >= 1 worker")
        options = _options(text, m[2], _COLOCATED_OPTIONS)
        return StackSpec(text, 0, int(m[1]), colocated=True, **options)
    raise ValueError(
        f"bad stack spec {text!r}: use disagg:XpYd[:threshold=N][:tokens=N]... or "
        "colocated:N[:tokens=N]"
    )


def stack_config(spec: StackSpec, model_dir: str, run_dir: str, **overrides):
    """The launcher's ``StackConfig`` for ``spec`` (on a free loopback port)."""
    from services.launcher.etcd import free_port
    from services.launcher.stack import StackConfig

    common = dict(model_dir=model_dir, run_dir=run_dir, port=free_port(), **overrides)
    if spec.tokens is not None:
        common["max_num_batched_tokens"] = spec.tokens
    if spec.path is not None:
        common["gateway_args"] = (*common.get("gateway_args", ()), "--token-path", spec.path)
    worker_args = list(common.get("worker_args", ()))
    for flag, value in (("--mixed-graph-max-tokens", spec.graphs),
                        ("--kv-host-cache-gib", spec.host),
                        ("--stream-interval", spec.interval)):  # fmt: skip
        if value is not None:
            worker_args += [flag, str(value)]
    if spec.spread is not None:
        worker_args.append("--decode-spread-graphs" if spec.spread else "--no-decode-spread-graphs")
    if spec.late:
        worker_args.append("--late-planning")
    if worker_args:
        common["worker_args"] = tuple(worker_args)
    if spec.traces:
        common["trace_files"] = True
    if spec.colocated:
        return StackConfig.colocated(spec.num_decode, **common)
    config = StackConfig(num_prefill=spec.num_prefill, num_decode=spec.num_decode, **common)
    if spec.threshold is not None:
        config = replace(config, decode_only_threshold=spec.threshold)
    if spec.mode is not None:
        config = replace(config, disagg_mode=spec.mode)
    return replace(config, router_policy=spec.policy or "", num_routers=spec.routers)


def _switch_interval(us: int | None) -> contextlib.AbstractContextManager:
    """The stack's processes, started inside, take ``us`` as their switch interval (they
    inherit this process's environment, restored on leaving)."""
    from engine.gil import SWITCH_INTERVAL_ENV

    if us is None:
        return contextlib.nullcontext()
    return unittest.mock.patch.dict(os.environ, {SWITCH_INTERVAL_ENV: str(us)})


@contextlib.contextmanager
def running_stack(
    spec: StackSpec, model_dir: str, run_dir: Path, **overrides
) -> Iterator[tuple[Endpoint, Stack]]:
    """Start the stack of ``spec`` (logs under ``run_dir``), yield its endpoint and the
    stack, stop it."""
    from services.launcher.stack import Stack

    config = stack_config(spec, model_dir, str(run_dir), **overrides)
    stack = Stack(config)
    try:
        with _switch_interval(spec.switch):
            stack.start()
        yield Endpoint(spec.name, stack.url + "/v1"), stack
    finally:
        stack.stop()
