"""The GPU benchmark, one script per device call: kernels checked, then timed against the
ceilings measured in the same run.

1. ceilings: device-to-device copy bandwidth and the bf16 matrix rate on random data;
2. every Triton kernel against its reference on fresh random inputs (stops if one fails);
3. attention kernels alone; decode steps of the Llama-3.1-8B shape (random bf16 weights,
   CUDA-graph replay) at batch 1/8/32/128 and contexts 1k/8k as a fraction of the bandwidth
   roofline (weights + KV read per step over the copy bandwidth); prefill at 1k/4k/8k as a
   fraction of the matrix rate; a per-kernel profile of one eager decode step;
4. ``transformers`` generate on the same shape (median time between tokens).

    python -m bench.gpu [--out bench/results] [--skip-hf]

Prints markdown tables and writes ``gpu_<device>.md`` and ``gpu_<device>.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import shlex
import sys
from pathlib import Path

import torch

from bench.gpu_checks import GEMV_VARIANTS, check_kernels, time_attention, time_gemv
from bench.gpu_common import llama_config, measure_ceilings, table
from bench.gpu_llama import BLOCK, LlamaBench, kv_bytes_per_token
from engine.model import DecoderModel
from kernels import KernelChoices

DECODE = [(b, ctx) for ctx in (1024, 8192) for b in (1, 8, 32, 128)]
PREFILL = [1024, 4096, 8192]
HF_MAX_TOKENS = 8192 * 32  # prompt tokens of one generate call (its prefill is one pass)


GEMV_COLS = ["weight", "rows"] + [f"{v}_{x}" for v in GEMV_VARIANTS for x in ("us", "frac_copy_bw")]
DECODE_COLS = [
    "batch",
    "ctx",
    "step_ms",
    "roofline_ms",
    "frac_roofline",
    "step_with_host_ms",
    "hf_step_ms",
    "speedup_vs_hf",
    "skipped",
]
ATTN_COLS = ["kernel", "batch", "ctx", "ms", "frac_copy_bw", "frac_matmul"]


def pool_blocks(c, configs: list[tuple[int, int]], reserve_bytes: int) -> tuple[int, list]:
    """Blocks for the largest decode config that fits beside the weights; configs that fit."""
    free, _ = torch.cuda.mem_get_info()
    block_bytes = BLOCK * kv_bytes_per_token(c)
    weights = 16 * 1024**3  # allocated after this estimate
    budget = (free - weights - reserve_bytes) // block_bytes
    need = {cfg: cfg[0] * -(-(cfg[1] + 1) // BLOCK) for cfg in configs}
    fits = [cfg for cfg in configs if need[cfg] <= budget]
    return max(need[cfg] for cfg in fits), fits


def run(args) -> dict:
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "date": args.date,
        "command": args.command,
        "torch": torch.__version__,
    }
    import triton

    res["triton"] = triton.__version__
    ceil = measure_ceilings()
    res["copy_TBps"] = ceil.copy_bytes_per_s / 1e12
    res["matmul_TFLOPs"] = ceil.matmul_flops_per_s / 1e12
    print(f"# copy {res['copy_TBps']:.3f} TB/s, matmul {res['matmul_TFLOPs']:.1f} TFLOP/s")
    res["checks"] = [r for seed in (1, 2, 3) for r in check_kernels(seed)]
    print(table(res["checks"], ["kernel", "rel_err", "ok"]), flush=True)
    if not all(r["ok"] for r in res["checks"]):
        res["aborted"] = "a kernel failed its check; nothing timed"
        return res
    res["attention"] = time_attention(ceil)
    print(table(res["attention"], ATTN_COLS), flush=True)
    res["gemv"] = time_gemv(ceil)
    print(table(res["gemv"], GEMV_COLS), flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    run_model(res, ceil)
    if not args.skip_hf:
        res["hf"] = run_hf()
    return res


def run_model(res: dict, ceil) -> None:
    """Decode steps, prefill and profiles of the engine's model on the 8B shape."""
    c = llama_config()
    blocks, fits = pool_blocks(c, DECODE, reserve_bytes=6 * 1024**3)
    bench = LlamaBench(c, blocks, max_len=16384)
    if KernelChoices().fold_norms:  # as the engine folds a bf16 model of one rank on CUDA
        bench.model.fold()
    res["folded"] = bench.model.folded
    res["decode"] = []
    for cfg in DECODE:
        if cfg in fits:
            row = bench.decode(*cfg, ceil)
        else:
            gib = cfg[0] * (cfg[1] + 1) * kv_bytes_per_token(c) / 1024**3
            row = {"batch": cfg[0], "ctx": cfg[1], "skipped": f"KV {gib:.0f} GiB > free memory"}
        res["decode"].append(row)
        print(row, flush=True)
    res["decode_cublas_only"] = decode_without_gemv(bench, ceil)
    res["prefill"] = [bench.prefill(t, ceil) for t in PREFILL]
    print(table(res["prefill"], ["tokens", "ms", "frac_matmul"]), flush=True)
    res["profile_decode_b1_1k"] = bench.profile_decode(1, 1024)
    res["profile_decode_b32_8k"] = bench.profile_decode(32, 8192) if (32, 8192) in fits else ""
    del bench
    gc.collect()
    torch.cuda.empty_cache()


