"""What a local stack is made of (``StackConfig``): its processes, their models and placement,
and the options its workers get; frozen, and read by the launcher's other modules
(``kv_budget`` fits it, ``options`` builds it from flags, ``stack`` starts it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.common.models import parse_models
from services.launcher.etcd import EtcdTLS
from services.launcher.placement import Placement, place

# Launcher policy. A CPU step's time grows with its tokens, and the decodes batched with a
# prefill chunk wait for it: on a CPU stack the chunk is smaller than the workers' default.
CPU_MAX_NUM_BATCHED_TOKENS = 256
# Workers run this many nice steps below the other processes once they serve, so the gateway
# and routers still get a core at once (bench/results/overload_cpu.md).
DEFAULT_WORKER_NICE = 10

# The decode-only threshold of a colocated stack: longer than any prompt, so every request goes
# decode-only (the router also falls back to decode-only when no prefill worker is live).
COLOCATED_THRESHOLD = 1 << 30


@dataclass(frozen=True, slots=True)
class StackConfig:
    model_dir: str
    run_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    prefill_tp: int = 1  # --tensor-parallel-size of each prefill worker
    decode_tp: int = 1  # and of each decode worker (colocated workers too)
    # Worker options (None / "": the worker's own default). kv_cache_bytes None: on a CPU
    # stack, a pool that holds the model's context (`kv_budget`); on GPUs each worker sizes
    # its pool from its memory share. The default chunk is the CPU's (`tandem serve` passes
    # None, the workers' own, on GPUs).
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_num_batched_tokens: int | None = CPU_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    dtype: str = ""
    load_format: str = ""
    # GPUs to place workers on (CUDA_VISIBLE_DEVICES entries; launcher.placement); () = none.
    gpus: tuple[str, ...] = ()
    gpu_memory_utilization: float | None = None  # per worker; None: 0.9 split per device
    decode_only_threshold: int = 256
    disagg_mode: str = ""  # the routers' --disagg-mode; empty: their default (slo)
    # Workers switch roles at run time (--switchable) as the first router's planner says
    # (--balance-roles).
    switch_roles: bool = False
    api_keys: tuple[str, ...] = ()
    member_ttl: int = 10
    member_refresh: float = 3.0
    lease_seconds: float = 30.0
    start_timeout: float = 120.0
    kv_transport: str = ""  # "nixl" or "grpc"; empty: the workers' default (nixl if importable)
    metrics: bool = True  # each process serves /metrics on a free port (`Stack.scrape_targets`)
    trace_files: bool = False  # each process appends its spans to run_dir/traces/NAME.jsonl
    num_routers: int = 1  # replicas: "router", "router-1", ...; the gateway spreads over them
    router_policy: str = ""  # --policy of the routers; empty: their default (kv)
    # Extra flags per kind of process (limits, TLS, ...), appended to its command line.
    worker_args: tuple[str, ...] = ()
    # Further base models, DIR or NAME=DIR: each gets num_prefill + num_decode workers of its
    # own (numbered after the first model's), and the routers and gateway serve them all.
    extra_models: tuple[str, ...] = ()
    # LoRA adapters the workers load at start, NAME=PATH or NAME=PATH@MODEL: each adapter by
    # the workers of the one model it fits (`services.launcher.adapters`).
    lora_modules: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    etcd_tls: EtcdTLS | None = None  # serve etcd over TLS (client certificates required)
    # CPU priority of the workers below the other processes once they serve (nice steps; 0:
    # the same): on a host whose cores the workers' compute fills (a CPU stack), the gateway
    # and router still get a core at once to answer, 429s included
    # (bench/results/overload_cpu.md).
    worker_nice: int = DEFAULT_WORKER_NICE

    @classmethod
    def colocated(cls, workers: int, **kwargs) -> StackConfig:
        """``workers`` workers that each do both phases: decode workers prefill their own
        prompts inside their continuous batch, and there is no prefill worker. The baseline
        that disaggregation must beat."""
        return cls(
            num_prefill=0, num_decode=workers, decode_only_threshold=COLOCATED_THRESHOLD, **kwargs
        )

    @property
    def models(self) -> dict[str, str]:
        """Served name -> folder of every base model, the first first."""
        return {Path(self.model_dir).name: self.model_dir, **parse_models(self.extra_models)}

    def worker_models(self) -> dict[str, str]:
        """Worker name -> the served name of its model."""
        out: dict[str, str] = {}
        for k, name in enumerate(self.models):
            out.update(
                {f"prefill-{k * self.num_prefill + i}": name for i in range(self.num_prefill)}
            )
            out.update({f"decode-{k * self.num_decode + i}": name for i in range(self.num_decode)})
        return out

    @property
    def worker_names(self) -> list[str]:
        def order(name: str) -> tuple[bool, int]:
            role, _, index = name.partition("-")
            return role == "decode", int(index)

        return sorted(self.worker_models(), key=order)

    def placements(self) -> dict[str, Placement]:
        sizes = {w: self.tp_of(w.partition("-")[0]) for w in self.worker_names}
        return place(self.worker_names, self.gpus, self.gpu_memory_utilization, sizes)

    def tp_of(self, role: str) -> int:
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def worker_option_args(self) -> list[str]:
        """The engine flags every worker of this stack gets."""
        options = [
            ("--kv-cache-bytes", self.kv_cache_bytes),
            ("--num-kv-blocks", self.num_kv_blocks),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-model-len", self.max_model_len),
            ("--dtype", self.dtype or None),
            ("--load-format", self.load_format or None),
        ]
        return [a for flag, v in options if v is not None for a in (flag, str(v))]

    @property
    def topology(self) -> str:
        """``colocated:N`` or ``disagg:XpYd``."""
        if self.num_prefill == 0 and self.decode_only_threshold >= COLOCATED_THRESHOLD:
            return f"colocated:{self.num_decode}"
        return f"disagg:{self.num_prefill}p{self.num_decode}d"
