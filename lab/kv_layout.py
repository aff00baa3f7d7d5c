"""Block-major against layer-major KV pools, side by side in one run: what each costs a KV
transfer (descriptors per block, NIXL READ bandwidth between two processes) and attention
(the engine's paged attention and KV write over the same blocks).

- block-major ``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`` (the engine's):
  one block of all layers is one contiguous range, one transfer descriptor;
- layer-major ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (one tensor per
  layer and K/V, as in vLLM's per-layer caches): a block is ``2 * num_layers`` ranges.

Within one (block, layer, K|V) both layouts hold the same contiguous ``block_size * kv_heads *
head_dim`` rows, so attention reads the same runs of memory; only the stride between blocks of
a layer differs.

    python -m lab.kv_layout [--device cpu|cuda] [--model-shape smollm2|llama8b]

Prints a markdown table; writes ``kv_layout_<device>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import kernels
from bench import kv_peer
from bench.kv_transfer import Source, command, machine_name
from libkv.transfer import AgentInfo, StaticPeers
from libkv.transfer.nixl import NixlTransport
from libkv.transfer.nixl_agent import NixlEndpoint

SHAPES = {  # layers, q heads, kv heads, head dim
    "smollm2": (30, 9, 3, 64),
    "llama8b": (32, 32, 8, 128),
}


def caches(num_blocks: int, layers: int, hkv: int, d: int, bs: int, dtype, device):
    block_major = torch.zeros(num_blocks, layers, 2, bs, hkv, d, dtype=dtype, device=device)
    layer_major = torch.zeros(layers, 2, num_blocks, bs, hkv, d, dtype=dtype, device=device)
    return {"block-major": block_major, "layer-major": layer_major.permute(2, 0, 1, 3, 4, 5)}


def metadata(batch: int, ctx: int, q_len: int, bs: int, device) -> kernels.AttentionMetadata:
    per_seq = -(-ctx // bs)
    rng = np.random.default_rng(0)
    tables = torch.tensor(rng.permutation(batch * per_seq).reshape(batch, per_seq), device=device)
    pos = torch.arange(ctx - q_len, ctx, device=device).repeat(batch)
    rows = torch.arange(batch, device=device).repeat_interleave(q_len)
    return kernels.AttentionMetadata(
        slot_blocks=tables[rows, pos // bs],
        slot_offsets=pos % bs,
        block_tables=tables,
        seq_lens=torch.full((batch,), ctx, device=device),
        query_start_loc=torch.arange(0, batch * q_len + 1, q_len, device=device),
        max_query_len=q_len,
        max_seq_len=ctx,
        block_size=bs,
    )


def attention_ms(cache, shape, meta, reps: int) -> float:
    layers, h, hkv, d = shape
    t = int(meta.query_start_loc[-1])
    q = torch.randn(t, h, d, dtype=cache.dtype, device=cache.device)
    k = torch.randn(t, hkv, d, dtype=cache.dtype, device=cache.device)
    times = []
    for _ in range(reps + 1):
        if cache.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(layers):
            kernels.write_kv(cache, layer, k, k, meta)
            kernels.paged_attention(q, cache, layer, meta, d**-0.5)
        if cache.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


async def transfer_gbps(block_bytes: int, descs_per_block: int, blocks: int, total: int) -> float:
    """NIXL READ of ``blocks`` scattered blocks, each ``descs_per_block`` descriptors."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=kv_peer.serve, args=(child, "cpu", total), daemon=True)
    proc.start()
    conn.recv()
    chunk = block_bytes // descs_per_block
    conn.send(("setup", chunk))
    info = AgentInfo.from_json(conn.recv())
    pool = torch.ones(total, dtype=torch.uint8)
    endpoint = await NixlEndpoint.start(f"layout-{descs_per_block}", kv_peer.region(pool, chunk))
    transport = NixlTransport(endpoint, StaticPeers({"peer": info}), "read")
    num_blocks = total // block_bytes
    rng = np.random.default_rng(1)
    best = float("inf")
    for rep in range(4):
        src = rng.choice(num_blocks, blocks, replace=False)
        dst = rng.choice(num_blocks, blocks, replace=False)
        # Descriptor j of block b sits at chunk j * num_blocks + b (layer-major) or at
        # b * descs + j (block-major, where descs == 1).
        j = np.arange(descs_per_block)
        s_idx = (j[None, :] * num_blocks + src[:, None]).reshape(-1).tolist()
        d_idx = (j[None, :] * num_blocks + dst[:, None]).reshape(-1).tolist()
        t0 = time.perf_counter()
        await transport.fetch(f"r{rep}", Source("peer", f"bs{chunk}", "", chunk), s_idx, d_idx, 120)
        if rep:
            best = min(best, time.perf_counter() - t0)
    await transport.close()
    conn.send(("stop",))
    conn.recv()
    proc.join(10)
    return blocks * block_bytes / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.kv_layout", description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model-shape", choices=tuple(SHAPES), default="smollm2")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--skip-transfer", action="store_true", help="attention only")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    shape, bs = SHAPES[args.model_shape], args.block_size
    layers, _, hkv, d = shape
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    block_bytes = layers * 2 * bs * hkv * d * dtype.itemsize
    cases = {"decode b16 ctx1024": (16, 1024, 1), "prefill 512": (1, 512, 512)}
    pools = caches(16 * 64 + 8, layers, hkv, d, bs, dtype, args.device)
    metas = {name: metadata(b, ctx, q, bs, args.device) for name, (b, ctx, q) in cases.items()}
    for cache in pools.values():  # warm-up: first touches, allocator, thread pool
        for meta in metas.values():
            attention_ms(cache, shape, meta, 1)
    rows = [
        {"layout": name, "descriptors_per_block": 1 if name == "block-major" else 2 * layers}
        for name in pools
    ]
    for case, meta in metas.items():  # interleaved, so drifts of a shared host hit both
        samples: dict[str, list[float]] = {name: [] for name in pools}
        for _ in range(args.reps):
            for name, cache in pools.items():
                samples[name].append(attention_ms(cache, shape, meta, 1))
        for row in rows:
            row[f"{case} ms"] = statistics.median(samples[row["layout"]])
    del pools
    total = min(512 * 1024**2, 1024 * block_bytes)
    for row in rows:
        if not args.skip_transfer:
            row["NIXL READ GB/s"] = asyncio.run(
                transfer_gbps(block_bytes, row["descriptors_per_block"], 64, total)
            )
        print(row, flush=True)
    cols = list(rows[0])
    md = [
        f"# KV pool layout ({args.device}, {args.model_shape} shape, block of {bs} tokens = "
        f"{block_bytes // 1024} KiB, {str(dtype).removeprefix('torch.')})",
        "",
        f"- machine: {machine_name(args.device)}",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- command: `{command().replace('kv_transfer', 'kv_layout')}`",
        "- attention: write_kv + paged_attention over all layers (engine kernels), median of "
        f"{args.reps}, layouts interleaved; "
        + (
            "transfer not measured (--skip-transfer; see kv_transfer_*.md)"
            if args.skip_transfer
            else "NIXL READ: 64 scattered blocks between two processes, best of 3"
        ),
        "",
        "| " + " | ".join(cols) + " |",
        "|---" * len(cols) + "|",
        *(
            "| "
            + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols)
            + " |"
            for r in rows
        ),  # fmt: skip
        "",
    ]
    text = "\n".join(md)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kv_layout_{args.device}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
