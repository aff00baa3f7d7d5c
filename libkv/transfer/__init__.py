"""The KV transfer interface (no torch, no grpc): how a decode worker obtains prefilled blocks.

Two implementations sit behind `KVTransport`; services choose one through config only:
- NIXL over UCX (``libkv.transfer.nixl``): the whole pool is registered once, a transfer is a
  list of block indices into descriptor lists prepared once per peer, and a notification
  tells the other side the blocks may be released. Decode either READs (pulls) the blocks or
  asks prefill to WRITE (push) them into blocks it pre-allocated.
- the gRPC block stream (``libkv.transfer.grpc_stream``): the fallback where NIXL is not
  importable or not wanted; bytes travel in a server stream and are copied into the pool.

Pool layout: block ``i`` of a pool is the byte range ``[addr + i * block_bytes, + block_bytes)``
holding all layers, K and V of that block (``engine.kv_pool`` keeps the pool head-major,
``[num_blocks, kv_heads, num_layers, 2, block_size, head_dim]``, ``libkv.kv_layout``), so one
block is exactly one transfer descriptor, and so is any contiguous range of its KV heads (what
a tensor-parallel rank holds). Per-layer tensors (vLLM's layout) would make it ``2 * num_layers``
descriptors of ``block_size * kv_heads * head_dim`` elements each (32 KiB for Llama-3-8B in
bf16), and a transfer costs per descriptor: NIXL READ of scattered blocks between two H200s
moved 2.2 GB/s with 16 KiB descriptors, 7.7 GB/s with 64 KiB, 94 GB/s with 2 MiB
(bench/results/kv_transfer_cuda.md); on CPU 64 SmolLM2 blocks moved at 4.1 GB/s as 1
descriptor each and 1.55 GB/s as 60 (kv_layout_cpu.md). Attention does not care: within a
(block, layer, K|V) both layouts hold the same contiguous rows, only the stride between blocks
differs; Llama-3-8B shape on an H100 with the Triton kernels, all 32 layers: decode (batch 16,
1024 context) 4.24 ms block-major vs 4.66 ms layer-major, prefill of 512 tokens 2.85 ms both
(kv_layout_cuda.md); the CPU reference path: decode 248 vs 230 ms, prefill 227 vs 248 ms, i.e.
within the noise of a shared 2-core host (kv_layout_cpu.md).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable


class KVTransferError(RuntimeError):
    """The blocks could not be obtained (peer gone, stale incarnation, timeout)."""


class StalePeerError(KVTransferError):
    """The handle names an incarnation that is no longer the live one: the worker restarted."""


class KVSource(Protocol):
    """Where a request's blocks live: enough to reach the peer and name the blocks."""

    worker_id: str
    address: str
    incarnation: str
    block_ids: tuple[int, ...]
    block_bytes: int
    lease_expires_unix_ms: int


