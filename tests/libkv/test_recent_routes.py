"""A router's memory of its recent routes, merged with the etcd index (no etcd needed)."""

from __future__ import annotations

import random

from libkv.cluster.location_summary import SNAPSHOT, Summary, entry_key, snapshot_key
from libkv.cluster.recent_routes import HintedIndex, RecentRoutes
from libkv.cluster.registry import Member
from libkv.cluster.summary_index import SummaryIndex
from services.router.policy import Chooser, PolicyConfig, RouteRequest

rng = random.Random(0)


def chain(n: int) -> list[bytes]:
    return [rng.randbytes(16) for _ in range(n)]


def test_recent_routes_remember_every_16th_position_until_they_expire():
    now = [0.0]
    recent = RecentRoutes(ttl=2.0, every=16, clock=lambda: now[0])
    hinted = HintedIndex(SummaryIndex(), recent)
    c = chain(39)  # positions 16 and 32
    hinted.note([("w1", "i")], c)
    assert hinted.match(c + chain(5)) == {("w1", "i"): 32}
    assert hinted.match(c[:31]) == {("w1", "i"): 16} and hinted.match(c[:15]) == {}
    assert len(recent) == 2
    now[0] = 1.9
    hinted.note([("w2", "i")], c[:20])  # a newer route of position 16 to another worker
    assert hinted.match(c) == {("w1", "i"): 32, ("w2", "i"): 16}
    now[0] = 2.0  # w1's route expired; w2's stays until 3.9
    assert hinted.match(c) == {("w2", "i"): 16} and len(recent) == 1
    now[0] = 3.9
    assert hinted.match(c) == {} and len(recent) == 0


def test_index_and_recent_routes_merge_each_holders_deepest():
    idx = SummaryIndex()
    c = chain(64)
    idx.put(snapshot_key("w1", "i"), Summary(SNAPSHOT, 1, 0, 4, 4, [entry_key(c[43])]).encode())
    hinted = HintedIndex(idx, RecentRoutes(clock=lambda: 0.0))
    hinted.note([("w1", "i")], c[:20])  # position 16 ...
    hinted.note([("w2", "i"), ("w3", "j")], c[:50])  # ... then routed to w2 and w3 together
    m = hinted.match(c)
    assert m.get(("w1", "i")) == 44 and m[("w2", "i")] == 48 and m.get(("w4", "i")) == 0
    assert dict(m) == {("w1", "i"): 44, ("w2", "i"): 48, ("w3", "j"): 48}
    assert [d for d, _ in m.positions()] == [48, 44, 32, 16]


def test_kv_policy_sends_a_quick_second_turn_where_the_first_went():
    workers = [Member(f"p{i}", "prefill", "m", f"a:{i}", block_size=16) for i in range(3)]

    class Directory:
        def members_by_role(self, role: str) -> list[Member]:
            return workers if role == "prefill" else [Member("d", "decode", "m", "a:9")]

    hinted = HintedIndex(SummaryIndex(), RecentRoutes())
    chooser = Chooser(Directory(), PolicyConfig("kv", decode_only_threshold=16), hinted)
    turn1 = [rng.randrange(1000) for _ in range(300)]
    first = chooser.plan(RouteRequest(turn1), set())
    assert first is not None and first.prefill is not None
    chooser.inflight[first.prefill.worker_id] += 1  # still running: the others look idler
    second = chooser.plan(RouteRequest(turn1 + [5] * 100), set())
    assert second is not None and second.prefill == first.prefill and second.reason == "kv-hit"
    assert second.cached_blocks == 300 // 16 // 16 * 16  # every 16th block is remembered
