"""`libkv.transfer.sharded.ShardedReader` alone, with a fake rank-0 endpoint and fake ranks
(the real READs between processes are in test_nixl_transfer.py and test_e2e_tensor_parallel.py):
which byte ranges each decode rank READs from which prefill rank, the release after every READ,
and that stale agents and failures are refused without a rank left writing."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from libkv.kv_layout import LAYOUT_KEY, KVLayout
from libkv.transfer import AgentInfo, KVTransferError, PoolRegion, StalePeerError
from libkv.transfer.sharded import RankRead, ShardedReader, rank_agent_name, ranks_extra

HB = 1000  # head bytes: 1 layer x 2 x 5 tokens x 25 dims x 4 bytes


def layout(tp: int) -> KVLayout:
    return KVLayout(num_layers=1, num_kv_heads=3, head_dim=25, block_size=5, dtype="float32",
                    element_size=4, tp=tp)  # fmt: skip


@dataclass(frozen=True)
class Source:
    worker_id: str = "prefill-0"
    incarnation: str = "inc"
    block_ids: tuple[int, ...] = ()
    block_bytes: int = 3 * HB
    address: str = ""
    lease_expires_unix_ms: int = 0


def prefill_extra(tp: int, incarnation: str = "inc") -> dict[str, str]:
    agents = [
        AgentInfo(rank_agent_name("prefill-0", incarnation, r), b"",
                  PoolRegion(0, 8, layout(tp).shard_block_bytes(r)))
        for r in range(tp)
    ]  # fmt: skip
    return {LAYOUT_KEY: layout(tp).to_json(), **ranks_extra(agents)}


class FakeEndpoint:
    def __init__(self, fail: bool = False) -> None:
        self.reads: list[tuple[int, str, list[int], list[int], list]] = []
        self.notes: list[tuple[str, dict]] = []
        self.fail = fail

    async def connect(self, peer: AgentInfo) -> None:
        pass

    async def transfer(self, op, peer, local, remote, notif, timeout, parts=()) -> None:
        assert op == "READ" and notif == b""
        await asyncio.sleep(0.01)
        if self.fail:
            raise KVTransferError("rank 0's READ failed")
        self.reads.append((0, peer, list(local), list(remote), list(parts)))

    async def notify(self, peer: str, message: bytes) -> None:
        self.notes.append((peer, json.loads(message)))


class FakeRanks:
    def __init__(self, endpoint: FakeEndpoint) -> None:
        self.endpoint = endpoint
        self.finished = 0

    async def read(self, rank: int, job: RankRead) -> None:
        await asyncio.sleep(0.05)  # slower than rank 0
        self.endpoint.reads.append(
            (rank, job.peer.name, list(job.local_blocks), list(job.remote_blocks), job.parts)
        )
        self.finished += 1


def test_p2_to_d1_reads_each_prefill_ranks_heads_into_place():
    ep = FakeEndpoint()
    reader = ShardedReader(ep, layout(1))  # type: ignore[arg-type]
    extra = prefill_extra(2)
    assert reader.applies(extra)
    path = asyncio.run(reader.fetch("r", Source(), extra, [4, 5], [0, 7], 5.0))
    assert path == "nixl-read"
    # Prefill rank 0 holds head 0, rank 1 heads 1-2: two READs by decode's only rank.
    assert sorted(ep.reads) == [
        (0, "prefill-0@inc", [0, 7], [4, 5], [(0, 0, HB)]),
        (0, "prefill-0@inc#r1", [0, 7], [4, 5], [(0, HB, 2 * HB)]),
    ]
    assert ep.notes == [("prefill-0@inc", {"t": "rel", "rid": "r"})]
    assert "r" in reader.released


def test_p1_to_d2_each_decode_rank_reads_its_heads():
    ep = FakeEndpoint()
    ranks = FakeRanks(ep)
    reader = ShardedReader(ep, layout(2), ranks)  # type: ignore[arg-type]
    extra = prefill_extra(1)
    assert reader.applies(extra)
    asyncio.run(reader.fetch("r", Source(), extra, [3], [9], 5.0))
    assert sorted(ep.reads) == [
        (0, "prefill-0@inc", [9], [3], [(0, 0, HB)]),
        (1, "prefill-0@inc", [9], [3], [(HB, 0, 2 * HB)]),
    ]


def test_tp1_pairs_are_left_to_the_whole_block_transport():
    reader = ShardedReader(FakeEndpoint(), layout(1))  # type: ignore[arg-type]
    assert not reader.applies(prefill_extra(1))
    assert not reader.applies({LAYOUT_KEY: layout(2).to_json()})  # no NIXL agents: gRPC


def test_stale_agents_and_failures_are_refused_after_every_read_ended():
    ep = FakeEndpoint()
    reader = ShardedReader(ep, layout(2), FakeRanks(ep))  # type: ignore[arg-type]
    with pytest.raises(StalePeerError):
        asyncio.run(reader.fetch("r", Source(incarnation="new"), prefill_extra(2), [1], [1], 5.0))
    assert ep.reads == [] and ep.notes == []
    failing = FakeEndpoint(fail=True)
    ranks = FakeRanks(failing)
    reader = ShardedReader(failing, layout(2), ranks)  # type: ignore[arg-type]
    with pytest.raises(KVTransferError, match="rank 0's READ failed"):
        asyncio.run(reader.fetch("r", Source(), prefill_extra(2), [1], [1], 5.0))
    assert ranks.finished == 1  # rank 1's slower READ ended before the error was raised
    assert failing.notes == [] and "r" not in reader.released  # nothing freed on prefill
    assert reader.stats.failures == 1
