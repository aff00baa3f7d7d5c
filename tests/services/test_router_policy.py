"""Routing policies in isolation: a fixed member list and a hand-filled prefix index."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import pytest

from libkv.cluster.registry import LORAS, Member, MemberChange, MemberLoad
from libkv.hashing import encode_extra_keys, hash_prefix_blocks
from libkv.kv_layout import LAYOUT_KEY, KVLayout
from services.router.policy import Chooser, PolicyConfig, RouteRequest

BS = 16
Holder = tuple[str, str]  # (worker_id, incarnation)


class PrefixIndex:
    """A hand-filled `LocationLookup`: the chain positions each worker incarnation published."""

    def __init__(self) -> None:
        self._by_hash: dict[bytes, set[Holder]] = {}

    def put(self, holder: Holder, block_hash: bytes) -> None:
        self._by_hash.setdefault(block_hash, set()).add(holder)

    def match(self, hashes: Sequence[bytes]) -> dict[Holder, int]:
        """Each holder's deepest published position of the chain, in blocks."""
        depth: dict[Holder, int] = {}
        for i in range(len(hashes) - 1, -1, -1):
            for holder in self._by_hash.get(hashes[i], ()):
                depth.setdefault(holder, i + 1)
        return depth


PROMPT = list(range(1000, 1000 + 40 * BS))  # 40 blocks


class Directory:
    def __init__(self, members: list[Member]) -> None:
        self.members = members

    def members_by_role(self, role: str) -> list[Member]:
        return sorted((m for m in self.members if m.role == role), key=lambda m: m.worker_id)


def member(worker_id: str, role: str, queue: int = 0, running: int = 0, free: int = 900) -> Member:
    load = MemberLoad(queue_length=queue, running=running, kv_blocks_free=free, kv_blocks_used=10)
    return Member(worker_id, role, "m", f"{worker_id}:1", 1000, BS, f"inc-{worker_id}", load=load)


def publish(index: PrefixIndex, m: Member, prompt: list[int], blocks: int, tenant: str = ""):
    """``m`` holds the first ``blocks`` blocks of ``prompt`` (published every 4 blocks)."""
    chain = hash_prefix_blocks(prompt, BS, encode_extra_keys(tenant or None))
    for i in range(3, blocks, 4):
        index.put((m.worker_id, m.incarnation), chain[i])


def chooser(members, policy="kv", index=None, threshold=256, inflight=None) -> Chooser:
    config = PolicyConfig(policy, threshold)
    return Chooser(Directory(members), config, index if index is not None else PrefixIndex(),
                   inflight)  # fmt: skip


def req(prompt=PROMPT, tenant="", session="") -> RouteRequest:
    return RouteRequest(prompt, tenant, session, max_tokens=16)


STACK = [member("p0", "prefill"), member("p1", "prefill"), member("d0", "decode"),
         member("d1", "decode")]  # fmt: skip


def test_kv_prefers_the_prefill_worker_holding_the_prefix():
    index = PrefixIndex()
    publish(index, STACK[1], PROMPT, 32)
    plan = chooser(STACK, index=index).plan(req(), set())
    assert plan.prefill.worker_id == "p1" and plan.reason == "kv-hit" and plan.cached_blocks == 32
    # Without any hit it is load: the idle worker with the lower id.
    plan = chooser(STACK).plan(req(), set())
    assert (plan.prefill.worker_id, plan.decode.worker_id, plan.reason) == ("p0", "d0", "load")


def test_kv_spills_over_when_the_holder_is_much_busier():
    index = PrefixIndex()
    publish(index, STACK[1], PROMPT, 32)
    busy = [member("p0", "prefill"), member("p1", "prefill", running=1), *STACK[2:]]
    assert chooser(busy, index=index).plan(req(), set()).prefill.worker_id == "p1"
    # The load weighs the blocks p1 would compute (8 of 40): 8 * (1 + 0.5 * 10) > 40.
    busier = [member("p0", "prefill"), member("p1", "prefill", queue=6, running=4), *STACK[2:]]
    plan = chooser(busier, index=index).plan(req(), set())
    assert plan.prefill.worker_id == "p0" and plan.reason == "load"
    # The router's own in-flight count weighs too (it is more current than etcd's report).
    inflight = Counter({"p1": 10})
    assert chooser(STACK, index=index, inflight=inflight).plan(req(), set()).prefill.worker_id \
        == "p0"  # fmt: skip


