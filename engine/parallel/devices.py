"""Where each rank of a tensor-parallel engine computes: its device, or its share of a CPU's
cores. Read by the rank processes (``engine.parallel.worker``), by rank 0 as it starts them
(``engine.parallel.ranks``) and by every rank's runner (``engine.model_runner``)."""

from __future__ import annotations

import os

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


def set_cpu_threads(size: int) -> None:
    """On a CPU host each of the ``size`` ranks computes with its share of the cores (they
    would otherwise all spin on every core and slow each other down)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
