"""Run-time roles of switchable workers: the role balancer's choice (`services.router.roles`:
the planner's split as roles, hysteresis, minimum dwell, one move at a time, a floor of one
worker per role, operator pins), role orders in a real etcd (`libkv.cluster.roles`), and the
switchable worker's dispatch of gRPC calls to the role it serves (`services.worker.switch`)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from libkv.cluster.registry import DRAINING, Member, MemberLoad
from libkv.cluster.roles import SWITCHABLE, RoleOrder, RoleOrders, RoleOrderWatch
from services.common.errors import Unavailable
from services.launcher.etcd import EtcdServer
from services.router.metrics import RouterCollector
from services.router.roles import Pool, RoleBalancer, RolePolicy, desired_roles, target_prefill
from services.worker.switch import SERVICES, RoleDispatch

NOW_MS = 10_000_000
POLICY = RolePolicy(hysteresis=0.25, min_dwell=60, settle=120)


def member(wid: str, role: str, *, switchable: bool = True, age_s: float = 600, running: int = 0,
           draining: bool = False) -> Member:  # fmt: skip
    extra = {SWITCHABLE: "1"} if switchable else {}
    if draining:
        extra[DRAINING] = "1"
    started = NOW_MS - int(age_s * 1000)
    return Member(wid, role, "m", f"{wid}:1", started_unix_ms=started,
                  load=MemberLoad(running=running), extra=extra)  # fmt: skip


def test_target_keeps_the_count_within_the_hysteresis_and_a_floor_per_role() -> None:
    assert target_prefill(0.5, 4, 2, 0.25) == 2
    assert target_prefill(0.68, 4, 2, 0.25) == 2  # ideal 2.72: within 0.75 of 2
    assert target_prefill(0.70, 4, 2, 0.25) == 3  # ideal 2.8: past it
    assert target_prefill(0.0, 4, 2, 0.25) == 1  # never no prefill worker
    assert target_prefill(1.0, 4, 2, 0.25) == 3  # never no decode worker
    assert target_prefill(math.nan, 4, 2, 0.25) == 2  # nothing planned: nothing moves
    assert target_prefill(0.9, 1, 0, 0.25) == 0  # one worker: nothing to balance


def test_prefill_heavy_plan_moves_the_least_loaded_decode_worker() -> None:
    ms = [member("p0", "prefill"), member("d0", "decode", running=5),
          member("d1", "decode", running=1), member("d2", "decode", switchable=False)]  # fmt: skip
    assert desired_roles(ms, 0.75, {}, POLICY, NOW_MS) == {"d1": "prefill"}
    assert desired_roles(ms, 0.3, {}, POLICY, NOW_MS) == {}  # 1.2 of 4: within the hysteresis


def test_decode_heavy_plan_moves_a_prefill_worker_but_keeps_one() -> None:
    ms = [member("p0", "prefill"), member("p1", "prefill", running=2), member("d0", "decode")]
    assert desired_roles(ms, 0.0, {}, POLICY, NOW_MS) == {"p0": "decode"}
    one = [member("p0", "prefill"), member("d0", "decode"), member("d1", "decode")]
    assert desired_roles(one, 0.0, {}, POLICY, NOW_MS) == {}  # the last prefill worker stays


def test_minimum_dwell_and_operator_pins_are_respected() -> None:
    ms = [member("p0", "prefill"), member("d0", "decode", age_s=30), member("d1", "decode")]
    assert desired_roles(ms, 0.9, {}, POLICY, NOW_MS) == {"d1": "prefill"}  # d0 too recent
    pinned = {"d1": RoleOrder("decode", "operator", NOW_MS - 500_000)}
    assert desired_roles(ms, 0.9, pinned, POLICY, NOW_MS) == {}


def test_one_move_at_a_time() -> None:
    ms = [member("p0", "prefill"), member("d0", "decode"), member("d1", "decode"),
          member("d2", "decode")]  # fmt: skip
    # d1 was told to switch 10 s ago and has not yet: nothing else moves.
    told = {"d1": RoleOrder("prefill", "planner", NOW_MS - 10_000)}
    assert desired_roles(ms, 0.9, told, POLICY, NOW_MS) == {}
    # A switchable worker draining (its switch under way): nothing moves either.
    ms[1] = member("d0", "decode", draining=True)
    assert desired_roles(ms, 0.9, {}, POLICY, NOW_MS) == {}
    # A worker that never followed its order (gone since) stops blocking after `settle`.
    stale = {"gone": RoleOrder("prefill", "planner", NOW_MS - 200_000)}
    ms[1] = member("d0", "decode")
    assert desired_roles(ms, 0.9, stale, POLICY, NOW_MS) == {"d0": "prefill"}


def test_role_order_json_and_validation() -> None:
    order = RoleOrder("decode", "operator", 123)
    assert RoleOrder.from_json(order.to_json()) == order
    with pytest.raises(ValueError, match="worker role"):
        RoleOrder("router")
    with pytest.raises(ValueError, match="by one of"):
        RoleOrder("decode", "someone")


@pytest.mark.timeout(60)
async def test_balancer_writes_one_order_and_the_worker_watch_sees_it(tmp_path) -> None:
    with EtcdServer(tmp_path) as etcd:
        seen: list[RoleOrder | None] = []
        watch = await RoleOrderWatch.start(etcd.endpoint, "d1", seen.append)
        other = await RoleOrderWatch.start(etcd.endpoint, "d", lambda o: seen.append(o))
        ms = [member("p0", "prefill"), member("d0", "decode", running=3), member("d1", "decode")]
        balancer = RoleBalancer(
            [Pool("m", lambda: ms, lambda: 0.7)], RoleOrders(etcd.endpoint), POLICY
        )
        try:
            assert await balancer.step() == {"d1": "prefill"}
            assert await balancer.step() == {}  # d1 has not switched yet
            for _ in range(100):
                if watch.order is not None:
                    break
                await asyncio.sleep(0.05)
            assert watch.order is not None and watch.order.role == "prefill"
            assert watch.order.by == "planner" and balancer.moves["prefill"] == 1
            assert role_orders_exported(balancer) == {"prefill": 1, "decode": 0}
            assert other.order is None  # "d" is a prefix of "d1", not its key
            orders = RoleOrders(etcd.endpoint)
            await orders.delete("d1")  # `tandem role d1 auto`
            for _ in range(100):
                if watch.order is None:
                    break
                await asyncio.sleep(0.05)
            assert watch.order is None and seen[-1] is None
            await orders.close()
        finally:
            await balancer.stop()
            await watch.stop()
            await other.stop()


def role_orders_exported(balancer: RoleBalancer) -> dict[str, float]:
    """``tandem_router_role_orders_total`` by role, as a router with this balancer exports it."""
    reg = CollectorRegistry()
    reg.register(RouterCollector([], SimpleNamespace(members={}), balancer))
    reg_samples = [s for m in reg.collect() for s in m.samples]
    return {
        s.labels["role"]: s.value
        for s in reg_samples
        if s.name == "tandem_router_role_orders_total"
    }


class FakePrefill:
    async def Stats(self, request, context):  # noqa: N802
        return ("stats", request)


class FakeBlocks:
    async def PullBlocks(self, request, context):  # noqa: N802
        for i in range(3):
            yield (i, request)


async def test_dispatch_sends_calls_to_the_role_served_now() -> None:
    dispatch = RoleDispatch("w0")
    servicers = dict(dispatch.servicers())
    add_prefill, _ = SERVICES["Prefill"]
    add_decode, _ = SERVICES["Decode"]
    add_kv, _ = SERVICES["KVTransport"]
    with pytest.raises(Unavailable, match="switching roles"):
        await servicers[add_prefill].Stats("q", None)
    dispatch.set("prefill", [(add_prefill, FakePrefill()), (add_kv, FakeBlocks())])
    assert await servicers[add_prefill].Stats("q", None) == ("stats", "q")
    assert [x async for x in servicers[add_kv].PullBlocks("r", None)] == [
        (0, "r"), (1, "r"), (2, "r")
    ]  # fmt: skip
    with pytest.raises(Unavailable, match="serves prefill: no tandem.v1.Decode"):
        await servicers[add_decode].Stats("q", None)
