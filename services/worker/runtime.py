"""The worker runtime that prefill and decode share: start the engine, serve gRPC, register in
etcd (with the block locations), tell live from ready, drain on SIGTERM and stop, in that
order. A role adds its core, servicers and KV side through a `Wire` function
(`services.prefill.__main__`, `services.decode.__main__`)."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from engine.core.client import EngineClient
from engine.core.process import ENGINE_DIED, EngineDied
from libkv.cluster.adapters import AdapterRecords
from libkv.cluster.registry import LORAS, Registration
from libkv.transfer.pool import PoolStore
from libkv.transfer.setup import KVSide, confine_kv_network
from services.common.admission import BOUND_KEY, TokenLedger, bound_record
from services.common.channels import internal_channel
from services.common.grpc_server import AddServicerFn, start_server
from services.common.health import Health
from services.common.process import run_until_signal
from services.common.security import apply as apply_security
from services.observability.engine import observe_engine
from services.observability.metrics import AdmissionCollector, KVPathCollector
from services.observability.process import Observability
from services.worker import adapters as lora
from services.worker.config import WorkerConfig, parse_lora_modules
from services.worker.pace import PaceMeter, chain
from services.worker.presence import Presence, register
from services.worker.rank_kv import RankNixl
from services.worker.slo_gate import SloGate, WorkerLoad

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """What a role's wiring gets: the config and the started parts every worker has."""

    config: WorkerConfig
    obs: Observability
    engine: EngineClient
    incarnation: str
    ledger: TokenLedger  # admission in tokens (prefill: prompts; decode: `request_cost`)
    pool: PoolStore  # the engine's KV pool as the transports see it
    pace: PaceMeter = field(default_factory=PaceMeter)  # its measured speed (member record)

    def gate(self) -> SloGate | None:
        """The SLO admission of ``--slo-shed-factor`` (None when 0: off)."""
        if self.config.slo_shed_factor <= 0:
            return None
        engine = self.engine

        def load() -> WorkerLoad:
            snap = engine.snapshot
            if snap is None:
                return WorkerLoad(0, 0)
            return WorkerLoad(snap.stats.num_running, snap.stats.prefill_backlog)

        return SloGate(self.config.slo_shed_factor, self.config.worker_id, self.pace.report, load)

    def rank_agents(self) -> RankNixl | None:
        """A tensor-parallel engine's ranks 1..N-1 on the KV side (None at TP=1)."""
        group = self.engine.ranks
        return RankNixl(group) if group is not None else None

    def channel(self, address: str) -> grpc.aio.Channel:
        """A channel to a peer worker (mutual TLS when configured, keepalive, tracing)."""
        return internal_channel(address, self.config.security.tls)


async def _nothing() -> None:
    return None


@dataclass
class Role:
    """A role's part of a worker: its servicers and KV side, the work a drain waits for
    (``busy``), what it does once the server's address is known and what it stops last."""

    servicers: Sequence[tuple[AddServicerFn, Any]]
    service_names: Sequence[str]
    kv: KVSide
    busy: Callable[[], int]
    bound: Callable[[str], None] = lambda address: None
    stop: Callable[[], Awaitable[None]] = _nothing
    collectors: Sequence[Any] = field(default_factory=list)  # Prometheus collectors
    # On SIGTERM, once routers no longer pick this worker: move work elsewhere (live KV
    # migration of a decode worker's running requests).
    hand_over: Callable[[], Awaitable[object]] = _nothing


Wire = Callable[[Worker], Awaitable[Role]]


async def start_engine(config: WorkerConfig) -> EngineClient:
    """The engine core in its own process (``engine.core.process``): this process's gRPC
    server, etcd keepalives and KV transfers never share a GIL with the model's steps. An
    engine that dies ends this process (``ENGINE_DIED``): a worker without one cannot serve."""
    confine_kv_network(config.host, os.environ)  # before any NIXL/UCX agent exists
    try:
        engine = await EngineClient.spawn(
            config.engine_config(), config.log_level, f"{config.role}-engine"
        )
    except EngineDied as e:  # the reason, not a traceback
        log.error("cannot start: %s", e)
        raise SystemExit(f"error: {e}") from e
    engine.on_death = _engine_died
    return engine


def _engine_died(why: str) -> None:
    log.critical("the engine process is gone (%s): exiting", why)
    logging.shutdown()
    os._exit(ENGINE_DIED)


def engine_pool(engine: EngineClient) -> PoolStore:
    """The engine's KV pool as the transports see it (mapped into this process; byte copies
    go through the engine)."""
    share = engine.info.pool
    return PoolStore(
        engine.pool(), engine.info.block_bytes, engine, share.ipc if share is not None else ""
    )


def pending_limit(config: WorkerConfig, engine: EngineClient) -> int:
    """The admission bound in tokens (``--max-pending-tokens``, default twice the pool)."""
    return config.max_pending_tokens or 2 * engine.info.num_blocks * config.block_size


