"""Where the local stack's workers run: one GPU per worker (one per rank of a tensor-parallel
worker), shared when there are fewer GPUs than workers, each worker with its own share of its
device's memory.

A worker sees its own GPU first in ``CUDA_VISIBLE_DEVICES`` (so its ``cuda:0`` is that GPU)
followed by the stack's other GPUs: a worker only ever allocates on ``cuda:0``, while a peer's
GPU stays visible so that the KV hand-off can map the peer's pool over NVLink (CUDA IPC)
instead of going through a network stack. Workers that share a device split
``DEFAULT_UTILIZATION`` evenly unless ``--gpu-memory-utilization`` says otherwise, and start
one after another (each sizes its KV pool from what the device has free, see
``engine.memory``). Workers without a GPU split the host's cores instead (`cpu_share`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.config import ENGINE_KNOBS

# A worker's own default share of a device, split here among the workers that share one.
DEFAULT_UTILIZATION: float = ENGINE_KNOBS["gpu_memory_utilization"].default


@dataclass(frozen=True, slots=True)
class Placement:
    """One worker's device and memory share; ``device`` None: no GPU placement (CPU), with
    ``cpu_threads`` torch threads (0: torch's default, a thread per core)."""

    device: str | None = None
    visible: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES, own device first
    utilization: float | None = None
    shared_with: int = 1  # workers on this device, this one included
    ranks: tuple[str, ...] = ()  # a tensor-parallel worker's devices of ranks 1..N-1
    cpu_threads: int = 0  # a CPU worker's share of the host's cores (`cpu_share`)

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device this worker uses (rank order)."""
        return () if self.device is None else (self.device, *self.ranks)

    @property
    def env(self) -> dict[str, str]:
        if self.device is not None:
            return {"CUDA_VISIBLE_DEVICES": ",".join(self.visible)}
        # torch sizes its intra-op thread pool from it as it starts (the engine process too).
        return {"OMP_NUM_THREADS": str(self.cpu_threads)} if self.cpu_threads else {}

    @property
    def args(self) -> list[str]:
        if self.utilization is None:
            return []
        return ["--gpu-memory-utilization", f"{self.utilization:.4g}"]


def parse_gpus(text: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """``auto`` (every GPU this host shows, none on a CPU host), ``none``, or a list such as
    ``0,1`` (indices or UUIDs as CUDA_VISIBLE_DEVICES takes them)."""
    text = text.strip()
    if text == "none" or text == "":
        return ()
    if text == "auto":
        return detect_gpus(os.environ if env is None else env)
    gpus = tuple(g.strip() for g in text.split(",") if g.strip())
    if len(set(gpus)) != len(gpus):
        raise ValueError(f"--gpus {text!r} names a device twice")
    return gpus


def detect_gpus(env: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs of this host as CUDA_VISIBLE_DEVICES entries: that variable when it is set,
    else what ``nvidia-smi`` lists; () without either."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(v.strip() for v in visible.split(",") if v.strip() and v.strip() != "-1")
    if shutil.which("nvidia-smi") is None:
        return ()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.splitlines() if line.strip())


def cpu_share(ranks: int, cpus: int | None = None, env: Mapping[str, str] | None = None) -> int:
    """The torch threads of each of ``ranks`` engine processes that compute on one host's
    ``cpus`` cores (default: this host's): the cores split evenly, at least one each; 0 (torch's
    default) for a lone engine, or where the environment (``env``, default this process's) sets
    OMP_NUM_THREADS itself. Why: each engine otherwise runs a thread per core, and with more
    threads than cores OpenMP threads wait on descheduled peers at every barrier; two engines
    computing at once on two cores stepped about 5x slower with two threads each than with one
    (a decode step 2.7 s against 0.2 s), which put requests that decode workers had to prefill
    themselves past a minute on the CPU stack."""
    env = os.environ if env is None else env
    if ranks <= 1 or "OMP_NUM_THREADS" in env:
        return 0
    return max(1, (cpus or os.cpu_count() or 1) // ranks)


def place(
    workers: Sequence[str],
    gpus: Sequence[str],
    utilization: float | None = None,
    sizes: Mapping[str, int] | None = None,
    cpus: int | None = None,
) -> dict[str, Placement]:
    """Worker name -> placement: each worker takes the next ``sizes[worker]`` GPUs (its
    tensor-parallel size, 1 by default) round the list, rank 0's first. Without GPUs every
    worker computes with its share of the host's ``cpus`` cores (`cpu_share`, over every rank
    of every worker)."""
    sizes = sizes or {}
    if not gpus:
        share = cpu_share(sum(sizes.get(w, 1) for w in workers), cpus)
        return {w: Placement(cpu_threads=share) for w in workers}
    groups, cursor = [], 0
    for worker in workers:
        n = sizes.get(worker, 1)
        if n > len(gpus):
            raise ValueError(f"{worker} needs {n} GPUs for its ranks; the stack has {len(gpus)}")
        groups.append(tuple(gpus[(cursor + k) % len(gpus)] for k in range(n)))
        cursor += n
    count = Counter(d for group in groups for d in group)
    out = {}
    for worker, group in zip(workers, groups, strict=True):
        shared = max(count[d] for d in group)
        share = utilization if utilization is not None else DEFAULT_UTILIZATION / shared
        visible = (*group, *[g for g in gpus if g not in group])
        out[worker] = Placement(group[0], visible, round(share, 4), shared, group[1:])
    return out