def test_a_stale_load_report_does_not_count_this_routers_finished_requests():
    """A worker's load report is up to one member refresh old: in a conversation it still
    counts the previous turn, which just finished on the worker that caches it. The router
    knows its own requests: it weighs the report less what it had in flight when the report
    arrived (other routers' requests), plus what it has in flight now."""
    index = PrefixIndex()
    turn = PROMPT[: 20 * BS]
    publish(index, STACK[2], turn, 8)  # d0 caches the previous turn (8 of 20 blocks)
    inflight: Counter[str] = Counter({"d0": 2})  # the previous turn and another one
    c = chooser(STACK, index=index, inflight=inflight)
    reporting = member("d0", "decode", running=2)  # d0's report, while they ran
    c.observe(MemberChange("put", "d0", reporting))
    inflight["d0"] -= 2  # both finished; the report stays until d0's next refresh
    c.directory = Directory([*STACK[:2], reporting, STACK[3]])
    assert c.load(reporting) == 0
    plan = c.plan(req(turn), set())
    assert (plan.decode.worker_id, plan.reason, plan.cached_blocks) == ("d0", "decode-only", 8)
    # Without the listener the report counts as it is, and the load beats the cached part.
    blind = chooser([*STACK[:2], reporting, STACK[3]], index=index, inflight=Counter())
    assert blind.load(reporting) == 2 and blind.plan(req(turn), set()).decode.worker_id == "d1"
    # Other routers' requests in the report still count: 3 reported while this router had 1
    # there, and 2 of its own now: 2 + (3 - 1).
    busy = member("d0", "decode", running=3)
    inflight["d0"] = 1
    c.observe(MemberChange("put", "d0", busy))
    inflight["d0"] = 2
    assert c.load(busy) == 4
    # A report that arrived unobserved (another object) counts as it is.
    assert c.load(member("d0", "decode", running=3)) == 3
    c.observe(MemberChange("delete", "d0", busy))
    assert c.load(busy) == 3


def test_the_load_weighs_the_blocks_a_worker_computes_not_a_large_cached_prefix():
    """Requests in flight delay what a worker computes for this request: on the worker that
    caches 28 of 40 blocks, the 12 left. Two requests there no longer send the conversation's
    next turn to an idle worker that would compute all 40 (nor, over the threshold, to a cold
    prefill worker); five do."""
    index = PrefixIndex()
    publish(index, STACK[2], PROMPT, 28)
    plan = chooser(STACK, index=index, inflight=Counter({"d0": 2})).plan(req(), set())
    assert (plan.decode.worker_id, plan.reason, plan.cached_blocks) == ("d0", "decode-only", 28)
    plan = chooser(STACK, index=index, inflight=Counter({"d0": 5})).plan(req(), set())
    assert plan.decode.worker_id == "d1" and plan.prefill is not None  # 12 * 3.5 > 40
    # A decode worker that receives the KV decodes the whole request: there the load weighs
    # the whole prompt, so hand-offs still spread by load.
    index = PrefixIndex()
    publish(index, STACK[2], PROMPT, 32)
    c = chooser(STACK, index=index, threshold=1, inflight=Counter({"d0": 1}))
    assert c.plan(req(), set()).decode.worker_id == "d1"  # 0.25 * 8 + 0.5 * 40 > 0.25 * 40


def test_free_blocks_count_what_this_routers_requests_freed_since_the_report():
    """A worker reported few free KV blocks while this router's requests ran there; they have
    ended since (their blocks are free again), so it is not avoided as full."""
    index = PrefixIndex()
    publish(index, STACK[2], PROMPT, 28)
    c = chooser(STACK, index=index)
    d0 = member("d0", "decode", running=2, free=5)
    ctx = c.working(d0, 40 * BS), c.working(d0, 30 * BS)
    for w in ctx:
        w.__enter__()
    c.observe(MemberChange("put", "d0", d0))  # reported while both ran
    for w in ctx:
        w.__exit__(None, None, None)
    assert c.free_blocks(d0) == 5 + 70 and c.load(d0) == 0
    c.directory = Directory([*STACK[:2], d0, STACK[3]])
    plan = c.plan(req(), set())
    assert (plan.decode.worker_id, plan.reason) == ("d0", "decode-only")
    # Requests started since the report take blocks: 5 + 70 - 72 is too few for 13.
    with c.working(d0, 72 * BS):
        assert c.free_blocks(d0) == 3
        assert c.plan(req(), set()).decode.worker_id == "d1"
    # The report as it is (not observed arriving): 5 free, too few.
    blind = chooser([*STACK[:2], d0, STACK[3]], index=index)
    assert blind.free_blocks(d0) == 5 and blind.plan(req(), set()).decode.worker_id == "d1"


