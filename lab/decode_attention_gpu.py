"""Decode attention alone (issue 19): launch plans of ``kernels.triton_decode`` side by side in
one run, against the rule ``DecodePlan.make`` installs (``default``), for batch 1 and 8, ctx 1k
and 4k, bf16 and FP8 KV, on the engine's pool layout with scattered blocks. Every layer of the
8B shape back to back in one CUDA graph, as in a step; the KV read as a fraction of the copy
bandwidth measured in the same run. Each plan's output is checked against ``default``'s.

Run through ``lab.decode_variants --only-attention``; it writes the best plan per batch size
(fastest over the four ctx/KV cases, by geometric mean against ``default``) to
``decode_attention_plans.json``, which ``lab.decode_variants --attention-plans`` times in
the whole step against the installed rule.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from bench.gpu_common import Ceilings, graph_time_ms, table
from engine import kv_pool
from engine.config import ModelConfig
from kernels.triton_decode import candidates
from libkv.kv_layout import KVLayout

COLS = ["batch", "ctx", "kv", "plan", "us_per_layer", "frac_copy", "vs_default", "max_err"]
BLOCK = 16


def _pool(c: ModelConfig, blocks: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "bfloat16", 2)
    pool = kv_pool.allocate(layout, 0, blocks, torch.bfloat16, torch.device(device))
    for i in range(0, blocks, 256):  # random, never zeros
        pool[i : i + 256].normal_()
    if dtype != torch.bfloat16:
        pool = torch.cat([pool[i : i + 256].to(dtype) for i in range(0, blocks, 256)])
    return kv_pool.kernel_view(pool)


def run(
    c: ModelConfig,
    ceil: Ceilings,
    batches: list[int],
    ctxs: list[int],
    device: str = "cuda",
    labels: list[str] | None = None,
    spread: float = 0.0,
    kvs: tuple[str, ...] = ("bf16", "fp8"),
) -> dict:
    """Rows for every (batch, ctx, KV dtype, plan) and the best knobs per batch size
    (``device`` "cpu": a dry run through Triton's interpreter, one layer, fp16 queries);
    ``labels``: only the candidates whose label starts with one of them, beside the default;
    ``spread``: each sequence's context drawn from ``ctx * (1 +- spread)`` (seeded), as a
    served batch's lengths are, instead of ``ctx`` for all; ``kvs``: the KV dtypes timed."""
    from kernels import triton_decode as T
    from kernels.triton_cache import PagedLayer

    t0 = time.perf_counter()
    per_seq = -(-(int(max(ctxs) * (1 + spread)) + 1) // BLOCK)
    blocks = max(batches) * per_seq + 8
    perm = torch.randperm(blocks).tolist()
    rows: list[dict] = []
    gen = torch.Generator().manual_seed(0)
    dtypes = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
    for kv_name, dtype in ((k, dtypes[k]) for k in kvs):
        kv = _pool(c, blocks, dtype, device)
        layers = c.num_layers if device == "cuda" else 1
        for b in batches:
            # (the interpreter's bf16 tl.dot is wrong: fp16 there)
            qdt = torch.bfloat16 if device == "cuda" else torch.float16
            q = torch.randn(b, c.num_heads, c.head_dim, device=device, dtype=qdt)
            default = T.DecodePlan(b, c.num_heads, c.num_kv_heads, c.head_dim, 4)
            if device == "cuda":
                default = T.DecodePlan.make(q, PagedLayer.of(kv, 0))
            more = [T.DecodePlan(b, c.num_heads, c.num_kv_heads, c.head_dim, **k)
                    for k in candidates(b)]  # type: ignore[arg-type]  # fmt: skip
            keep = tuple(labels) if labels else ("",)
            plans = [default] + [p for p in more if p.label().startswith(keep)]
            for ctx in ctxs:
                lo, hi = int(ctx * (1 - spread)), int(ctx * (1 + spread))
                ctx_of = torch.randint(max(lo, 1), hi + 1, (b,), generator=gen) if spread else (
                    torch.full((b,), ctx))  # fmt: skip
                nb = -(-(int(ctx_of.max()) + 1) // BLOCK)
                tables = torch.tensor([perm[i * per_seq : i * per_seq + nb] for i in range(b)],
                                      device=device, dtype=torch.int32)  # fmt: skip
                lens = (ctx_of + 1).to(device=device, dtype=torch.int32)
                kv_bytes = int(lens.sum()) * 2 * c.num_kv_heads * c.head_dim * kv.element_size()
                ref, base = None, None
                for i, plan in enumerate(plans):
                    call = functools.partial(T.decode_attention, q, kv, 0, tables, lens, 0.088,
                                             plan, 0.5, 0.5)  # fmt: skip
                    try:
                        out = call().float()
                        fns = [functools.partial(T.decode_attention, q, kv, layer, tables, lens,
                                                 0.088, plan, 0.5, 0.5)
                               for layer in range(layers)]  # fmt: skip
                        us = graph_time_ms(fns) * 1e3
                    except Exception as e:  # recorded; the next plan still runs
                        rows.append({"batch": b, "ctx": ctx, "kv": kv_name, "plan": plan.label(),
                                     "error": f"{type(e).__name__}: {e}"[:300]})  # fmt: skip
                        print(rows[-1], flush=True)
                        continue
                    ref = out if ref is None else ref
                    base = us if i == 0 else base
                    err = ((out - ref).norm() / ref.norm().clamp_min(1e-9)).item()
                    rows.append({"batch": b, "ctx": ctx, "kv": kv_name,
                                 "plan": ("default " if i == 0 else "") + plan.label(),
                                 "knobs": plan.knobs(), "us_per_layer": us,
                                 "frac_copy": kv_bytes / ceil.copy_bytes_per_s / (us / 1e6),
                                 "vs_default": us / base if base else None,
                                 "max_err": err})  # fmt: skip
        del kv
        if device == "cuda":
            torch.cuda.empty_cache()
    best = best_plans(rows)
    for b in batches:
        mine = [r for r in rows if r["batch"] == b and "us_per_layer" in r]
        name = best.get(b, {}).get("label")
        print(table([r for r in mine if r["plan"].startswith("default") or r["plan"] == name],
                    COLS), flush=True)  # fmt: skip
    return {"attention": rows, "best": best, "attention_s": time.perf_counter() - t0}


def best_plans(rows: list[dict]) -> dict[int, dict]:
    """Per batch size, the plan with the least geometric mean of ``vs_default`` over the cases
    where it ran (all of them: a plan that failed anywhere is out) and whose output agreed."""
    out: dict[int, dict] = {}
    for b in sorted({r["batch"] for r in rows}):
        mine = [r for r in rows if r["batch"] == b]
        cases = {(r["ctx"], r["kv"]) for r in mine}
        by_plan: dict[str, list[dict]] = {}
        for r in mine:
            by_plan.setdefault(r["plan"], []).append(r)
        scored = []
        for name, rs in by_plan.items():
            ok = [r for r in rs if r.get("vs_default") and r.get("max_err", 1) < 2e-2]
            if len(ok) == len(cases):
                gm = math.exp(sum(math.log(r["vs_default"]) for r in ok) / len(ok))
                scored.append((gm, name, ok[0]["knobs"]))
        if scored:
            gm, name, knobs = min(scored, key=lambda t: t[0])
            out[b] = {"label": name, "geomean_vs_default": gm, "knobs": knobs}
    return out


def report(res: dict) -> list[str]:
    lines = ["## Decode attention alone", "", f"best per batch: {res.get('best')}", "",
             table(res["attention"], COLS + ["error"]), ""]  # fmt: skip
    return lines
