"""Faster decode on the GPU (issue 19), one device call: every figure against ceilings and
baselines measured in the same run.

Sections, in order; each is saved to ``decode_gpu_<device>.json`` as soon as it ends (a call cut
short still returns what it did), and one that fails is recorded without stopping the next:

1. ``ceilings``: device-to-device copy bandwidth and the bf16 matrix rate;
2. ``checks``: every Triton kernel against its reference (``bench.gpu_checks``) and the FP8
   ones;
3. ``roofline``: decode steps of the 8B shape (random bf16 weights, CUDA-graph replay) at batch
   1 and 8, ctx 1k, as a fraction of the bandwidth roofline (bytes read / copy bandwidth): the
   skinny products (the default kernel choices) and every product on cuBLAS
   (``KernelChoices(skinny_rows=0)``);
4. ``fp8_weights``: the same steps with the layers' matrices in FP8, against bf16 (target: the
   FP8 step <= 0.6x the bf16 one at batch 1), then with the LM head in FP8 too (the engine's
   ``quantize_lm_head``: rows ``weights+lm_head``, with their ratio to the FP8 step);
5. ``fp8_kv``: a step where the KV dominates (batch 16, ctx 8k), KV in bf16 against FP8 (the
   weights as section 4 left them);
6. ``gemv``: each product of the 8B shape alone at 1 and 8 rows: the skinny kernel's installed
   plan, the same plan with split-K 2 and 4, and cuBLAS;
7. ``handoff``: bytes per block and per 1k-token prompt and the CUDA IPC gather, bf16 vs FP8;
8. ``agreement``: greedy agreement and mean |logprob change| of FP8 KV and FP8 weights (the LM
   head in bf16, then in FP8 too) against bf16 through the engine (SmolLM2 shape, shared random
   weights: the GPU host has no checkpoint; ``--model DIR`` takes one);
9. ``spec``: n-gram speculative decoding at batch 1 on the 8B shape: a step verifying d drafts
   timed for each d, then the measured CPU run's per-step traces replayed (a projection:
   random weights accept no drafts; ``lab.spec_decode --mode replay``).

    SHAPE=llama-3.1-8b bash bench/device/run.sh bench lab.decode_gpu --out $OUT
    # the FP8 steps (bf16, FP8, FP8 with the LM head) and the agreement alone:
    bash bench/device/run.sh bench lab.decode_gpu --out $OUT --skip checks roofline fp8_kv \
        gemv handoff spec
    python -m lab.decode_gpu --dry-run --out /tmp/dry     # off the GPU: tiny shapes, no
                                                           # Triton; checks that it runs

Prints short tables; writes ``decode_gpu_<device>.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

import kernels
from bench.gpu_common import Ceilings, graph_time_ms, measure_ceilings, parse_bench_args, table
from bench.gpu_llama import BLOCK, LlamaBench
from engine.config import ModelConfig
from engine.fp8 import quantize_head, quantize_layer
from engine.model import DecoderModel
from engine.shapes import SHAPES
from lab import gpu_fp8

SECTIONS = (
    "ceilings", "checks", "roofline", "fp8_weights", "fp8_kv", "gemv", "handoff", "agreement",
    "spec",
)  # fmt: skip
# Decode modes of the roofline section: the kernel choices of the model each step takes.
MODES = {"skinny": kernels.KernelChoices(), "cublas": kernels.KernelChoices(skinny_rows=0)}
ROOF_COLS = ["mode", "batch", "ctx", "step_ms", "roofline_ms", "frac_roofline",
             "step_with_host_ms"]  # fmt: skip
FP8_COLS = ["fp8", "batch", "ctx", "bf16_ms", "fp8_ms", "ratio", "vs_fp8", "bf16_frac_roofline",
            "fp8_frac_roofline"]  # fmt: skip


class Run:
    """The run's settings, results, and where they go."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.device = "cuda" if torch.cuda.is_available() and not self.dry else "cpu"
        if not self.dry and self.device != "cuda":
            raise SystemExit("no CUDA device: use --dry-run to check the script off the GPU")
        shape = "smollm2-135m" if self.dry else args.shape
        self.config = ModelConfig.from_dict(SHAPES[shape])
        self.shape = shape
        name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu (dry run)"
        self.res: dict = {
            "device": name,
            "date": args.date,
            "command": args.command,
            "torch": torch.__version__,
            "shape": shape,
            "errors": {},
            "seconds": {},
        }
        self.ceil: Ceilings | None = None
        self.bench: LlamaBench | None = None
        stem = "decode_gpu_" + name.lower().replace("nvidia ", "").replace(" ", "_")
        self.stem = args.out / stem.replace("(", "").replace(")", "")

    def section(self, name: str, fn: Callable[[], object]) -> None:
        if name in self.args.skip:
            return
        t0 = time.perf_counter()
        print(f"## {name}", flush=True)
        try:
            self.res[name] = fn()
        except Exception as e:  # recorded; the next section still runs
            traceback.print_exc()
            self.res["errors"][name] = f"{type(e).__name__}: {e}"
        self.res["seconds"][name] = round(time.perf_counter() - t0, 1)
        self.save()

    def save(self) -> None:
        self.args.out.mkdir(parents=True, exist_ok=True)
        self.stem.with_suffix(".json").write_text(json.dumps(self.res, indent=1, default=str))

    def free(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


# -- 1, 2: ceilings and checks -------------------------------------------------------------------
def ceilings(run: Run) -> dict:
    run.ceil = measure_ceilings(small=run.dry)
    out = {"copy_TBps": run.ceil.copy_bytes_per_s / 1e12,
           "matmul_TFLOPs": run.ceil.matmul_flops_per_s / 1e12}  # fmt: skip
    print(f"copy {out['copy_TBps']:.3f} TB/s, matmul {out['matmul_TFLOPs']:.1f} TFLOP/s")
    return out


def checks(run: Run) -> list[dict]:
    if run.device != "cuda":
        return [{"skipped": "needs CUDA (Triton)"}]
    from bench.gpu_checks import check_kernels

    rows = check_kernels(1) + gpu_fp8.checks()
    print(table(rows, ["kernel", "rel_err", "ok"]), flush=True)
    return rows


# -- 3, 4, 5: decode steps of the 8B shape -----------------------------------------------------
def bench_for(run: Run) -> LlamaBench:
    if run.bench is None:
        ctx = 8192 if not run.dry else 256
        run.res["kv_pool_blocks"] = blocks = 16 * -(-(ctx + 1) // BLOCK)
        run.bench = LlamaBench(run.config, blocks, max_len=2 * ctx, device=run.device)
    return run.bench


def roofline(run: Run) -> list[dict]:
    bench, ceil = bench_for(run), run.ceil or measure_ceilings(small=run.dry)
    ctx = 1024 if not run.dry else 64
    default = bench.model
    rows = []
    try:
        for mode, choices in MODES.items():
            # a model over the bench's weights that takes the mode's kernels
            bench.model = DecoderModel(bench.c, bench.w, bench.max_len, choices=choices)
            for b in (1, 8):
                rows.append({"mode": mode, **bench.decode(b, ctx, ceil)})
                print(rows[-1], flush=True)
        best = min((r for r in rows if r["batch"] == 1), key=lambda r: r["step_ms"])
        if run.device == "cuda":
            bench.model = DecoderModel(bench.c, bench.w, bench.max_len,
                                       choices=MODES[best["mode"]])  # fmt: skip
            run.res["profile_best_b1"] = bench.profile_decode(1, ctx)
    finally:
        bench.model = default
    run.res["best_mode"] = best["mode"]
    print(table(rows, ROOF_COLS), flush=True)
    return rows


def fp8_weights(run: Run) -> list[dict]:
    """FP8 layer matrices against the bf16 steps of the roofline section (same mode); then the
    LM head in FP8 too (``quantize_lm_head``), against the same bf16 steps (``ratio``) and the
    FP8 steps with a bf16 head (``vs_fp8``). The head goes back to bf16 after."""
    bench, ceil = bench_for(run), run.ceil or measure_ceilings(small=run.dry)
    ctx = 1024 if not run.dry else 64
    base = {b: bench.decode(b, ctx, ceil) for b in (1, 8)}
    bench.w.layers[:] = [quantize_layer(lw) for lw in bench.w.layers]
    run.free()
    rows = [gpu_fp8._pair("weights", b, ctx, base[b], bench.decode(b, ctx, ceil)) for b in (1, 8)]
    head = bench.w.lm_head
    bench.w.lm_head = quantize_head(head)
    try:
        for b, w8 in zip((1, 8), list(rows), strict=True):
            row = gpu_fp8._pair("weights+lm_head", b, ctx, base[b], bench.decode(b, ctx, ceil))
            rows.append({**row, "vs_fp8": row["fp8_ms"] / w8["fp8_ms"]})
    finally:
        bench.w.lm_head = head
    print(table(rows, FP8_COLS), flush=True)
    return rows


def fp8_kv(run: Run) -> list[dict]:
    bench, ceil = bench_for(run), run.ceil or measure_ceilings(small=run.dry)
    b, ctx = (16, 8192) if not run.dry else (2, 128)
    base = bench.decode(b, ctx, ceil)
    bench.kv = bench.kv.to(kernels.FP8)
    run.free()
    rows = [gpu_fp8._pair("kv_cache", b, ctx, base, bench.decode(b, ctx, ceil))]
    print(table(rows, ["fp8", "batch", "ctx", "bf16_ms", "fp8_ms", "ratio"]), flush=True)
    return rows


# -- 6: the products alone -----------------------------------------------------------------------
def gemv(run: Run) -> list[dict]:
    """Each product alone, over enough weight copies that the L2 cannot serve them."""
    if run.device != "cuda":
        return [{"skipped": "needs CUDA (Triton)"}]
    c, ceil = run.config, run.ceil or measure_ceilings()
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    shapes = {"qkv": (qkv, c.hidden_size), "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
              "gate_up": (2 * c.intermediate_size, c.hidden_size),
              "down": (c.hidden_size, c.intermediate_size)}  # fmt: skip
    rows = []
    for name, (n, k) in shapes.items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in (1, 8):
            variants = gemv_variants(name, m, k)
            row: dict = {"weight": name, "rows": m}
            for label, fn in variants.items():
                ms = graph_time_ms([lambda w=w, fn=fn: fn(w) for w in ws] * 2)
                row[f"{label}_us"] = ms * 1e3
                row[f"{label}_frac_bw"] = nbytes / ceil.copy_bytes_per_s / (ms / 1e3)
            rows.append(row)
            print(row, flush=True)
        del ws
        run.free()
    return rows


def gemv_variants(name: str, m: int, k: int) -> dict[str, Callable[[torch.Tensor], object]]:
    """The ways to run product ``name`` of ``m`` rows: the skinny kernel's installed plan, the
    same with split-K 2 and 4, and cuBLAS."""
    from kernels import triton_skinny

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

    def skinny(split: int) -> Callable[[torch.Tensor], object]:
        def run(w: torch.Tensor) -> object:
            plan = triton_skinny.plan_for(m, *w.shape, w.dtype)
            plan = plan if split == 1 else dataclasses.replace(plan, split_k=split)
            return triton_skinny.linear(x, w, plan=plan)

        return run

    out = {f"split{s}": skinny(s) for s in (1, 2, 4)}
    out["cublas"] = lambda w: x @ w.T
    return out


# -- 7, 8, 9: hand-off, agreement, speculative decoding -----------------------------------------
def handoff(run: Run) -> list[dict]:
    rows = gpu_fp8.handoff_rows(run.config, run.device)
    print(table(rows, ["kv", "block_bytes", "prompt_bytes", "gather_ms"]), flush=True)
    return rows


def agreement(run: Run) -> list[dict]:
    n, tokens = (20, 32) if not run.dry else (2, 4)
    return gpu_fp8.agreement_rows(run.args.model, n, tokens)


def spec(run: Run) -> dict:
    from lab.spec_decode import replay

    args = argparse.Namespace(  # replay's arguments (lab.spec_decode); n-gram only here
        trace=str(run.args.trace), shape=run.shape, context=1024 if not run.dry else 64,
        steps=40 if not run.dry else 3, draft_shape="",
    )  # fmt: skip
    out = replay(args)
    print(table(out["rows"], ["workload", "decode_tokens", "steps", "step_ms_plain",
                              "step_ms_verify_k", "projected_speedup"]), flush=True)  # fmt: skip
    return out


def report(res: dict) -> str:
    out = [
        f"# Faster decode on the GPU (issue 19): {res['device']}",
        "",
        f"- date: {res['date']}; command: `{res['command']}`; torch {res['torch']}; "
        f"shape {res['shape']}",
    ]
    if "ceilings" in res:
        c = res["ceilings"]
        out.append(f"- copy bandwidth (read + write) {c['copy_TBps']:.3f} TB/s; bf16 matmul "
                   f"{c['matmul_TFLOPs']:.1f} TFLOP/s")  # fmt: skip
    if res["errors"]:
        out += ["", "## Sections that failed", "```", json.dumps(res["errors"], indent=1), "```"]
    parts = [
        ("checks", "Kernel checks (relative error vs reference)", ["kernel", "rel_err", "ok"]),
        ("roofline", "Decode step vs the bandwidth roofline (CUDA graph replay)", ROOF_COLS),
        ("fp8_weights", "FP8 weights vs bf16 (weights+lm_head: the LM head in FP8 too; vs_fp8: "
         "against the FP8 step with a bf16 head)", FP8_COLS),
        ("fp8_kv", "FP8 KV vs bf16", ["fp8", "batch", "ctx", "bf16_ms", "fp8_ms", "ratio"]),
        ("gemv", "Products alone (us; fraction of copy bandwidth)", None),
        ("handoff", "KV hand-off of a 1,024-token prompt (64 blocks)",
         ["kv", "block_bytes", "prompt_bytes", "gather_ms"]),
        ("agreement", "Greedy agreement with bf16 and logprob changes",
         ["vs_bf16", "model", "greedy_identical", "mean_first_divergence",
          "mean_abs_logprob_delta"]),
    ]  # fmt: skip
    for key, title, cols in parts:
        rows = res.get(key)
        if rows:
            cols = cols or list(dict.fromkeys(k for r in rows for k in r))
            out += ["", f"## {title}", table(rows, cols)]
    if res.get("best_mode"):
        out.append(f"\nFastest mode at batch 1: {res['best_mode']}")
    if res.get("spec"):
        s = res["spec"]
        steps = {d: round(t, 3) for d, t in s["step_ms"].items()}
        out += ["", "## N-gram speculative decoding, batch 1 (replayed CPU traces)",
                f"step ms by drafts verified: {json.dumps(steps)}",
                table(s["rows"], ["workload", "decode_tokens", "steps", "step_ms_plain",
                                  "step_ms_verify_k", "projected_speedup"])]  # fmt: skip
    out += ["", f"Seconds per section: {json.dumps(res['seconds'])}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--model", type=Path, default=None, help="agreement: a real checkpoint")
    p.add_argument("--trace", type=Path, default=Path("bench/results/spec_decode_cpu.json"))
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    args = parse_bench_args(p, "lab.decode_gpu", argv)
    run = Run(args)
    steps: dict[str, Callable[[Run], object]] = {
        "ceilings": ceilings, "checks": checks, "roofline": roofline, "fp8_weights": fp8_weights,
        "fp8_kv": fp8_kv, "gemv": gemv, "handoff": handoff, "agreement": agreement, "spec": spec,
    }  # fmt: skip
    for name in SECTIONS:
        run.section(name, lambda f=steps[name]: f(run))
        if name == "fp8_kv":  # the 8B model and its pool go; the engines of 8, 9 need room
            run.bench = None
            run.free()
    md = report(run.res)
    print(md)
    run.stem.with_suffix(".md").write_text(md)
    if run.res["errors"]:
        raise SystemExit(f"sections failed: {', '.join(run.res['errors'])}")


if __name__ == "__main__":
    main()