def test_a_worker_without_room_is_avoided():
    index = PrefixIndex()
    full = member("p1", "prefill", free=2)
    publish(index, full, PROMPT, 32)
    plan = chooser([STACK[0], full, *STACK[2:]], index=index).plan(req(), set())
    assert plan.prefill.worker_id == "p0"


def test_stale_incarnation_and_other_tenants_never_match():
    index = PrefixIndex()
    old = Member("p1", "prefill", "m", "p1:1", 1000, BS, "old-incarnation")
    publish(index, old, PROMPT, 40)  # the previous process of p1 left these behind
    publish(index, STACK[0], PROMPT, 40, tenant="acme")
    plan = chooser(STACK, index=index).plan(req(), set())
    assert plan.reason == "load" and plan.cached_blocks == 0
    plan = chooser(STACK, index=index).plan(req(tenant="acme"), set())
    assert plan.prefill.worker_id == "p0" and plan.reason == "kv-hit"
    plan = chooser(STACK, index=index).plan(req(tenant="other"), set())
    assert plan.reason == "load"


def test_conditional_disaggregation_uses_the_cached_part():
    index = PrefixIndex()
    publish(index, STACK[3], PROMPT, 36)  # d1 holds 36 of 40 blocks: 64 tokens uncached
    plan = chooser(STACK, index=index).plan(req(), set())
    assert plan.prefill is None and plan.decode.worker_id == "d1"
    assert plan.reason == "decode-only" and plan.cached_blocks == 36
    # Holding only half leaves too much to compute: disaggregate, decode still on the holder
    # (it receives only the blocks it lacks).
    index = PrefixIndex()
    publish(index, STACK[3], PROMPT, 20)
    publish(index, STACK[0], PROMPT, 40)
    plan = chooser(STACK, index=index).plan(req(), set())
    assert (plan.prefill.worker_id, plan.decode.worker_id, plan.reason) == ("p0", "d1", "kv-hit")
    # A short prompt goes decode-only whatever the cache holds.
    assert chooser(STACK).plan(req(PROMPT[:100]), set()).prefill is None


def test_replicas_with_the_same_view_choose_alike_and_exclusions_hold():
    index = PrefixIndex()
    publish(index, STACK[1], PROMPT, 24)
    publish(index, STACK[0], PROMPT, 24)
    a = chooser(STACK, index=index).plan(req(), set())
    b = chooser(list(reversed(STACK)), index=index).plan(req(), set())
    assert (a.prefill, a.decode) == (b.prefill, b.decode)
    c = chooser(STACK, index=index).plan(req(), {"p0", "d0"})
    assert (c.prefill.worker_id, c.decode.worker_id) == ("p1", "d1")
    assert chooser(STACK[:2]).plan(req(), set()) is None  # no decode worker


def test_round_robin_alternates_per_role():
    ch = chooser(STACK, policy="round-robin")
    plans = [ch.plan(req(), set()) for _ in range(4)]
    assert [p.prefill.worker_id for p in plans] == ["p0", "p1", "p0", "p1"]
    assert [p.decode.worker_id for p in plans] == ["d0", "d1", "d0", "d1"]
    assert {p.reason for p in plans} == {"round-robin"}
    assert ch.plan(req(PROMPT[:10]), set()).reason == "decode-only"


def test_session_is_sticky_and_agreed_and_least_loaded_without_a_key():
    plans = {s: chooser(STACK, policy="session").plan(req(session=s), set()) for s in "abcdefgh"}
    assert {p.reason for p in plans.values()} == {"session"}
    assert len({p.prefill.worker_id for p in plans.values()}) == 2  # keys spread over workers
    for s, p in plans.items():  # another replica, workers listed differently: same choice
        again = chooser(list(reversed(STACK)), policy="session").plan(req(session=s), set())
        assert (again.prefill, again.decode) == (p.prefill, p.decode)
    # Only the sessions of a worker that leaves move.
    gone = plans["a"].prefill.worker_id
    rest = [m for m in STACK if m.worker_id != gone]
    for s, p in plans.items():
        if p.prefill.worker_id != gone:
            assert chooser(rest, policy="session").plan(req(session=s), set()).prefill == p.prefill
    busy = [member("p0", "prefill", queue=4), *STACK[1:]]
    plan = chooser(busy, policy="session").plan(req(), set())
    assert plan.prefill.worker_id == "p1" and plan.reason == "load"


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="unknown policy"):
        PolicyConfig("random")


