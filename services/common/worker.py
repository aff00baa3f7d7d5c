"""What prefill and decode workers share: their frozen config (flags with environment
fallbacks), engine construction, etcd registration and the run-until-signal loop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from engine import EngineConfig, LLMEngine
from engine.async_engine import AsyncEngine
from engine.errors import InsufficientMemoryError
from libkv.registry import Member, MemberLoad, Registration
from libkv.summary_publisher import SummaryConfig
from services.common.admission import add_admission_flags
from services.common.grpc_server import GrpcServerHandle
from services.common.kv_setup import (
    NIXL_MODES,
    TRANSPORTS,
    confine_kv_network,
    default_transport,
)
from services.common.obs_config import (
    ObservabilityConfig,
    add_observability_flags,
    observability_config,
)
from services.common.presence import Presence, add_location_flags, location_config
from services.common.security import Security, add_security_flags, security_from_args
from services.common.tracing import install_log_context

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process's configuration, parsed once in ``__main__``."""

    role: str
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""
    worker_id: str = ""
    etcd: tuple[str, ...] = ()
    served_model_name: str = ""
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: the engine's default (CPU) or memory share (GPU)
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    lease_seconds: float = 30.0
    member_ttl: int = 10
    member_refresh: float = 3.0
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "safetensors"
    kv_transport: str = "grpc"  # "nixl" or "grpc" (see services.common.kv_setup)
    nixl_mode: str = "auto"  # decode: "read" (pull), "write" (prefill pushes) or per host kind
    on_transfer_failure: str = "recompute"  # decode: "recompute" locally or "retry" (router)
    kv_transfer_timeout: float = 10.0
    cuda_ipc: bool = True  # GPU pools: hand KV to/from peers on this host over CUDA IPC
    drain_timeout: float = 30.0  # on SIGTERM: most seconds to finish the work in flight
    locations: SummaryConfig = SummaryConfig()  # block locations published to etcd
    observability: ObservabilityConfig = ObservabilityConfig()
    security: Security = Security()  # mutual TLS between services, TLS/auth to etcd
    max_pending_tokens: int = 0  # admission bound in tokens; 0: twice the KV pool's tokens
    batch_admission_fraction: float = 0.5  # batch requests only up to this part of the bound

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name

    @property
    def bind(self) -> str:
        return f"{self.host}:{self.port}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_dir=self.model_dir,
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes,
            num_kv_blocks=self.num_kv_blocks,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            device=self.device,
            dtype=self.dtype,
            load_format=self.load_format,
        )


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"TANDEM_{name}", default)


def _env_int(name: str) -> int | None:
    value = _env(name)
    return int(value) if value else None


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """Flags of both worker roles; each falls back to a TANDEM_* environment variable."""
    p.add_argument("--model-dir", default=_env("MODEL_DIR"), required=_env("MODEL_DIR") is None)
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(_env("PORT", "0") or 0))
    p.add_argument("--advertise-host", default=_env("ADVERTISE_HOST", ""))
    p.add_argument("--worker-id", default=_env("WORKER_ID", ""))
    p.add_argument("--etcd", default=_env("ETCD_ENDPOINTS", ""), help="host:port[,host:port]")
    p.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME", ""))
    p.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16") or 16))
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=_env_int("KV_CACHE_BYTES"),
        help="KV pool size in bytes (default: 512 MiB on CPU; on CUDA what "
        "--gpu-memory-utilization leaves after weights, activations and CUDA graphs)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=_env_int("NUM_KV_BLOCKS"),
        help="KV pool size in blocks (overrides --kv-cache-bytes)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(_env("GPU_MEMORY_UTILIZATION", "0.9") or 0.9),
        help="CUDA: share of the device's total memory this worker may use for weights, "
        "activations, CUDA graphs and KV (workers sharing a device each take their own share)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=_env_int("MAX_MODEL_LEN"),
        help="longest sequence (prompt + output) in tokens (default: the model's context)",
    )
    p.add_argument("--max-num-seqs", type=int, default=int(_env("MAX_NUM_SEQS", "64") or 64))
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=int(_env("MAX_BATCHED_TOKENS", "512"))
    )
    p.add_argument("--lease-seconds", type=float, default=float(_env("KV_LEASE_SECONDS", "30")))
    p.add_argument("--member-ttl", type=int, default=int(_env("MEMBER_TTL", "10") or 10))
    p.add_argument("--member-refresh", type=float, default=float(_env("MEMBER_REFRESH", "3")))
    p.add_argument(
        "--device",
        default=_env("DEVICE", "auto"),
        help="cpu, cuda or cuda:N (auto: cuda when available); `tandem serve --gpus` places "
        "each worker through CUDA_VISIBLE_DEVICES instead",
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default=_env("DTYPE", "auto"),
        help="weights and KV (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--load-format",
        choices=("safetensors", "dummy"),
        default=_env("LOAD_FORMAT", "safetensors"),
        help="safetensors: the folder's weights; dummy: seeded random weights of the folder's "
        "config.json shapes (benchmarks without downloads: python -m engine.shapes)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=float(_env("DRAIN_TIMEOUT", "30") or 30),
        help="on SIGTERM: most seconds to finish the work in flight (decode: running streams; "
        "prefill: prefills and the hand-off of their KV blocks) before exiting",
    )
    add_kv_transfer_flags(p)
    add_location_flags(p)
    add_observability_flags(p)
    add_admission_flags(p)
    add_security_flags(p)


