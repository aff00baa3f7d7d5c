"""Decode-side transport choice per peer: `PathTransport` sends each fetch over the path
`libkv.transfer.handoff_path` names for the pair (CUDA IPC on one host, else the network
transport), reading the peers' member records through `EtcdPeers`."""

from __future__ import annotations

from collections.abc import Sequence

from libkv.cluster.registry import MemberWatcher
from libkv.transfer import (
    AgentInfo,
    KVSource,
    KVTransferError,
    KVTransport,
    StalePeerError,
    TransferStats,
    handoff_path,
)
from libkv.transfer.cuda_ipc import CudaIpcTransport
from libkv.transfer.rank_ipc import ShardedIpcReader
from libkv.transfer.sharded import ShardedReader


class EtcdPeers:
    """PeerDirectory over a live view of the members in etcd (prefill workers, and decode
    workers whose moved KV is taken over)."""

    def __init__(self, watcher: MemberWatcher) -> None:
        self.watcher = watcher

    async def agent_info(
        self, worker_id: str, incarnation: str, timeout: float
    ) -> AgentInfo | None:
        return AgentInfo.from_extra(await self.extra(worker_id, incarnation, timeout))

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        """The member-record fields of that live incarnation."""
        member = self.watcher.members.get(worker_id)
        if member is None or member.incarnation != incarnation:
            # The handle may be newer than this view (a worker registered or restarted a
            # moment ago): give the watch a moment to catch up before calling it stale.
            def live(ms: dict) -> bool:
                return worker_id in ms and ms[worker_id].incarnation == incarnation

            await self.watcher.wait_for(live, min(timeout, 1.0))
            member = self.watcher.members.get(worker_id)
        if member is None:
            raise KVTransferError(f"worker {worker_id} is not registered (gone?)")
        if member.incarnation != incarnation:
            raise StalePeerError(
                f"worker {worker_id} restarted: the handle names incarnation "
                f"{incarnation}, the live one is {member.incarnation}"
            )
        return member.extra


class PathTransport:
    """The decode side's `KVTransport`: for each source, the path `handoff_path` names
    between the source's member record and this worker's (``mine``): CUDA IPC (``local``),
    the network transport, or none (KVTransferError: the prompt is recomputed or retried).
    Releases always go through the network transport (NIXL notification or gRPC). Over the
    network, a hand-off where one side is tensor-parallel goes rank by rank (``sharded``,
    `libkv.transfer.sharded`) when the source runs NIXL agents, and on this host rank by rank
    over CUDA IPC (``by_rank``, `libkv.transfer.rank_ipc`) when the source exports its ranks'
    shards."""

    def __init__(
        self,
        peers: EtcdPeers,
        mine: dict[str, str],
        network: KVTransport,
        local: CudaIpcTransport | None = None,
        sharded: ShardedReader | None = None,
        by_rank: ShardedIpcReader | None = None,
    ) -> None:
        self.peers, self.mine, self.network, self.local = peers, mine, network, local
        self.sharded, self.by_rank = sharded, by_rank
        self.name = network.name
        self.names = [network.name, *(["grpc"] if network.name != "grpc" else [])]
        if local is not None:
            self.names.insert(0, local.name)

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        extra = await self.peers.extra(source.worker_id, source.incarnation, timeout)
        path = handoff_path(extra, self.mine)
        if path == "cuda-ipc" and self.by_rank is not None and self.by_rank.applies(extra):
            return await self.by_rank.fetch(
                request_id, source, extra, src_blocks, dst_blocks, timeout
            )
        if path == "cuda-ipc" and self.local is not None:
            return await self.local.fetch(request_id, source, src_blocks, dst_blocks, timeout)
        if path != "network":
            raise KVTransferError(
                f"no GPU-direct path from {source.worker_id} to this worker (GPU memory never "
                "moves over TCP)"
            )
        if self.sharded is not None and self.sharded.applies(extra):
            return await self.sharded.fetch(
                request_id, source, extra, src_blocks, dst_blocks, timeout
            )
        return await self.network.fetch(request_id, source, src_blocks, dst_blocks, timeout)

    @property
    def stats(self) -> TransferStats:
        """Both paths' counters together."""
        total = TransferStats()
        for part in (self.network, self.local, self.sharded, self.by_rank):
            st = getattr(part, "stats", None)
            if st is not None:
                total.transfers += st.transfers
                total.blocks += st.blocks
                total.bytes += st.bytes
                total.seconds += st.seconds
                total.failures += st.failures
        return total

    async def verify(self, request_id: str, expected: Sequence[int]) -> int | None:
        """`CudaIpcTransport.verify` of the sums its fused copy took; None when the fetch went
        another way (the caller checks the arrived blocks)."""
        if self.local is None:
            return None
        return await self.local.verify(request_id, expected)

    async def release(self, request_id: str, source: KVSource) -> None:
        if self.sharded is not None and request_id in self.sharded.released:
            self.sharded.released.discard(request_id)  # freed on the READs' notification
            return
        await self.network.release(request_id, source)

    async def close(self) -> None:
        if self.local is not None:
            await self.local.close()
        await self.network.close()