async def test_router_core_counts_plans_by_policy_and_reason():
    from engine.sampling_params import SamplingParams
    from services.router.calls import RouteJob
    from services.router.core import RouterCore
    from tests.services.test_router_core import Clients, collect

    index = PrefixIndex()
    publish(index, STACK[1], PROMPT, 32)
    clients = Clients()
    core = RouterCore(Directory(STACK), clients, policy=PolicyConfig("kv"), index=index)
    await collect(core, RouteJob("r1", PROMPT, SamplingParams(max_tokens=3)))
    await collect(core, RouteJob("r2", PROMPT[:100], SamplingParams(max_tokens=3)))
    assert clients.calls == [("prefill", "p1"), ("decode", "d0"), ("decode", "d0")]
    assert core.stats.decisions == {("kv", "kv-hit"): 1, ("kv", "decode-only"): 1}


def with_layout(m: Member, tp: int, **geometry) -> Member:
    """``m`` publishing a KV layout at TP size ``tp`` (``geometry`` overrides)."""
    g = dict(num_layers=2, num_kv_heads=4, head_dim=8, block_size=BS, dtype="float32",
             element_size=4)  # fmt: skip
    layout = KVLayout(**{**g, **geometry}, tp=tp)
    return dataclasses.replace(m, extra={LAYOUT_KEY: layout.to_json()}, tensor_parallel_size=tp)


def test_pairs_of_any_tp_sizes_hand_off_and_other_geometries_are_refused(caplog):
    p2, d1 = with_layout(STACK[0], 2), with_layout(STACK[2], 1)
    plan = chooser([p2, d1]).plan(req(), set())
    assert (plan.prefill.worker_id, plan.decode.worker_id) == ("p0", "d0")
    p1, d4 = with_layout(STACK[0], 1), with_layout(STACK[2], 4)
    assert chooser([p1, d4]).plan(req(), set()).prefill.worker_id == "p0"
    # A bf16 prefill pool cannot feed a float32 decode pool: never paired, served decode-only
    # (the decode worker prefills), and the reason is logged once.
    bf16 = with_layout(STACK[1], 2, dtype="bfloat16", element_size=2)
    for _ in range(3):
        plan = chooser([bf16, d1]).plan(req(), set())
        assert plan.prefill is None and plan.reason == "decode-only"
    refusals = [r.getMessage() for r in caplog.records if "not pairing" in r.getMessage()]
    assert len(refusals) == 1
    assert "p1 (tp 2)" in refusals[0] and "d0 (tp 1)" in refusals[0]
    assert "dtype bfloat16 vs float32" in refusals[0]
    # With both kinds of prefill worker live, only the compatible one is picked.
    plan = chooser([bf16, p2, d1]).plan(req(), set())
    assert plan.prefill.worker_id == "p0"


def with_loras(m: Member, *names: str) -> Member:
    return dataclasses.replace(m, extra={**m.extra, LORAS: ",".join(names)})


@pytest.mark.parametrize("policy", ["kv", "least-loaded", "round-robin"])
def test_an_adapters_requests_go_to_workers_that_hold_it(policy):
    members = [
        member("p0", "prefill"),
        with_loras(member("p1", "prefill", queue=5), "a"),
        member("d0", "decode"),
        with_loras(member("d1", "decode", queue=5), "a", "b"),
    ]
    lora = RouteRequest(PROMPT, max_tokens=16, lora="a")
    for _ in range(3):  # busier, yet the only holders
        plan = chooser(members, policy).plan(lora, set())
        assert (plan.prefill.worker_id, plan.decode.worker_id) == ("p1", "d1")
    # No prefill worker holds b: the holder decodes it alone; nobody holds c: no plan.
    plan = chooser(members, policy).plan(RouteRequest(PROMPT, max_tokens=16, lora="b"), set())
    assert plan.prefill is None and plan.decode.worker_id == "d1"
    assert chooser(members, policy).plan(RouteRequest(PROMPT, lora="c"), set()) is None
    # The base model goes anywhere (the idle workers here).
    plan = chooser(members, policy).plan(req(), set())
    assert plan.decode.worker_id == "d0" or policy == "round-robin"


def test_prefix_hashes_are_salted_by_adapter():
    index = PrefixIndex()
    hit = member("d1", "decode")
    chain = hash_prefix_blocks(PROMPT, BS, encode_extra_keys(None, "a"))
    index.put(("d1", hit.incarnation), chain[31])
    members = [member("d0", "decode"), with_loras(hit, "a")]
    plan = chooser(members, index=index).plan(RouteRequest(PROMPT, lora="a"), set())
    assert plan.decode.worker_id == "d1" and plan.cached_blocks == 32
    members = [member("d0", "decode"), hit]
    assert chooser(members, index=index).plan(req(), set()).cached_blocks == 0
