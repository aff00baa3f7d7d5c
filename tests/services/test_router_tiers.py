"""The router knows the tiers: a worker's host-tier prefixes reach a real summary index under
its ``<incarnation>~host`` pseudo-incarnation, and the kv policy scores a host-tier hit
between a device hit and a miss (``libkv.cluster.tiers``)."""

from __future__ import annotations

from libkv.cluster.location_summary import snapshot_key
from libkv.cluster.summary_index import SummaryIndex
from libkv.cluster.summary_state import SummaryConfig, SummaryState
from libkv.cluster.tiers import HOST, HOST_HIT_VALUE, tier_cached_blocks, tier_depths
from libkv.cluster.tiers import tier_incarnation as host_of
from libkv.hashing import ROOT_HASH, hash_prefix_blocks
from tests.services.test_router_policy import BS, PROMPT, chooser, member, req


def test_a_host_hit_scores_between_a_device_hit_and_a_miss() -> None:
    assert tier_cached_blocks(0, 0) == 0
    assert tier_cached_blocks(10, 0) == 10
    assert tier_cached_blocks(0, 10) == 10 * HOST_HIT_VALUE
    assert tier_cached_blocks(4, 10) == 4 + 6 * HOST_HIT_VALUE  # only what lies past the device
    assert tier_cached_blocks(10, 4) == 10
    assert 0 < tier_cached_blocks(0, 10) < tier_cached_blocks(10, 0)


def publish_tier(index: SummaryIndex, worker: str, incarnation: str, blocks: int) -> None:
    """A worker's snapshot of the first ``blocks`` blocks of PROMPT, as its publisher writes it."""
    state = SummaryState(SummaryConfig(base=4))
    chain = hash_prefix_blocks(PROMPT, BS)
    for i in range(blocks):
        state.cached(i, chain[i], chain[i - 1] if i else ROOT_HASH)
    plan = state.plan(epoch=1)
    assert plan is not None
    index.put(snapshot_key(worker, incarnation), plan.summary.encode())


def test_the_index_holds_each_tier_under_its_own_incarnation() -> None:
    index = SummaryIndex()
    publish_tier(index, "p0", "inc-p0", 8)
    publish_tier(index, "p0", host_of("inc-p0", HOST), 24)
    match = index.match(hash_prefix_blocks(PROMPT, BS))
    assert tier_depths(match, "p0", "inc-p0") == (8, 24)
    assert tier_depths(match, "p0", "inc-restarted") == (0, 0)  # a new incarnation: nothing


def test_kv_policy_prefers_device_then_host_then_a_miss() -> None:
    stack = [member("p0", "prefill"), member("p1", "prefill"), member("p2", "prefill"),
             member("d0", "decode")]  # fmt: skip
    index = SummaryIndex()
    publish_tier(index, "p1", host_of("inc-p1", HOST), 32)  # p1: the prompt in its host tier
    plan = chooser(stack, index=index).plan(req(), set())
    assert plan.prefill.worker_id == "p1" and plan.reason == "kv-hit"
    assert plan.cached_blocks == 32 * HOST_HIT_VALUE
    publish_tier(index, "p2", "inc-p2", 32)  # p2: the same prefix on its device
    plan = chooser(stack, index=index).plan(req(), set())
    assert plan.prefill.worker_id == "p2" and plan.cached_blocks == 32
