"""One mixed step (a decode batch beside a prompt chunk), eager against piecewise CUDA graphs
(``engine.mixed_graphs``), on a model shape with dummy weights, in-process.

    SHAPE=llama-3.1-8b bash bench/device/run.sh bench bench.mixed_step \\
        --model /tmp/models/llama-3.1-8b --out "$OUT/mixed_step.json"

A ``ModelRunner`` is built as a worker builds it (decode and mixed graphs captured; no warm-up
passes: each case's first untimed repeats compile what it needs). Each case is ``D`` decode
rows (sequences of ``--context`` tokens) plus one prompt chunk of ``T - D`` tokens over a cached
prefix of ``P`` tokens (every case pads to a bucket). First the check: the graphed step's
logits against the eager step's (relative error, argmax agreement), and against the same
pieces run eagerly on the same padded rows (about equal: the graphs' own error). Then per
mode, ``--repeats`` timed runs of ``ModelRunner._forward`` (inputs up, forward pass, LM head
on the sample rows), medians of:

- ``wall_ms``: host time from the call to the step's end on the device (synchronized before
  and after): what a step costs when nothing else overlaps it;
- ``gpu_ms``: CUDA events around the step queued behind a ~25 ms device sleep, so the host has
  launched everything before the device starts it: the device's own time, launch gaps hidden;
- ``host_ms``: the call's own host time in that run (the launches).

Prints a markdown table and writes JSON to ``--out``; exits 1 when a check fails.
``--dry-run``: the SmolLM2 shape on the CPU (the pieces run eagerly there), tiny.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.gpu_common import parse_bench_args, table
from engine.config import EngineConfig, ModelConfig
from engine.mixed_graphs import MixedGraphs, mixed_graph_sizes
from engine.model_runner import ModelRunner, StepPlan
from engine.shapes import write_shape

# (decode rows, total tokens): each pads to a bucket (64, 128, 256, 512) as real steps do
CASES = ((8, 60), (32, 120), (64, 250), (8, 500), (64, 500))
PREFIXES = (0, 2048)
SLEEP_CYCLES = 50_000_000  # about 25 ms at an H200's clock
# bf16 rounding of other kernels at the bucket's row count stays far below; a wrong row ~1
MAX_REL_ERR = 0.1


def build(args: argparse.Namespace) -> ModelRunner:
    blocks = 64 * -(-args.context // 16) + 2 * -(-(max(PREFIXES) + 512) // 16) + 16
    config = EngineConfig(
        model_dir=str(args.model), load_format="dummy", device=args.device,
        max_num_seqs=64, max_num_batched_tokens=512, num_kv_blocks=blocks,
        max_model_len=max(PREFIXES) + 1024,
    )  # fmt: skip
    runner = ModelRunner(config, ModelConfig.from_dir(args.model), config.max_model_len or 4096)
    if runner.mixed is None:  # off CUDA: the same pieces, eagerly
        sizes = mixed_graph_sizes(config.mixed_graph_sizes, 512, 512)
        runner.mixed = MixedGraphs(runner.model, runner.kv_cache, sizes)
    return runner


def case_plan(decode: int, total: int, prefix: int, context: int, vocab: int) -> StepPlan:
    """``decode`` sequences of ``context`` tokens decoding one each, then a chunk of the rest of
    ``total`` tokens over ``prefix`` cached ones; every sequence in blocks of its own."""
    bs, g = 16, torch.Generator().manual_seed(total + prefix)
    chunk = total - decode
    plan = StepPlan([], [], [], [0], [], [], max(chunk, 1), [])
    first = 0
    for lo, n in [(context - 1, 1)] * decode + [(prefix, chunk)]:
        hi = lo + n
        table = list(range(first, first + -(-hi // bs)))
        first += len(table)
        plan.token_ids += torch.randint(3, vocab, (n,), generator=g).tolist()
        plan.positions += range(lo, hi)
        plan.slots += [table[p // bs] * bs + p % bs for p in range(lo, hi)]
        plan.query_start.append(plan.query_start[-1] + n)
        plan.seq_lens.append(hi)
        plan.block_tables.append(table)
        plan.sample_rows.append(plan.query_start[-1] - 1)
    return plan


def measure(fn: Callable[[], object], repeats: int, cuda: bool) -> dict[str, float]:
    """Medians of wall, device and host time of ``fn`` (see the module's note)."""
    wall, gpu, host = [], [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        if not cuda:
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    out = {"wall_ms": statistics.median(wall)}
    if cuda:
        out |= {"gpu_ms": statistics.median(gpu), "host_ms": statistics.median(host)}
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp(min=1e-12))


def run_case(runner: ModelRunner, mixed: MixedGraphs, plan: StepPlan, args) -> dict:
    """The check, then both modes' timings, for one step."""
    cuda = runner.device.type == "cuda"

    def step(graphs: bool) -> torch.Tensor:
        runner.mixed = mixed if graphs else None
        out = runner._forward(plan)
        assert out is not None
        return out

    want, got = step(False), step(True)
    captured, mixed.captured = mixed.captured, False
    pieces = step(True)  # the same pieces on the same rows, eagerly
    mixed.captured = captured
    row: dict = {
        "rel_err": _rel(got, want),
        "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "rel_err_vs_eager_pieces": _rel(got, pieces),
    }
    for mode, graphs in (("eager", False), ("graphs", True)):
        for _ in range(args.warmup):
            step(graphs)
        for key, value in measure(lambda g=graphs: step(g), args.repeats, cuda).items():
            row[f"{mode}_{key}"] = value
    row["wall_speedup"] = row["eager_wall_ms"] / row["graphs_wall_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.mixed_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, help="model folder (default: the Llama-3.1-8B shape)")
    p.add_argument("--context", type=int, default=512, help="tokens of each decoding sequence")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs per case and mode")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per case and mode")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, default=Path("bench/results/mixed_step.json"))
    args = parse_bench_args(p, "bench.mixed_step", argv)
    tmp = None
    if args.dry_run:
        args.device, args.warmup, args.repeats, args.context = "cpu", 1, 2, 64
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        shape = "smollm2-135m" if args.dry_run else "llama-3.1-8b"
        args.model = write_shape(shape, Path(tmp.name) / shape)
    t0 = time.perf_counter()
    runner = build(args)
    build_s = time.perf_counter() - t0
    mixed = runner.mixed
    assert mixed is not None
    cases = CASES[:2] if args.dry_run else CASES
    rows = []
    for decode, total in cases:
        for prefix in PREFIXES[:1] if args.dry_run else PREFIXES:
            plan = case_plan(decode, total, prefix, args.context, runner.model.config.vocab_size)
            row = {"decode": decode, "tokens": total, "prefix": prefix}
            row |= run_case(runner, mixed, plan, args)
            rows.append(row)
    device = torch.cuda.get_device_name() if runner.device.type == "cuda" else "cpu"
    ok = all(r["rel_err"] < MAX_REL_ERR and r["rel_err_vs_eager_pieces"] < 1e-3 for r in rows)
    cols = ["decode", "tokens", "prefix", "eager_wall_ms", "graphs_wall_ms", "wall_speedup"]
    if runner.device.type == "cuda":
        cols += ["eager_gpu_ms", "graphs_gpu_ms", "eager_host_ms", "graphs_host_ms"]
    cols += ["rel_err", "argmax_agree", "rel_err_vs_eager_pieces"]
    print(f"{device}, {args.model.name}: one mixed step, eager vs piecewise CUDA graphs "
          f"(pool {mixed.pool_bytes / 2**20:.0f} MiB, buckets {mixed.sizes}, "
          f"build {build_s:.1f} s)")  # fmt: skip
    print(table(rows, cols))
    print(f"logits check (rel err < {MAX_REL_ERR}): {'ok' if ok else 'FAILED'}")
    result = {
        "date": args.date, "command": args.command, "device": device, "model": str(args.model),
        "context": args.context, "repeats": args.repeats, "pool_bytes": mixed.pool_bytes,
        "buckets": mixed.sizes, "captured": mixed.captured, "build_s": build_s,
        "cases": rows, "check_ok": ok,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
