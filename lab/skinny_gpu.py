"""The skinny decode products and the decode step against the bandwidth roofline (issue 19),
in one device call of about two minutes, every figure against the copy bandwidth measured in the
same run:

1. ``ceilings``: device-to-device copy bandwidth (read + write bytes per second);
2. ``products``: each matrix product of the 8B shape alone (``qkv``, ``o_proj``, ``gate_up``,
   ``down``; ``lm_head`` with the default plan), 1 and 8 rows, bf16 and FP8 weights: cuBLAS
   (bf16) and every candidate plan of the skinny kernel (``triton_skinny.candidates``), each
   checked against the reference, as a fraction of the copy bandwidth (weight bytes / copy
   rate / time); the fastest correct plan is installed for the steps and written to
   ``skinny_plans_<device>.json`` (the format of ``kernels/skinny_plans.json``);
3. ``steps``: decode steps of the 8B shape (random weights, CUDA-graph replay, ctx 1k) at
   batch 1 and 8, against the roofline (bytes read / copy bandwidth), with and without
   programmatic dependent launch (``KernelChoices.pdl``; the ``step_pdl`` mode, Hopper:
   ``same_as_no_pdl`` says the logits equal those with it off), then the layers in FP8 (the
   same modes): the FP8 step against the bf16 one (target <= 0.6x at batch 1; decode >= 90%
   of the roofline); the skinny plan each product took and where the plans came from.

    SHAPE=llama-3.1-8b bash bench/device/run.sh bench lab.skinny_gpu --out $OUT
    python -m lab.skinny_gpu --dry-run --out /tmp/dry   # off the GPU: tiny shapes, CPU

``--plans FILE`` installs the plans of an earlier run (``--skip products``: steps only).
Prints short tables; writes ``skinny_gpu_<device>.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from bench.gpu_common import Ceilings, graph_time_ms, measure_ceilings, parse_bench_args, table
from bench.gpu_llama import BLOCK, LlamaBench
from engine.config import ModelConfig
from engine.fp8 import quantize_layer
from engine.model import DecoderModel
from engine.shapes import SHAPES
from kernels import KernelChoices, reference

SECTIONS = ("ceilings", "products", "steps")
ROWS = (1, 8)
TOL = 2e-2  # bf16 outputs against the float32 reference of the same (dequantized) weights
PROD_COLS = ["weight", "dtype", "rows", "cublas_frac", "default_frac", "best_us", "best_frac",
             "best_plan", "bad_plans"]  # fmt: skip
STEP_COLS = ["weights", "mode", "batch", "step_ms", "roofline_ms", "frac_roofline",
             "step_with_host_ms"]  # fmt: skip
# The steps' modes: the kernel choices of the model each takes (``step_pdl``: programmatic
# dependent launch; its ``same_as_no_pdl``: the logits equal ``step``'s bit for bit).
MODES = {"step": KernelChoices(pdl=False), "step_pdl": KernelChoices(pdl=True)}


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.device = "cuda" if torch.cuda.is_available() and not self.dry else "cpu"
        if not self.dry and self.device != "cuda":
            raise SystemExit("no CUDA device: use --dry-run to check the script off the GPU")
        self.shape = "smollm2-135m" if self.dry else args.shape
        self.config = ModelConfig.from_dict(SHAPES[self.shape])
        self.name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu (dry run)"
        self.res: dict = {"device": self.name, "date": args.date, "command": args.command,
                          "torch": torch.__version__, "shape": self.shape, "errors": {},
                          "seconds": {}}  # fmt: skip
        self.ceil: Ceilings | None = None
        self.plans_source = ""
        stem = "skinny_gpu_" + self.name.lower().replace("nvidia ", "").replace(" ", "_")
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
        self.args.out.mkdir(parents=True, exist_ok=True)
        self.stem.with_suffix(".json").write_text(json.dumps(self.res, indent=1, default=str))

    def ceilings(self) -> Ceilings:
        if self.ceil is None:
            self.ceil = measure_ceilings(small=self.dry)
        return self.ceil


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ceilings(run: Run) -> dict:
    c = run.ceilings()
    out = {"copy_TBps": c.copy_bytes_per_s / 1e12, "matmul_TFLOPs": c.matmul_flops_per_s / 1e12}
    print(f"copy {out['copy_TBps']:.3f} TB/s, matmul {out['matmul_TFLOPs']:.1f} TFLOP/s")
    return out


# -- 2: the products alone -----------------------------------------------------------------------
def shapes(c: ModelConfig) -> dict[str, tuple[int, int]]:
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return {"qkv": (qkv, c.hidden_size), "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
            "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}  # fmt: skip


def _weights(n: int, k: int, fp8: bool) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Enough copies of a random ``[N, K]`` weight that the L2 cannot serve them (256 MiB)."""
    nbytes = n * k * (1 if fp8 else 2)
    out = []
    for _ in range(max(2, -(-(256 << 20) // nbytes))):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        if fp8:
            q = reference.quantize_fp8_rows(w)
            out.append((q.weight, q.scale))
        else:
            out.append((w, None))
        del w
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _time_us(ws: list, fn: Callable) -> float:
    return graph_time_ms([lambda w=w, s=s: fn(w, s) for w, s in ws] * 2) * 1e3


def products(run: Run) -> dict:
    if run.device != "cuda":
        return {"skipped": "needs CUDA (Triton)"}
    from kernels import triton_skinny

    ceil = run.ceilings()
    # kernels/skinny_plans.json first (under --plans), so that what this section does not
    # measure keeps the file's plans and "default" below is the heuristic
    triton_skinny.load_plans()
    rows_out = []
    for name, (n, k) in shapes(run.config).items():
        for fp8 in (False, True):
            # (the LM head stays bf16 under --quantization fp8 unless --quantize-lm-head)
            ws = _weights(n, k, fp8)
            wdtype = ws[0][0].dtype
            nbytes = ws[0][0].numel() * ws[0][0].element_size()

            def frac(us: float, nbytes: int = nbytes) -> float:
                return nbytes / ceil.copy_bytes_per_s / (us / 1e6)

            for m in run.args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w0, s0 = ws[0]
                want = reference.linear(x.float(), w0.float() * (s0[:, None] if fp8 else 1))
                row: dict = {"weight": name, "dtype": "fp8" if fp8 else "bf16", "rows": m}
                if not fp8:
                    row["cublas_frac"] = frac(_time_us(ws, lambda w, s, x=x: x @ w.T))
                key = triton_skinny.plan_key(m, n, k, wdtype)
                triton_skinny.set_plan(key, None)
                default = triton_skinny.plan_for(m, n, k, wdtype)
                plans = [default] if name == "lm_head" and not fp8 else [default] + [
                    p for p in triton_skinny.candidates(m, wdtype) if p != default]  # fmt: skip
                timed, bad = {}, []
                for p in plans:
                    got = triton_skinny.linear(x, w0, None, s0, p)
                    if p.qx:  # W8A8: against x quantized as the kernel does
                        fw = reference.Fp8Weight(w0, s0)
                        ref = reference.linear_fp8_qx(x, fw, p.block_k)
                        row["qx_err_vs_weight_only"] = _rel(got, want)
                    else:
                        ref = want
                    err = _rel(got, ref)
                    if not err < TOL:
                        bad.append(f"{p.label()} (rel err {err:.3g})")
                        continue
                    timed[p] = _time_us(ws, lambda w, s, x=x, p=p: triton_skinny.linear(
                        x, w, None, s, p))  # fmt: skip
                row["plans_us"] = {p.label(): us for p, us in timed.items()}
                if default in timed:
                    row["default_frac"] = frac(timed[default])
                if timed:
                    best = min(timed, key=timed.__getitem__)
                    for b in (1,) if m == 1 else (2, 4, 8):  # batches 2-8 take the 8 rows' plan
                        triton_skinny.set_plan(triton_skinny.plan_key(b, n, k, wdtype), best)
                    row.update(best_us=timed[best], best_frac=frac(timed[best]),
                               best_plan=best.label(), best=asdict(best))  # fmt: skip
                row["bad_plans"] = "; ".join(bad)
                rows_out.append(row)
                print({c: row.get(c) for c in PROD_COLS}, flush=True)
            del ws
            free()
    plans = triton_skinny.plans_json(run.name)
    run.args.out.mkdir(parents=True, exist_ok=True)
    run.stem.with_name(run.stem.name + "_plans.json").write_text(json.dumps(plans, indent=1))
    print(table(rows_out, PROD_COLS), flush=True)
    return {"rows": rows_out, "plans": plans}


# -- 3: decode steps -------------------------------------------------------------------------------
def steps(run: Run) -> list[dict]:
    ceil = run.ceilings()
    ctx = 1024 if not run.dry else 64
    bench = LlamaBench(run.config, 16 * -(-(ctx + 1) // BLOCK), max_len=2 * ctx,
                       device=run.device)  # fmt: skip
    rows, used, profiles = [], [], []
    logits: dict[tuple, torch.Tensor] = {}
    for weights in ("bf16", "fp8"):
        if weights == "fp8":
            bench.w.layers[:] = [quantize_layer(lw) for lw in bench.w.layers]
            free()
        for b in (1, 8):
            used.append({"weights": weights, "batch": b, **step_plans(run, b, weights)})
        for mode, choices in MODES.items():
            if run.args.modes and mode not in run.args.modes:
                continue
            if choices.pdl and (run.device != "cuda" or torch.cuda.get_device_capability()[0] < 9):
                continue  # griddepcontrol: Hopper and newer
            # a model over the bench's weights that takes the mode's kernels
            bench.model = DecoderModel(bench.c, bench.w, bench.max_len, choices=choices)
            for b in (1, 8):
                r = {"weights": weights, "mode": mode, **bench.decode(b, ctx, ceil)}
                out = logits[weights, choices.pdl, b] = bench.last_logits
                prev = logits.get((weights, False, b))
                if choices.pdl and prev is not None:  # PDL off: the same logits bit for bit
                    r["same_as_no_pdl"] = bool(torch.equal(out, prev))
                rows.append(r)
                print({c: r.get(c) for c in STEP_COLS}, flush=True)
                if mode == run.args.profile and run.device == "cuda":
                    prof = bench.profile_graph(b, ctx)
                    profiles.append({"weights": weights, "mode": mode, **prof})
                    cols = ["kernel", "us_per_step", "calls_per_step"]
                    print(table(prof.get("rows", []), cols), flush=True)
                    print({k: v for k, v in prof.items() if k != "rows"}, flush=True)
    print(table(rows, STEP_COLS), flush=True)
    print(table(used, list(used[0])), flush=True)
    return {"rows": rows, "plans": used, "plans_source": run.plans_source, "profiles": profiles}


def step_plans(run: Run, b: int, weights: str) -> dict:
    """The skinny plan each product of the step takes at batch ``b`` (labels)."""
    if run.device != "cuda":
        return {}
    from kernels import triton_skinny

    wdtype = torch.float8_e4m3fn if weights == "fp8" else torch.bfloat16
    return {name: triton_skinny.plan_for(b, n, k, torch.bfloat16 if name == "lm_head" else wdtype)
            .label() for name, (n, k) in shapes(run.config).items()}  # fmt: skip


def _step_rows(res: dict) -> list[dict]:
    s = res.get("steps") or {}
    return s.get("rows", []) if isinstance(s, dict) else s


def summary(res: dict) -> list[dict]:
    """Best step per weight dtype and batch, and the FP8 / bf16 ratio."""
    best: dict[tuple[str, int], dict] = {}
    for r in _step_rows(res):
        k = (r["weights"], r["batch"])
        if k not in best or r["step_ms"] < best[k]["step_ms"]:
            best[k] = r
    out = []
    for b in (1, 8):
        bf, f8 = best.get(("bf16", b)), best.get(("fp8", b))
        if bf and f8:
            out.append({"batch": b, "bf16_mode": bf["mode"], "bf16_ms": bf["step_ms"],
                        "bf16_frac_roofline": bf["frac_roofline"], "fp8_mode": f8["mode"],
                        "fp8_ms": f8["step_ms"], "fp8_frac_roofline": f8["frac_roofline"],
                        "fp8_vs_bf16": f8["step_ms"] / bf["step_ms"]})  # fmt: skip
    return out


def report(res: dict) -> str:
    out = [f"# Skinny decode products and the decode step: {res['device']}", "",
           f"- date: {res['date']}; command: `{res['command']}`; torch {res['torch']}; "
           f"shape {res['shape']}"]  # fmt: skip
    if "ceilings" in res:
        out.append(f"- copy bandwidth (read + write) {res['ceilings']['copy_TBps']:.3f} TB/s "
                   "(every fraction below is against it)")  # fmt: skip
    if res["errors"]:
        out += ["", "## Sections that failed", "```", json.dumps(res["errors"], indent=1), "```"]
    p = res.get("products") or {}
    if p.get("rows"):
        out += ["", "## Products alone (CUDA graph of back-to-back calls over L2-sized copies)",
                table(p["rows"], PROD_COLS)]  # fmt: skip
    if _step_rows(res):
        out += ["", "## Decode step, ctx 1k, CUDA graph replay",
                table(_step_rows(res), STEP_COLS + ["same_as_no_pdl"])]  # fmt: skip
        st = res["steps"] if isinstance(res["steps"], dict) else {}
        if st.get("plans") and st["plans"][0].get("qkv"):
            out += ["", f"## Skinny plans the steps used ({st['plans_source']})",
                    table(st["plans"], list(st["plans"][0]))]  # fmt: skip
        s = summary(res)
        if s:
            out += ["", "## Best step per weight dtype", table(s, list(s[0]))]
    out += ["", f"Seconds per section: {json.dumps(res['seconds'])}"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    p.add_argument("--plans", type=Path, default=None,
                   help="install the plans of an earlier run (its _plans.json)")  # fmt: skip
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS), choices=ROWS,
                   help="products: the row counts measured (8 stands for 2-8)")  # fmt: skip
    p.add_argument(
        "--profile",
        default="step_pdl",
        help="steps: the mode whose replays are profiled per kernel ('' for none)",
    )
    p.add_argument(
        "--modes", nargs="*", default=None, help="steps: only these modes (default: all)"
    )
    args = parse_bench_args(p, "lab.skinny_gpu", argv)
    run = Run(args)
    measured = "products" not in args.skip
    given = f"--plans {args.plans}" if args.plans is not None else "kernels/skinny_plans.json"
    run.plans_source = (f"this run's products section at rows {args.rows}, else {given}"
                        if measured else given) + ", else the heuristic"  # fmt: skip
    if args.plans is not None and run.device == "cuda":
        from kernels import triton_skinny

        triton_skinny.install_plans(args.plans, run.name)
    steps_of: dict[str, Callable[[Run], object]] = {
        "ceilings": ceilings, "products": products, "steps": steps}  # fmt: skip
    for name in SECTIONS:
        run.section(name, lambda f=steps_of[name]: f(run))
    run.res["summary"] = summary(run.res)
    md = report(run.res)
    print(md)
    run.stem.with_suffix(".md").write_text(md)
    run.stem.with_suffix(".json").write_text(json.dumps(run.res, indent=1, default=str))
    if run.res["errors"]:
        raise SystemExit(f"sections failed: {', '.join(run.res['errors'])}")


if __name__ == "__main__":
    main()
