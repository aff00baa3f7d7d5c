"""Where the local stack's workers run: one GPU per worker (one per rank of a tensor-parallel
worker), shared when there are fewer GPUs than workers, each worker with its own share of its
device's memory.

A worker sees its own GPU first in ``CUDA_VISIBLE_DEVICES`` (so its ``cuda:0`` is that GPU)
followed by the stack's other GPUs: a worker only ever allocates on ``cuda:0``, while a peer's
GPU stays visible so that the KV hand-off can map the peer's pool over NVLink (CUDA IPC)
instead of going through a network stack. Workers that share a device split
``DEFAULT_UTILIZATION`` evenly unless ``--gpu-memory-utilization`` says otherwise, and start
one after another (each sizes its KV pool from what the device has free, see
``engine.memory``).
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
    """One worker's device and memory share; ``device`` None: no GPU placement (CPU)."""

    device: str | None = None
    visible: tuple[str, ...] = ()  # CUDA_VISIBLE_DEVICES, own device first
    utilization: float | None = None
    shared_with: int = 1  # workers on this device, this one included
    ranks: tuple[str, ...] = ()  # a tensor-parallel worker's devices of ranks 1..N-1

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device this worker uses (rank order)."""
        return () if self.device is None else (self.device, *self.ranks)

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.visible)} if self.device is not None else {}

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


def place(
    workers: Sequence[str],
    gpus: Sequence[str],
    utilization: float | None = None,
    sizes: Mapping[str, int] | None = None,
) -> dict[str, Placement]:
    """Worker name -> placement: each worker takes the next ``sizes[worker]`` GPUs (its
    tensor-parallel size, 1 by default) round the list, rank 0's first. Without GPUs every
    worker gets the empty placement (its own defaults)."""
    if not gpus:
        return {w: Placement() for w in workers}
    sizes = sizes or {}
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
