"""The device-local KV hand-off where at least one side is tensor-parallel: every rank of a
worker exports its shard of the pool for CUDA IPC (`cuda_ipc.export_pool`), and each rank of
the destination maps the source ranks that hold its heads and copies, per run of blocks
consecutive on both sides (`block_runs`), one byte range per source rank and block
(`libkv.kv_layout.slice_plan`: head-major blocks make a rank's heads one range).

Member record: ``cuda_ipc`` is rank 0's export as at TP=1 (whose ``block_bytes`` is a shard's,
so the whole-block `CudaIpcTransport` refuses it), ``cuda_ipc_ranks`` lists every rank's
export (rank 0 first) of a tensor-parallel worker; a TP=1 worker's one export is its
``cuda_ipc``. Every listed GPU must be on this host and mappable here (``kv_devices``).

Ordering is as between TP=1 workers (`libkv.transfer.cuda_ipc`): the source hands a request
over after its step's kernels ran on every rank (the first token waits for the step), and the
destination waits for every rank's copy before the request joins its batch; a failed rank's
copy fails the fetch only after every rank's copy ended, so the caller frees the destination
blocks with nothing still writing them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from libkv.kv_layout import KVLayout, slice_plan
from libkv.transfer import (
    CUDA_IPC_KEY,
    HOST_KEY,
    KVSource,
    KVTransferError,
    TransferStats,
    agent_name,
    block_runs,
)
from libkv.transfer.cuda_ipc import IpcPool, host_id, open_pool, visible_devices

RANKS_IPC_KEY = "cuda_ipc_ranks"  # Member.extra: JSON list of every rank's IpcPool JSON
Parts = list[tuple[int, int, int]]  # (source offset, destination offset, bytes) in a block
# Above this many runs the copy is one gather/scatter per part instead of a copy per run.
RUN_COPIES = 16


def ranks_ipc_extra(exports: Sequence[str]) -> dict[str, str]:
    """Member-record field listing every rank's export (IpcPool JSON, rank order)."""
    return {RANKS_IPC_KEY: json.dumps(list(exports), separators=(",", ":"))}


def rank_pools(extra: Mapping[str, str]) -> list[IpcPool]:
    """Every rank's exported shard from a member record (a TP=1 worker's one pool; [] when the
    worker exports none)."""
    if RANKS_IPC_KEY in extra:
        return [IpcPool.from_json(t) for t in json.loads(extra[RANKS_IPC_KEY])]
    one = extra.get(CUDA_IPC_KEY)
    return [IpcPool.from_json(one)] if one else []