def decode_without_gemv(bench: LlamaBench, ceil) -> list[dict]:
    """The same decode steps with every matrix product on cuBLAS (A/B of the skinny kernel): a
    second model over the same (folded) weights, built with ``skinny_rows`` 0."""
    skinny = bench.model
    bench.model = DecoderModel(bench.c, bench.w, bench.max_len,
                               choices=KernelChoices(skinny_rows=0))  # fmt: skip
    try:
        rows = [bench.decode(b, ctx, ceil) for b, ctx in [(1, 1024), (8, 1024)]]
    finally:
        bench.model = skinny
    print(rows, flush=True)
    return rows


def run_hf() -> list[dict]:
    from bench.gpu_hf import build_model, hf_decode_step_ms

    model = build_model()
    rows = []
    for b, ctx in DECODE:
        if b * ctx > HF_MAX_TOKENS:
            rows.append({"batch": b, "ctx": ctx, "skipped": "prefill too large for one pass"})
            continue
        try:
            rows.append({"batch": b, "ctx": ctx, "step_ms": hf_decode_step_ms(model, b, ctx)})
        except torch.OutOfMemoryError:
            rows.append({"batch": b, "ctx": ctx, "skipped": "out of memory"})
        torch.cuda.empty_cache()
        print(rows[-1], flush=True)
    return rows


def report(res: dict) -> str:
    hf = {(r["batch"], r["ctx"]): r.get("step_ms") for r in res.get("hf", [])}
    for r in res.get("decode", []):
        ref = hf.get((r["batch"], r["ctx"]))
        if ref and "step_ms" in r:
            r["hf_step_ms"] = ref
            r["speedup_vs_hf"] = ref / r["step_ms"]
    head = [
        f"# GPU benchmark: {res['device']}",
        "",
        f"- date: {res['date']}",
        f"- command: `{res['command']}`",
        f"- torch {res['torch']}, triton {res.get('triton')}",
        f"- measured copy bandwidth (read + write): {res['copy_TBps']:.3f} TB/s; "
        f"bf16 matmul 8192^3: {res['matmul_TFLOPs']:.1f} TFLOP/s",
        "",
        "## Kernel checks (relative error vs reference, fresh random inputs)",
        table(res["checks"], ["kernel", "rel_err", "ok"]),
    ]
    if "decode" in res:
        head += [
            "", "## Attention kernels alone (8B heads, CUDA graph replays)",
            table(res["attention"], ATTN_COLS),
            "", "## Decode step, Llama-3.1-8B shape, bf16, CUDA graph replay"
            + (" (norms folded, as the engine runs it)" if res.get("folded") else ""),
            table(res["decode"], DECODE_COLS),
            "", "Same steps with every matrix product on cuBLAS (skinny Triton kernel off):",
            table(res["decode_cublas_only"], DECODE_COLS),
            "", "## Skinny matrix products (decode), Triton kernel against cuBLAS",
            table(res["gemv"], GEMV_COLS),
            "", "## Prefill, one sequence, no cached prefix",
            table(res["prefill"], ["tokens", "ms", "frac_matmul"]),
            "", "## Profile of one eager decode step, batch 1, ctx 1k",
            "```", res["profile_decode_b1_1k"], "```",
            "", "## Profile of one eager decode step, batch 32, ctx 8k",
            "```", res["profile_decode_b32_8k"], "```",
        ]  # fmt: skip
    return "\n".join(head) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--date", default=dt.date.today().isoformat())
    args = p.parse_args()
    args.command = "python -m bench.gpu " + shlex.join(sys.argv[1:])
    res = run(args)
    md = report(res)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gpu_" + res["device"].lower().replace("nvidia ", "").replace(" ", "_")
    (args.out / f"{name}.md").write_text(md)
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
