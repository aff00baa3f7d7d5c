"""``python -m services.router``: the router (config, wiring, signals)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from tandem.v1 import router_pb2_grpc

from engine.gil import quick_handoffs
from engine.tokenizer import Tokenizer
from libkv.cluster.adapters import AdapterRecords
from libkv.cluster.recent_routes import HintedIndex, RecentRoutes
from libkv.cluster.registry import Member, MemberWatcher, ModelDirectory, Registration
from libkv.cluster.roles import RoleOrders
from libkv.cluster.summary_index import LocationIndex
from services.common.admission import refusal_memory_option
from services.common.grpc_server import start_server
from services.common.health import Health, model_service
from services.common.models import parse_models
from services.common.options import Options, option
from services.common.process import log_level_option, run_until_signal, setup_logging
from services.common.security import ETCD_OLD_ENV, Security
from services.common.security import apply as apply_security
from services.observability.config import ObservabilityConfig
from services.observability.process import Observability
from services.router.codec import GrpcWorkerClients
from services.router.core import RouterCore
from services.router.disagg import MODES
from services.router.metrics import RouterCollector
from services.router.planner import Planner
from services.router.policy import POLICIES, PolicyConfig
from services.router.roles import RoleBalancer, RolePolicy, pool_of
from services.router.server import RouterServicer

log = logging.getLogger("tandem.router")


def hash_keys(keys: tuple[str, ...]) -> frozenset[str]:
    """SHA-256 hex digests of the keys (``key`` or ``key:tenant``: the tenant is the gateway's
    business)."""
    return frozenset(hashlib.sha256(k.split(":", 1)[0].encode()).hexdigest() for k in keys)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router's settings; every field with a flag is an option (`services.common.options`)."""

    model_dir: str = option(
        "", "model folder (its tokenizer reads text prompts)", required=True,
        convert=os.path.expanduser,
    )  # fmt: skip
    etcd: tuple[str, ...] = option(
        (), "etcd endpoints host:port[,...]", required=True, old_env=ETCD_OLD_ENV
    )
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "gRPC port (0: a free one)")
    advertise_host: str = option("", "host others dial (default: --host)")
    router_id: str = option("", "id in etcd (default: router-HOSTNAME-RANDOM)")
    served_model_name: str = option("", "model name (default: the folder's name)")
    extra_models: tuple[str, ...] = option(
        (),
        "another base model served beside --model-dir, DIR or NAME=DIR (repeatable): requests "
        "pick one by model; each routes only to workers registered under its name",
        flag="--extra-model",
        metavar="[NAME=]DIR",
    )
    log_level: str = log_level_option()
    decode_only_threshold: int = option(
        256,
        "cold start only: until the workers report a measured prefill rate, prompts whose "
        "uncached part is shorter go straight to a decode worker (afterwards the choice is "
        "predicted against each request's SLOs: services/router/disagg.py)",
    )
    disagg_mode: str = option(
        "slo",
        "where a prompt is computed: slo (a prefill worker or the decode worker, whichever is "
        "predicted to meet the request's SLOs: services/router/disagg.py) or length (the "
        "--decode-only-threshold rule for every request, whatever the load)",
        choices=MODES,
    )
    slo_ttft_ms: float = option(
        1000.0, "TTFT objective (ms) of a request that carries none (the gateway sends one)"
    )
    slo_tpot_ms: float = option(50.0, "TPOT objective (ms) of a request that carries none")
    planner_window: float = option(
        60.0, "seconds of traffic the pool planner sizes the prefill and decode pools from"
    )
    planner_utilization: float = option(
        0.8, "the planner's target busy share of each worker (below 1 keeps queues short)"
    )
    balance_roles: bool = option(
        False,
        "turn the pool planner's prefill:decode split into run-time roles of --switchable "
        "workers (etcd role orders; services/router/roles.py); on one router only",
    )
    balance_interval: float = option(10.0, "seconds between two rounds of --balance-roles")
    role_min_dwell: float = option(
        60.0, "--balance-roles: seconds a worker keeps a role before it may switch again"
    )
    role_hysteresis: float = option(
        0.25,
        "--balance-roles: workers the planned split must be off by, past rounding, before a "
        "worker switches",
    )
    slo_shed_factor: float = option(
        0.0,
        "refuse (429, Retry-After) an interactive request whose predicted TTFT is past this "
        "many times its TTFT objective on the workers tried; 0: never",
    )
    api_keys: frozenset[str] = option(
        frozenset(),
        "require this API key (key or key:tenant) from callers; repeatable",
        flag="--api-key",
        old_env=("TANDEM_API_KEYS",),
        raw="tuple",
        convert=hash_keys,
        secret=True,
    )  # only SHA-256 hashes are kept (compared in constant time by the servicer)
    policy: str = option(
        "kv",
        "how workers are chosen (see services/router/policy.py)",
        choices=POLICIES,
        old_env=("TANDEM_ROUTER_POLICY",),
    )
    kv_load_weight: float = option(
        0.5,
        "kv policy: cost of one queued or running request, in prompt blocks per block",
        old_env=("TANDEM_ROUTER_KV_LOAD_WEIGHT",),
    )
    kv_recent_ttl: float = option(
        2.0,
        "kv policy: seconds this router remembers where it sent a prompt, until the worker's "
        "block-location summary (written at most once a second) shows it; 0: off",
    )
    max_migrations: int = option(
        2,
        "times a stream whose decode worker fails after sending tokens moves to another decode "
        "worker (resumed from the prompt and the tokens sent); then it ends with an error event",
    )
    refusal_memory: float = refusal_memory_option("decode worker")
    drain_timeout: float = option(
        30.0,
        "on SIGTERM: most seconds streams in flight get to finish (new calls are refused at "
        "once, so clients reconnect to another router)",
    )
    observability: ObservabilityConfig = ObservabilityConfig()
    security: Security = Security()  # mutual TLS between services, TLS/auth to etcd

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name

    @property
    def models(self) -> dict[str, str]:
        """Served name -> model folder, the first model first."""
        return {self.model_name: self.model_dir, **parse_models(self.extra_models)}


