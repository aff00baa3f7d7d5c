"""KV hand-off over NIXL between workers of which at least one is tensor-parallel: every rank
of a worker runs its own NIXL agent over its shard of the pool (`libkv.kv_layout`: head-major,
so a rank's heads of one block are one byte range), and each decode rank READs the heads it
owns straight from the prefill ranks that hold them (`libkv.kv_layout.slice_plan`): one
descriptor per block and source rank, the same count as between two single-device workers.

Member records: ``nixl_agent`` names rank 0's agent (it also serves the notifications:
``rel`` frees the held blocks, as between single-device workers), and ``nixl_ranks`` lists
every rank's agent (rank 0 first) of a tensor-parallel worker; a worker at TP=1 has only the
first. Agent names embed the worker's incarnation (``worker@incarnation``, ``#rN`` for rank
N), so a restarted worker's ranks are never reached through their old agents.

Only READ: a decode worker in WRITE mode still pulls from (or into) a tensor-parallel pool.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from libkv.kv_layout import KVLayout, slice_plan
from libkv.transfer import (
    EXTRA_KEY,
    AgentInfo,
    KVSource,
    KVTransferError,
    StalePeerError,
    TransferStats,
    agent_name,
)
from libkv.transfer.nixl_agent import NixlEndpoint

RANKS_KEY = "nixl_ranks"  # Member.extra: JSON list of every rank's AgentInfo JSON
Parts = list[tuple[int, int, int]]  # (source offset, destination offset, bytes) in a block


def rank_agent_name(worker_id: str, incarnation: str, rank: int) -> str:
    base = agent_name(worker_id, incarnation)
    return base if rank == 0 else f"{base}#r{rank}"


def ranks_extra(agents: Sequence[AgentInfo]) -> dict[str, str]:
    """Member-record fields naming every rank's agent (rank order)."""
    return {RANKS_KEY: json.dumps([a.to_json() for a in agents], separators=(",", ":"))}


def rank_agents(extra: Mapping[str, str]) -> list[AgentInfo]:
    """Every rank's agent from a member record (a TP=1 worker's one agent; [] without NIXL)."""
    if RANKS_KEY in extra:
        return [AgentInfo.from_json(t) for t in json.loads(extra[RANKS_KEY])]
    one = extra.get(EXTRA_KEY)
    return [AgentInfo.from_json(one)] if one else []


@dataclass(frozen=True, slots=True)
class RankRead:
    """One rank's READ: ``parts`` of ``remote_blocks`` of ``peer`` into ``local_blocks``."""

    peer: AgentInfo
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    parts: Parts
    timeout: float


class RankReads(Protocol):
    """The decode worker's ranks 1..N-1, each READing into its own shard with its own agent."""

    def read(self, rank: int, job: RankRead) -> Awaitable[None]: ...


class RankAgents(RankReads, Protocol):
    """A tensor-parallel worker's ranks 1..N-1 as the KV side sees them: each starts a NIXL
    agent over its shard (``start`` returns their infos in rank order) and READs with it."""

    async def start(self, worker_id: str, incarnation: str) -> list[AgentInfo]: ...

    async def close(self) -> None: ...


class ShardedReader:
    """Decode side: obtains a prompt's blocks rank by rank from a tensor-parallel prefill
    worker, or into a tensor-parallel decode worker, or both (``applies``)."""

    name = "nixl-read"

    def __init__(
        self, endpoint: NixlEndpoint, layout: KVLayout, ranks: RankReads | None = None
    ) -> None:
        if layout.tp > 1 and ranks is None:
            raise ValueError("a tensor-parallel worker needs its ranks to read")
        self.endpoint = endpoint  # rank 0's agent
        self.layout = layout
        self.ranks = ranks
        self.stats = TransferStats()
        self.released: set[str] = set()  # requests whose blocks were freed by the READ's rel

    def applies(self, extra: Mapping[str, str]) -> bool:
        """Whether the hand-off from the worker with member record ``extra`` goes rank by
        rank: one side is tensor-parallel and the source has NIXL agents."""
        if not rank_agents(extra):
            return False
        src = KVLayout.from_extra(extra)
        # A source without a layout (an older worker) is TP=1; to a tensor-parallel pool its
        # blocks still go rank by rank (fetch refuses it: never whole blocks into one shard).
        return self.layout.tp > 1 or (src is not None and src.tp > 1)

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        extra: Mapping[str, str],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        t0 = time.monotonic()
        src = KVLayout.from_extra(extra)
        agents = rank_agents(extra)
        try:
            if src is None:
                raise KVTransferError(f"{source.worker_id} publishes no KV layout")
            if len(agents) != src.tp:
                raise KVTransferError(
                    f"{source.worker_id} lists {len(agents)} rank agents for TP {src.tp}"
                )
            for rank, agent in enumerate(agents):
                if agent.name != rank_agent_name(source.worker_id, source.incarnation, rank):
                    raise StalePeerError(
                        f"{source.worker_id} rank {rank} runs agent {agent.name}, not the handle's"
                    )
            reads = []
            for dst_rank in range(self.layout.tp):
                by_src: dict[int, Parts] = {}
                for p in slice_plan(src, self.layout, dst_rank):
                    by_src.setdefault(p.src_rank, []).append((p.src_offset, p.dst_offset, p.nbytes))
                for src_rank, parts in by_src.items():
                    reads.append(
                        self._read(
                            dst_rank, agents[src_rank], dst_blocks, src_blocks, parts, t0, timeout
                        )  # fmt: skip
                    )
            # Every READ ends (each within the timeout) before a failure is raised: the caller
            # then frees the destination blocks, and no rank may still be writing into them.
            results = await asyncio.gather(*reads, return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                if isinstance(errors[0], KVTransferError):
                    raise errors[0]
                raise KVTransferError(f"READ from {source.worker_id} failed: {errors[0]!r}")
            # Every rank's data is in place: rank 0 tells prefill's rank 0 to free the blocks.
            await self.endpoint.connect(agents[0])
            await self.endpoint.notify(agents[0].name, _rel(request_id))
        except KVTransferError:
            self.stats.failures += 1
            raise
        self.released.add(request_id)
        self.stats.add(len(src_blocks), len(src_blocks) * src.block_bytes, time.monotonic() - t0)
        return self.name

    async def _read(
        self,
        rank: int,
        peer: AgentInfo,
        local: Sequence[int],
        remote: Sequence[int],
        parts: Parts,
        t0: float,
        timeout: float,
    ) -> None:
        left = timeout - (time.monotonic() - t0)
        if rank == 0:
            await self.endpoint.connect(peer)
            await self.endpoint.transfer("READ", peer.name, local, remote, b"", left, parts)
            return
        assert self.ranks is not None
        await self.ranks.read(rank, RankRead(peer, tuple(local), tuple(remote), parts, left))


def _rel(request_id: str) -> bytes:
    """The notification on which a prefill worker frees a request's held blocks
    (`libkv.transfer.nixl.NixlBlockServer`)."""
    return json.dumps({"t": "rel", "rid": request_id}, separators=(",", ":")).encode()
