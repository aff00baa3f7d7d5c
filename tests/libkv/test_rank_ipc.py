"""Tests of libkv.transfer.rank_ipc on host memory: the member record listing every rank's
exported shard, which peers go rank by rank over CUDA IPC, and the per-rank copies of P tp=2 ->
D tp=1 and P tp=1 -> D tp=2 re-slicing heads unevenly (3 KV heads, as SmolLM2), checked
against canonical blocks. The CUDA mapping itself (``open_pool``) needs a GPU: here each
"export" names a host tensor (tests/gpu/test_tp_handoff_gpu.py runs the real thing)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace

import pytest
import torch

from libkv.kv_layout import LAYOUT_KEY, KVLayout
from libkv.transfer import CUDA_IPC_KEY, DEVICE_KEY, HOST_KEY, VISIBLE_KEY, KVTransferError
from libkv.transfer.cuda_ipc import IpcPool
from libkv.transfer.path import PathTransport
from libkv.transfer.rank_ipc import (
    RANKS_IPC_KEY,
    IpcCopy,
    ShardedIpcReader,
    ShardMaps,
    copy_parts,
    rank_pools,
    ranks_ipc_extra,
    run_copy,
)
from libkv.transfer.setup import KVSide, _rank_exports

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, block_size=2, dtype="float32",
                  element_size=4)  # fmt: skip
NUM_BLOCKS = 40
HOST = "host-a"
SHARDS: dict[str, torch.Tensor] = {}  # "handle" -> the host tensor it stands for


def export(name: str, shard: torch.Tensor, device: str) -> IpcPool:
    SHARDS[name] = shard
    return IpcPool(device, name, shard.numel(), 0, "", 0, "", False, shard.shape[0],
                   shard.shape[1])  # fmt: skip


def opener(info: IpcPool, device: torch.device) -> torch.Tensor:
    return SHARDS[info.handle]


def shard_of(canon: torch.Tensor, layout: KVLayout, rank: int) -> torch.Tensor:
    lo, hi = layout.heads(rank)
    return canon[:, lo * layout.head_bytes : hi * layout.head_bytes].clone()


def source(name: str, tp: int) -> tuple[dict[str, str], torch.Tensor]:
    """A source worker's member record (TP ``tp``) over random canonical blocks."""
    layout = replace(LAYOUT, tp=tp)
    canon = torch.randint(0, 256, (NUM_BLOCKS, LAYOUT.block_bytes), dtype=torch.uint8)
    pools = [export(f"{name}#r{r}", shard_of(canon, layout, r), f"gpu-{r}") for r in range(tp)]
    extra = {HOST_KEY: HOST, LAYOUT_KEY: layout.to_json(), CUDA_IPC_KEY: pools[0].to_json()}
    if tp > 1:
        extra.update(ranks_ipc_extra([p.to_json() for p in pools]))
    return extra, canon


class HostRanks:
    """Destination ranks 1..N-1 as host tensors, each copying with its own mappings."""

    def __init__(self, shards: list[torch.Tensor]) -> None:
        self.shards = shards
        self.maps = [ShardMaps(torch.device("cpu"), opener) for _ in shards]

    async def copy(self, rank: int, job: IpcCopy) -> None:
        shard = self.shards[rank]
        await run_copy(shard, shard.shape[1], self.maps[rank], job)


def reader(tp: int) -> tuple[ShardedIpcReader, list[torch.Tensor]]:
    layout = replace(LAYOUT, tp=tp)
    shards = [torch.zeros(NUM_BLOCKS, layout.shard_block_bytes(r), dtype=torch.uint8)
              for r in range(tp)]  # fmt: skip
    ranks = HostRanks(shards) if tp > 1 else None
    r = ShardedIpcReader(shards[0], shards[0].shape[1], layout, ranks, opener, HOST,
                         {"gpu-0", "gpu-1"})  # fmt: skip
    return r, shards


def test_the_record_lists_every_ranks_shard_and_a_tp1_worker_its_one_pool() -> None:
    extra, _ = source("p", 2)
    pools = rank_pools(extra)
    assert [p.handle for p in pools] == ["p#r0", "p#r1"]
    assert [p.block_bytes for p in pools] == [LAYOUT.head_bytes, 2 * LAYOUT.head_bytes]
    one, _ = source("q", 1)
    assert RANKS_IPC_KEY not in one and [p.handle for p in rank_pools(one)] == ["q#r0"]
    assert rank_pools({HOST_KEY: HOST}) == []


def test_rank_by_rank_applies_only_to_a_mixed_pair_on_this_host_with_every_gpu_mapped() -> None:
    tp1, _ = reader(1)
    tp2, _ = reader(2)
    p2, _ = source("p2", 2)
    p1, _ = source("p1", 1)
    assert tp1.applies(p2) and tp2.applies(p1) and tp2.applies(p2)
    assert not tp1.applies(p1)  # TP=1 to TP=1: the whole-block CUDA IPC transport's
    assert not tp1.applies({**p2, HOST_KEY: "host-b"})
    tp1.visible = {"gpu-0"}  # rank 1's GPU is not mappable here
    assert not tp1.applies(p2)
    no_ranks = {k: v for k, v in p2.items() if k != RANKS_IPC_KEY}
    assert not tp2.applies(no_ranks)  # rank 0's shard alone is not the whole KV


@dataclass(frozen=True)
class Source:
    """A KV handle's source fields (`libkv.transfer.KVSource`)."""

    worker_id: str
    incarnation: str = "inc"
    address: str = "w:1"
    block_ids: tuple[int, ...] = ()
    block_bytes: int = LAYOUT.block_bytes
    lease_expires_unix_ms: int = 0


