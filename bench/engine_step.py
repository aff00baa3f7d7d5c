"""Engine step time at one decode batch: synchronous steps against async scheduling, in-process.

    python -m engine.shapes llama-3.1-8b --out /tmp/m8b
    python -m bench.engine_step --model /tmp/m8b --out bench/results/engine_step_h200.json

For each mode (``async_scheduling`` off, then on) an ``LLMEngine`` is built on the folder with
dummy weights (CUDA graphs as served, unless ``--enforce-eager``); ``--batch`` greedy requests
of ``--prompt-tokens`` seeded token ids are added and prefilled; then ``--warmup`` decode steps
run untimed and ``--steps`` are timed (wall time around each ``step()`` call: with async
scheduling a call launches one step and reads the one before, so the mean is the time per
step of the pipeline); then the requests run to the end. Prints a table and writes JSON to
``--out``; exits 1 unless both modes produced the same greedy tokens. ``--dry-run``: the
SmolLM2 shape on the CPU, tiny, to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_common import parse_bench_args, table
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.shapes import write_shape

SEED = 1234
MODES = {"sync": False, "async": True}


def _engine(args: argparse.Namespace, overlap: bool) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(args.model),
            load_format="dummy",
            device=args.device,
            async_scheduling=overlap,
            max_num_seqs=args.batch,
            max_model_len=args.prompt_tokens + args.warmup + args.steps + args.tail + 16,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
        )
    )


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    """Seeded ids the bundled tokenizer knows (every shape's vocabulary holds them)."""
    rng = random.Random(SEED)
    return [
        [rng.randrange(1000, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.batch)
    ]


def run_mode(args: argparse.Namespace, overlap: bool) -> tuple[dict, dict[str, list[int]]]:
    """Timings of one mode and every request's greedy tokens."""
    engine = _engine(args, overlap)
    new = args.warmup + args.steps + args.tail
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i, prompt in enumerate(_prompts(args)):
        engine.add_request(f"r{i}", prompt, params)
    finals: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids

    sched = engine.scheduler
    while sched.waiting or any(s.is_prefilling for s in sched.running):
        step()
    for _ in range(args.warmup):
        step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    ms = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        ms.append((time.perf_counter() - t0) * 1e3)
    while engine.has_unfinished():
        step()
    engine.check_integrity()
    mean = statistics.fmean(ms)
    row = {
        "mode": "async" if overlap else "sync",
        "ms_per_step_mean": mean,
        "ms_per_step_median": statistics.median(ms),
        "ms_per_step_p90": sorted(ms)[int(0.9 * (len(ms) - 1))],
        "tokens_per_s": args.batch / (mean / 1e3),
        "overlapped_steps": engine.stepper.overlapped_steps,
        "graphed": engine.runner.graphs is not None,
    }
    engine.close()
    return row, finals


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.engine_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, help="model folder (default: the Llama-3.1-8B shape)")
    p.add_argument("--batch", type=int, default=64, help="decoding sequences")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=16, help="decode steps before timing")
    p.add_argument("--steps", type=int, default=128, help="decode steps timed")
    p.add_argument("--tail", type=int, default=8, help="decode steps after the timed ones")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--out", type=Path, default=Path("bench/results/engine_step.json"))
    args = parse_bench_args(p, "bench.engine_step", argv)
    tmp = None
    if args.dry_run:
        args.device, args.batch, args.prompt_tokens = "cpu", 4, 24
        args.warmup, args.steps, args.tail = 2, 6, 2
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        shape = "smollm2-135m" if args.dry_run else "llama-3.1-8b"
        args.model = write_shape(shape, Path(tmp.name) / shape)
    rows, tokens = [], {}
    for name, overlap in MODES.items():
        row, tokens[name] = run_mode(args, overlap)
        rows.append(row)
        gc.collect()  # the engine of this mode, before the next one plans its memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    equal = tokens["sync"] == tokens["async"] and len(tokens["sync"]) == args.batch
    speedup = rows[0]["ms_per_step_mean"] / rows[1]["ms_per_step_mean"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    cols = ["mode", "ms_per_step_mean", "ms_per_step_median", "ms_per_step_p90",
            "tokens_per_s", "overlapped_steps", "graphed"]  # fmt: skip
    print(f"{device}, {args.model.name}, batch {args.batch}, prompt {args.prompt_tokens} tokens")
    print(table(rows, cols))
    print(f"async / sync step time: {1 / speedup:.3f} ({speedup:.3f}x faster); "
          f"greedy tokens equal: {equal}")  # fmt: skip
    result = {
        "date": args.date,
        "command": args.command,
        "device": device,
        "model": str(args.model),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "steps": args.steps,
        "modes": rows,
        "speedup": speedup,
        "greedy_tokens_equal": equal,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
