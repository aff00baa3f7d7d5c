"""The host KV tier's targets (issue 40), in-process on one device, one command:

    python -m bench.host_tier --out bench/results/host_tier_h200.json

1. **Page-in bandwidth**: ``--bw-blocks`` blocks of the model's KV layout paged in from the
   host tier (``HostStore.copy``), scattered (one DMA per block) and contiguous (one DMA),
   against one pinned host-to-device copy of the same bytes in the same run.
2. **Multi-turn TTFT**: ``--conversations`` conversations of ``--turns`` turns (each turn the
   whole history plus ``--user-tokens`` new tokens, answered with ``--answer-tokens``), at most
   ``--concurrency`` in flight, on a GPU pool of ``--pool-blocks`` blocks (the working set is
   about ``working_set_x`` times it), three ways: the GPU pool alone, with a host tier holding
   the working set, and an unbounded GPU pool (the hit-rate ceiling). TTFT p50/p90 and prefix
   hit rates; targets: TTFT p50 >= 2x better with the tier, hit rate >= 90% of unbounded.
3. **Decode TPOT with pages moving**: ``--batch`` sequences decoding; step times with the tier
   quiet, then with ``--busy-blocks`` page-outs issued every step (the side stream busy).
   Target: busy / quiet TPOT p50 <= 1.05.

Every engine uses dummy weights of ``--model`` (default: the Llama-3.1-8B shape) and greedy
sampling. Prints a table and writes JSON. ``--dry-run``: the SmolLM2 shape on the CPU, tiny
(checks the script; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_common import parse_bench_args, table
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.host_store import HostStore
from engine.shapes import write_shape


def _timed(fn, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn`` (synchronized around each call)."""
    times = []
    for i in range(iters + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first call warms up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(args, engine: LLMEngine) -> dict:
    """Page-in bandwidth of the host tier against a pinned copy of the same bytes."""
    pool = engine.runner.kv_pool  # its block shape and dtype; the copies go elsewhere
    n = args.bw_blocks
    device = pool.device
    store = HostStore(torch.empty((n, *pool.shape[1:]), dtype=pool.dtype, device=device), n)
    nbytes = n * pool[0].numel() * pool.element_size()
    order = list(range(n))
    random.Random(0).shuffle(order)
    ref_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    ref_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def reference() -> None:
        ref_dst.copy_(ref_src, non_blocking=True)

    scattered = _timed(lambda: store.copy([], [], order, list(range(n))), device, args.iters)
    contiguous = _timed(lambda: store.copy([], [], list(range(n)), list(range(n))), device,
                        args.iters)  # fmt: skip
    pinned = _timed(reference, device, args.iters)
    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    return {
        "blocks": n, "bytes": nbytes, "block_bytes": nbytes // n,
        "page_in_scattered_gbs": gbs(scattered), "page_in_contiguous_gbs": gbs(contiguous),
        "pinned_copy_gbs": gbs(pinned), "scattered_vs_pinned": pinned / scattered,
        "contiguous_vs_pinned": pinned / contiguous,
    }  # fmt: skip


def conversations(args) -> list[list[int]]:
    """Each conversation's first user message (seeded token ids)."""
    rng = random.Random(1)
    return [[rng.randrange(100, 30000) for _ in range(args.user_tokens)]
            for _ in range(args.conversations)]  # fmt: skip


def multi_turn(args, engine: LLMEngine) -> dict:
    """Run the conversations to the end; TTFT and TPOT per turn, prefix hit rate."""
    rng = random.Random(2)
    params = SamplingParams(max_tokens=args.answer_tokens, temperature=0, ignore_eos=True)
    history = conversations(args)
    turn = [0] * len(history)
    waiting = list(range(len(history)))
    live: dict[str, tuple[int, float, list[float]]] = {}  # rid -> (conv, sent, token times)
    ttft, tpot = [], []
    before = engine.stats()
    t0 = time.perf_counter()
    while waiting or live:
        while waiting and len(live) < args.concurrency:
            c = waiting.pop(0)
            rid = f"c{c}t{turn[c]}"
            engine.add_request(rid, history[c], params)
            live[rid] = (c, time.perf_counter(), [])
        for out in engine.step():
            c, sent, times = live[out.request_id]
            now = time.perf_counter()
            times.extend([now] * (len(out.token_ids) - len(times)))
            if not out.finished:
                continue
            del live[out.request_id]
            ttft.append(times[0] - sent)
            if len(times) > 1:
                tpot.append((times[-1] - times[0]) / (len(times) - 1))
            turn[c] += 1
            if turn[c] < args.turns:
                history[c] = (
                    history[c]
                    + out.token_ids
                    + [rng.randrange(100, 30000) for _ in range(args.user_tokens)]
                )
                waiting.append(c)
    after = engine.stats()
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens
    prompt = after.prompt_tokens - before.prompt_tokens
    tier = after.tier
    return {
        "requests": len(ttft), "seconds": time.perf_counter() - t0,
        "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": _pct(ttft, 0.9),
        "tpot_p50_s": statistics.median(tpot) if tpot else 0.0,
        "hit_rate": hits / max(prompt, 1), "preemptions": after.num_preemptions,
        "host_hit_blocks": tier.hit_blocks if tier else 0,
        "page_in_bytes": tier.page_in_blocks * tier.block_bytes if tier else 0,
        "page_out_bytes": tier.page_out_blocks * tier.block_bytes if tier else 0,
        "swaps": tier.swaps if tier else 0,
    }  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def decode_tpot(args, engine: LLMEngine) -> dict:
    """Decode step times of ``--batch`` sequences, the tier quiet, then busy with page-outs."""
    max_tokens = 2 * args.steps + 8  # decoding through both timed phases
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, p in enumerate(conversations(args)[: args.batch]):
        engine.add_request(f"d{i}", p, params)
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    store = engine.runner.host_store
    assert store is not None, "decode_tpot needs a host tier"
    busy = min(args.busy_blocks, store.num_slots, engine.pool.num_blocks)
    # Free blocks (those a page-out reads after the step that cached them), into slots the
    # decoding sequences no longer need.
    blocks = [b.block_id for b in engine.pool.blocks if b.ref_cnt == 0][:busy]
    slots = list(range(len(blocks)))

    def steps(page: bool) -> list[float]:
        out = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            if page:  # what write-through issues after a step: a batch of page-outs
                store.copy(blocks, slots, [], [])
            engine.step()
            out.append(time.perf_counter() - t0)
        return out

    quiet, loaded = steps(False), steps(True)
    store.synchronize()
    while engine.has_unfinished():  # the rest of their tokens (some may have finished)
        engine.step()
    return {
        "batch": args.batch, "busy_blocks_per_step": busy,
        "tpot_quiet_p50_s": statistics.median(quiet), "tpot_busy_p50_s": statistics.median(loaded),
        "busy_vs_quiet": statistics.median(loaded) / statistics.median(quiet),
    }  # fmt: skip


def build(args, num_blocks: int, host_gib: float, seqs: int = 0) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model_dir=str(args.model), load_format="dummy", device=args.device,
        num_kv_blocks=num_blocks, kv_host_cache_gib=host_gib,
        max_num_seqs=seqs or args.concurrency,
        max_model_len=args.turns * (args.user_tokens + args.answer_tokens) + args.steps + 256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_swap_min_tokens=args.swap_min_tokens,
    ))  # fmt: skip


