"""``python -m services.router``: the router (config, wiring, signals)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from tandem.v1 import router_pb2_grpc

from engine.tokenizer import Tokenizer
from libkv.recent_routes import HintedIndex, RecentRoutes
from libkv.registry import Member, MemberWatcher, Registration
from libkv.summary_index import LocationIndex
from services.common.grpc_server import start_server
from services.common.obs_config import (
    ObservabilityConfig,
    add_observability_flags,
    observability_config,
)
from services.common.observability import Observability
from services.common.security import Security, add_security_flags, security_from_args
from services.common.security import apply as apply_security
from services.common.worker import run_until_signal, setup_logging
from services.router.codec import GrpcWorkerClients
from services.router.core import RouterCore
from services.router.metrics import RouterCollector
from services.router.policy import POLICIES, PolicyConfig
from services.router.server import RouterServicer

log = logging.getLogger("tandem.router")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model_dir: str
    etcd: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    router_id: str = ""
    served_model_name: str = ""
    decode_only_threshold: int = 256
    api_keys: frozenset[str] = frozenset()
    policy: str = "kv"  # see services.router.policy.POLICIES
    kv_load_weight: float = 0.5  # kv policy: prompt blocks one queued/running request weighs
    kv_recent_ttl: float = 2.0  # kv policy: seconds a route is remembered before etcd shows it
    drain_timeout: float = 30.0  # on SIGTERM: most seconds streams in flight get to finish
    observability: ObservabilityConfig = ObservabilityConfig()
    security: Security = Security()  # mutual TLS between services, TLS/auth to etcd

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="tandem router", description=__doc__)
    p.add_argument(
        "--model-dir", default=env("TANDEM_MODEL_DIR"), required=not env("TANDEM_MODEL_DIR")
    )
    p.add_argument("--etcd", default=env("TANDEM_ETCD_ENDPOINTS", ""), help="host:port[,...]")
    p.add_argument("--host", default=env("TANDEM_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("TANDEM_PORT", "0")))
    p.add_argument("--advertise-host", default=env("TANDEM_ADVERTISE_HOST", ""))
    p.add_argument("--router-id", default=env("TANDEM_ROUTER_ID", ""))
    p.add_argument("--served-model-name", default=env("TANDEM_SERVED_MODEL_NAME", ""))
    p.add_argument(
        "--decode-only-threshold", type=int, default=int(env("TANDEM_DECODE_ONLY_THRESHOLD", "256"))
    )
    p.add_argument("--api-key", action="append", default=None)
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=env("TANDEM_ROUTER_POLICY", "kv"),
        help="how workers are chosen (see services/router/policy.py)",
    )
    p.add_argument(
        "--kv-load-weight",
        type=float,
        default=float(env("TANDEM_ROUTER_KV_LOAD_WEIGHT", "0.5")),
        help="kv policy: cost of one queued or running request, in prompt blocks per block",
    )
    p.add_argument(
        "--kv-recent-ttl",
        type=float,
        default=float(env("TANDEM_KV_RECENT_TTL", "2.0")),
        help="kv policy: seconds this router remembers where it sent a prompt, until the "
        "worker's block-location summary (written at most once a second) shows it; 0: off",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(env("TANDEM_DRAIN_TIMEOUT", "30")),
        help="on SIGTERM: most seconds streams in flight get to finish (new calls are refused "
        "at once, so clients reconnect to another router)",
    )
    add_observability_flags(p)
    add_security_flags(p)
    a = p.parse_args(argv)
    try:
        security = security_from_args(a)
    except ValueError as e:
        p.error(str(e))
    keys = a.api_key or [k for k in env("TANDEM_API_KEYS", "").split(",") if k]
    etcd = tuple(e for e in a.etcd.split(",") if e)
    if not etcd:
        p.error("--etcd (or TANDEM_ETCD_ENDPOINTS) is required")
    return RouterConfig(
        model_dir=os.path.expanduser(a.model_dir),
        etcd=etcd,
        host=a.host,
        port=a.port,
        advertise_host=a.advertise_host,
        router_id=a.router_id or f"router-{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        served_model_name=a.served_model_name,
        decode_only_threshold=a.decode_only_threshold,
        # Only hashes are kept (compared in constant time by the servicer).
        api_keys=frozenset(hashlib.sha256(k.split(":", 1)[0].encode()).hexdigest() for k in keys),
        policy=a.policy,
        kv_load_weight=a.kv_load_weight,
        kv_recent_ttl=a.kv_recent_ttl,
        drain_timeout=a.drain_timeout,
        observability=observability_config(a),
        security=security,
    )


async def serve(argv: list[str] | None = None) -> None:
    config = parse_config(argv)
    apply_security(config.security)  # before any etcd connection
    obs = Observability.start(config.observability, "router", config.model_name, config.router_id)
    tokenizer = Tokenizer(config.model_dir)
    watcher = await MemberWatcher.start(list(config.etcd))
    clients = GrpcWorkerClients(tls=config.security.tls)
    policy = PolicyConfig(config.policy, config.decode_only_threshold, config.kv_load_weight)
    # The kv policy routes by the block locations workers publish in etcd (nothing else).
    index = await LocationIndex.start(list(config.etcd)) if config.policy == "kv" else None
    lookup = index
    if index is not None and config.kv_recent_ttl > 0:
        lookup = HintedIndex(index, RecentRoutes(ttl=config.kv_recent_ttl))
    core = RouterCore(watcher, clients, policy=policy, index=lookup)
    server = await start_server(
        [
            (
                router_pb2_grpc.add_RouterServicer_to_server,
                RouterServicer(core, tokenizer, config.model_name, config.api_keys),
            )
        ],
        ["tandem.v1.Router"],
        f"{config.host}:{config.port}",
        metrics=obs.grpc,
        tls=config.security.tls,
    )
    obs.metrics.register(RouterCollector(core, watcher))
    address = f"{config.advertise_host or config.host}:{server.port}"
    reg = await Registration.start(
        list(config.etcd), Member(config.router_id, "router", config.model_name, address)
    )
    log.info("router %s listening on %s", config.router_id, address)
    print(f"READY router {address}", flush=True)

    async def cleanup() -> None:
        await server.set_serving(False)
        await reg.stop()
        # GOAWAY: new calls go to another router; streams in flight run to the end (or timeout).
        await server.stop(grace=config.drain_timeout)
        await core.close()
        await clients.close()
        await watcher.stop()
        if index is not None:
            await index.stop()
        obs.stop()

    await run_until_signal(cleanup)


def main(argv: list[str] | None = None) -> None:
    setup_logging("router")
    asyncio.run(serve(argv))


if __name__ == "__main__":
    main()
