"""Block locations as bounded per-worker summaries: codec, index and publisher (real etcd)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import pytest

from libkv.block_pool import BlockPool
from libkv.cluster.location_summary import (
    DELTA,
    RING,
    SNAPSHOT,
    Summary,
    SummaryKey,
    delta_key,
    entry_key,
    parse_summary_key,
    snapshot_key,
)
from libkv.cluster.registry import Member, Registration
from libkv.cluster.summary_index import LocationIndex, SummaryIndex
from libkv.cluster.summary_publisher import SummaryConfig, SummaryPublisher
from libkv.cluster.summary_state import SummaryState
from libkv.hashing import ROOT_HASH, encode_extra_keys, hash_prefix_blocks
from libkv.kv_manager import KVCacheManager
from services.launcher.etcd import EtcdServer

pytestmark = pytest.mark.timeout(60)

TTL, REFRESH = 2, 0.3
BS = 4  # tokens per block in these tests
_ids = itertools.count()


def chain(tokens: list[int], tenant: str = "") -> list[bytes]:
    return hash_prefix_blocks(tokens, BS, encode_extra_keys(tenant or None))


def fill(kv: KVCacheManager, seq: str, tokens: list[int]) -> None:
    """Admit ``tokens`` as a computed sequence and commit its full blocks to the cache."""
    hit = kv.find_prefix(tokens)
    assert kv.admit(seq, hit, len(tokens), len(tokens), b"") is not None
    kv.commit(seq, tokens, len(tokens))


def keys(c: list[bytes], *positions: int) -> list[int]:
    """Entries of chain positions given as depths (1-based)."""
    return [entry_key(c[d - 1]) for d in positions]


# -- codec and index (no etcd) ----------------------------------------------------------------
def test_keys_and_values_round_trip_and_reject_foreign_ones():
    assert parse_summary_key(snapshot_key("p-0", "inc")) == SummaryKey("p-0", "inc", None)
    assert parse_summary_key(delta_key("p-0", "inc", RING + 3)) == SummaryKey("p-0", "inc", 3)
    for bad in (b"/tandem/v1/locations/p-0/snapshot", b"/tandem/v1/locations/p/i/delta/99",
                b"/tandem/v1/locations/p/i/other", b"/tandem/v1/blocks/p/i/snapshot"):  # fmt: skip
        assert parse_summary_key(bad) is None
    s = Summary(DELTA, 3, 7, 16, 4, [1, 2**64 - 1], [5])
    assert Summary.decode(s.encode()) == s
    assert len(s.encode()) == 22 + 3 * 8
    assert Summary.decode(s.encode()[:-1]) is None and Summary.decode(b"x") is None


def test_index_rebuilds_from_snapshot_and_ring_and_ignores_gaps_and_stale_ones():
    c = chain(list(range(48)))  # 12 blocks
    idx = SummaryIndex()
    snap = Summary(SNAPSHOT, 1, 4, 4, 4, keys(c, 4, 8))
    d5 = Summary(DELTA, 1, 5, 4, 4, keys(c, 12), keys(c, 8))
    d6 = Summary(DELTA, 1, 6, 4, 4, keys(c, 8))
    old = Summary(DELTA, 1, 3, 4, 4, keys(c, 4))  # before the snapshot: already in it
    # A range read returns the ring in key order, not sequence order.
    ring = [(delta_key("a", "i", n), s.encode()) for n, s in [(6, d6), (3, old), (5, d5)]]
    idx.reset([ring[0], ring[1], (snapshot_key("a", "i"), snap.encode()), ring[2]])
    assert idx.match(c) == {("a", "i"): 12} and idx.entries("a") == 3
    assert idx.match(c[:11]) == {("a", "i"): 8} and idx.match(c[:7]) == {("a", "i"): 4}
    # A delta that skips one is not applied (the next snapshot heals); a stale one neither.
    idx.put(delta_key("a", "i", 8), Summary(DELTA, 1, 8, 4, 4, [], keys(c, 4)).encode())
    idx.put(delta_key("a", "i", 6), d6.encode())
    assert idx.entries("a") == 3 and (idx.stats.gaps, idx.stats.stale) == (1, 2)
    # Another worker shares a position; the lookup keeps each one's deepest.
    idx.put(snapshot_key("b", "j"), Summary(SNAPSHOT, 1, 0, 4, 4, keys(c, 4)).encode())
    assert idx.match(c) == {("a", "i"): 12, ("b", "j"): 4}
    assert idx.holders(c[3]) == {("a", "i"), ("b", "j")}
    # The snapshot key going (lease expired) drops the worker; its delta keys do not matter.
    idx.delete(delta_key("a", "i", 5))
    assert idx.entries("a") == 3
    idx.delete(snapshot_key("a", "i"))
    assert idx.match(c) == {("b", "j"): 4} and idx.entries("a") == 0 and len(idx) == 1
    assert idx.holders(c[3]) == {("b", "j")}


def test_state_caps_a_delta_at_the_budget_and_writes_a_failed_one_again():
    st = SummaryState(SummaryConfig(base=1, budget=3, max_granularity=1))
    c = chain(list(range(40)))  # 10 blocks, all published at granularity 1
    for i, h in enumerate(c):
        st.cached(i, h, c[i - 1] if i else ROOT_HASH)
    first = st.plan(epoch=1)
    assert first is not None and first.summary.kind == SNAPSHOT and len(first.summary.added) == 10
    st.applied(first, 100)
    for h in reversed(c[5:]):  # leaves first, as the pool evicts
        st.evicted(h)
    p = st.plan(epoch=1)
    assert p is not None and p.summary.kind == DELTA and len(p.summary.removed) == 3
    st.failed(p)  # etcd did not take it: the same changes come again
    again = st.plan(epoch=1)
    assert again is not None and sorted(again.summary.removed) == sorted(p.summary.removed)
    st.applied(again, 50)
    rest = st.plan(epoch=1)
    assert rest is not None and (rest.summary.seq, len(rest.summary.removed)) == (2, 2)
    st.applied(rest, 40)
    assert st.plan(epoch=1) is None
    assert (st.stats.txns, st.stats.puts, st.stats.deletes) == (3, 10, 5)
    assert st.plan(epoch=2).summary.kind == SNAPSHOT and st.stats.republished == 1  # new lease


@pytest.mark.parametrize("hashseed", ["6", "31"])  # split the capped delta apart before
def test_a_capped_delta_is_the_same_whatever_the_hash_seed(hashseed: str):
    """A set of bytes iterates by the process's string hash seed: the test above, under seeds
    that once made its retried delta carry other removals."""
    name = test_state_caps_a_delta_at_the_budget_and_writes_a_failed_one_again.__name__
    script = f"from tests.libkv.test_location_summary import {name} as t; t()"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(root)}
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env, cwd=root, timeout=60)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]


# -- publisher and index against etcd ---------------------------------------------------------
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


def publisher(
    etcd, reg: Registration, blocks: int, **config
) -> tuple[SummaryPublisher, KVCacheManager]:
    m = reg.member
    pub = SummaryPublisher(etcd.endpoint, m.worker_id, m.incarnation, reg, SummaryConfig(**config))
    kv = KVCacheManager(BlockPool(blocks, BS))
    kv.set_listener(pub)
    return pub, kv


def depth(index: SummaryIndex, reg: Registration, tokens: list[int]) -> int:
    return index.match(chain(tokens)).get((reg.member.worker_id, reg.member.incarnation), 0)


async def test_fixed_positions_and_leaves_follow_the_cache(etcd, index):
    reg = await registered(etcd)
    wid = reg.member.worker_id
    pub, kv = publisher(etcd, reg, 20, granularity=16)  # fixed positions: every 16th block
    try:
        turn1 = list(range(100, 140))  # 10 blocks: leaf 8 (the last multiple of base 4)
        fill(kv, "t1", turn1)
        assert await pub.flush() == 1 and pub.stats.snapshots == 1  # the epoch's first write
        assert await index.wait_for(lambda i: i.entries(wid) == 1, timeout=3.0)
        assert depth(index, reg, turn1 + [1, 2, 3, 4]) == 8
        # The next turn goes on past 12 and 16 in one interval: leaf 8 is retracted, 12 never
        # leaves the worker, 16 (a fixed position and the new leaf) is announced.
        kv.free("t1")
        turn2 = turn1 + list(range(500, 528))  # 17 blocks
        fill(kv, "t2", turn2)
        assert await pub.flush() == 1
        # (written as a snapshot of one entry: smaller than the delta +16 -8)
        assert pub.stats.snapshots == 2 and (pub.stats.puts, pub.stats.deletes) == (1 + 1, 0)
        assert await index.wait_for(lambda i: depth(i, reg, turn2) == 16, timeout=3.0)
        assert depth(index, reg, turn1) == 0  # cached, but neither a leaf nor a fixed position
        # Nothing changed: nothing is written.
        assert await pub.flush() == 0 and pub.stats.txns == 2
        # Another prompt evicts turn 2's deepest blocks (leaves first): 16 is retracted.
        kv.free("t2")
        other = list(range(900, 948))  # 12 blocks, leaf 12
        fill(kv, "x", other)
        await pub.flush()
        assert await index.wait_for(lambda i: depth(i, reg, turn2) == 0, timeout=3.0)
        assert depth(index, reg, other) == 12 and index.entries(wid) == 1
        kv.check_integrity()
    finally:
        await pub.stop()
        await reg.stop()
    assert await index.wait_for(lambda i: i.entries(wid) == 0, timeout=3.0)  # lease revoked


async def test_granularity_adapts_to_the_budget_and_writes_stay_one_per_flush(etcd, index):
    reg = await registered(etcd)
    wid, inc = reg.member.worker_id, reg.member.incarnation
    pub, kv = publisher(etcd, reg, 256, budget=4, patience=2)  # 4 entry changes per write
    try:
        fill(kv, "a", list(range(64)))  # 16 blocks: 4 fixed + 1 leaf
        await pub.flush()
        fill(kv, "b", list(range(1000, 1128)))  # 32 blocks: 8 fixed + 1 leaf > 4 changes
        assert await pub.flush() == 1 and pub.granularity == 8 and pub.stats.snapshots == 2
        assert await index.wait_for(lambda i: i.granularity((wid, inc)) == 8, timeout=3.0)
        assert index.entries(wid) == 2 + 4  # positions 8, 16 and 8, 16, 24, 32 (the leaves)
        for n in range(3):  # small changes: refined after `patience` quiet writes
            fill(kv, f"s{n}", [7] * 15 + [n])  # 4 blocks each: a leaf
            assert await pub.flush() == 1
        assert pub.granularity == 4 and pub.stats.txns == 5
        assert await index.wait_for(lambda i: i.entries(wid) == pub.num_held, timeout=3.0)
    finally:
        await pub.stop()
        await reg.stop()


async def test_restarted_router_rebuilds_from_snapshot_and_ring(etcd, index):
    reg = await registered(etcd)
    wid = reg.member.worker_id
    pub, kv = publisher(etcd, reg, 512)
    try:
        for n in range(RING + 3):  # more deltas than the ring holds: a snapshot in between
            fill(kv, f"s{n}", [n] * 4 + list(range(32)))
            assert await pub.flush() == 1
        assert pub.stats.snapshots == 2 and pub.stats.txns == RING + 3
        assert await index.wait_for(lambda i: i.entries(wid) == pub.num_held, timeout=3.0)
        fresh = await LocationIndex.start(etcd.endpoint)
        try:
            assert fresh.synced and fresh.entries(wid) == pub.num_held
            probe = chain([2] * 4 + list(range(32)))
            assert dict(fresh.match(probe)) == dict(index.match(probe))
            assert fresh.stats.gaps == 0
        finally:
            await fresh.stop()
    finally:
        await pub.stop()
        await reg.stop()


async def test_lost_lease_starts_a_new_epoch_with_a_snapshot(etcd, index):
    reg = await registered(etcd)
    wid = reg.member.worker_id
    pub, kv = publisher(etcd, reg, 16, interval=0.05)
    pub.start()
    try:
        fill(kv, "s", list(range(32)))  # 8 blocks: 4, 8 (also the leaf)
        assert await index.wait_for(lambda i: i.entries(wid) == 2, timeout=3.0)
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
            await client.revoke_lease(reg.lease_id)  # as if etcd lost it
        assert await index.wait_for(lambda i: i.entries(wid) == 0, timeout=3.0)
        assert await index.wait_for(lambda i: i.entries(wid) == 2, timeout=3.0)
        assert pub.stats.republished == 1 and pub.stats.snapshots == 2
        assert reg.registrations == 2
    finally:
        await pub.stop()
        await reg.stop()


async def test_new_incarnation_replaces_the_old_one_when_its_lease_ends(etcd, index):
    old = await registered(etcd)
    wid = old.member.worker_id
    pub, kv = publisher(etcd, old, 16)
    fill(kv, "s", list(range(32)))
    await pub.flush()
    await pub.stop()
    await old.stop(revoke=False)  # the process died; its lease runs out by itself
    new_member = Member(wid, "prefill", "m", "127.0.0.1:2", block_size=BS)
    new = await Registration.start(etcd.endpoint, new_member, ttl=TTL, refresh=REFRESH)
    pub2, kv2 = publisher(etcd, new, 16)
    try:
        fill(kv2, "s", list(range(100, 116)))
        await pub2.flush()
        incs = {old.member.incarnation, new.member.incarnation}
        assert await index.wait_for(lambda i: i.entries(wid) == 2 + 1, timeout=3.0)
        assert {inc for (w, inc) in index._workers if w == wid} == incs
        assert await index.wait_for(lambda i: i.entries(wid) == 1, timeout=TTL + 1.5)
        assert depth(index, old, list(range(32))) == 0
        assert depth(index, new, list(range(100, 116))) == 4
    finally:
        await pub2.stop()
        await new.stop()


async def test_index_and_publisher_resync_after_an_etcd_restart(etcd, index):
    reg = await registered(etcd)
    wid = reg.member.worker_id
    pub, kv = publisher(etcd, reg, 64, interval=0.05)
    pub.start()
    try:
        fill(kv, "a", list(range(32)))
        assert await index.wait_for(lambda i: i.entries(wid) == 2, timeout=3.0)
        resyncs = index.follower.resyncs
        etcd.stop()
        fill(kv, "b", list(range(200, 264)))  # cached while etcd is down
        assert index.entries(wid) == 2  # the router keeps its last view
        etcd.start()
        assert await index.wait_for(lambda i: i.entries(wid) == 2 + 4, timeout=10.0)
        assert index.follower.resyncs > resyncs and index.stats.gaps == 0
        assert depth(index, reg, list(range(200, 264))) == 16
    finally:
        await pub.stop()
        await reg.stop()