def pending_limit(config: WorkerConfig, engine: LLMEngine) -> int:
    """The admission bound in tokens (``--max-pending-tokens``, default twice the pool)."""
    return config.max_pending_tokens or 2 * engine.pool.num_blocks * config.block_size


def add_kv_transfer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kv-transport",
        choices=TRANSPORTS,
        default=_env("KV_TRANSPORT", default_transport()),
        help="how KV blocks move between workers (default: nixl when importable)",
    )
    p.add_argument(
        "--nixl-mode",
        choices=NIXL_MODES,
        default=_env("NIXL_MODE", "auto"),
        help="decode: READ (pull) or WRITE (prefill pushes); auto picks per host kind",
    )
    p.add_argument(
        "--on-transfer-failure",
        choices=("recompute", "retry"),
        default=_env("ON_TRANSFER_FAILURE", "recompute"),
        help="decode, when obtaining the KV fails: prefill the prompt locally, or fail so "
        "the router retries on another prefill worker",
    )
    p.add_argument(
        "--kv-transfer-timeout", type=float, default=float(_env("KV_TRANSFER_TIMEOUT", "10"))
    )
    p.add_argument(
        "--cuda-ipc",
        action=argparse.BooleanOptionalAction,
        default=_env("CUDA_IPC", "1") not in ("0", "false", "no"),
        help="GPU pools: move KV between workers of this host by CUDA IPC and device copies "
        "(prefill exports its pool, decode maps it); --no-cuda-ipc leaves only NIXL",
    )


def worker_config(role: str, args: argparse.Namespace) -> WorkerConfig:
    return WorkerConfig(
        role=role,
        model_dir=os.path.expanduser(args.model_dir),
        host=args.host,
        port=args.port,
        advertise_host=args.advertise_host,
        worker_id=args.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
        etcd=tuple(e for e in args.etcd.split(",") if e),
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        lease_seconds=args.lease_seconds,
        member_ttl=args.member_ttl,
        member_refresh=args.member_refresh,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        kv_transport=args.kv_transport,
        nixl_mode=args.nixl_mode,
        on_transfer_failure=args.on_transfer_failure,
        kv_transfer_timeout=args.kv_transfer_timeout,
        cuda_ipc=args.cuda_ipc,
        drain_timeout=args.drain_timeout,
        locations=location_config(args),
        observability=observability_config(args),
        max_pending_tokens=args.max_pending_tokens,
        batch_admission_fraction=args.batch_admission_fraction,
        security=_security(args),
    )


def _security(args: argparse.Namespace) -> Security:
    try:
        return security_from_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e


def start_engine(config: WorkerConfig) -> AsyncEngine:
    confine_kv_network(config.host, os.environ)  # before any NIXL/UCX agent exists
    try:
        llm_engine = LLMEngine(config.engine_config())
    except InsufficientMemoryError as e:  # the numbers, not a traceback
        log.error("cannot start: %s", e)
        raise SystemExit(f"error: {e}") from e
    engine = AsyncEngine(llm_engine)
    engine.start()
    return engine


async def register(
    config: WorkerConfig,
    address: str,
    engine: LLMEngine,
    incarnation: str,
    extra: dict[str, str] | None = None,
) -> Presence | None:
    """Register this worker in etcd and publish its cached prefixes under the same lease
    (None when no etcd is configured)."""
    if not config.etcd:
        return None

    def load() -> MemberLoad:
        s = engine.stats()
        return MemberLoad(
            queue_length=s.num_waiting,
            running=s.num_running,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_free=s.kv_blocks_total - s.kv_blocks_used,
        )

    member = Member(
        worker_id=config.worker_id,
        role=config.role,
        model=config.model_name,
        address=address,
        kv_blocks_total=engine.pool.num_blocks,
        block_size=config.block_size,
        incarnation=incarnation,
        extra=dict(extra or {}),
    )
    registration = await Registration.start(
        list(config.etcd),
        member,
        ttl=config.member_ttl,
        refresh=config.member_refresh,
        load_fn=load,
    )
    return Presence.start(list(config.etcd), registration, engine, config.locations)


async def drain(
    server: GrpcServerHandle,
    registration: Registration | None,
    busy: Callable[[], int],
    timeout: float,
) -> int:
    """Graceful termination before the server stops, once admission is closed: readiness
    turns NOT_SERVING, the etcd record is marked draining (routers send nothing new; the record
    stays, so a prefill worker's KV blocks are still found and pulled), then wait up to
    ``timeout`` seconds for ``busy()`` (work in flight) to reach 0. Returns what is left."""
    await server.set_serving(False)
    if registration is not None:
        await registration.drain()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while busy() and loop.time() < deadline:
        await asyncio.sleep(0.05)
    left = busy()
    if left:
        log.warning("drain timed out after %.0f s with %d still in flight", timeout, left)
    return left


def advertised(config: WorkerConfig, port: int) -> str:
    return f"{config.advertise_host or config.host}:{port}"


async def run_until_signal(cleanup: Callable[[], Awaitable[None]]) -> None:
    """Block until SIGINT/SIGTERM, then run ``cleanup``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await cleanup()


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=os.environ.get("TANDEM_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    install_log_context(name)  # lines carry the request id and trace id
