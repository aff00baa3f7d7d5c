"""The role balancer (a router's ``--balance-roles``): turns the pool planner's recommended
prefill:decode split (`services.router.planner`) into a role per switchable worker, written as
role orders in etcd (`libkv.cluster.roles`) that the workers follow at run time.

Each round (``--balance-interval`` seconds), per base model:

- the target prefill count is the planner's prefill fraction times the workers there are
  (fixed ones of either role, switchable ones, operator-pinned ones), rounded, and clamped so
  at least one prefill and one decode worker remain;
- hysteresis: nothing moves while the ideal (unrounded) count is within ``0.5 + hysteresis``
  workers of the current one, so a fraction hovering near a rounding edge does not flap;
- at most one worker moves per round and none while an earlier move is still under way (a
  worker draining, or an order younger than ``settle`` seconds that its worker has not yet
  followed): each move's effect is in the planner's figures before the next;
- the worker moved is one that has served its role at least ``min_dwell`` seconds, is not
  pinned by an operator (`tandem role`), and is the least loaded of its role.

No plan yet (NaN: no traffic or no measured rate): nothing moves. Run it on one router: several
would each write orders from their own traffic.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from libkv.cluster.registry import Member, MemberWatcher
from libkv.cluster.roles import SWITCHABLE, WORKER_ROLES, RoleOrder, RoleOrders

if TYPE_CHECKING:
    from services.router.core import RouterCore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RolePolicy:
    hysteresis: float = 0.25  # workers of slack past rounding before a move
    min_dwell: float = 60.0  # seconds a worker serves a role before it may move again
    settle: float = 120.0  # seconds an unfollowed order counts as a move under way


def target_prefill(fraction: float, total: int, current: int, hysteresis: float) -> int:
    """Prefill workers out of ``total`` for a planned ``fraction``, ``current`` kept while the
    ideal is within ``0.5 + hysteresis`` of it; at least one of each role (``total`` >= 2)."""
    if math.isnan(fraction) or total < 2:
        return current
    ideal = fraction * total
    if abs(ideal - current) <= 0.5 + hysteresis:
        return min(max(current, 1), total - 1)
    return min(max(round(ideal), 1), total - 1)


def desired_roles(
    members: Iterable[Member],
    fraction: float,
    orders: dict[str, RoleOrder],
    policy: RolePolicy,
    now_ms: int,
) -> dict[str, str]:
    """The role orders to write this round (worker id -> role; at most one), from the live
    ``members`` of one model (draining ones included), the planned prefill ``fraction`` and the
    ``orders`` in etcd."""
    workers = [m for m in members if m.role in WORKER_ROLES]
    by_id = {m.worker_id: m for m in workers}
    for wid, order in orders.items():
        m = by_id.get(wid)
        followed = m is not None and m.role == order.role and not m.draining
        if not followed and now_ms - order.unix_ms < policy.settle * 1000:
            return {}  # a move under way
    if any(m.draining and m.extra.get(SWITCHABLE) == "1" for m in workers):
        return {}
    live = [m for m in workers if not m.draining]
    current = sum(m.role == "prefill" for m in live)
    target = target_prefill(fraction, len(live), current, policy.hysteresis)
    if target == current:
        return {}
    source, dest = ("decode", "prefill") if target > current else ("prefill", "decode")
    movable = [
        m
        for m in live
        if m.role == source
        and m.extra.get(SWITCHABLE) == "1"
        and orders.get(m.worker_id, RoleOrder(m.role)).by != "operator"
        and now_ms - m.started_unix_ms >= policy.min_dwell * 1000
    ]
    if not movable:
        return {}
    pick = min(movable, key=lambda m: (m.load.running + m.load.queue_length, m.worker_id))
    return {pick.worker_id: dest}


@dataclass(frozen=True, slots=True)
class Pool:
    """One base model as the balancer sees it: its members and its planned prefill fraction."""

    model: str
    members: Callable[[], Sequence[Member]]
    fraction: Callable[[], float]


def pool_of(core: RouterCore, directory: MemberWatcher) -> Pool:
    """A router core's model as a pool: its members from ``directory`` (draining ones too: a
    switch under way) and its planner's prefill fraction at the default TPOT objective."""

    def members() -> list[Member]:
        return [m for m in directory.members.values() if m.model == core.model]

    def fraction() -> float:
        tpot = core.chooser.disagg.default_slo.tpot_s
        return core.planner.plan(core.workers(), tpot).prefill_fraction

    return Pool(core.model, members, fraction)


class RoleBalancer:
    """Writes the orders of `desired_roles` every ``interval`` seconds (see module doc)."""

    def __init__(
        self,
        pools: Sequence[Pool],
        orders: RoleOrders,
        policy: RolePolicy = RolePolicy(),
        interval: float = 10.0,
    ) -> None:
        self.pools, self.orders, self.policy, self.interval = pools, orders, policy, interval
        self.moves: dict[str, int] = dict.fromkeys(WORKER_ROLES, 0)  # orders written, by role
        self._task: asyncio.Task[None] | None = None

    async def step(self) -> dict[str, str]:
        """One round over every pool; returns the orders written."""
        orders = await self.orders.list()
        written: dict[str, str] = {}
        now_ms = int(time.time() * 1000)
        seen = {pool.model: list(pool.members()) for pool in self.pools}
        known = {m.worker_id for ms in seen.values() for m in ms}
        for pool in self.pools:
            members = seen[pool.model]
            ids = {m.worker_id for m in members}
            # A worker between its two registrations is in no pool: its order still counts.
            mine = {w: o for w, o in orders.items() if w in ids or w not in known}
            changes = desired_roles(members, pool.fraction(), mine, self.policy, now_ms)
            for worker_id, role in changes.items():
                await self.orders.put(worker_id, RoleOrder(role, "planner"))
                self.moves[role] += 1
                log.info("role balancer: %s of %s -> %s", worker_id, pool.model, role)
            written.update(changes)
        return written

    def start(self) -> RoleBalancer:
        self._task = asyncio.create_task(self._run(), name="role-balancer")
        return self

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.step()
            except Exception:  # etcd away: the next round tries again
                log.exception("role balancer round failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.orders.close()
