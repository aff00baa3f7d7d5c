"""Builds a worker's KV transfer side from its config: NIXL (primary) or the gRPC block stream
(fallback, chosen by config or when NIXL cannot start), and finds peers' NIXL agents through
their etcd member records."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from libkv.nixl_agent import NixlEndpoint, nixl_available
from libkv.nixl_transport import NixlBlockServer, NixlTransport
from libkv.registry import MEMBERS_PREFIX, MemberWatcher
from libkv.transfer import (
    AgentInfo,
    BlockHolder,
    KVTransferError,
    KVTransport,
    StalePeerError,
    agent_name,
)
from services.common.kv_transport import EngineBlockStore, GrpcStreamTransport
from services.common.tls import TLSFiles

log = logging.getLogger(__name__)

TRANSPORTS = ("nixl", "grpc")
NIXL_MODES = ("auto", "read", "write")
# Which NIXL direction "auto" picks per host kind, measured side by side with
# bench/kv_transfer.py (1 GiB in 64 MiB requests of scattered blocks; bench/results/):
# - cpu (2 shared cores, UCX cma): READ 4.6-5.3 GB/s vs WRITE 3.2-3.9 GB/s for blocks of
#   128 KiB and up, single block 1.6-2.6 ms vs 4.2-6.0 ms. Both directions copy at the same
#   kernel rate (process_vm_readv/writev); WRITE adds a request and a reply notification,
#   each waiting for the other process to poll.
# - cuda (2 x H200 over NVLink, UCX cuda_ipc): READ 94 GB/s vs WRITE 49 GB/s with 2 MiB blocks
#   (a Llama-3-8B block), equal within 10% from 64 KiB to 1 MiB, single block 0.25 ms vs
#   1.5 ms. Reports of pull over cuda_ipc being far slower than push did not hold here
#   (nixl-cu13 1.5.1, its bundled UCX); WRITE pays the same extra round trip as on CPU.
DEFAULT_NIXL_MODE = {"cpu": "read", "cuda": "read"}


def default_transport() -> str:
    return "nixl" if nixl_available() else "grpc"


def confine_kv_network(host: str, env: MutableMapping[str, str]) -> None:
    """A worker bound to loopback keeps its KV transfers (UCX, under NIXL) on loopback too:
    UCX otherwise listens on every network device. Set UCX_NET_DEVICES to choose the
    data-plane devices of a multi-host deployment (then this leaves it alone)."""
    if "UCX_NET_DEVICES" not in env and _is_loopback(host):
        env["UCX_NET_DEVICES"] = "lo"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def nixl_mode_for(mode: str, device_type: str) -> str:
    return DEFAULT_NIXL_MODE.get(device_type, "read") if mode == "auto" else mode


class EtcdPeers:
    """PeerDirectory over a live view of the prefill members in etcd."""

    def __init__(self, watcher: MemberWatcher) -> None:
        self.watcher = watcher

    async def agent_info(
        self, worker_id: str, incarnation: str, timeout: float
    ) -> AgentInfo | None:
        member = self.watcher.members.get(worker_id)
        if member is None or member.incarnation != incarnation:
            # The handle may be newer than this view (a worker registered or restarted a
            # moment ago): give the watch a moment to catch up before calling it stale.
            def live(ms: dict) -> bool:
                return worker_id in ms and ms[worker_id].incarnation == incarnation

            await self.watcher.wait_for(live, min(timeout, 1.0))
            member = self.watcher.members.get(worker_id)
        if member is None:
            raise KVTransferError(f"prefill worker {worker_id} is not registered (gone?)")
        if member.incarnation != incarnation:
            raise StalePeerError(
                f"prefill worker {worker_id} restarted: the handle names incarnation "
                f"{incarnation}, the live one is {member.incarnation}"
            )
        return AgentInfo.from_extra(member.extra)


@dataclass
class KVSide:
    """What a worker's wiring gets: the transport (decode), the member-record fields to publish
    and what to close at shutdown."""

    transport: KVTransport | None = None
    server: NixlBlockServer | None = None
    extra: dict[str, str] = field(default_factory=dict)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    async def close(self) -> None:
        for close in reversed(self.closers):
            try:
                await close()
            except Exception:
                log.exception("closing the KV transport failed")


async def _endpoint(kind: str, engine: LLMEngine, worker_id: str, incarnation: str, etcd):
    """A NIXL endpoint over the engine's pool, or None (with the reason logged) for gRPC."""
    if kind != "nixl":
        return None
    if not nixl_available():
        log.warning("--kv-transport nixl but NIXL is not importable; using the gRPC stream")
        return None
    if not etcd:
        log.warning("NIXL agents are found through etcd, none configured; using the gRPC stream")
        return None
    try:
        store = EngineBlockStore(engine)
        return await NixlEndpoint.start(agent_name(worker_id, incarnation), store.region)
    except Exception as e:
        log.warning("starting the NIXL agent failed (%r); using the gRPC stream", e)
        return None


async def decode_side(
    kind: str,
    mode: str,
    engine: LLMEngine,
    worker_id: str,
    incarnation: str,
    etcd: tuple,
    tls: TLSFiles | None = None,
) -> KVSide:
    grpc = GrpcStreamTransport(EngineBlockStore(engine), tls)
    endpoint = await _endpoint(kind, engine, worker_id, incarnation, etcd)
    if endpoint is None:
        return KVSide(transport=grpc, closers=[grpc.close])
    assert endpoint.info is not None
    watcher = await MemberWatcher.start(list(etcd), MEMBERS_PREFIX + "prefill/")
    mode = nixl_mode_for(mode, engine.runner.device.type)
    transport = NixlTransport(endpoint, EtcdPeers(watcher), mode, fallback=grpc)
    log.info("KV transport: NIXL %s (agent %s), gRPC fallback", mode.upper(), endpoint.name)
    return KVSide(transport, None, endpoint.info.to_extra(), [watcher.stop, transport.close])


async def prefill_side(
    kind: str,
    engine: LLMEngine,
    worker_id: str,
    incarnation: str,
    etcd: tuple,
    holder: BlockHolder,
) -> KVSide:
    """The prefill worker always serves the gRPC stream too (its servicer is registered by the
    caller), so decode workers configured for gRPC still reach it."""
    endpoint = await _endpoint(kind, engine, worker_id, incarnation, etcd)
    if endpoint is None:
        return KVSide()
    assert endpoint.info is not None
    server = NixlBlockServer(endpoint, holder, busy=lambda: engine.num_held > 0)
    log.info("KV transport: NIXL agent %s serves READ and WRITE", endpoint.name)
    return KVSide(None, server, endpoint.info.to_extra(), [server.close])
