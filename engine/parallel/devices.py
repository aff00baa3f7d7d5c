"""Where each rank of a tensor-parallel engine computes: its device, or its share of a CPU's
cores. Read by the rank processes (``engine.parallel.worker``), by rank 0 as it starts them
(``engine.parallel.ranks``) and by every rank's runner (``engine.model_runner``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from engine.config import EngineConfig


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank ``rank``'s device: ``cuda:k`` (``k`` from ``config.device``, 0 by default) gives
    rank r ``cuda:k+r``; a CPU engine's ranks all use the CPU."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    base = device.index if device.index is not None else 0
    return torch.device("cuda", base + rank)


def rank_cpu_threads(size: int, env: Mapping[str, str] | None = None) -> int:
    """Torch threads of each of a CPU worker's ``size`` ranks: they split the worker's share of
    the host's cores, at least one each. The share is OMP_NUM_THREADS of ``env`` (default this
    process's; the launcher's ``cpu_share`` where CPU workers split a host, or the operator's
    own) when it holds a positive count (its first, outermost level), else every core."""
    env = os.environ if env is None else env
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    share = int(first) if first.isdigit() and int(first) > 0 else (os.cpu_count() or 1)
    return max(1, share // size)


def set_cpu_threads(size: int) -> None:
    """On a CPU host each of the ``size`` ranks computes with its share of the worker's cores
    (`rank_cpu_threads`): they would otherwise all spin on every core, and on the cores of the
    host's other CPU workers, and slow each other down."""
    torch.set_num_threads(rank_cpu_threads(size))
