"""Where a step's GPU time goes at long context: decode steps and mixed steps, in-process.

    python -m bench.step_profile --out bench/results/step_profile_h200.json

An ``LLMEngine`` on the Llama-3.1-8B shape (dummy weights, as served: CUDA graphs, async
scheduling, the attention backend the device picks) prefills ``--batch`` requests of
``--context`` seeded tokens, decodes them ``--warmup`` steps, then profiles (``torch.profiler``,
CUDA activity):

- ``decode``: the decode batch alone;
- ``mixed``: the same batch while one ``--prompt``-token request prefills beside it in chunks of
  ``--max-num-batched-tokens`` (every measured step is a chunk plus the decodes).

Each phase times up to ``--steps`` steps unprofiled (wall time per step, the pipeline's pace),
then profiles up to ``--steps`` more: GPU kernel time per step by kind (matrix products,
attention, the rest), the top kernels and the operators that launched the most GPU time. Kernels
launched early under programmatic dependent launch count their wait, so the kinds can sum past
the wall time. The kinds come from the kernels' names, so they are a
guide: a fused kernel counts where its name puts it. ``--dry-run``: a tiny CPU run of the script.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench.gpu_common import parse_bench_args, table
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.shapes import write_shape

SEED = 1234
KINDS = (
    ("attention", re.compile(r"flash|attn|attention|fmha", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|skinny|linear|sm90", re.I)),
)


def kind_of(name: str) -> str:
    """The kind of a kernel by its name: ``attention``, ``matmul`` or ``other``."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


def _kernels(prof) -> dict[str, float]:
    """Self GPU time (ms) per kernel name over the profile."""
    out: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        out[e.key] += e.self_device_time_total / 1e3
    return out


def _top_ops(prof, n: int = 8) -> list[dict]:
    """The host-side operators whose launches took the most GPU time, with their inputs'
    shapes: what a kernel or a copy in the top list came from."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        if e.device_type == torch.autograd.DeviceType.CPU and e.device_time_total > 0:
            rows.append((e.device_time_total / 1e3, e.key, str(e.input_shapes)[:160]))
    rows.sort(reverse=True)
    return [{"ms": ms, "op": op, "shapes": shapes} for ms, op, shapes in rows[:n]]


def _profile(
    engine: LLMEngine, timed: int, steps: int, device: str, trace: Path | None = None
) -> dict:
    """Wall time of ``timed`` engine steps, then GPU time of ``steps`` more (profiled)."""
    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device != "cpu":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    sync()
    t0 = time.perf_counter()
    for _ in range(timed):
        engine.step()
    sync()
    wall = (time.perf_counter() - t0) * 1e3 / timed
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    if trace is not None:  # Chrome's trace format (gzipped where the name ends in .gz)
        prof.export_chrome_trace(str(trace))
    kernels = {k: v / steps for k, v in _kernels(prof).items()}
    kinds: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        kinds[kind_of(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {
        "ms_per_step_wall": wall,
        "gpu_ms_per_step": sum(kernels.values()),
        "gpu_ms_by_kind": dict(kinds),
        "top_kernels_ms": [{"name": n[:120], "ms": ms} for n, ms in top],
        "top_ops_ms_total": _top_ops(prof),
    }


def _decoding(engine: LLMEngine) -> int:
    return sum(1 for s in engine.scheduler.running if not s.is_prefilling)


def run(args: argparse.Namespace) -> dict:
    # The first requests decode while the later ones prefill: enough tokens that none finishes
    # before the end (every profiled step must have the whole batch).
    budget = args.max_num_batched_tokens
    new = (args.batch * args.context + args.prompt) // budget + 4 * args.steps + 64
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(args.model),
            load_format="dummy",
            device=args.device,
            max_num_seqs=max(64, args.batch + 1),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=max(args.context + new, args.prompt) + 64,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
    )
    rng = random.Random(SEED)
    long_run = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"d{i}", _ids(rng, args.context), long_run)
    sched = engine.scheduler
    while sched.waiting or any(s.is_prefilling for s in sched.running):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    decode = _profile(engine, args.steps, args.steps, args.device) | {"batch": _decoding(engine)}
    engine.add_request("long", _ids(rng, args.prompt), SamplingParams(max_tokens=1))
    engine.step()  # the first chunk (the request's admission)
    chunks = args.prompt // args.max_num_batched_tokens - 2  # all but the first and the last
    timed = max(1, min(args.steps, chunks // 2))
    profiled = max(1, min(args.steps, chunks - timed))
    mixed = _profile(engine, timed, profiled, args.device, args.trace)
    mixed["batch"] = _decoding(engine)  # the decodes beside the chunk
    if decode["batch"] != args.batch or mixed["batch"] != args.batch:
        raise RuntimeError(f"decode batch {decode['batch']} / {mixed['batch']}, not {args.batch}")
    engine.close()
    return {"decode": decode, "mixed": mixed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.step_profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, help="model folder (default: the Llama-3.1-8B shape)")
    p.add_argument("--batch", type=int, default=32, help="decoding sequences")
    p.add_argument("--context", type=int, default=12000, help="their context (tokens)")
    p.add_argument("--prompt", type=int, default=32768, help="the long prompt prefilled beside")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="steps profiled per phase")
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--trace", type=Path, help="the mixed phase's profile, Chrome's format (.gz)")
    p.add_argument("--out", type=Path, default=Path("bench/results/step_profile.json"))
    args = parse_bench_args(p, "bench.step_profile", argv)
    tmp = None
    if args.dry_run:
        args.device, args.batch, args.context, args.prompt = "cpu", 2, 40, 96
        args.max_num_batched_tokens, args.warmup, args.steps = 16, 1, 2
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        shape = "smollm2-135m" if args.dry_run else "llama-3.1-8b"
        args.model = write_shape(shape, Path(tmp.name) / shape)
    result = run(args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = []
    for phase, r in result.items():
        row = {"phase": phase, "batch": r["batch"], "wall_ms": r["ms_per_step_wall"]}
        row["gpu_ms"] = r["gpu_ms_per_step"]
        row.update({k: r["gpu_ms_by_kind"].get(k, 0.0) for k in ("matmul", "attention", "other")})
        rows.append(row)
    print(f"{device}: batch {args.batch} at {args.context} tokens; mixed with a "
          f"{args.prompt}-token prompt in {args.max_num_batched_tokens}-token chunks")  # fmt: skip
    print(table(rows, ["phase", "batch", "wall_ms", "gpu_ms", "matmul", "attention", "other"]))
    for phase, r in result.items():
        print(f"\n{phase}: top kernels (ms per step)")
        for k in r["top_kernels_ms"]:
            print(f"  {k['ms']:8.3f}  {k['name']}")
        print(f"{phase}: operators launching the most GPU time (ms over the profiled steps)")
        for k in r["top_ops_ms_total"]:
            print(f"  {k['ms']:8.3f}  {k['op']}  {k['shapes']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    paths = {k: str(getattr(args, k)) for k in ("model", "out", "trace")}
    report = {"device": device, "args": vars(args) | paths, "phases": result}
    args.out.write_text(json.dumps(report, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
