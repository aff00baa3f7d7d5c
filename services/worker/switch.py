"""A switchable worker (``--switchable``): one engine (one set of weights) serving the prefill
or the decode role, and switching between them at run time when its role order says so
(`libkv.cluster.roles`: a router's role balancer or `tandem role`).

The gRPC server is built once with both roles' services (`RoleDispatch`); each call goes to the
servicer of the role served now, and a call of the other role's service is refused UNAVAILABLE
(routers then try another worker). A switch is sequential:

1. drain the current role as a SIGTERM would (`services.worker.runtime.drain`): its admission
   closes, its member record is marked draining, a decode role hands its running streams over
   with their KV, and prefills in flight and held KV leases finish, up to ``--drain-timeout``;
2. stop its member record and block-location publishers, its KV side and its core;
3. wire the new role with a new incarnation (a new KV side: peers never reuse the old NIXL agent
   or mapping) and register it (member key under the new role, ``switchable=1``).

A drain that does not finish in time abandons the switch: the record is unmarked, admission
reopens and the worker stays in its role (counted as failed); a later order tries again. The
process, its engine and its prefix cache (the weights, the cached KV) stay throughout."""

from __future__ import annotations

import asyncio
import importlib
import logging
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from tandem.v1 import worker_pb2, worker_pb2_grpc

from engine.gil import quick_handoffs
from libkv.cluster.roles import SWITCHABLE, WORKER_ROLES, RoleOrder, RoleOrderWatch
from services.common.errors import Unavailable
from services.common.grpc_server import start_server
from services.common.health import Health
from services.common.process import run_until_signal, setup_logging
from services.observability.metrics import AdmissionCollector, KVPathCollector
from services.worker import adapters as lora
from services.worker.config import WorkerConfig, parse_config
from services.worker.presence import Presence
from services.worker.runtime import Base, Role, Wire, Worker, drain, serve

log = logging.getLogger(__name__)

# Each role's wiring, by module (the worker runtime does not import the role packages).
WIRES = {"prefill": "services.prefill.__main__", "decode": "services.decode.__main__"}
SERVICES = {  # gRPC service -> (its add function, the roles that serve it)
    "Prefill": (worker_pb2_grpc.add_PrefillServicer_to_server, ("prefill",)),
    "Decode": (worker_pb2_grpc.add_DecodeServicer_to_server, ("decode",)),
    "KVTransport": (worker_pb2_grpc.add_KVTransportServicer_to_server, WORKER_ROLES),
}


def wire_of(role: str) -> Wire:
    return importlib.import_module(WIRES[role]).wire


class RoleDispatch:
    """The servicers registered once; each call goes to the current role's (see module doc)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.role = ""  # "" between two roles
        self._servicers: dict[Callable, Any] = {}  # add function -> the role's servicer

    def set(self, role: str, servicers: list[tuple[Callable, Any]]) -> None:
        self.role, self._servicers = role, dict(servicers)

    def target(self, service: str) -> Any:
        add, _ = SERVICES[service]
        servicer = self._servicers.get(add)
        if servicer is None:
            now = f"serves {self.role}" if self.role else "is switching roles"
            raise Unavailable(f"worker {self.worker_id} {now}: no tandem.v1.{service} here now")
        return servicer

    def servicers(self) -> list[tuple[Callable, Any]]:
        return [(add, _proxy(service, self.target)) for service, (add, _) in SERVICES.items()]


def _proxy(service: str, target: Callable[[str], Any]) -> Any:
    """A servicer of ``service`` whose every method calls ``target(service)``'s."""
    base = getattr(worker_pb2_grpc, f"{service}Servicer")
    methods: dict[str, Any] = {}
    for method in worker_pb2.DESCRIPTOR.services_by_name[service].methods:
        name = method.name
        if method.server_streaming:

            async def stream(self, request, context, _name=name):
                async for item in getattr(target(service), _name)(request, context):
                    yield item

            methods[name] = stream
        else:

            async def unary(self, request, context, _name=name):
                return await getattr(target(service), _name)(request, context)

            methods[name] = unary
    return type(f"Switchable{service}Servicer", (base,), methods)()


@dataclass
class Active:
    """The role served now."""

    name: str
    worker: Worker
    role: Role
    presence: Presence | None


