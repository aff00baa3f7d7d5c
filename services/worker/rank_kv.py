"""A tensor-parallel worker's ranks 1..N-1 on the KV side: each runs a NIXL agent over its own
shard of the pool and READs into it (`libkv.transfer.sharded.RankAgents`), and on a GPU exports
its shard for CUDA IPC and copies peers' shards into it (`libkv.transfer.rank_ipc`). The
functions below run inside the rank processes, on their call loops (`engine.parallel.rpc`),
off their steps."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from libkv.transfer import AgentInfo, KVTransferError, PoolRegion
from libkv.transfer.cuda_ipc import export_pool
from libkv.transfer.nixl_agent import NixlEndpoint
from libkv.transfer.rank_ipc import IpcCopy, ShardMaps, run_copy
from libkv.transfer.sharded import Parts, RankRead, rank_agent_name

if TYPE_CHECKING:
    from engine.parallel.ranks import RankGroup
    from engine.parallel.worker import RankContext

STATE_KEY = "nixl"  # RankContext.state: the rank's NixlEndpoint
MAPS_KEY = "ipc_maps"  # RankContext.state: the rank's ShardMaps (peers' shards it mapped)


class RankNixl:
    """`RankAgents` over an engine's `RankGroup`."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group

    async def _call(self, rank: int, fn, *args):
        try:
            return await asyncio.wrap_future(self.group.call(rank, fn, *args))
        except RuntimeError as e:  # RankCallError: the rank's exception, or the rank is gone
            raise KVTransferError(f"rank {rank}: {e}") from e

    async def start(self, worker_id: str, incarnation: str) -> list[AgentInfo]:
        names = [rank_agent_name(worker_id, incarnation, r) for r in range(1, self.group.size)]
        infos = await asyncio.gather(
            *(self._call(r, start_agent, name) for r, name in enumerate(names, start=1))
        )
        return [AgentInfo.from_json(i) for i in infos]

    async def read(self, rank: int, job: RankRead) -> None:
        await self._call(
            rank,
            read,
            job.peer.to_json(),
            list(job.local_blocks),
            list(job.remote_blocks),
            job.parts,
            job.timeout,
        )

    async def export(self) -> list[str]:
        """Ranks 1..N-1's shards exported for CUDA IPC (IpcPool JSON, rank order)."""
        return list(
            await asyncio.gather(*(self._call(r, export_shard) for r in range(1, self.group.size)))
        )

    async def copy(self, rank: int, job: IpcCopy) -> None:
        await self._call(rank, ipc_copy, job)

    async def close(self) -> None:
        for r in range(1, self.group.size):
            # A rank that is gone or stopping takes its agent with it.
            with contextlib.suppress(KVTransferError, TimeoutError):
                await asyncio.wait_for(self._call(r, close_agent), 5.0)


# -- inside a rank process ----------------------------------------------------------------------
async def start_agent(ctx: RankContext, name: str) -> str:
    """Start this rank's agent over its pool shard; its info as JSON."""
    pool = ctx.runner.kv_pool
    on_gpu = pool.device.type == "cuda"
    region = PoolRegion(
        addr=pool.data_ptr(),
        num_blocks=pool.shape[0],
        block_bytes=ctx.runner.block_bytes,
        mem_type="VRAM" if on_gpu else "DRAM",
        device_id=(pool.device.index or 0) if on_gpu else 0,
    )
    endpoint = await NixlEndpoint.start(name, region)
    # Peers READ this shard; UCX needs this agent polled for their connection's wire-up.
    endpoint.start_pump(lambda peer, raw: None, busy=lambda: False, idle_interval=0.005)
    ctx.state[STATE_KEY] = endpoint
    assert endpoint.info is not None
    return endpoint.info.to_json()


async def read(
    ctx: RankContext,
    peer_json: str,
    local_blocks: list[int],
    remote_blocks: list[int],
    parts: Parts,
    timeout: float,
) -> None:
    """READ ``parts`` of ``remote_blocks`` of ``peer`` into this rank's ``local_blocks``."""
    endpoint: NixlEndpoint = ctx.state[STATE_KEY]
    peer = AgentInfo.from_json(peer_json)
    await endpoint.connect(peer)
    await endpoint.transfer("READ", peer.name, local_blocks, remote_blocks, b"", timeout, parts)


async def close_agent(ctx: RankContext) -> None:
    endpoint = ctx.state.pop(STATE_KEY, None)
    if endpoint is not None:
        await endpoint.close()


def export_shard(ctx: RankContext) -> str:
    """This rank's pool shard exported for CUDA IPC (`libkv.transfer.cuda_ipc.IpcPool` JSON)."""
    return export_pool(ctx.runner.kv_pool, ctx.runner.block_bytes).to_json()


async def ipc_copy(ctx: RankContext, job: IpcCopy) -> None:
    """Copy ``job``'s parts from a peer rank's exported shard into this rank's shard."""
    pool = ctx.runner.kv_pool
    maps = ctx.state.get(MAPS_KEY)
    if maps is None:
        maps = ctx.state[MAPS_KEY] = ShardMaps(pool.device)
    await run_copy(pool, ctx.runner.block_bytes, maps, job)
