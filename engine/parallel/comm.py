"""The collectives of a tensor-parallel model, over ``torch.distributed`` (NCCL on CUDA, gloo on
CPU). At size 1 every operation is the plain single-device one, so the unsharded model runs
exactly as it would without this module.

All of them run on the default process group, in the same order on every rank: rank 0 decides
what runs (``engine.parallel.ranks``) and every rank executes the same model code. The
all-reduce and the logits all-gather are captured in the decode CUDA graphs like any kernel
(NCCL collectives are capturable once the communicator exists; the memory profile's forward
pass creates it before capture).
"""

from __future__ import annotations

import datetime
import logging
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.parallel.shard import ModelShard

log = logging.getLogger(__name__)
# torch 2.13 renamed all_gather_into_tensor (older GPU hosts' torch has only the old name).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Collectives run only inside steps, which every rank enters together; a rank that dies is
# caught by the rank watchdog (engine.parallel.ranks) long before this.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


STORE_TIMEOUT = datetime.timedelta(seconds=120)
# How long leaving the process group may take before a closing engine stops waiting for it.
LEAVE_TIMEOUT_S = 20.0


def leave_group(timeout: float = LEAVE_TIMEOUT_S) -> bool:
    """Leave the process group (``dist.destroy_process_group``), waiting at most ``timeout``
    seconds: NCCL's shutdown can wait for peers that are gone, or for CUDA graphs that still
    hold its collectives (pytorch #115388; ranks release theirs first), and a closing engine
    must not hang on it. Returns whether it finished; if not, it goes on in a daemon thread
    and the communicator is leaked, with a warning."""
    if not dist.is_initialized():
        return True
    leaving = threading.Thread(target=dist.destroy_process_group, name="leave-group", daemon=True)
    leaving.start()
    leaving.join(timeout)
    if leaving.is_alive():
        log.warning("leaving the tensor-parallel process group took over %.0f s: left behind",
                    timeout)  # fmt: skip
        return False
    return True


def master_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``.port``)."""
    return dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False
    )


def client_store(host: str, port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, size, is_master=False, timeout=STORE_TIMEOUT)


def init_group(store: dist.Store, rank: int, size: int, device: torch.device) -> None:
    """Join the engine's process group: NCCL on CUDA, gloo on CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )


class TPComm:
    """This process's place in the engine's tensor-parallel group."""

    def __init__(self, shard: ModelShard) -> None:
        self.shard = shard
        self.rank = shard.rank
        self.size = shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (in place; row-parallel outputs)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Embedding rows of ``ids`` from a vocab-parallel table (rows ``shard.vocab``)."""
        if self.size == 1:
            return F.embedding(ids, weight)
        lo, hi = self.shard.vocab
        outside = (ids < lo) | (ids >= hi)
        x = F.embedding((ids - lo).clamp(0, hi - lo - 1), weight)
        return self.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's ``[T, vocab shard]`` logits side by side: ``[T, vocab]`` on each rank."""
        if self.size == 1:
            return logits
        width = self.shard.vocab_width
        if logits.shape[1] < width:
            logits = F.pad(logits, (0, width - logits.shape[1]))
        out = logits.new_empty((self.size * logits.shape[0], width))
        _all_gather(out, logits.contiguous())  # rank by rank along dim 0
        out = out.view(self.size, logits.shape[0], width)
        return torch.cat([out[r, :, :n] for r, n in enumerate(self.shard.vocab_rows)], dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value``."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_to_first(self, obj: object) -> list[object] | None:
        """Every rank's ``obj`` on rank 0 (in rank order), None elsewhere (CPU pools only)."""
        if self.size == 1:
            return [obj]
        out: list[object] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out