@dataclass
class Base:
    """What a worker process starts once, whatever its role: observability, the engine (the
    weights), its pace meter and the LoRA adapters (run-time loads of ``records``)."""

    config: WorkerConfig
    obs: Observability
    engine: EngineClient
    pace: PaceMeter
    adapters: lora.Adapters
    records: AdapterRecords | None
    pool: PoolStore  # mapped once per process, whatever roles it serves

    @classmethod
    async def start(cls, config: WorkerConfig) -> Base:
        apply_security(config.security)  # before any etcd connection
        obs = Observability.start(
            config.observability, config.role, config.model_name, config.worker_id
        )
        engine = await start_engine(config)
        observe_engine(engine, obs.metrics.registry)
        pace = PaceMeter()  # reported in the member record, for the routers' disagg choice
        engine.on_step = chain(engine.on_step, pace)
        adapters = lora.Adapters(engine)
        await adapters.load_at_start(parse_lora_modules(config.lora_modules))
        with_lora = engine.info.enable_lora
        records = AdapterRecords(list(config.etcd)) if config.etcd and with_lora else None
        if records is not None:  # run-time loads made before this worker started
            await adapters.load_recorded(records, config.model_name)
        return cls(config, obs, engine, pace, adapters, records, engine_pool(engine))

    def worker(self, role: str, incarnation: str) -> Worker:
        """A role's view of this process: a fresh admission ledger and ``incarnation``."""
        config = replace(self.config, role=role)
        ledger = TokenLedger(
            pending_limit(config, self.engine),
            config.batch_admission_fraction,
            name=f"{role} worker {config.worker_id}",
        )
        return Worker(config, self.obs, self.engine, incarnation, ledger, self.pool, self.pace)

    async def register(
        self, worker: Worker, role: Role, address: str, extra: dict[str, str] | None = None
    ) -> Presence | None:
        """Register ``worker`` in its role (None without etcd), its KV side and adapters
        republishing member-record fields through the registration."""
        fields = {
            **role.kv.extra,
            LORAS: await self.adapters.record(),
            BOUND_KEY: bound_record(worker.ledger),
            **(extra or {}),
        }
        c = worker.config
        presence = await register(c, address, self.engine, worker.incarnation, fields, self.pace)
        if presence is not None:
            role.kv.publish = presence.registration.set_extra
            self.adapters.set_extra = presence.registration.set_extra
            self.adapters.publish = presence.registration.publish
        return presence

    async def loaded_since(self) -> None:
        """Once registered: a load that listed the live workers just before this one."""
        if self.records is not None:
            await self.adapters.load_recorded(self.records, self.config.model_name)
            await self.records.close()
            self.records = None

    def adapters_servicer(self) -> tuple[AddServicerFn, Any]:
        return (lora.add_to_server, lora.AdaptersServicer(self.adapters, self.config.worker_id))


async def serve(config: WorkerConfig, wire: Wire) -> None:
    """Run one worker of ``config.role`` until SIGINT/SIGTERM. Ready (grpc.health.v1 "") once
    registered; live ("liveness") while the engine's step thread runs. (A ``--switchable``
    worker runs `services.worker.switch.serve_switchable` instead.)"""
    base = await Base.start(config)
    obs, engine = base.obs, base.engine
    worker = base.worker(config.role, uuid.uuid4().hex)
    role = await wire(worker)
    server = await start_server(
        [*role.servicers, base.adapters_servicer()],
        [*role.service_names, lora.SERVICE_NAME],
        config.bind,
        metrics=obs.grpc,
        tls=config.security.tls,
        ready=False,
    )
    address = config.advertised(server.port)
    role.bound(address)
    presence = await base.register(worker, role, address)
    await base.loaded_since()
    for collector in (
        AdmissionCollector(worker.ledger),
        KVPathCollector(role.kv),
        *role.collectors,
    ):
        obs.metrics.register(collector)
    health = await Health(server, live=lambda: engine.alive).start()
    log.info("%s worker %s listening on %s", config.role, config.worker_id, address)
    print(f"READY {config.role} {address}", flush=True)

    async def cleanup() -> None:
        worker.ledger.close()  # new work gets UNAVAILABLE: the router retries it elsewhere
        await health.drain()
        registration = presence.registration if presence is not None else None
        left = await drain(registration, role.busy, config.drain_timeout, role.hand_over)
        if presence is not None:
            await presence.stop()
        # Past the drain timeout the work left is cut at once (a router moves a cut decode
        # stream to another worker); otherwise calls just finishing get a few seconds.
        await server.stop(grace=0.5 if left else 5)
        await health.stop()
        await role.kv.close()
        await role.stop()
        engine.stop()
        obs.stop()

    await run_until_signal(cleanup)


async def drain(
    registration: Registration | None,
    busy: Callable[[], int],
    timeout: float,
    hand_over: Callable[[], Awaitable[object]] = _nothing,
) -> int:
    """Graceful termination before the server stops, once admission is closed and readiness is
    NOT_SERVING: the etcd record is marked draining (routers send nothing new; the record stays,
    so a prefill worker's KV blocks are still found and pulled), ``hand_over()`` moves what it
    can elsewhere, then wait up to ``timeout`` seconds for ``busy()`` (work in flight) to reach
    0. Returns what is left."""
    if registration is not None:
        await registration.drain()
    try:
        await hand_over()
    except Exception:  # what did not move finishes here or is cut at the timeout
        log.exception("handing work over failed")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while busy() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    left = busy()
    if left:
        log.warning("drain timed out after %.0f s with %d still in flight", timeout, left)
    return left
