"""Run-time roles of switchable workers (``--switchable``): which role each should serve.

Key: ``/tandem/v1/roles/<worker_id>``; value: JSON ``{"role", "by", "unix_ms"}`` (`RoleOrder`).
No lease: an order outlives the processes that wrote and read it, so a worker restarted after a
switch comes back in the role it was told. ``by`` says who wrote it: ``planner`` (a router's
role balancer, `services.router.roles`, which rewrites its own orders as the traffic changes)
or ``operator`` (`tandem role WORKER ROLE`, which the balancer leaves alone until `tandem role
WORKER auto` deletes it). A switchable worker follows its own key (`RoleOrderWatch`) and
switches when the order names the other role; a worker never writes its key.

The role a worker serves now is the role of its member key (`libkv.cluster.registry`); its
member record carries ``switchable=1`` (`SWITCHABLE`) so the balancer knows whom it may move.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from libkv.cluster.etcd_follow import Endpoints, EtcdConnection, PrefixFollower, read_prefix

log = logging.getLogger(__name__)

ROLES_PREFIX = "/tandem/v1/roles/"
WORKER_ROLES = ("prefill", "decode")
BY = ("planner", "operator")
SWITCHABLE = "switchable"  # Member.extra key: "1" on a worker that switches roles when told


@dataclass(frozen=True, slots=True)
class RoleOrder:
    """The role a switchable worker should serve, and who said so."""

    role: str
    by: str = "planner"
    unix_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    def __post_init__(self) -> None:
        if self.role not in WORKER_ROLES:
            raise ValueError(f"a worker role is one of {WORKER_ROLES}, not {self.role!r}")
        if self.by not in BY:
            raise ValueError(f"an order is by one of {BY}, not {self.by!r}")

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RoleOrder:
        raw = json.loads(data)
        return cls(str(raw["role"]), str(raw.get("by", "planner")), int(raw.get("unix_ms", 0)))


def role_key(worker_id: str) -> bytes:
    if not worker_id or "/" in worker_id:
        raise ValueError(f"worker_id must be non-empty and contain no '/': {worker_id!r}")
    return f"{ROLES_PREFIX}{worker_id}".encode()


def _parse(key: bytes, value: bytes) -> tuple[str, RoleOrder] | None:
    worker_id = key[len(ROLES_PREFIX) :].decode()
    try:
        return worker_id, RoleOrder.from_json(value)
    except (ValueError, KeyError, TypeError):
        log.warning("ignoring a malformed role order at %r", key)
        return None


class RoleOrders:
    """Put, delete and list role orders (one retry on a new connection after an etcd error)."""

    def __init__(self, endpoints: Endpoints, timeout: float = 5.0) -> None:
        self._etcd = EtcdConnection(endpoints, timeout, "roles")

    async def _call(self, fn):
        try:
            return await fn()
        except Exception:
            await self._etcd.reset()
            return await fn()

    async def put(self, worker_id: str, order: RoleOrder) -> None:
        await self._call(lambda: self._etcd.client.put(role_key(worker_id), order.to_json()))

    async def delete(self, worker_id: str) -> None:
        await self._call(lambda: self._etcd.client.delete(role_key(worker_id)))

    async def list(self) -> dict[str, RoleOrder]:
        """Worker id -> its order, for every order."""
        items, _ = await self._call(lambda: read_prefix(self._etcd, ROLES_PREFIX.encode()))
        return dict(p for key, value in items if (p := _parse(key, value)) is not None)

    async def close(self) -> None:
        await self._etcd.close()


class RoleOrderWatch:
    """Follows one worker's order and calls ``on_order`` (in the event loop) with each new one
    (None when it is deleted). Keys of other workers that share the prefix are ignored."""

    def __init__(
        self,
        endpoints: Endpoints,
        worker_id: str,
        on_order: Callable[[RoleOrder | None], None],
        timeout: float = 2.0,
    ) -> None:
        self.key = role_key(worker_id)
        self.order: RoleOrder | None = None
        self.on_order = on_order
        self.follower = PrefixFollower(endpoints, self.key, self, timeout)

    @classmethod
    async def start(
        cls, endpoints: Endpoints, worker_id: str, on_order: Callable[[RoleOrder | None], None]
    ) -> RoleOrderWatch:
        self = cls(endpoints, worker_id, on_order)
        await self.follower.start()
        return self

    def _set(self, order: RoleOrder | None) -> None:
        if order != self.order:
            self.order = order
            self.on_order(order)

    def reset(self, items: list[tuple[bytes, bytes]]) -> None:
        found = next((p for k, v in items if k == self.key and (p := _parse(k, v))), None)
        self._set(found[1] if found is not None else None)

    def put(self, key: bytes, value: bytes) -> None:
        if key == self.key and (parsed := _parse(key, value)) is not None:
            self._set(parsed[1])

    def delete(self, key: bytes) -> None:
        if key == self.key:
            self._set(None)

    async def stop(self) -> None:
        await self.follower.stop()
