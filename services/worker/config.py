"""A worker's frozen config: every option of both worker roles, declared once
(`services.common.options`), parsed once by `parse_config`."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from engine.config import EngineConfig, SpeculativeConfig
from libkv.cluster.summary_publisher import SummaryConfig
from libkv.transfer.setup import NIXL_MODES, TRANSPORTS
from services.common.admission import batch_fraction_option
from services.common.engine_options import engine_option
from services.common.models import parse_lora_modules
from services.common.options import Options, option
from services.common.process import log_level_option
from services.common.security import ETCD_OLD_ENV, Security
from services.observability.config import ObservabilityConfig

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process's configuration; ``role`` is set by the entry point, not a flag."""

    model_dir: str = option("", "model folder", required=True, convert=os.path.expanduser)
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "gRPC port (0: a free one)")
    advertise_host: str = option("", "host routers and peers dial (default: --host)")
    worker_id: str = option("", "id in etcd (default: ROLE-HOSTNAME-RANDOM)")
    etcd: tuple[str, ...] = option((), "etcd endpoints host:port[,...]", old_env=ETCD_OLD_ENV)
    served_model_name: str = option("", "model name (default: the folder's name)")
    log_level: str = log_level_option()
    block_size: int = engine_option("block_size")
    kv_cache_bytes: int | None = engine_option("kv_cache_bytes")
    num_kv_blocks: int | None = engine_option("num_kv_blocks")
    kv_host_cache_gib: float | None = engine_option("kv_host_cache_gib")
    kv_disk_cache_dir: str | None = engine_option("kv_disk_cache_dir")
    kv_disk_cache_gib: float | None = engine_option("kv_disk_cache_gib")
    kv_swap_min_tokens: int = engine_option("kv_swap_min_tokens")
    gpu_memory_utilization: float = engine_option("gpu_memory_utilization")
    max_model_len: int | None = engine_option("max_model_len")
    max_num_seqs: int = engine_option("max_num_seqs")
    max_num_batched_tokens: int = engine_option(
        "max_num_batched_tokens", old_env=("TANDEM_MAX_BATCHED_TOKENS",)
    )
    mixed_graph_max_tokens: int = engine_option("mixed_graph_max_tokens")
    decode_spread_graphs: bool = engine_option("decode_spread_graphs")
    lease_seconds: float = option(
        30.0,
        "prefill: seconds prefilled KV is held for a decode worker",
        old_env=("TANDEM_KV_LEASE_SECONDS", "KV_LEASE_SECONDS"),
    )
    member_ttl: int = option(10, "seconds of the etcd member lease")
    member_refresh: float = option(3.0, "seconds between lease refreshes")
    device: str = engine_option("device")
    dtype: str = engine_option("dtype")
    load_format: str = engine_option("load_format")
    tensor_parallel_size: int = engine_option("tensor_parallel_size")
    kv_transport: str = option(
        "auto",
        "how KV blocks move between workers (auto: nixl when importable, else grpc)",
        choices=TRANSPORTS,
    )
    nixl_mode: str = option(
        "auto",
        "decode: READ (pull) or WRITE (prefill pushes); auto: per host kind",
        choices=NIXL_MODES,
    )
    on_transfer_failure: str = option(
        "recompute",
        "decode, when obtaining the KV fails: prefill the prompt locally, or fail so the router "
        "retries on another prefill worker",
        choices=("recompute", "retry"),
    )
    kv_transfer_timeout: float = option(10.0, "decode: seconds to obtain a request's KV")
    stream_interval: int = option(
        1,
        "decode: stream each request's tokens in messages of this many (its first token and its "
        "last at once), so every hop to the client costs per N tokens; tokens wait up to N-1 "
        "steps (1: a message per step)",
    )
    kv_checksums: bool = option(
        True,
        "prefill: checksum each KV block once when it is full (on the pool's device) and send "
        "the sums with a hand-off; decode: check what arrived and recompute the prompt on a "
        "mismatch",
    )
    kv_fault: str = option(
        "",
        "test only: decode corrupts the first block of every KV transfer (after it arrived; "
        "over CUDA IPC with checksums, in transit: one bit flipped in what the copy reads)",
        choices=("", "corrupt"),
    )
    cuda_ipc: bool = option(
        True,
        "GPU pools: move KV between workers of this host by CUDA IPC and device copies "
        "(prefill exports its pool, decode maps it); --no-cuda-ipc leaves only NIXL",
    )
    drain_timeout: float = option(
        30.0,
        "on SIGTERM: most seconds to finish the work in flight (decode: running streams; "
        "prefill: prefills and the hand-off of their KV blocks) before exiting",
    )
    kv_location_blocks: int = option(
        4,
        "finest routing granularity: every N-th block of the prefix hash chain is published "
        "(plus the last block of every cached prompt); coarsened under load",
    )
    kv_location_interval: float = option(
        1.0,
        "seconds between block-location writes to etcd (one key each: a delta or a snapshot)",
    )
    kv_location_budget: int = option(
        256, "block-location entry changes per second before the granularity is coarsened"
    )
    max_pending_tokens: int = option(
        0,
        "refuse new requests (RESOURCE_EXHAUSTED) once the accepted ones hold this many tokens "
        "(prompt + booked completion tokens: max_tokens, or the gateway's "
        "--default-booked-tokens where max_tokens is omitted; prefill: prompt); "
        "0 = twice the KV pool",
    )
    batch_admission_fraction: float = batch_fraction_option()
    slo_shed_factor: float = option(
        0.0,
        "refuse (RESOURCE_EXHAUSTED: the router tries another worker) a new request whose "
        "objective this worker's measured pace already misses by this factor (decode: step "
        "time vs its TPOT; prefill: queued prompt tokens at the measured rate vs its TTFT); "
        "0: never (services/worker/slo_gate.py)",
    )
    switchable: bool = option(
        False,
        "serve both roles from this one engine and switch between them at run time when told "
        "(the etcd key /tandem/v1/roles/WORKER_ID, written by a router's --balance-roles or "
        "`tandem role`): drain the current role, re-register under the other; the flag's "
        "entry point (tandem prefill / tandem decode) is the role it starts in",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "LoRA adapters to load at start, NAME=PATH of a PEFT folder (vLLM's --lora-modules); "
        "requests name an adapter as their model",
    )
    enable_lora: bool = engine_option("enable_lora")
    max_loras: int = engine_option("max_loras")
    max_lora_rank: int = engine_option("max_lora_rank")
    speculative_config: SpeculativeConfig | None = engine_option("speculative_config")
    kv_cache_dtype: str = engine_option("kv_cache_dtype")
    attention_backend: str = engine_option("attention_backend")
    quantization: str | None = engine_option("quantization")
    quantize_lm_head: bool = engine_option("quantize_lm_head")
    async_scheduling: bool = engine_option("async_scheduling")
    late_planning: bool = engine_option("late_planning")
    observability: ObservabilityConfig = ObservabilityConfig()
    security: Security = Security()  # mutual TLS between services, TLS/auth to etcd
    role: str = ""  # "prefill" or "decode"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name

    @property
    def bind(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def locations(self) -> SummaryConfig:
        """What the block-location publisher writes and how often."""
        return SummaryConfig(
            base=self.kv_location_blocks,
            interval=self.kv_location_interval,
            budget=self.kv_location_budget,
        )

    @property
    def handoff_cuda_ipc(self) -> bool:
        """``--cuda-ipc``; at ``--tensor-parallel-size`` above 1 every rank exports its shard
        (`libkv.transfer.rank_ipc`)."""
        return self.cuda_ipc

    def advertised(self, port: int) -> str:
        """host:port routers and peers dial, once the server is bound to ``port``."""
        return f"{self.advertise_host or self.host}:{port}"

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model_dir=self.model_dir,
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes,
            num_kv_blocks=self.num_kv_blocks,
            kv_host_cache_gib=self.kv_host_cache_gib,
            kv_disk_cache_dir=self.kv_disk_cache_dir,
            kv_disk_cache_gib=self.kv_disk_cache_gib,
            kv_swap_min_tokens=self.kv_swap_min_tokens,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            mixed_graph_max_tokens=self.mixed_graph_max_tokens,
            decode_spread_graphs=self.decode_spread_graphs,
            device=self.device,
            dtype=self.dtype,
            load_format=self.load_format,
            tensor_parallel_size=self.tensor_parallel_size,
            enable_lora=self.enable_lora or bool(self.lora_modules),
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            # Only decode runs drafts: a prefill worker's first token is the model's own, and the
            # decode worker drafts from the whole history after the hand-off.
            speculative_config=None if self.role == "prefill" else self.speculative_config,
            kv_cache_dtype=self.kv_cache_dtype,
            attention_backend=self.attention_backend,
            quantization=self.quantization,
            quantize_lm_head=self.quantize_lm_head,
            # A prefill worker sums each block once, when it is sealed; a hand-off reads them.
            # A switchable worker may become one, and its engine is started once.
            seal_checksums=self.kv_checksums and (self.role == "prefill" or self.switchable),
            async_scheduling=self.async_scheduling,
            late_planning=self.late_planning,
        )


