"""The worker options that ``tandem serve`` and ``tandem bench --stack`` pass through to the
workers they start (placement, memory, batching, dtype, weights), declared once for both."""

from __future__ import annotations

import argparse
from typing import Any

from services.launcher.placement import parse_gpus


def add_worker_options(p: argparse.ArgumentParser) -> None:
    """Flags for the workers of a local stack (`services.launcher.StackConfig` fields)."""
    g = p.add_argument_group("workers of the local stack")
    g.add_argument(
        "--gpus",
        default="auto",
        metavar="auto|none|I,J,...",
        help="GPUs to place workers on, one per worker (shared when there are fewer GPUs than "
        "workers), set through each worker's CUDA_VISIBLE_DEVICES; auto: every GPU of this "
        "host (none on a CPU host)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="each worker's share of its GPU's total memory (default: 0.9 split evenly among "
        "the workers sharing a GPU)",
    )
    for role in ("prefill", "decode"):
        g.add_argument(
            f"--{role}-tp",
            type=int,
            default=None,
            metavar="N",
            help=f"tensor-parallel size of each {role} worker (its --tensor-parallel-size; "
            "one GPU per rank; default 1)"
            + ("; colocated workers are decode workers" if role == "decode" else ""),
        )
    g.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="each worker's KV pool (MiB; default on CPU: one sequence of the model's context, "
        "128 MiB to 2 GiB, the context capped past that; on GPUs: what the memory share leaves)",
    )
    g.add_argument("--num-kv-blocks", type=int, default=None, help="each worker's KV pool")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per engine step, the prefill chunk (default: 256 on CPU, the workers' "
        "default of 512 on GPUs)",
    )
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences per batch")
    g.add_argument("--max-model-len", type=int, default=None, help="longest sequence in tokens")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None)
    g.add_argument(
        "--load-format",
        choices=("safetensors", "dummy"),
        default=None,
        help="dummy: random weights of the model folder's shapes (python -m engine.shapes)",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) every worker loads at start, vLLM's syntax; requests "
        "name an adapter as their model",
    )
    g.add_argument("--max-loras", type=int, default=None, help="LoRA adapters in one batch")
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="the gateway serves /v1/load_lora_adapter and /v1/unload_lora_adapter, and the "
        "workers reserve LoRA slots for them",
    )
    g.add_argument("--max-lora-rank", type=int, default=None, help="highest LoRA rank accepted")
    g.add_argument(
        "--worker-nice",
        type=int,
        default=None,
        metavar="N",
        help="run the workers N steps below the other processes' CPU priority (default 10; 0: "
        "the same), so the gateway and router answer at once while the workers' compute fills "
        "the cores",
    )
    g.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="FLAG[=VALUE]",
        help="any other worker flag, passed as is (repeatable), e.g. --worker-arg=--nixl-mode=read",
    )


def worker_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """`StackConfig` fields from the flags of `add_worker_options` (only those given)."""
    try:
        gpus = parse_gpus(args.gpus)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    out: dict[str, Any] = {"gpus": gpus}
    if args.gpu_memory_utilization is not None:
        out["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.kv_cache_mib is not None:
        out["kv_cache_bytes"] = args.kv_cache_mib * 1024**2
    if args.max_num_batched_tokens is not None:
        out["max_num_batched_tokens"] = args.max_num_batched_tokens
    elif gpus:
        out["max_num_batched_tokens"] = None  # the workers' default
    for name in ("prefill_tp", "decode_tp"):
        size = getattr(args, name)
        if size is not None and size < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, not {size}")
    if args.worker_nice is not None and not 0 <= args.worker_nice <= 19:
        raise SystemExit(f"error: --worker-nice must be in [0, 19], not {args.worker_nice}")
    for name in ("num_kv_blocks", "max_num_seqs", "max_model_len", "prefill_tp", "decode_tp",
                 "worker_nice"):  # fmt: skip
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    for name in ("dtype", "load_format"):
        if getattr(args, name):
            out[name] = getattr(args, name)
    passed = list(args.worker_arg)
    passed += [f"--lora-modules={m}" for m in args.lora_modules]
    if args.allow_runtime_lora_updating:
        passed.append("--enable-lora")
        out["gateway_args"] = ("--allow-runtime-lora-updating",)
    for flag, value in (("--max-loras", args.max_loras), ("--max-lora-rank", args.max_lora_rank)):
        if value is not None:
            passed.append(f"{flag}={value}")
    if passed:
        out["worker_args"] = tuple(passed)
    return out
