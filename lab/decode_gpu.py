"""Faster decode on the GPU (issue 19), one device call: every figure against ceilings and
baselines measured in the same run.

Sections, in order; each is saved to ``decode_gpu_<device>.json`` as soon as it ends (a call cut
short still returns what it did), and one that fails is recorded without stopping the next:

1. ``ceilings``: device-to-device copy bandwidth and the bf16 matrix rate;
2. ``checks``: every Triton kernel against its reference (``bench.gpu_checks``), the FP8 ones,
   and the decode fusions (RMSNorm and SiLU-and-multiply folded into the skinny product,
   split-K); a fusion that fails its check is turned off for the timings, and the table says so;
3. ``roofline``: decode steps of the 8B shape (random bf16 weights, CUDA-graph replay) at batch
   1 and 8, ctx 1k, as a fraction of the bandwidth roofline (bytes read / copy bandwidth):
   fusions off, on, and on with split-K 2 and 4 for the products with few row tiles;
4. ``fp8_weights``: the same steps with the layers' matrices in FP8, against bf16 (target: the
   FP8 step <= 0.6x the bf16 one at batch 1), then with the LM head in FP8 too (the engine's
   ``quantize_lm_head``: rows ``weights+lm_head``, with their ratio to the FP8 step);
5. ``fp8_kv``: a step where the KV dominates (batch 16, ctx 8k), KV in bf16 against FP8 (the
   weights as section 4 left them);
6. ``gemv``: each product of the 8B shape alone at 1 and 8 rows: the skinny kernel, split-K 2
   and 4, and each fused prologue against the unfused pair of kernels;
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
from engine.shapes import SHAPES
from lab import gpu_fp8
from tests.kernel_cases import rel_err

SECTIONS = (
    "ceilings", "checks", "roofline", "fp8_weights", "fp8_kv", "gemv", "handoff", "agreement",
    "spec",
)  # fmt: skip
# Decode modes of the roofline section: (fusions on, split-K parts for short products; 1: off).
MODES = {"unfused": (False, 1), "fused": (True, 1), "fused_splitk2": (True, 2),
         "fused_splitk4": (True, 4)}  # fmt: skip
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
        self.splitk_ok = True
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
    rows = fusion_checks(run)
    if run.device == "cuda":
        from bench.gpu_checks import check_kernels

        rows = check_kernels(1) + gpu_fp8.checks() + rows
    print(table(rows, ["kernel", "rel_err", "ok"]), flush=True)
    bad = {r["kernel"] for r in rows if not r["ok"]}
    if any(k.startswith("fused_") for k in bad):
        kernels.FUSE_DECODE = False
        run.res["fusion_off"] = "a fused kernel failed its check: the timings run unfused"
    run.splitk_ok = not any(k.startswith("splitk") for k in bad)
    return rows


def fusion_checks(run: Run) -> list[dict]:
    """The fused prologues (through the engine's dispatch: fused on CUDA within GEMV_MAX_ROWS)
    against norm-then-product / SiLU-then-product, and split-K against the reference."""
    c, dev = run.config, run.device
    hidden, inter = c.hidden_size, c.intermediate_size
    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    rows = []
    for m in (1, 8):
        x, res = (torch.randn(m, hidden, device=dev).bfloat16() for _ in range(2))
        g = (1 + 0.1 * torch.randn(hidden, device=dev)).bfloat16()
        w = (torch.randn(qkv_rows, hidden, device=dev) * 0.02).bfloat16()
        out, res_out = kernels.norm_linear(x, res, g, 1e-5, w)
        h, want = kernels.reference.rms_norm(x, g, 1e-5, res)
        err = rel_err(out, kernels.reference.linear(h.float(), w.float()))
        rows.append(("fused_norm_qkv", m, err if torch.equal(res_out, want) else float("inf")))
        y = torch.randn(m, 2 * inter, device=dev).bfloat16()
        wd = (torch.randn(hidden, inter, device=dev) * 0.02).bfloat16()
        got = kernels.silu_mul_linear(y, wd)
        exact = torch.equal(got, kernels.linear(kernels.silu_and_mul(y), wd))
        err = rel_err(got, kernels.reference.linear(kernels.reference.silu_and_mul(y.float()),
                                                    wd.float()))  # fmt: skip
        rows.append(("fused_silu_down", m, err if exact else float("inf")))
        if dev == "cuda":
            from kernels.triton_gemv import GemvPlan, linear

            for split in (2, 4):
                a = linear(y[:, :inter].contiguous(), wd, None, GemvPlan(split_k=split))
                again = linear(y[:, :inter].contiguous(), wd, None, GemvPlan(split_k=split))
                ref = kernels.reference.linear(y[:, :inter].float(), wd.float())
                err = rel_err(a, ref) if torch.equal(a, again) else float("inf")
                rows.append((f"splitk{split}_down", m, err))
    return [{"kernel": f"{n}_rows{m}", "rel_err": e, "ok": e < 1e-2} for n, m, e in rows]


# -- 3, 4, 5: decode steps of the 8B shape -----------------------------------------------------
def bench_for(run: Run) -> LlamaBench:
    if run.bench is None:
        ctx = 8192 if not run.dry else 256
        run.res["kv_pool_blocks"] = blocks = 16 * -(-(ctx + 1) // BLOCK)
        run.bench = LlamaBench(run.config, blocks, max_len=2 * ctx, device=run.device)
    return run.bench


def set_mode(fuse: bool, split: int) -> None:
    from kernels import triton_gemv  # noqa: F401 - only where Triton imports

    kernels.FUSE_DECODE = fuse
    # The split-K modes are the first skinny kernel's (``triton_gemv``); the others run the
    # default one (``triton_skinny``, whose plans carry their own split-K: lab.skinny_gpu).
    kernels.SKINNY_KERNEL = "gemv" if split > 1 else "skinny"
    triton_gemv.SPLIT_K_TILES_PER_SM = 4 if split > 1 else 0
    triton_gemv.SPLIT_K = split


def roofline(run: Run) -> list[dict]:
    bench, ceil = bench_for(run), run.ceil or measure_ceilings(small=run.dry)
    ctx = 1024 if not run.dry else 64
    fused_ok = "fusion_off" not in run.res  # fusion is off by default; timed unless a check failed
    rows = []
    for mode, (fuse, split) in MODES.items():
        if (fuse and not fused_ok) or (split > 1 and not run.splitk_ok):
            continue
        if run.device == "cuda":
            set_mode(fuse, split)
        else:
            kernels.FUSE_DECODE = fuse
        for b in (1, 8):
            rows.append({"mode": mode, **bench.decode(b, ctx, ceil)})
            print(rows[-1], flush=True)
    best = min((r for r in rows if r["batch"] == 1), key=lambda r: r["step_ms"])
    fuse, split = MODES[best["mode"]]
    if run.device == "cuda":
        set_mode(fuse, split)
        run.res["profile_best_b1"] = bench.profile_decode(1, ctx)
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
    """The ways to run product ``name`` of ``m`` rows: split-K 1/2/4, and for the products
    that follow a norm or SiLU-and-multiply, fused and unfused."""
    from kernels.triton_gemv import GemvPlan, linear, norm_linear, silu_mul_linear
    from kernels.triton_norm import rms_norm, silu_and_mul

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out: dict[str, Callable[[torch.Tensor], object]] = {
        f"split{s}": lambda w, s=s: linear(x, w, plan=GemvPlan(split_k=s)) for s in (1, 2, 4)
    }
    if name in ("qkv", "gate_up"):
        g = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        out["fused"] = lambda w: norm_linear(x, x, g, 1e-5, w)
        out["unfused"] = lambda w: linear(rms_norm(x, g, 1e-5, x)[0], w)
    elif name == "down":
        y = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
        out["fused"] = lambda w: silu_mul_linear(y, w)
        out["unfused"] = lambda w: linear(silu_and_mul(y), w)
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
    if res.get("fusion_off"):
        out.append(f"- {res['fusion_off']}")
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