def options(role: str, env: Mapping[str, str] | None = None) -> Options:
    """The command line of a ``role`` worker."""
    return Options(WorkerConfig, f"tandem {role}", f"A {role} worker.", env)


def parse_config(
    role: str, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> WorkerConfig:
    """The frozen config of a ``role`` worker from flags, falling back to TANDEM_* variables."""
    opts = options(role, env)
    config = opts.parse(argv)
    try:
        config.security.check()
        config.locations  # noqa: B018 - validates granularity and interval
        if config.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, not {config.tensor_parallel_size}"
            )
        if config.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, not {config.stream_interval}")
        parse_lora_modules(config.lora_modules)
        if config.max_loras < 1 or config.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be >= 1")
        if config.quantize_lm_head and config.quantization != "fp8":
            raise ValueError("--quantize-lm-head needs --quantization fp8")
        if config.slo_shed_factor < 0:
            raise ValueError("--slo-shed-factor must be >= 0")
        if config.switchable and config.speculative_config is not None:
            # A prefill worker's first token is the model's own; drafting is decode's alone.
            raise ValueError("--switchable does not go with --speculative-config")
    except ValueError as e:
        opts.error(str(e))
    worker_id = config.worker_id or f"{role}-{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return replace(config, role=role, worker_id=worker_id)