def options(env: Mapping[str, str] | None = None) -> Options:
    """The router's command line."""
    return Options(RouterConfig, "tandem router", "The router.", env)


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> RouterConfig:
    """The frozen config from flags, falling back to TANDEM_* environment variables."""
    opts = options(env)
    config = opts.parse(argv)
    try:
        config.security.check()
    except ValueError as e:
        opts.error(str(e))
    if config.refusal_memory < 0:
        opts.error("--refusal-memory must be >= 0 seconds")
    if not (config.slo_ttft_ms > 0 and config.slo_tpot_ms > 0 and config.slo_shed_factor >= 0):
        opts.error("--slo-ttft-ms and --slo-tpot-ms must be > 0, --slo-shed-factor >= 0")
    if not (config.balance_interval > 0 and config.role_min_dwell >= 0
            and config.role_hysteresis >= 0):  # fmt: skip
        opts.error("--balance-interval must be > 0, --role-min-dwell and --role-hysteresis >= 0")
    if not (config.planner_window > 0 and 0 < config.planner_utilization <= 1):
        opts.error("--planner-window must be > 0 and --planner-utilization in (0, 1]")
    try:
        if len(config.models) != 1 + len(config.extra_models):
            raise ValueError("--extra-model: every model needs its own name")
    except ValueError as e:
        opts.error(f"--extra-model: {e}")
    router_id = config.router_id or f"router-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return replace(config, router_id=router_id)


async def serve(config: RouterConfig) -> None:
    """Route until SIGINT/SIGTERM. Ready (grpc.health.v1 "") once its member view is loaded;
    ``model:NAME`` SERVING while a live decode worker of its model is in that view (what the
    gateway's /health asks); live ("liveness") until it stops."""
    apply_security(config.security)  # before any etcd connection
    obs = Observability.start(config.observability, "router", config.model_name, config.router_id)
    watcher = await MemberWatcher.start(list(config.etcd))
    clients = GrpcWorkerClients(tls=config.security.tls)
    policy = PolicyConfig(
        config.policy, config.decode_only_threshold, config.kv_load_weight,
        config.slo_ttft_ms, config.slo_tpot_ms, config.disagg_mode,
    )  # fmt: skip
    # The kv policy routes by the block locations workers publish in etcd (nothing else).
    index = await LocationIndex.start(list(config.etcd)) if config.policy == "kv" else None
    lookup = index
    if index is not None and config.kv_recent_ttl > 0:
        lookup = HintedIndex(index, RecentRoutes(ttl=config.kv_recent_ttl))
    # One core per base model, each over its own workers; tokenizers read text prompts of
    # internal callers only.
    records = AdapterRecords(list(config.etcd))  # run-time adapter loads, for later workers
    routes = {
        name: (
            RouterCore(
                ModelDirectory(watcher, name),
                clients,
                policy=policy,
                index=lookup,
                max_migrations=config.max_migrations,
                records=records,
                model=name,
                refusal_memory=config.refusal_memory,
                slo_shed_factor=config.slo_shed_factor,
                planner=Planner(config.planner_window, config.planner_utilization, name),
            ),
            Tokenizer(folder),
        )
        for name, folder in config.models.items()
    }
    for core, _ in routes.values():  # load reports less this router's own requests
        watcher.add_listener(core.chooser.observe)
        watcher.add_listener(core.planner.observe)  # decode step times for its fit
    servicer = RouterServicer(routes, config.api_keys)
    server = await start_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, servicer)],
        ["tandem.v1.Router"],
        f"{config.host}:{config.port}",
        metrics=obs.grpc,
        tls=config.security.tls,
        ready=False,
    )

    def can_route() -> dict[str, bool]:
        decode = watcher.members_by_role("decode")
        return {model_service(n): any(m.model == n for m in decode) for n in config.models}

    health = await Health(
        server,
        ready=lambda: None if watcher.synced else "no member view from etcd yet",
        extra=can_route,
    ).start()
    address = f"{config.advertise_host or config.host}:{server.port}"
    reg = await Registration.start(
        list(config.etcd), Member(config.router_id, "router", config.model_name, address)
    )
    balancer = None
    if config.balance_roles:
        policy = RolePolicy(config.role_hysteresis, config.role_min_dwell)
        pools = [pool_of(core, watcher) for core, _ in routes.values()]
        orders = RoleOrders(list(config.etcd))
        balancer = RoleBalancer(pools, orders, policy, config.balance_interval).start()
    obs.metrics.register(RouterCollector([c for c, _ in routes.values()], watcher, balancer))
    log.info("router %s listening on %s", config.router_id, address)
    print(f"READY router {address}", flush=True)

    async def cleanup() -> None:
        await health.drain()
        if balancer is not None:
            await balancer.stop()
        await reg.stop()
        # GOAWAY: new calls go to another router; streams in flight run to the end (or timeout).
        await server.stop(grace=config.drain_timeout)
        await health.stop()
        for core, _ in routes.values():
            await core.close()
        await clients.close()
        await records.close()
        await watcher.stop()
        if index is not None:
            await index.stop()
        obs.stop()

    await run_until_signal(cleanup)


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    quick_handoffs()
    setup_logging("router", config.log_level)
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
