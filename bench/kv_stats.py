"""Prefix-cache and block-location measurements of a ``tandem bench --stack`` run.

Read from the workers' Stats RPC before and after a run:

- prefix hit rate: prompt tokens served from a prefix cache over all prompt tokens, summed over
  workers (each request counts once: on its prefill worker, or on its decode worker when it
  went decode-only);
- etcd writes of the block locations (one key each: a summary delta or snapshot) per second
  per worker, and the prefix entries they announced or retracted per 1,000 prefilled (computed,
  not cached) tokens.

Compared with what one prefix cache shared by every worker would hit on the same requests in
the same order (``ideal_hit_rate``): unbounded, and an LRU of the workers' combined KV blocks.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from libkv.hashing import hash_prefix_blocks

STATS_TIMEOUT_S = 30.0  # a worker's Stats answer; a CPU worker busy prefilling can be slow


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """The Stats counters of one worker that a run's difference is taken of."""

    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    location_txns: int = 0
    location_puts: int = 0
    location_deletes: int = 0
    kv_blocks_total: int = 0


def snapshot(addresses: dict[str, str]) -> dict[str, WorkerCounters]:
    """Stats of every worker (name -> gRPC address; names start with its role)."""
    import grpc
    from tandem.v1 import common_pb2, worker_pb2_grpc

    async def query() -> dict[str, WorkerCounters]:
        out = {}
        for name, address in addresses.items():
            async with grpc.aio.insecure_channel(address) as ch:
                cls = worker_pb2_grpc.PrefillStub if name.startswith("prefill") else (
                    worker_pb2_grpc.DecodeStub
                )  # fmt: skip
                s = await cls(ch).Stats(common_pb2.StatsRequest(), timeout=STATS_TIMEOUT_S)
            out[name] = WorkerCounters(
                s.prompt_tokens, s.prefix_hit_tokens, s.location_txns, s.location_puts,
                s.location_deletes, s.kv_blocks_total,
            )  # fmt: skip
        return out

    return asyncio.run(query())


@dataclass(frozen=True, slots=True)
class CacheReport:
    """Prefix-cache and block-location figures of one run on a local stack."""

    workers: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    ideal_hit_rate: float  # one unbounded cache shared by all workers
    ideal_pooled_hit_rate: float  # one LRU cache of the workers' combined KV blocks
    location_txns: int  # etcd writes (one key each)
    location_entries: int  # prefix entries announced + retracted
    writes_per_s_per_worker: float  # etcd writes
    prefilled_tokens_per_s_per_worker: float
    entries_per_1k_prefilled: float


def cache_report(
    before: dict[str, WorkerCounters],
    after: dict[str, WorkerCounters],
    duration: float,
    ideal: tuple[float, float],
) -> CacheReport:
    """The differences between two snapshots of the same workers over ``duration`` seconds."""
    names = [n for n in after if n in before]

    def total(field: str) -> int:
        return sum(getattr(after[n], field) - getattr(before[n], field) for n in names)

    prompt, hit = total("prompt_tokens"), total("prefix_hit_tokens")
    entries = total("location_puts") + total("location_deletes")
    txns = total("location_txns")
    prefilled = prompt - hit
    n = max(len(names), 1)
    return CacheReport(
        workers=len(names),
        prompt_tokens=prompt,
        hit_tokens=hit,
        hit_rate=hit / prompt if prompt else float("nan"),
        ideal_hit_rate=ideal[0],
        ideal_pooled_hit_rate=ideal[1],
        location_txns=txns,
        location_entries=entries,
        writes_per_s_per_worker=txns / duration / n if duration > 0 else float("nan"),
        prefilled_tokens_per_s_per_worker=prefilled / duration / n if duration > 0 else 0.0,
        entries_per_1k_prefilled=1000 * entries / prefilled if prefilled else float("nan"),
    )


def ideal_hit_rate(
    prompts: Sequence[Sequence[int]], block_size: int = 16, capacity: int | None = None
) -> float:
    """Hit rate of one prefix cache shared by everyone, over ``prompts`` in order: each prompt
    hits its longest cached prefix of full blocks (at most all but its last token, which is
    always computed), then caches all its full blocks. ``capacity``: LRU limit in blocks."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hit = total = 0
    for ids in prompts:
        chain = hash_prefix_blocks(ids, block_size)
        depth = 0
        while depth < len(chain) and chain[depth] in cache:
            depth += 1
        hit += min(depth * block_size, len(ids) - 1)
        total += len(ids)
        for h in chain:
            cache[h] = None
            cache.move_to_end(h)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total if total else float("nan")


def render_cache_table(rows: Sequence[tuple[str, str, CacheReport]]) -> str:
    """Markdown table: one row per (endpoint, workload)."""
    lines = [
        "| endpoint | workload | prefix hit rate | vs one shared cache (unbounded / pooled) "
        "| location etcd writes/s/worker | prefilled tok/s/worker "
        "| entries changed per 1k prefilled tok | etcd writes |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for endpoint, workload, c in rows:
        unbounded = c.hit_rate / c.ideal_hit_rate if c.ideal_hit_rate else float("nan")
        pooled = c.hit_rate / c.ideal_pooled_hit_rate if c.ideal_pooled_hit_rate else float("nan")
        lines.append(
            f"| {endpoint} | {workload} | {c.hit_rate:.1%} | {unbounded:.0%} / {pooled:.0%} "
            f"(ideal {c.ideal_hit_rate:.1%} / {c.ideal_pooled_hit_rate:.1%}) "
            f"| {c.writes_per_s_per_worker:.2f} | {c.prefilled_tokens_per_s_per_worker:.0f} "
            f"| {c.entries_per_1k_prefilled:.1f} | {c.location_txns} |"
        )
    return "\n".join(lines)


def prompts_in_order(workload, records, model_dir: str, api: str) -> list[list[int]]:
    """Token ids of the requests as the gateway builds them (chat template for the chat API),
    in the order the run sent them."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    specs = {spec.request_id: spec for spec in workload.requests}
    out = []
    for rec in sorted(records, key=lambda r: r.start):
        spec = specs[rec.request_id]
        if api == "chat":
            out.append(tok.encode_chat([{"role": m.role, "content": m.content}
                                        for m in spec.messages]))  # fmt: skip
        else:
            out.append(tok.encode(spec.prompt))
    return out


def cache_report_of(
    before: dict[str, WorkerCounters],
    after: dict[str, WorkerCounters],
    prompts: list[list[int]],
    duration: float,
) -> CacheReport:
    """The `CacheReport` of two snapshots, with the ideals of ``prompts``."""
    pooled = sum(c.kv_blocks_total for c in after.values())
    ideal = (ideal_hit_rate(prompts), ideal_hit_rate(prompts, capacity=pooled or None))
    return cache_report(before, after, duration, ideal)
