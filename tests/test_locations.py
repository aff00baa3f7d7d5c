"""Block locations: publisher (worker side) and index (router side) against a real etcd."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import textwrap
import time
from collections.abc import AsyncIterator, Iterator

import aetcd
import pytest

from libkv.block_pool import BlockPool
from libkv.cluster.location_index import LocationIndex, PrefixIndex
from libkv.cluster.locations import (
    LocationPublisher,
    PublisherConfig,
    location_key,
    parse_location_key,
)
from libkv.cluster.registry import Member, Registration
from libkv.hashing import encode_extra_keys, hash_prefix_blocks
from libkv.kv_manager import KVCacheManager
from services.launcher.etcd import EtcdServer
from tests.child import python_child

pytestmark = pytest.mark.timeout(60)

TTL, REFRESH = 2, 0.3
BS = 4  # tokens per block in these tests
_ids = itertools.count()


def chain(tokens: list[int], tenant: str = "") -> list[bytes]:
    return hash_prefix_blocks(tokens, BS, encode_extra_keys(tenant or None))


def fill(kv: KVCacheManager, seq: str, tokens: list[int], tenant: str = "") -> None:
    """Admit ``tokens`` as a computed sequence and commit its full blocks to the cache."""
    extra = encode_extra_keys(tenant or None)
    hit = kv.find_prefix(tokens, extra)
    assert kv.admit(seq, hit, len(tokens), len(tokens), extra) is not None
    kv.commit(seq, tokens, len(tokens))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
async def index(etcd) -> AsyncIterator[LocationIndex]:
    idx = await LocationIndex.start(etcd.endpoint)
    yield idx
    await idx.stop()


async def registered(etcd: EtcdServer) -> Registration:
    m = Member(f"w{next(_ids)}-{os.getpid()}", "prefill", "m", "127.0.0.1:1", block_size=BS)
    return await Registration.start(etcd.endpoint, m, ttl=TTL, refresh=REFRESH)


def test_keys_round_trip_and_reject_foreign_keys():
    h = bytes(range(16))
    key = location_key("prefill-0", "abc", h)
    assert key == b"/tandem/v1/blocks/prefill-0/abc/" + h.hex().encode()
    assert parse_location_key(key) == ("prefill-0", "abc", h)
    assert parse_location_key(b"/tandem/v1/blocks/prefill-0/abc/zz") is None
    assert parse_location_key(b"/tandem/v1/blocks/prefill-0/" + h.hex().encode()) is None


def test_index_match_is_the_deepest_published_prefix_per_holder():
    idx = PrefixIndex()
    c = chain(list(range(40)))  # 10 blocks
    idx.reset([(location_key("a", "i1", c[3]), b"4"), (location_key("b", "i2", c[7]), b"8")])
    idx.put(location_key("a", "i1", c[7]), b"8")
    assert idx.match(c) == {("a", "i1"): 8, ("b", "i2"): 8}
    assert idx.match(c[:6]) == {("a", "i1"): 4}
    idx.delete(location_key("a", "i1", c[7]))
    assert idx.match(c) == {("a", "i1"): 4, ("b", "i2"): 8}
    assert idx.entries() == 2 and idx.entries("a") == 1
    # Another tenant's chain over the same tokens matches nothing.
    assert idx.match(chain(list(range(40)), tenant="t2")) == {}


async def test_publisher_granularity_batching_and_eviction(etcd, index):
    reg = await registered(etcd)
    wid = reg.member.worker_id
    pub = LocationPublisher(etcd.endpoint, wid, "inc1", reg, PublisherConfig(every=2))
    kv = KVCacheManager(BlockPool(12, BS))
    kv.set_listener(pub)
    try:
        tokens = list(range(100, 124))  # 6 full blocks -> published at blocks 2, 4, 6
        fill(kv, "s1", tokens)
        assert pub.num_held == 3
        t0 = time.monotonic()
        assert await pub.flush() == 3 and pub.stats.txns == 1  # one transaction
        assert await index.wait_for(lambda i: i.entries(wid) == 3, timeout=1.0)
        assert time.monotonic() - t0 < 1.0
        assert index.match(chain(tokens)) == {(wid, "inc1"): 6}
        # Free it, then fill the pool with another prompt: the cached blocks are evicted
        # leaves first, and the evicted published ones are retracted.
        kv.free("s1")
        fill(kv, "s2", list(range(500, 532)))  # 8 blocks: 6 fresh + 2 evicted
        assert await pub.flush() == 1 + 4  # delete of block 6, puts of 2, 4, 6, 8
        assert await index.wait_for(lambda i: i.entries(wid) == 6, timeout=1.0)
        assert index.match(chain(tokens)) == {(wid, "inc1"): 4}
        # A put and a delete of the same key between flushes cancel out: nothing written.
        kv.free("s2")
        puts = pub.stats.puts
        fill(kv, "s3", list(range(900, 908)))
        kv.free("s3")
        fill(kv, "s4", list(range(700, 748)))  # evicts everything cached
        kv.free("s4")
        await pub.flush()
        assert pub.stats.puts - puts == 48 // BS // 2  # only s4: s3's put never left
        kv.check_integrity()
    finally:
        await pub.stop()
        await reg.stop()
    # Revoking the lease (worker stop) removes every entry at once.
    assert await index.wait_for(lambda i: i.entries(wid) == 0, timeout=1.0)


async def test_rate_limit_caps_operations_per_transaction(etcd, index):
    reg = await registered(etcd)
    wid = reg.member.worker_id
    pub = LocationPublisher(etcd.endpoint, wid, "i", reg, PublisherConfig(every=1, max_ops=5))
    kv = KVCacheManager(BlockPool(32, BS))
    kv.set_listener(pub)
    try:
        fill(kv, "s", list(range(48)))  # 12 blocks, every one published
        assert [await pub.flush() for _ in range(4)] == [5, 5, 2, 0]
        assert pub.stats.txns == 3 and pub.stats.puts == 12
        assert await index.wait_for(lambda i: i.entries(wid) == 12, timeout=1.0)
    finally:
        await pub.stop()
        await reg.stop()


async def test_new_lease_republishes_everything(etcd, index):
    reg = await registered(etcd)
    wid = reg.member.worker_id
    pub = LocationPublisher(etcd.endpoint, wid, "i", reg, PublisherConfig(every=1, interval=0.05))
    kv = KVCacheManager(BlockPool(16, BS))
    kv.set_listener(pub)
    pub.start()
    try:
        fill(kv, "s", list(range(16)))
        assert await index.wait_for(lambda i: i.entries(wid) == 4, timeout=1.0)
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
            await client.revoke_lease(reg.lease_id)  # as if etcd lost it
        assert await index.wait_for(lambda i: i.entries(wid) == 0, timeout=1.0)
        assert await index.wait_for(lambda i: i.entries(wid) == 4, timeout=3.0)
        assert pub.stats.republished == 1 and reg.registrations == 2
    finally:
        await pub.stop()
        await reg.stop()


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from libkv.block_pool import BlockPool
    from libkv.kv_manager import KVCacheManager, PrefixHit
    from libkv.cluster.locations import LocationPublisher, PublisherConfig
    from libkv.cluster.registry import Member, Registration

    async def main():
        m = Member(worker_id=sys.argv[2], role="prefill", model="m", address="127.0.0.1:1")
        reg = await Registration.start(sys.argv[1], m, ttl=2, refresh=0.3)
        pub = LocationPublisher(sys.argv[1], m.worker_id, m.incarnation, reg,
                                PublisherConfig(every=1, interval=0.05))
        kv = KVCacheManager(BlockPool(8, 4))
        kv.set_listener(pub)
        pub.start()
        kv.admit("s", PrefixHit([], []), 16, 16, b"")
        kv.commit("s", list(range(16)), 16)
        print("ready", m.incarnation, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


async def test_entries_of_another_process_appear_within_1s_and_vanish_after_kill_9(etcd, index):
    worker_id = f"child-{next(_ids)}"
    async with python_child(CHILD, etcd.endpoint, worker_id) as proc:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.startswith(b"ready ")
        incarnation = line.split()[1].decode()
        assert await index.wait_for(lambda i: i.entries(worker_id) == 4, timeout=1.0)
        assert index.match(chain(list(range(16)))) == {(worker_id, incarnation): 4}
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
        t0 = time.monotonic()
        assert await index.wait_for(lambda i: i.entries(worker_id) == 0, timeout=TTL + 1.5)
        assert time.monotonic() - t0 <= TTL + 1.5