def _free() -> None:
    """Free a dropped engine's memory before the next one plans its pool."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", type=Path, help="model folder (default: the Llama-3.1-8B shape)")
    p.add_argument("--device", default="auto")
    p.add_argument("--bw-blocks", type=int, default=512, help="blocks paged in per copy")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=512)
    p.add_argument("--answer-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=4096, help="the GPU KV pool, in blocks")
    p.add_argument("--host-gib", type=float, default=64.0, help="the host tier when on")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--swap-min-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="decoding sequences (TPOT)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per mode")
    p.add_argument("--busy-blocks", type=int, default=16, help="page-outs per busy step")
    p.add_argument("--out", type=Path, default=Path("bench/results/host_tier.json"))
    args = parse_bench_args(p, "bench.host_tier", argv)
    tmp = tempfile.TemporaryDirectory()
    if args.dry_run:
        args.device, args.bw_blocks, args.iters = "cpu", 8, 2
        args.conversations, args.turns, args.user_tokens, args.answer_tokens = 4, 2, 40, 2
        args.concurrency, args.pool_blocks, args.host_gib = 2, 12, 0.05
        args.max_num_batched_tokens, args.swap_min_tokens = 128, 16
        args.batch, args.steps, args.busy_blocks = 2, 2, 4
    if args.model is None:
        shape = "smollm2-135m" if args.dry_run else "llama-3.1-8b"
        args.model = write_shape(shape, Path(tmp.name) / shape)
    final = args.user_tokens * args.turns + args.answer_tokens * (args.turns - 1)
    working_set = args.conversations * -(-final // 16)
    runs = {}
    for name, blocks, gib in (
        ("gpu", args.pool_blocks, 0.0),
        ("host_tier", args.pool_blocks, args.host_gib),
        ("unbounded", max(working_set + 64, args.pool_blocks), 0.0),
    ):
        engine = build(args, blocks, gib)
        runs[name] = multi_turn(args, engine)
        if name == "host_tier":
            bw = bandwidth(args, engine)
        engine.close()
        del engine
        _free()
    engine = build(args, args.pool_blocks, args.host_gib, seqs=args.batch)
    tpot = decode_tpot(args, engine)
    engine.close()
    del engine
    _free()
    g, h, u = runs["gpu"], runs["host_tier"], runs["unbounded"]
    summary = {
        "working_set_x": working_set / args.pool_blocks,
        "ttft_p50_speedup": g["ttft_p50_s"] / h["ttft_p50_s"],
        "hit_rate_vs_unbounded": h["hit_rate"] / max(u["hit_rate"], 1e-9),
        "page_in_vs_pinned": bw["scattered_vs_pinned"], "tpot_busy_vs_quiet": tpot["busy_vs_quiet"],
    }  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(table([{"mode": k, **v} for k, v in runs.items()],
                ["mode", "requests", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "hit_rate",
                 "host_hit_blocks", "swaps", "preemptions"]))  # fmt: skip
    print(table([bw], list(bw)))
    print(table([tpot], list(tpot)))
    print(table([summary], list(summary)))
    report = {"command": args.command, "date": args.date, "device": device, "summary": summary,
              "multi_turn": runs, "bandwidth": bw, "decode": tpot}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
