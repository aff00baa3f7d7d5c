"""Builds a worker's KV transfer side from its config: CUDA IPC between GPU workers of one
host, NIXL (primary between hosts and for host memory) or the gRPC block stream (fallback,
chosen by config or when NIXL cannot start); peers' agents and pools are found through their
etcd member records. Nothing here knows the engine: the worker hands in its pool
(`libkv.transfer.pool.PoolStore`)."""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

from libkv.cluster.registry import MEMBERS_PREFIX, MemberWatcher
from libkv.kv_layout import KVLayout
from libkv.transfer import (
    CUDA_IPC_KEY,
    NIXL_GPU_KEY,
    VISIBLE_KEY,
    BlockHolder,
    KVTransport,
    agent_name,
)
from libkv.transfer.cuda_ipc import CudaIpcTransport, pool_record
from libkv.transfer.grpc_stream import ChannelFactory, GrpcStreamTransport, plain_channel
from libkv.transfer.nixl import NixlBlockServer, NixlTransport
from libkv.transfer.nixl_agent import NixlEndpoint, nixl_available, ucx_cuda_problem
from libkv.transfer.path import EtcdPeers, PathTransport
from libkv.transfer.pool import PoolStore
from libkv.transfer.rank_ipc import RankShards, ShardedIpcReader, ranks_ipc_extra
from libkv.transfer.sharded import RankAgents, ShardedReader, ranks_extra

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "nixl", "grpc")  # auto: nixl when importable
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


class RankSide(RankAgents, RankShards, Protocol):
    """A tensor-parallel worker's ranks 1..N-1 on the KV side: NIXL agents and CUDA IPC."""


def resolve_transport(kind: str) -> str:
    """``kind`` with "auto" made concrete: nixl when importable, else grpc."""
    if kind != "auto":
        return kind
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


@dataclass
class KVSide:
    """What a worker's wiring gets: the transport (decode), the member-record fields to publish
    and what to close at shutdown. For a GPU pool: whether each hand-off path can move its GPU
    memory device-direct, and how many transfers were caught on a slow path."""

    transport: KVTransport | None = None
    server: NixlBlockServer | None = None
    extra: dict[str, str] = field(default_factory=dict)
    closers: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    gpu_direct: dict[str, bool] = field(default_factory=dict)  # path -> usable (GPU pools)
    slow_transfers: int = 0
    # Set by the wiring once registered: republishes a member-record field.
    publish: Callable[[str, str], None] | None = None
    nixl: NixlTransport | None = None  # a decode worker's NIXL side, when it runs an agent
    whole_blocks: bool = True  # False: tensor-parallel, each rank's agent holds its heads

    def serve_held(self, holder: BlockHolder, busy: Callable[[], bool]) -> bool:
        """Serve ``holder``'s held blocks to peers over this worker's NIXL agent (a decode
        worker's moved KV); False without one (peers then pull over the gRPC stream)."""
        if self.nixl is None:
            return False
        self.nixl.serve(holder, busy, self.whole_blocks)
        return True

    async def close(self) -> None:
        for close in reversed(self.closers):
            try:
                await close()
            except Exception:
                log.exception("closing the KV transport failed")

    def network_slow(self, peer: str, rate: float) -> None:
        """NIXL moved GPU memory on a slow path: stop offering it (routers stop pairing
        this worker over the network; CUDA IPC peers still disaggregate)."""
        self.slow_transfers += 1
        self.gpu_direct["network"] = False
        self.extra[NIXL_GPU_KEY] = "0"
        if self.publish is not None:
            self.publish(NIXL_GPU_KEY, "0")


async def _endpoint(
    kind: str, pool: PoolStore, worker_id: str, incarnation: str, etcd, ranks: RankSide | None
):
    """A NIXL endpoint over the pool, or None (with the reason logged) for gRPC."""
    if resolve_transport(kind) != "nixl":
        return None
    if not nixl_available():
        log.warning("--kv-transport nixl but NIXL is not importable; using the gRPC stream")
        return None
    if not etcd:
        log.warning("NIXL agents are found through etcd, none configured; using the gRPC stream")
        return None
    if pool.on_gpu and ucx_cuda_problem() is not None:
        return None  # said by _gpu_side: GPU memory would move over TCP
    try:
        return await NixlEndpoint.start(agent_name(worker_id, incarnation), pool.region)
    except Exception as e:
        log.warning("starting the NIXL agent failed (%r); using the gRPC stream", e)
        return None


async def _rank_exports(side: KVSide, ranks: RankSide | None) -> None:
    """A tensor-parallel GPU worker exporting its pool: every rank's shard in the record."""
    if ranks is not None and CUDA_IPC_KEY in side.extra:
        exports = [side.extra[CUDA_IPC_KEY], *await ranks.export()]
        side.extra.update(ranks_ipc_extra(exports))
        log.info("KV transport: CUDA IPC exports of %d ranks' shards", len(exports))


def _gpu_side(side: KVSide, pool: PoolStore, kind: str, nixl: bool, export: bool) -> None:
    """A GPU pool's hand-off record: host, GPU, mappable GPUs, the pool exported for CUDA IPC
    (prefill workers for their hand-offs, decode workers for the live moves of a drain: a
    peer on this host then maps it and copies GPU to GPU), and whether NIXL moves its GPU
    memory device-direct. Says at start, as an error,
    when no network path can (then only peers on this host disaggregate with it)."""
    side.extra.update(pool_record(pool.cache, pool.block_bytes, export, pool.exported))
    side.extra[NIXL_GPU_KEY] = "1" if nixl else "0"
    side.gpu_direct = {"cuda-ipc": True, "network": nixl}
    if nixl:
        return
    if resolve_transport(kind) != "nixl":
        why = f"--kv-transport {kind} carries KV through host memory and TCP"
    else:
        why = ucx_cuda_problem() or "NIXL is not available"
    log.error(
        "no GPU-direct network path for this worker's KV (%s): GPU memory never moves over TCP, "
        "so routers pair it only with workers on this host that CUDA IPC reaches, and serve "
        "the rest without disaggregation",
        why,
    )