def fetch(r: ShardedIpcReader, extra, src: list[int], dst: list[int], source: Source) -> str:
    return asyncio.run(r.fetch("req", source, extra, src, dst, 5.0))


@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
def test_p2_to_d1_assembles_canonical_blocks(scattered: bool) -> None:
    r, (dst,) = reader(1)
    extra, canon = source("p2", 2)
    src = (
        [5, 9, 1, 30, 31, 7, 12, 2, 3, 20, 22, 24, 26, 28, 0, 33, 35, 37]
        if scattered
        else [4, 5, 6, 7]
    )
    out = (
        [10, 2, 30, 1, 5, 8, 14, 16, 18, 20, 22, 24, 26, 28, 0, 33, 35, 37]
        if scattered
        else [11, 12, 13, 14]
    )
    assert fetch(r, extra, src, out, Source("p2")) == "cuda-ipc"
    assert torch.equal(dst[out], canon[src])
    untouched = [b for b in range(NUM_BLOCKS) if b not in out]
    assert not dst[untouched].any()
    assert r.stats.transfers == 1 and r.stats.bytes == len(src) * LAYOUT.block_bytes


def test_p1_to_d2_gives_each_rank_its_heads() -> None:
    r, shards = reader(2)
    extra, canon = source("p1", 1)
    src, out = [3, 4, 5, 8], [20, 21, 22, 0]
    fetch(r, extra, src, out, Source("p1"))
    layout = replace(LAYOUT, tp=2)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard[out], shard_of(canon, layout, rank)[src])


def test_p2_to_d2_and_a_restarted_source_is_mapped_anew() -> None:
    r, shards = reader(2)
    extra, canon = source("p2", 2)
    fetch(r, extra, [1, 2], [1, 2], Source("p2"))
    again, canon2 = source("p2b", 2)  # the same worker, a new incarnation's exports
    fetch(r, again, [1, 2], [3, 4], Source("p2", "inc2"))
    layout = replace(LAYOUT, tp=2)
    for rank, shard in enumerate(shards):
        assert torch.equal(shard[[1, 2]], shard_of(canon, layout, rank)[[1, 2]])
        assert torch.equal(shard[[3, 4]], shard_of(canon2, layout, rank)[[1, 2]])
    assert {name for name, _ in r.maps._maps} == {"p2@inc2"}  # the old mappings dropped


def test_a_source_of_other_geometry_is_refused() -> None:
    r, _ = reader(1)
    extra, _ = source("p2", 2)
    other = replace(LAYOUT, head_dim=8, tp=2)
    with pytest.raises(KVTransferError, match="geometry"):
        fetch(r, {**extra, LAYOUT_KEY: other.to_json()}, [1], [1], Source("p2"))
    assert r.stats.failures == 1


@pytest.mark.parametrize("width", [48, 45], ids=["words", "bytes"])
def test_copy_parts_moves_exactly_the_ranges_as_words_or_bytes(width: int) -> None:
    src = torch.randint(0, 256, (30, width), dtype=torch.uint8)
    dst = torch.zeros(30, 24, dtype=torch.uint8)
    parts = [(0, 16, 8), (40, 0, 8)] if width == 48 else [(1, 3, 5), (40, 10, 5)]
    blocks = list(range(20))  # one run, then scattered (the gather / scatter path)
    for src_blocks, dst_blocks in ((blocks, blocks), (blocks[::-1], blocks)):
        dst.zero_()
        copy_parts(dst, src, src_blocks, dst_blocks, parts)
        want = torch.zeros_like(dst)
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            for so, do, n in parts:
                want[d, do : do + n] = src[s, so : so + n]
        assert torch.equal(dst, want)


class Records:
    """The peers' member records (`libkv.transfer.path.EtcdPeers`'s one method used here)."""

    def __init__(self, extra: dict[str, str]) -> None:
        self.record = extra

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        return self.record


class Unused:
    name = "grpc"

    async def fetch(self, *args) -> str:
        raise AssertionError("a same-host pair of GPU workers went over the network")


def test_the_decode_side_sends_a_mixed_tp_pair_on_this_host_rank_by_rank() -> None:
    r, (dst,) = reader(1)
    extra, canon = source("p2", 2)
    extra[DEVICE_KEY] = "gpu-0"
    mine = {HOST_KEY: HOST, DEVICE_KEY: "gpu-0", VISIBLE_KEY: "gpu-0,gpu-1"}
    path = PathTransport(Records(extra), mine, Unused(), by_rank=r)  # type: ignore[arg-type]
    got = asyncio.run(path.fetch("req", Source("p2"), [3, 4], [7, 8], 5.0))
    assert got == "cuda-ipc" and torch.equal(dst[[7, 8]], canon[[3, 4]])
    assert path.stats.transfers == 1


def test_a_tp_worker_publishes_every_ranks_export_after_rank_0s() -> None:
    class Ranks:
        async def export(self) -> list[str]:
            return ['{"r":1}']

    side = KVSide(extra={CUDA_IPC_KEY: '{"r":0}'})
    asyncio.run(_rank_exports(side, Ranks()))  # type: ignore[arg-type]
    assert json.loads(side.extra[RANKS_IPC_KEY]) == ['{"r":0}', '{"r":1}']
    plain = KVSide(extra={})  # exporting nothing (--no-cuda-ipc): no rank exports either
    asyncio.run(_rank_exports(plain, Ranks()))  # type: ignore[arg-type]
    assert RANKS_IPC_KEY not in plain.extra