class Switcher:
    """Enters, leaves and switches roles (see module doc); one switch at a time."""

    def __init__(self, base: Base, dispatch: RoleDispatch, address: str) -> None:
        self.base, self.dispatch, self.address = base, dispatch, address
        self.active: Active | None = None
        self.switches: dict[tuple[str, str], int] = {}  # (from, to) -> switches done
        self.failed = 0  # switches abandoned (drain past its timeout)
        self.wanted = ""  # the role the order names ("": none)
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None

    async def enter(self, name: str) -> None:
        worker = self.base.worker(name, uuid.uuid4().hex)
        role = await wire_of(name)(worker)
        role.bound(self.address)
        presence = await self.base.register(worker, role, self.address, {SWITCHABLE: "1"})
        self.active = Active(name, worker, role, presence)
        self.dispatch.set(name, list(role.servicers))
        log.info("worker %s serves %s (incarnation %s)", worker.config.worker_id, name,
                 worker.incarnation)  # fmt: skip

    async def leave(self, final: bool = False) -> int:
        """Drain the current role; returns the work left at the timeout. Unless ``final``
        (SIGTERM), a role with work left stays (the switch is abandoned)."""
        a = self.active
        assert a is not None
        a.worker.ledger.close()  # new work of this role: UNAVAILABLE, routers go elsewhere
        registration = a.presence.registration if a.presence is not None else None
        timeout = self.base.config.drain_timeout
        left = await drain(registration, a.role.busy, timeout, a.role.hand_over)
        if left and not final:
            a.worker.ledger.closed = False
            if registration is not None:
                await registration.undrain()
            return left
        self.active = None
        self.dispatch.set("", [])
        if a.presence is not None:
            await a.presence.stop()
        await a.role.kv.close()
        await a.role.stop()
        return left

    async def switch(self, name: str) -> bool:
        """Serve ``name`` from now on; False when the current role could not drain."""
        async with self._lock:
            old = self.active.name if self.active is not None else ""
            if old == name:
                return True
            if old and await self.leave():
                self.failed += 1
                log.warning("switch %s -> %s abandoned: the drain did not finish", old, name)
                return False
            await self.enter(name)
            self.switches[(old, name)] = self.switches.get((old, name), 0) + 1
            return True

    def order(self, order: RoleOrder | None) -> None:
        """A new role order (the watch's callback): follow it in a task."""
        self.wanted = order.role if order is not None else ""
        if self.active is not None and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._follow(), name="role-switch")

    async def _follow(self) -> None:
        while self.wanted and self.active is not None and self.wanted != self.active.name:
            if not await self.switch(self.wanted):
                return  # a later order (or its rewrite) tries again

    async def stop(self) -> int:
        """SIGTERM: no more switches; drain the role served now for good."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        async with self._lock:
            return await self.leave(final=True) if self.active is not None else 0


class RoleCollector(Collector):
    """The current role's collectors plus ``tandem_worker_role`` and
    ``tandem_worker_role_switches_total``."""

    def __init__(self, switcher: Switcher) -> None:
        self.switcher = switcher

    def collect(self) -> Iterator[Metric]:
        s = self.switcher
        role = GaugeMetricFamily(
            "tandem_worker_role", "1 for the role this worker serves now.", labels=["role"]
        )
        active = s.active
        for name in WORKER_ROLES:
            role.add_metric([name], 1.0 if active is not None and active.name == name else 0.0)
        yield role
        switches = CounterMetricFamily(
            "tandem_worker_role_switches",
            "Run-time role switches done, by the role left and the role taken.",
            labels=["from_role", "to_role"],
        )
        for (old, new), n in sorted(s.switches.items()):
            if old:  # not the role it started in
                switches.add_metric([old, new], n)
        yield switches
        yield CounterMetricFamily(
            "tandem_worker_role_switches_failed",
            "Role switches abandoned: the role served could not drain within --drain-timeout.",
            value=s.failed,
        )
        if active is not None:
            for c in (AdmissionCollector(active.worker.ledger), KVPathCollector(active.role.kv),
                      *active.role.collectors):  # fmt: skip
                yield from c.collect()


def main(role: str, wire: Wire, argv: Sequence[str] | None = None) -> None:
    """``python -m services.<role>``: parse the config once, then serve until SIGTERM, as a
    ``role`` worker (``wire``) or, with ``--switchable``, starting in ``role``."""
    config = parse_config(role, argv)
    quick_handoffs()
    setup_logging(role, config.log_level)
    asyncio.run(serve_switchable(config) if config.switchable else serve(config, wire))


async def serve_switchable(config: WorkerConfig) -> None:
    """Run a switchable worker until SIGINT/SIGTERM, starting in its order's role (else
    ``config.role``)."""
    base = await Base.start(config)
    dispatch = RoleDispatch(config.worker_id)
    services = [f"tandem.v1.{s}" for s in SERVICES]
    server = await start_server(
        [*dispatch.servicers(), base.adapters_servicer()],
        [*services, lora.SERVICE_NAME],
        config.bind,
        metrics=base.obs.grpc,
        tls=config.security.tls,
        ready=False,
    )
    switcher = Switcher(base, dispatch, config.advertised(server.port))
    watch = None
    if config.etcd:  # before the first role: a restarted worker comes back in its order's
        watch = await RoleOrderWatch.start(list(config.etcd), config.worker_id, switcher.order)
    await switcher.enter(switcher.wanted or config.role)
    switcher.order(watch.order if watch is not None else None)
    await base.loaded_since()
    base.obs.metrics.register(RoleCollector(switcher))
    health = await Health(server, live=lambda: base.engine.alive).start()
    assert switcher.active is not None
    print(f"READY {switcher.active.name} {switcher.address}", flush=True)

    async def cleanup() -> None:
        if watch is not None:
            await watch.stop()
        await health.drain()
        left = await switcher.stop()
        await server.stop(grace=0.5 if left else 5)
        await health.stop()
        base.engine.stop()
        base.obs.stop()

    await run_until_signal(cleanup)
