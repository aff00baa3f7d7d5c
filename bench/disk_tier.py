"""The disk KV tier (issue 40, item 4), in-process on one device, one command:

    python -m bench.disk_tier --out bench/results/disk_tier_h200.json

1. **Disk page-in bandwidth**: ``--bw-blocks`` blocks of the model's KV layout written to a
   disk tier file (``engine.disk_store``) and read back into the device pool through pinned
   staging memory, warm (the file's pages in the page cache, as right after a demotion) and
   cold (written back and dropped from the page cache first: ``posix_fadvise(DONTNEED)``),
   against one pinned host-to-device copy of the same bytes in the same run.
2. **Multi-turn TTFT** (``bench.host_tier``'s conversations), the working set larger than the
   GPU pool plus the host tier: the GPU pool alone (``none``), with a host tier of
   ``--host-gib`` (``host``), with the host tier and a disk tier of ``--disk-gib`` in
   ``--disk-dir`` (``host_disk``), and the same with the disk file's pages dropped from the
   page cache every ``--cold-interval`` seconds (``host_disk_cold``: reads from the device,
   not RAM). TTFT p50/p90, prefix hit rate, blocks served per tier.

Every engine uses dummy weights of ``--model`` (default: the Llama-3.1-8B shape). Prints a
table and writes JSON. ``--dry-run``: the SmolLM2 shape on the CPU, tiny (checks the script).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
from pathlib import Path

import torch

from bench.gpu_common import parse_bench_args, table
from bench.host_tier import _free, _timed, multi_turn
from engine import EngineConfig, LLMEngine
from engine.disk_store import DiskStore
from engine.host_store import HostStore
from engine.shapes import write_shape


def _drop_cache(fd: int) -> None:
    """Write the file's dirty pages back, then drop its pages from the page cache."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def disk_bandwidth(args, engine: LLMEngine) -> dict:
    """Disk page-in bandwidth, warm and cold, against a pinned copy of the same bytes."""
    pool = engine.runner.kv_pool
    n, device = args.bw_blocks, pool.device
    src = torch.empty((n, *pool.shape[1:]), dtype=pool.dtype, device=device)
    host = HostStore(src, n)  # host slots shaped like the pool's blocks
    host.disk = disk = DiskStore(args.disk_dir, 0, n, host.host, src)
    nbytes = n * pool[0].numel() * pool.element_size()
    slots = list(range(n))
    host.copy(slots, slots, [], [])  # fill the host slots, then demote them all
    host.copy([], [], [], [], (), slots, slots)
    host.synchronize()
    order = slots[:]
    random.Random(0).shuffle(order)
    fd = disk._w.fd
    warm = _timed(lambda: disk.load(slots, slots), device, args.iters)
    warm_scattered = _timed(lambda: disk.load(order, slots), device, args.iters)
    cold = _timed(lambda: (_drop_cache(fd), disk.load(slots, slots)), device, args.iters)
    drop = _timed(lambda: _drop_cache(fd), device, args.iters)  # its own cost, taken off
    ref_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    ref_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = _timed(lambda: ref_dst.copy_(ref_src, non_blocking=True), device, args.iters)
    disk.close()
    gbs = lambda s: nbytes / max(s, 1e-9) / 1e9  # noqa: E731
    return {
        "blocks": n, "bytes": nbytes, "block_bytes": nbytes // n,
        "disk_in_warm_gbs": gbs(warm), "disk_in_warm_scattered_gbs": gbs(warm_scattered),
        "disk_in_cold_gbs": gbs(cold - drop), "pinned_copy_gbs": gbs(pinned),
        "warm_vs_pinned": pinned / warm, "cold_vs_pinned": pinned / max(cold - drop, 1e-9),
    }  # fmt: skip


class _Cold:
    """Drops the disk tier file's pages from the page cache every ``interval`` seconds."""

    def __init__(self, engine: LLMEngine, interval: float) -> None:
        store = engine.runner.host_store
        assert store is not None and store.disk is not None
        self.fd, self.interval = store.disk._w.fd, interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            _drop_cache(self.fd)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def build(args, host_gib: float, disk_gib: float) -> LLMEngine:
    disk = dict(kv_disk_cache_dir=args.disk_dir, kv_disk_cache_gib=disk_gib) if disk_gib else {}
    return LLMEngine(EngineConfig(
        model_dir=str(args.model), load_format="dummy", device=args.device,
        num_kv_blocks=args.pool_blocks, kv_host_cache_gib=host_gib,
        max_num_seqs=args.concurrency, max_num_batched_tokens=args.max_num_batched_tokens,
        # A conversation's whole history, not the config's 128k: the pool must hold one.
        max_model_len=args.turns * (args.user_tokens + args.answer_tokens) + 256,
        kv_swap_min_tokens=args.swap_min_tokens, **disk,
    ))  # fmt: skip