async def decode_side(
    kind: str,
    mode: str,
    pool: PoolStore,
    worker_id: str,
    incarnation: str,
    etcd: tuple,
    channel: ChannelFactory = plain_channel,
    cuda_ipc: bool = True,
    layout: KVLayout | None = None,
    ranks: RankSide | None = None,
    checksums: bool = False,
    fault: str = "",
) -> KVSide:
    """The decode worker's transport: CUDA IPC for peers whose GPU pool it can map, else NIXL
    (or the gRPC stream between host-memory pools, over channels made by ``channel``), per
    `libkv.transfer.handoff_path`. With ``checksums`` and whole canonical blocks (no ranks)
    the CUDA IPC copy sums what it moves (`CudaIpcTransport`, its ``fault`` hook too)."""
    grpc = GrpcStreamTransport(pool, channel)
    endpoint = await _endpoint(kind, pool, worker_id, incarnation, etcd, ranks)
    side = KVSide(whole_blocks=ranks is None)
    if pool.on_gpu:
        _gpu_side(side, pool, kind, endpoint is not None, export=cuda_ipc)
        await _rank_exports(side, ranks)
        if not cuda_ipc:
            side.extra[VISIBLE_KEY] = ""  # maps no peer's pool
            side.gpu_direct["cuda-ipc"] = False
    if not etcd or (endpoint is None and not (pool.on_gpu and cuda_ipc)):
        side.transport, side.closers = grpc, [grpc.close]
        return side
    # Every member, decode workers too: a draining decode worker's moved KV is READ from it.
    watcher = await MemberWatcher.start(list(etcd), MEMBERS_PREFIX)
    peers = EtcdPeers(watcher)
    network: KVTransport = grpc
    sharded = None
    if endpoint is not None:
        assert endpoint.info is not None
        side.extra.update(endpoint.info.to_extra())
        mode = nixl_mode_for(mode, pool.device_type)
        network = side.nixl = NixlTransport(
            endpoint, peers, mode, fallback=grpc, on_slow=side.network_slow
        )
        log.info("KV transport: NIXL %s (agent %s), gRPC fallback", mode.upper(), endpoint.name)
        if layout is not None:
            await _rank_agents(side, endpoint, worker_id, incarnation, ranks)
            sharded = ShardedReader(endpoint, layout, ranks)
    local = by_rank = None
    if pool.on_gpu and cuda_ipc:
        fused = checksums and ranks is None  # TP=1: the pool holds whole canonical blocks
        local = CudaIpcTransport(
            pool.cache, pool.block_bytes, peers, sums=fused, fault=fault if fused else ""
        )
        if layout is not None:  # rank by rank where either side is tensor-parallel
            by_rank = ShardedIpcReader(pool.cache, pool.block_bytes, layout, ranks)
        log.info("KV transport: CUDA IPC for peers whose GPU this worker can map")
    side.transport = PathTransport(peers, side.extra, network, local, sharded, by_rank)
    side.closers = [*side.closers, watcher.stop, side.transport.close]
    return side


async def _rank_agents(
    side: KVSide, endpoint: NixlEndpoint, worker_id: str, incarnation: str, ranks
) -> None:
    """Start ranks 1..N-1's NIXL agents and publish every rank's (`libkv.transfer.sharded`)."""
    if ranks is None:
        return
    assert endpoint.info is not None
    infos = [endpoint.info, *await ranks.start(worker_id, incarnation)]
    side.extra.update(ranks_extra(infos))
    side.closers.append(ranks.close)
    log.info("KV transport: NIXL agents of %d ranks: %s", len(infos), [i.name for i in infos])


async def prefill_side(
    kind: str,
    pool: PoolStore,
    worker_id: str,
    incarnation: str,
    etcd: tuple,
    holder: BlockHolder,
    busy: Callable[[], bool],
    cuda_ipc: bool = True,
    ranks: RankSide | None = None,
) -> KVSide:
    """The prefill worker always serves the gRPC stream too (its servicer,
    `libkv.transfer.grpc_stream.BlockStreamServicer`, is registered by the caller), so decode
    workers configured for gRPC still reach it (host-memory pools only) and can release blocks
    through it; a GPU pool is also exported for CUDA IPC. ``busy`` tells whether blocks are
    held for decode workers (the NIXL notification pump runs hot meanwhile)."""
    endpoint = await _endpoint(kind, pool, worker_id, incarnation, etcd, ranks)
    side = KVSide()
    if pool.on_gpu:
        _gpu_side(side, pool, kind, endpoint is not None, export=cuda_ipc)
        await _rank_exports(side, ranks)
    if endpoint is None:
        return side
    assert endpoint.info is not None
    side.server = NixlBlockServer(endpoint, holder, busy=busy, whole_blocks=ranks is None)
    side.extra.update(endpoint.info.to_extra())
    side.closers.append(side.server.close)
    await _rank_agents(side, endpoint, worker_id, incarnation, ranks)
    log.info("KV transport: NIXL agent %s serves READ and WRITE", endpoint.name)
    return side
