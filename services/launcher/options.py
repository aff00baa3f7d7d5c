"""The worker options that ``tandem serve`` and ``tandem bench --stack`` pass through to the
workers they start (placement, memory, batching, dtype, weights), declared once for both.

The engine knobs among them are not declared here: each flag takes its name, help, values and
default from the knob's one declaration (``engine.config.ENGINE_KNOBS``), as the workers' own
flags do. A flag left out leaves the workers' default, which ``--help`` shows, except where the
launcher has a policy of its own: those are named below and shown in ``--help`` too.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from services.common.engine_options import engine_spec
from services.launcher.adapters import SYNTAX
from services.launcher.kv_budget import CPU_KV_CACHE_MAX_BYTES, CPU_KV_CACHE_MIN_BYTES
from services.launcher.placement import DEFAULT_UTILIZATION, parse_gpus
from services.launcher.stack_config import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_WORKER_NICE,
    StackConfig,
)

# The engine knobs passed to every worker as given, in --help order.
PASSED_KNOBS = (
    "gpu_memory_utilization", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs",
    "max_model_len", "mixed_graph_max_tokens", "decode_spread_graphs", "dtype", "load_format",
    "kv_cache_dtype", "attention_backend", "quantization", "quantize_lm_head",
    "speculative_config", "async_scheduling", "late_planning", "max_loras", "max_lora_rank",
    "kv_host_cache_gib", "kv_swap_min_tokens", "kv_disk_cache_dir", "kv_disk_cache_gib",
)  # fmt: skip
# The engine knobs the launcher sets another way, and the flags that do it.
OWN_KNOBS = {
    "device": "--gpus",  # each worker's CUDA_VISIBLE_DEVICES, its own GPU first
    "tensor_parallel_size": "--prefill-tp, --decode-tp",  # one size per role
    "kv_cache_bytes": "--kv-cache-mib",  # on CPU sized to hold the context (kv_budget)
    "enable_lora": "--lora-modules, --allow-runtime-lora-updating",
    # The CPU pool sizing (kv_budget) counts in blocks of the workers' default size: another
    # size goes through --worker-arg=--block-size=N, knowingly.
    "block_size": "--worker-arg",
}
# What the launcher gives a knob when its flag is left out, where that is not the workers' own
# default (shown in --help after the default).
POLICY = {
    "gpu_memory_utilization": f"a GPU shared by N workers gives each {DEFAULT_UTILIZATION} / N",
    "max_num_batched_tokens": f"on CPU {CPU_MAX_NUM_BATCHED_TOKENS} (the launcher's "
    "CPU_MAX_NUM_BATCHED_TOKENS)",
    "max_model_len": "on CPU, capped to what a worker's KV pool holds",
}


def knob_help(name: str) -> str:
    """The launcher flag's help for engine knob ``name``: the declaration's, with the workers'
    default and the launcher's policy where it has one."""
    spec = engine_spec(name)
    notes = [n for n in (spec.shown_default, POLICY.get(name, "")) if n]
    return f"{spec.option.help} [{'; '.join(notes)}]" if notes else spec.option.help


def _add_knob(g: argparse._ArgumentGroup, name: str) -> None:
    spec = engine_spec(name)
    kw: dict[str, Any] = {"dest": name, "default": None, "help": knob_help(name)}
    if spec.kind == "bool":
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw.update(type=spec.read, metavar=spec.metavar)
    g.add_argument(spec.flag, **kw)