def copy_parts(
    dst: torch.Tensor,
    src: torch.Tensor,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    parts: Parts,
) -> None:
    """Copy ``parts`` of ``src_blocks`` of ``src`` into ``dst_blocks`` of ``dst`` (both
    ``[num_blocks, block_bytes]`` uint8, on one device as torch sees it; a peer GPU's mapping
    is read over peer access). A few runs: one strided copy per run and part; scattered
    blocks: one gather and one scatter per part (their ids go up once). Moved as 64-bit
    words where every range allows (a KV head's bytes always do): a strided copy's kernel
    then moves 8 bytes per element, not 1."""
    if all(x % 8 == 0 for x in (dst.shape[1], src.shape[1], *(v for p in parts for v in p))):
        dst, src = dst.view(torch.int64), src.view(torch.int64)
        parts = [(so // 8, do // 8, n // 8) for so, do, n in parts]
    runs = block_runs(src_blocks, dst_blocks)
    if len(runs) <= RUN_COPIES:
        for s, d, k in runs:
            for so, do, n in parts:
                dst[d : d + k, do : do + n].copy_(src[s : s + k, so : so + n], non_blocking=True)
        return
    si = torch.tensor(list(src_blocks), dtype=torch.int64).to(dst.device, non_blocking=True)
    di = torch.tensor(list(dst_blocks), dtype=torch.int64).to(dst.device, non_blocking=True)
    for so, do, n in parts:
        dst[di, do : do + n] = src.index_select(0, si)[:, so : so + n]


@dataclass(frozen=True, slots=True)
class IpcCopy:
    """One destination rank's copy from one source rank's exported shard."""

    worker: str  # the source's worker id (a restart unmaps its old shards)
    name: str  # agent name of the source incarnation (worker@incarnation)
    src_rank: int
    pool: str  # the source rank's IpcPool JSON
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    parts: Parts
    timeout: float


class RankCopies(Protocol):
    """The destination worker's ranks 1..N-1, each copying into its own shard."""

    def copy(self, rank: int, job: IpcCopy) -> Awaitable[None]: ...


class RankShards(RankCopies, Protocol):
    """A tensor-parallel worker's ranks 1..N-1 on CUDA IPC: they export their shards (IpcPool
    JSON, rank order) and copy peers' shards into their own."""

    async def export(self) -> list[str]: ...


Opener = Callable[[IpcPool, torch.device], torch.Tensor]


class ShardMaps:
    """One process's mappings of peers' exported shards, by source incarnation and rank; a
    restarted peer's old mappings are dropped when its new incarnation is first used."""

    def __init__(self, device: torch.device, opener: Opener = open_pool) -> None:
        self.device, self.opener = device, opener
        self.stream: Any = None  # the side stream copies into this process's shard run on
        self._maps: dict[tuple[str, int], torch.Tensor] = {}
        self._current: dict[str, str] = {}

    def get(self, job: IpcCopy) -> torch.Tensor:
        old = self._current.get(job.worker)
        if old is not None and old != job.name:
            self._maps = {k: v for k, v in self._maps.items() if k[0] != old}
        self._current[job.worker] = job.name
        key = (job.name, job.src_rank)
        if key not in self._maps:
            self._maps[key] = self.opener(IpcPool.from_json(job.pool), self.device)
        return self._maps[key]


async def run_copy(pool: torch.Tensor, block_bytes: int, maps: ShardMaps, job: IpcCopy) -> None:
    """``job`` into ``pool`` (this rank's shard, ``[num_blocks, ...]``), on a side stream on
    a GPU; returns once the copy completed (within ``job.timeout``: a copy still running past
    it is waited out before the error, never left writing freed blocks)."""
    dst = pool.view(torch.uint8).view(pool.shape[0], block_bytes)
    src = maps.get(job)
    if dst.device.type != "cuda":  # host memory: the tests' reference path
        copy_parts(dst, src, job.src_blocks, job.dst_blocks, job.parts)
        return
    torch.cuda.set_device(dst.device)
    if maps.stream is None:  # one side stream per process: the copies overlap the steps
        maps.stream = torch.cuda.Stream(dst.device)
    stream = maps.stream
    with torch.cuda.stream(stream):
        copy_parts(dst, src, job.src_blocks, job.dst_blocks, job.parts)
        done = torch.cuda.Event()
        done.record(stream)
    try:
        await asyncio.wait_for(asyncio.to_thread(done.synchronize), job.timeout)
    except TimeoutError as e:
        await asyncio.to_thread(done.synchronize)
        raise KVTransferError(f"CUDA IPC copy of rank {job.src_rank} took too long") from e


class ShardedIpcReader:
    """Decode side: a prompt's blocks over CUDA IPC, rank by rank, from a tensor-parallel
    source or into a tensor-parallel pool, or both (``applies``). ``pool`` is rank 0's shard
    as this process holds it; ``ranks`` copies into ranks 1..N-1 (None at TP=1)."""

    name = "cuda-ipc"

    def __init__(
        self,
        pool: Any,
        block_bytes: int,
        layout: KVLayout,
        ranks: RankCopies | None = None,
        opener: Opener = open_pool,
        host: str | None = None,
        visible: set[str] | None = None,
    ) -> None:
        if layout.tp > 1 and ranks is None:
            raise ValueError("a tensor-parallel worker needs its ranks to copy")
        self.pool, self.block_bytes, self.layout, self.ranks = pool, block_bytes, layout, ranks
        self.maps = ShardMaps(pool.device, opener)
        self.host = host_id() if host is None else host
        self.visible = set(visible_devices()) if visible is None else visible
        self.stats = TransferStats()

    def applies(self, extra: Mapping[str, str]) -> bool:
        """Whether the hand-off from the worker with member record ``extra`` goes rank by rank
        over CUDA IPC: one side is tensor-parallel, and every source shard is exported on this
        host from a GPU this worker maps."""
        src = KVLayout.from_extra(extra)
        if self.layout.tp == 1 and (src is None or src.tp == 1):
            return False
        pools = rank_pools(extra)
        return (
            bool(pools)
            and src is not None
            and len(pools) == src.tp
            and extra.get(HOST_KEY) == self.host
            and all(p.device_uuid in self.visible for p in pools)
        )

    def jobs(
        self, source: KVSource, extra: Mapping[str, str], src_blocks, dst_blocks, timeout: float
    ) -> list[tuple[int, IpcCopy]]:
        """(destination rank, copy) for every destination rank and source rank it reads."""
        src = KVLayout.from_extra(extra)
        pools = rank_pools(extra)
        if src is None or len(pools) != src.tp:
            raise KVTransferError(f"{source.worker_id} exports {len(pools)} shards, no TP match")
        if src.refusal(self.layout) is not None:
            raise KVTransferError(f"from {source.worker_id}: {src.refusal(self.layout)}")
        name = agent_name(source.worker_id, source.incarnation)
        out = []
        for dst_rank in range(self.layout.tp):
            by_src: dict[int, Parts] = {}
            for p in slice_plan(src, self.layout, dst_rank):
                by_src.setdefault(p.src_rank, []).append((p.src_offset, p.dst_offset, p.nbytes))
            for r, parts in by_src.items():
                job = IpcCopy(source.worker_id, name, r, pools[r].to_json(), tuple(src_blocks),
                              tuple(dst_blocks), parts, timeout)  # fmt: skip
                out.append((dst_rank, job))
        return out

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        extra: Mapping[str, str],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        if len(src_blocks) != len(dst_blocks):
            raise ValueError("src_blocks and dst_blocks differ in length")
        t0 = time.monotonic()
        try:
            copies: list[Awaitable[None]] = []
            for rank, job in self.jobs(source, extra, src_blocks, dst_blocks, timeout):
                if rank == 0:
                    copies.append(run_copy(self.pool, self.block_bytes, self.maps, job))
                else:
                    assert self.ranks is not None
                    copies.append(self.ranks.copy(rank, job))
            results = await asyncio.gather(*copies, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                if isinstance(errors[0], KVTransferError):
                    raise errors[0]
                raise KVTransferError(f"CUDA IPC copy from {source.worker_id}: {errors[0]!r}")
        except KVTransferError:
            self.stats.failures += 1
            raise
        n = len(src_blocks)
        self.stats.add(n, n * self.layout.block_bytes, time.monotonic() - t0)
        return self.name