@dataclass(frozen=True, slots=True)
class PoolRegion:
    """A KV pool as one contiguous memory range of ``num_blocks`` blocks.

    ``mem_type`` is NIXL's: "DRAM" (host memory) or "VRAM" (GPU ``device_id``).
    """

    addr: int
    num_blocks: int
    block_bytes: int
    mem_type: str = "DRAM"
    device_id: int = 0

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True, slots=True)
class AgentInfo:
    """What a peer needs to reach a worker's NIXL agent: its name (which embeds the worker's
    incarnation, so a restarted worker is never reached through its old agent), the agent's
    serialized metadata and the layout of its registered pool."""

    name: str
    metadata: bytes
    region: PoolRegion

    def to_json(self) -> str:
        raw = {
            "name": self.name,
            "metadata": base64.b64encode(self.metadata).decode(),
            "region": asdict(self.region),
        }
        return json.dumps(raw, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> AgentInfo:
        raw = json.loads(text)
        return cls(raw["name"], base64.b64decode(raw["metadata"]), PoolRegion(**raw["region"]))

    def to_extra(self) -> dict[str, str]:
        """Fields for ``Member.extra`` (the worker's etcd record)."""
        return {EXTRA_KEY: self.to_json()}

    @classmethod
    def from_extra(cls, extra: dict[str, str]) -> AgentInfo | None:
        text = extra.get(EXTRA_KEY)
        return cls.from_json(text) if text else None


EXTRA_KEY = "nixl_agent"
# Member-record fields that say which hand-off paths a worker offers (`handoff_path`).
HOST_KEY = "kv_host"  # the host (kernel boot id) the worker runs on
DEVICE_KEY = "kv_device"  # UUID of the GPU holding its pool; absent for a host-memory pool
VISIBLE_KEY = "kv_devices"  # comma-separated UUIDs of every GPU it can map (CUDA IPC)
CUDA_IPC_KEY = "cuda_ipc"  # its pool exported for CUDA IPC (`libkv.transfer.cuda_ipc.IpcPool`)
NIXL_GPU_KEY = "nixl_gpu"  # "1": its NIXL/UCX moves GPU memory device-direct; "0": it cannot


def handoff_path(src: Mapping[str, str], dst: Mapping[str, str]) -> str | None:
    """How KV can move from the worker whose member record has ``src`` (extra fields) to the
    one with ``dst``: ``"cuda-ipc"`` (same host, the source's GPU mappable by the destination),
    ``"network"`` (NIXL for GPU pools that both move GPU memory device-direct; NIXL or the
    gRPC stream between host-memory pools), or None when only a path through host memory and
    TCP is left for GPU memory: that pair must not disaggregate."""
    src_gpu, dst_gpu = DEVICE_KEY in src, DEVICE_KEY in dst
    if not src_gpu and not dst_gpu:
        return "network"
    if src_gpu != dst_gpu:
        return None
    if (
        CUDA_IPC_KEY in src
        and src.get(HOST_KEY) == dst.get(HOST_KEY)
        and src[DEVICE_KEY] in dst.get(VISIBLE_KEY, "").split(",")
    ):
        return "cuda-ipc"
    if src.get(NIXL_GPU_KEY) == "1" and dst.get(NIXL_GPU_KEY) == "1":
        return "network"
    return None


def agent_name(worker_id: str, incarnation: str) -> str:
    """NIXL agent name of one incarnation of a worker."""
    return f"{worker_id}@{incarnation}"


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """The copy as ``(src_start, dst_start, count)`` runs: maximal stretches where both the
    source and the destination blocks are consecutive, so each run is one contiguous range on
    both sides (one descriptor, one memcpy)."""
    if len(src) != len(dst):
        raise ValueError("src and dst differ in length")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class PeerDirectory(Protocol):
    """Finds the live NIXL agent of a worker incarnation (the etcd member record in services)."""

    async def agent_info(
        self, worker_id: str, incarnation: str, timeout: float
    ) -> AgentInfo | None:
        """The agent of that incarnation; None when the worker runs without NIXL.

        Raises StalePeerError when another incarnation of the worker is live, KVTransferError
        when the worker is not registered at all (within ``timeout``)."""
        ...


class StaticPeers:
    """A fixed PeerDirectory (benchmarks, tests): worker id -> info of its live agent."""

    def __init__(self, agents: dict[str, AgentInfo] | None = None) -> None:
        self.agents = dict(agents or {})

    async def agent_info(
        self, worker_id: str, incarnation: str, timeout: float
    ) -> AgentInfo | None:
        info = self.agents.get(worker_id)
        if info is None:
            raise KVTransferError(f"worker {worker_id} is not registered")
        if info.name != agent_name(worker_id, incarnation):
            raise StalePeerError(f"{worker_id} now runs {info.name}; the handle is stale")
        return info


class BlockStore(Protocol):
    """The local KV pool as transports see it."""

    region: PoolRegion

    async def read_blocks(self, block_ids: list[int]) -> list[bytes]: ...

    async def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None: ...


class BlockHolder(Protocol):
    """The serving (prefill) side: which blocks a request holds, and releasing them."""

    def held_blocks(self, request_id: str, incarnation: str, block_ids: Sequence[int]) -> None:
        """Raise unless this incarnation holds ``block_ids`` for the request."""
        ...

    def release(self, request_id: str) -> bool: ...


class KVTransport(Protocol):
    """Makes a peer's blocks appear in this worker's pool."""

    name: str  # "nixl-read", "nixl-write" or "grpc": for logs and stats

    async def fetch(
        self,
        request_id: str,
        source: KVSource,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        timeout: float,
    ) -> str:
        """Copy ``src_blocks`` (a subset of ``source.block_ids``) into local ``dst_blocks``;
        returns the name of the path that moved them (a transport may delegate to another).

        Returns only when the data is in place; raises KVTransferError within about
        ``timeout`` seconds otherwise, and then no transfer into ``dst_blocks`` is left running,
        so the caller may free them.
        """
        ...

    async def release(self, request_id: str, source: KVSource) -> None:
        """Tell the peer it may free the request's blocks (best effort; idempotent)."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class CopySums(Protocol):
    """A `KVTransport` whose copy may take each moved block's checksum as it writes it (CUDA
    IPC with the fused copy-and-sum), so that what arrived is checked without reading it
    again (`libkv.transfer.cuda_ipc.CudaIpcTransport.verify`; where the handle carried the
    sender's sums the fetch already compared them, and verify only answers)."""

    async def verify(self, request_id: str, expected: Sequence[int]) -> int | None:
        """How many blocks of ``request_id``'s last fetch differ from ``expected`` (the
        sender's ``wsum64``, in the fetch's order); None when the fetch took no sums or
        ``expected`` is empty (the caller then checks the arrived blocks). Drops the sums."""
        ...


@dataclass(slots=True)
class TransferStats:
    """Counters of one transport (exported in worker stats and benchmarks)."""

    transfers: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failures: int = 0

    def add(self, blocks: int, nbytes: int, seconds: float) -> None:
        self.transfers += 1
        self.blocks += blocks
        self.bytes += nbytes
        self.seconds += seconds