def add_worker_options(p: argparse.ArgumentParser) -> None:
    """Flags for the workers of a local stack (`services.launcher.StackConfig` fields, or flags
    passed to every worker)."""
    g = p.add_argument_group("workers of the local stack")
    g.add_argument(
        "--gpus",
        default="auto",
        metavar="auto|none|I,J,...",
        help="GPUs to place workers on, one per worker (shared when there are fewer GPUs than "
        "workers), set through each worker's CUDA_VISIBLE_DEVICES; auto: every GPU of this "
        "host (none on a CPU host)",
    )
    tp = engine_spec("tensor_parallel_size")
    for role in ("prefill", "decode"):
        g.add_argument(
            f"--{role}-tp",
            type=int,
            default=None,
            metavar="N",
            help=f"tensor-parallel size of each {role} worker (its --tensor-parallel-size; "
            f"one GPU per rank; {tp.shown_default})"
            + ("; colocated workers are decode workers" if role == "decode" else ""),
        )
    g.add_argument(
        "--kv-cache-mib",
        type=int,
        default=None,
        help="each worker's KV pool in MiB (its --kv-cache-bytes; default on CPU: one sequence "
        f"of the model's context, {CPU_KV_CACHE_MIN_BYTES // 1024**2} MiB to "
        f"{CPU_KV_CACHE_MAX_BYTES // 1024**3} GiB, the context capped past that; on GPUs: what "
        "the memory share leaves)",
    )
    for name in PASSED_KNOBS:
        _add_knob(g, name)
    g.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=[],
        metavar=SYNTAX,
        help="LoRA adapters (PEFT folders) the workers load at start, vLLM's syntax; requests "
        "name an adapter as their model. With several --model, each adapter is loaded by the "
        "workers of the model its weights fit, and listed under it; among models of one shape "
        "its base_model_name_or_path picks the one it names, else @MODEL must",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="the gateway serves /v1/load_lora_adapter and /v1/unload_lora_adapter, and the "
        "workers reserve LoRA slots for them",
    )
    g.add_argument(
        "--worker-nice",
        type=int,
        default=None,
        metavar="N",
        help="run the workers N steps below the other processes' CPU priority (default "
        f"{DEFAULT_WORKER_NICE}; 0: the same), so the gateway and router answer at once while "
        "the workers' compute fills the cores",
    )
    g.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="FLAG[=VALUE]",
        help="any other worker flag, passed as is (repeatable), e.g. --worker-arg=--nixl-mode=read",
    )


def worker_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """`StackConfig` fields from the flags of `add_worker_options` (only those given); engine
    knobs that are not StackConfig fields go to every worker in ``worker_args``."""
    try:
        gpus = parse_gpus(args.gpus)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    out: dict[str, Any] = {"gpus": gpus}
    if args.kv_cache_mib is not None:
        out["kv_cache_bytes"] = args.kv_cache_mib * 1024**2
    if args.max_num_batched_tokens is None and gpus:
        out["max_num_batched_tokens"] = None  # the workers' default
    for name in ("prefill_tp", "decode_tp"):
        size = getattr(args, name)
        if size is not None and size < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, not {size}")
    if args.worker_nice is not None and not 0 <= args.worker_nice <= 19:
        raise SystemExit(f"error: --worker-nice must be in [0, 19], not {args.worker_nice}")
    for name in ("prefill_tp", "decode_tp", "worker_nice"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    held = {f.name for f in dataclasses.fields(StackConfig)}
    passed = list(args.worker_arg)
    for name in PASSED_KNOBS:
        value = getattr(args, name)
        if value is None:
            continue
        if name in held:
            out[name] = value
        else:
            passed.append(_flag_arg(name, value))
    if args.lora_modules:
        out["lora_modules"] = tuple(args.lora_modules)
    if args.allow_runtime_lora_updating:
        passed.append("--enable-lora")
        out["gateway_args"] = ("--allow-runtime-lora-updating",)
    if passed:
        out["worker_args"] = tuple(passed)
    return out


def _flag_arg(name: str, value: Any) -> str:
    """The worker flag setting knob ``name`` to ``value`` (checked as the worker checks it)."""
    spec = engine_spec(name)
    if spec.kind == "bool":
        return spec.flag if value else "--no-" + spec.flag[2:]
    if spec.option.convert is not None:
        try:
            spec.option.convert(value)
        except ValueError as e:
            raise SystemExit(f"error: {spec.flag}: {e}") from e
    return f"{spec.flag}={value}"
