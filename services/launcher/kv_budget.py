"""A CPU stack's KV pools, sized so that every process agrees on the context they serve.

On a GPU a worker refuses to start when its pool cannot hold one sequence of its context
(`engine.memory.plan_cuda`, as vLLM does), so what the gateway advertises always fits. On the
CPU the stack gave each worker 128 MiB whatever the model, which held 2,912 tokens of SmolLM2
against its 8,192-token context: a request that left out ``max_tokens`` (the gateway's default,
up to 4,096) was refused with a 400 about KV blocks, and `/v1/models` advertised a context no
worker could hold.

Here a CPU stack with no pool size given gets pools that hold one sequence of the model's
context (at least 128 MiB, at most 2 GiB a worker). Where a pool cannot (one given, or the
2 GiB bound), the stack's ``max_model_len`` is capped to what it holds, for the workers and the
gateway alike. The sizes are worked out from the model folders alone (no torch): float32 unless
``dtype`` says otherwise, every KV head on each rank, plus a draft model's KV where
``--speculative-config`` names one; a pool that holds more than that (bf16 or FP8 KV, tensor
parallel ranks) only makes the estimate safe.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from engine.config import EngineConfig, ModelConfig
from engine.errors import UnsupportedModelError

if TYPE_CHECKING:
    from services.launcher.stack_config import StackConfig

CPU_KV_CACHE_MIN_BYTES = 128 * 1024**2  # a CPU worker's pool at least, when none is given
CPU_KV_CACHE_MAX_BYTES = 2 * 1024**3  # and at most (then the context is capped)
BLOCK_SIZE = EngineConfig.__dataclass_fields__["block_size"].default  # the workers' default
# A model folder that cannot be read: its workers refuse it with the reason; sized without it.
UNREADABLE = (UnsupportedModelError, OSError, ValueError, KeyError)


def token_bytes(model_dir: str, dtype: str) -> int:
    """KV bytes of one token of the model in ``model_dir`` (float32 on the CPU unless
    ``dtype`` is a 16-bit one)."""
    c = ModelConfig.from_dir(model_dir)
    element = 2 if dtype in ("bfloat16", "float16") else 4
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * element


def draft_dir(worker_args: tuple[str, ...]) -> str | None:
    """The draft model's folder that ``--speculative-config`` names among ``worker_args``."""
    for i, arg in enumerate(worker_args):
        if arg.startswith("--speculative-config"):
            text = arg.partition("=")[2] or (worker_args[i + 1] if i + 1 < len(worker_args) else "")
            try:
                spec = json.loads(text)
            except ValueError:
                return None  # the worker refuses it with a clear error
            model = spec.get("model") if isinstance(spec, dict) else None
            return model if isinstance(model, str) and model else None
    return None


def fit_cpu_pools(config: StackConfig) -> tuple[StackConfig, str]:
    """``config`` with its workers' KV pool size and its ``max_model_len`` set as the module
    says (unchanged on GPUs), and a line saying what was chosen ("" when nothing was)."""
    if config.gpus:
        return config, ""
    try:
        draft = draft_dir(config.worker_args)
        extra = token_bytes(draft, config.dtype) if draft else 0
    except UNREADABLE:
        extra = 0  # the worker refuses the draft's folder with the reason
    need: dict[str, tuple[int, int]] = {}  # model -> (its context, KV bytes of a token)
    for name, folder in config.models.items():
        try:
            context = ModelConfig.from_dir(folder).max_position_embeddings
            tb = token_bytes(folder, config.dtype) + extra
        except UNREADABLE:
            continue  # its workers refuse the folder, saying why
        if config.max_model_len:
            context = min(context, config.max_model_len)
        need[name] = (context, tb)
    pool = config.kv_cache_bytes
    chosen = pool is None and config.num_kv_blocks is None
    if chosen:
        sizes = [(-(-ctx // BLOCK_SIZE) + 1) * BLOCK_SIZE * tb for ctx, tb in need.values()]
        pool = min(max([*sizes, CPU_KV_CACHE_MIN_BYTES]), CPU_KV_CACHE_MAX_BYTES)
    held: dict[str, int] = {}
    for name, (_, tb) in need.items():
        blocks = config.num_kv_blocks or (pool or 0) // (BLOCK_SIZE * tb)
        held[name] = max(blocks - 1, 0) * BLOCK_SIZE  # one block spare, as on a GPU
    short = {n: held[n] for n, (ctx, _) in need.items() if held[n] < ctx}
    cap = min(short.values()) if short else config.max_model_len
    if cap is not None and cap < BLOCK_SIZE:
        raise SystemExit(
            f"error: each worker's KV pool holds {cap} tokens of {', '.join(short)}: give the "
            "workers a larger pool (--kv-cache-mib / --num-kv-blocks)"
        )
    fitted = dataclasses.replace(
        config, kv_cache_bytes=pool if chosen else config.kv_cache_bytes, max_model_len=cap
    )
    parts = []
    if chosen and pool is not None:
        parts.append(f"each worker's KV pool: {pool / 1024**2:.0f} MiB (CPU)")
    if short:
        models = ", ".join(f"{n} ({need[n][0]} tokens)" for n in short)
        parts.append(
            f"context capped to {cap} tokens: a worker's pool cannot hold one sequence of "
            f"{models} (--kv-cache-mib or --max-model-len to choose)"
        )
    return fitted, "; ".join(parts)