def run_mode(args, name: str, host_gib: float, disk_gib: float) -> tuple[dict, dict | None]:
    engine = build(args, host_gib, disk_gib)
    cold = _Cold(engine, args.cold_interval) if name.endswith("cold") else None
    try:
        out = multi_turn(args, engine)
    finally:
        if cold is not None:
            cold.close()
    stats = engine.stats()
    d = stats.disk_tier
    out["disk_hit_blocks"] = d.hit_blocks if d else 0
    out["disk_read_bytes"] = d.page_in_blocks * d.block_bytes if d else 0
    out["disk_write_bytes"] = d.page_out_blocks * d.block_bytes if d else 0
    out["disk_read_s"] = d.page_in_seconds if d else 0.0
    bw = disk_bandwidth(args, engine) if name == "host_disk" else None
    engine.close()
    del engine
    _free()
    return out, bw


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m bench.disk_tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, help="model folder (default: the Llama-3.1-8B shape)")
    p.add_argument("--device", default="auto")
    p.add_argument("--disk-dir", help="the disk tier's directory (default: a temporary one)")
    p.add_argument("--bw-blocks", type=int, default=1024, help="blocks read per load")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=512)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=2048, help="the GPU KV pool, in blocks")
    p.add_argument("--host-gib", type=float, default=6.0, help="the host tier when on")
    p.add_argument("--disk-gib", type=float, default=32.0, help="the disk tier when on")
    p.add_argument("--cold-interval", type=float, default=0.25)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--swap-min-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("bench/results/disk_tier.json"))
    args = parse_bench_args(p, "bench.disk_tier", argv)
    if args.dry_run:
        args.device, args.bw_blocks, args.iters = "cpu", 8, 2
        args.conversations, args.turns, args.user_tokens, args.answer_tokens = 6, 2, 40, 2
        args.concurrency, args.pool_blocks, args.host_gib, args.disk_gib = 2, 12, 0.002, 0.02
        args.max_num_batched_tokens, args.swap_min_tokens = 128, 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tmp = tempfile.TemporaryDirectory()
    if args.model is None:
        shape = "smollm2-135m" if args.dry_run else "llama-3.1-8b"
        args.model = write_shape(shape, Path(tmp.name) / shape)
    args.disk_dir = args.disk_dir or os.path.join(tmp.name, "kv-disk")
    final = args.user_tokens * args.turns + args.answer_tokens * (args.turns - 1)
    working_set = args.conversations * -(-final // 16)
    runs, bw = {}, None
    for name, host_gib, disk_gib in (("none", 0.0, 0.0), ("host", args.host_gib, 0.0),
                                     ("host_disk", args.host_gib, args.disk_gib),
                                     ("host_disk_cold", args.host_gib, args.disk_gib)):  # fmt: skip
        runs[name], got = run_mode(args, name, host_gib, disk_gib)
        bw = got or bw
    assert bw is not None
    n, h, d = runs["none"], runs["host"], runs["host_disk"]
    summary = {
        "working_set_blocks": working_set, "working_set_x_pool": working_set / args.pool_blocks,
        "ttft_p50_host_vs_none": n["ttft_p50_s"] / h["ttft_p50_s"],
        "ttft_p50_host_disk_vs_host": h["ttft_p50_s"] / d["ttft_p50_s"],
        "ttft_p50_cold_vs_host": h["ttft_p50_s"] / runs["host_disk_cold"]["ttft_p50_s"],
        "disk_in_cold_vs_pinned": bw["cold_vs_pinned"],
    }  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(table([{"mode": k, **v} for k, v in runs.items()],
                ["mode", "requests", "ttft_p50_s", "ttft_p90_s", "hit_rate", "host_hit_blocks",
                 "disk_hit_blocks", "disk_read_bytes", "disk_write_bytes"]))  # fmt: skip
    print(table([bw], list(bw)))
    print(table([summary], list(summary)))
    report = {"command": args.command, "date": args.date, "device": device, "summary": summary,
              "multi_turn": runs, "bandwidth": bw}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
