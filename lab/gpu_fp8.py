"""FP8 on the GPU, one script per device call, against bf16 measured in the same run:

1. the FP8 kernels checked against their references (stops if one fails);
2. decode steps of the Llama-3.1-8B shape (random weights, CUDA-graph replay) with the layers'
   matrices in bf16 and in FP8 at batch 1 and 8 (target: FP8 step <= 0.6x bf16 at batch 1),
   each as a fraction of its own bandwidth roofline (bytes read over the measured copy rate);
3. decode steps with the KV cache in bf16 and in FP8 where the KV dominates (batch 32, 8k);
4. the KV hand-off: bytes per block and the CUDA IPC gather kernel moving a 1k-token prompt of
   the 8B shape, bf16 against FP8;
5. greedy agreement and mean logprob changes of FP8 KV and of FP8 weights (the LM head in bf16,
   then in FP8 too) against bf16 through the engine, on the SmolLM2 shape with shared random
   weights (the GPU host has no real checkpoint; ``--model DIR`` takes one).

    python -m lab.gpu_fp8 [--out bench/results] [--model DIR]

Prints markdown and writes ``gpu_fp8_<device>.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch

import kernels
from bench.gpu_common import llama_config, measure_ceilings, table, time_ms
from bench.gpu_llama import BLOCK, LlamaBench
from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.fp8 import quantize_layer
from tests.kernel_cases import rel_err


def checks() -> list[dict]:
    """The FP8 kernels against their references (the GPU tests' cases, one each)."""
    from kernels import reference, triton_skinny
    from kernels.fp8_gemm import scaled_mm_linear

    rows = []
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    w = kernels.quantize_fp8_rows(torch.randn(6144, 4096, device="cuda") * 0.02)
    plan = triton_skinny.plan_for(8, 6144, 4096, w.weight.dtype)
    # a W8A8 plan (x quantized to e4m3 per step) against x quantized as the kernel does
    ref = reference.linear_fp8_qx(x, w, plan.block_k) if plan.qx else reference.linear(x.float(), w)
    got = triton_skinny.linear(x, w.weight, None, scale=w.scale, plan=plan)
    rows.append({"kernel": "fp8_skinny_rows8", "rel_err": rel_err(got, ref)})
    x = torch.randn(256, 4096, device="cuda").bfloat16()
    ref = reference.linear(x.float(), w)
    rows.append(
        {"kernel": "fp8_scaled_mm_rows256", "rel_err": rel_err(scaled_mm_linear(x, w), ref)}
    )
    for r in rows:
        r["ok"] = r["rel_err"] < (4e-2 if "scaled_mm" in r["kernel"] else 1e-2)
    return rows


def decode_rows(ceil) -> list[dict]:
    """bf16 against FP8 weights at batch 1/8 (ctx 1k), then bf16 against FP8 KV (batch 32, 8k)."""
    c = llama_config()
    bench = LlamaBench(c, 32 * (-(-8193 // BLOCK)), max_len=16384)
    rows = []
    bf16 = {b: bench.decode(b, 1024, ceil) for b in (1, 8)}
    kv_bf16 = bench.decode(32, 8192, ceil)
    bench.w.layers[:] = [quantize_layer(lw) for lw in bench.w.layers]
    gc.collect()
    torch.cuda.empty_cache()
    for b in (1, 8):
        f = bench.decode(b, 1024, ceil)
        rows.append(_pair("weights", b, 1024, bf16[b], f))
    bench.w.layers[:] = [
        dataclasses.replace(lw, qkv=_deq(lw.qkv), o_proj=_deq(lw.o_proj),
                            gate_up=_deq(lw.gate_up), down=_deq(lw.down))
        for lw in bench.w.layers
    ]  # fmt: skip
    bench.kv = bench.kv.to(kernels.FP8)
    gc.collect()
    torch.cuda.empty_cache()
    rows.append(_pair("kv_cache", 32, 8192, kv_bf16, bench.decode(32, 8192, ceil)))
    del bench
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def _deq(w) -> torch.Tensor:
    return (w.weight.float() * w.scale[:, None]).bfloat16()


def _pair(what: str, b: int, ctx: int, bf16: dict, fp8: dict) -> dict:
    row = {
        "fp8": what,
        "batch": b,
        "ctx": ctx,
        "bf16_ms": bf16["step_ms"],
        "fp8_ms": fp8["step_ms"],
        "ratio": fp8["step_ms"] / bf16["step_ms"],
        "bf16_frac_roofline": bf16["frac_roofline"],
        "fp8_frac_roofline": fp8["frac_roofline"],
        "fp8_step_with_host_ms": fp8["step_with_host_ms"],
    }
    print(row, flush=True)
    return row


def handoff_rows(c: ModelConfig | None = None, device: str = "cuda") -> list[dict]:
    """Bytes and CUDA IPC gather time of a 1,024-token prompt's blocks (8B shape)."""
    c = c or llama_config()
    rows = []
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", kernels.FP8)):
        shape = (256, c.num_layers, 2, BLOCK, c.num_kv_heads, c.head_dim)
        numel = 1
        for n in shape[1:]:
            numel *= n
        src = torch.zeros((256, numel * dtype.itemsize), dtype=torch.uint8, device=device)
        dst = torch.zeros_like(src)
        idx = torch.randperm(256, device=device)[:64]
        ms = time_ms(lambda d=dst, s=src, i=idx: kernels.copy_blocks_between(d, s, i, i), iters=50)
        rows.append({"kv": name, "block_bytes": src.shape[1], "prompt_bytes": 64 * src.shape[1],
                     "gather_ms": ms})  # fmt: skip
    rows.append({"kv": "fp8/bf16", "block_bytes": rows[1]["block_bytes"] / rows[0]["block_bytes"],
                 "prompt_bytes": rows[1]["prompt_bytes"] / rows[0]["prompt_bytes"],
                 "gather_ms": rows[1]["gather_ms"] / rows[0]["gather_ms"]})  # fmt: skip
    return rows


def agreement_rows(model: Path | None, n: int = 20, max_tokens: int = 32) -> list[dict]:
    """Greedy agreement and mean |logprob change| of FP8 KV / FP8 weights (the LM head in bf16,
    then in FP8 too) against bf16, over ``n`` random prompts of up to 200 tokens and
    ``max_tokens`` each."""
    from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts

    with tempfile.TemporaryDirectory() as tmp:
        folder = model or make_smol_shape_dir(Path(tmp) / "smol", seed=0)
        prompts = random_prompts(n, SMOL_CONFIG["vocab_size"], seed=1, hi=200)
        runs = {}
        for name, opts in (("bf16", {}), ("fp8_kv", {"kv_cache_dtype": "fp8"}),
                           ("fp8_weights", {"quantization": "fp8"}),
                           ("fp8_weights_lm_head", {"quantization": "fp8",
                                                    "quantize_lm_head": True})):  # fmt: skip
            llm = LLM(folder, num_kv_blocks=2048, max_num_seqs=32, dtype="bfloat16", **opts)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            outs = [o.token_ids for o in llm.generate(prompts, params)]
            scores = [llm.engine.score(p) for p in prompts]
            runs[name] = (outs, scores)
            del llm
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    rows = []
    base_outs, base_scores = runs["bf16"]
    for name in ("fp8_kv", "fp8_weights", "fp8_weights_lm_head"):
        outs, scores = runs[name]
        deltas = []
        for a, b in zip(base_scores, scores, strict=True):
            chosen = a.argmax(-1, keepdim=True)
            la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
            deltas.append((la.gather(1, chosen) - lb.gather(1, chosen)).abs().mean().item())
        first = [
            next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p))
            for p, q in zip(base_outs, outs, strict=True)
        ]
        rows.append({
            "vs_bf16": name,
            "model": "given" if model else "SmolLM2 shape, random weights",
            "greedy_identical": sum(x == y for x, y in zip(base_outs, outs, strict=True)) / n,
            "mean_first_divergence": sum(first) / len(first),
            "mean_abs_logprob_delta": sum(deltas) / len(deltas),
        })  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--date", default=dt.date.today().isoformat())
    args = p.parse_args(argv)
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "date": args.date,
        "command": "python -m lab.gpu_fp8 " + shlex.join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
    }
    ceil = measure_ceilings()
    res["copy_TBps"] = ceil.copy_bytes_per_s / 1e12
    res["checks"] = checks()
    print(table(res["checks"], ["kernel", "rel_err", "ok"]), flush=True)
    if all(r["ok"] for r in res["checks"]):
        res["decode"] = decode_rows(ceil)
        res["handoff"] = handoff_rows()
        res["agreement"] = agreement_rows(args.model)
    md = report(res)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "gpu_fp8_" + res["device"].lower().replace("nvidia ", "").replace(" ", "_")
    (args.out / f"{name}.md").write_text(md)
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))


def report(res: dict) -> str:
    out = [
        f"# FP8 on the GPU: {res['device']}",
        "",
        f"- date: {res['date']}; command: `{res['command']}`; torch {res['torch']}",
        f"- measured copy bandwidth (read + write): {res['copy_TBps']:.3f} TB/s",
        "",
        "## FP8 kernel checks (relative error vs reference)",
        table(res["checks"], ["kernel", "rel_err", "ok"]),
    ]
    if "decode" in res:
        out += [
            "", "## Decode step, Llama-3.1-8B shape (CUDA graph replay): bf16 vs FP8",
            table(res["decode"], ["fp8", "batch", "ctx", "bf16_ms", "fp8_ms", "ratio",
                                  "bf16_frac_roofline", "fp8_frac_roofline",
                                  "fp8_step_with_host_ms"]),
            "", "## KV hand-off of a 1,024-token prompt (8B shape, 64 blocks, CUDA IPC gather)",
            table(res["handoff"], ["kv", "block_bytes", "prompt_bytes", "gather_ms"]),
            "", "## Greedy agreement with bf16 (20 prompts, 32 tokens) and logprob changes",
            table(res["agreement"], ["vs_bf16", "model", "greedy_identical",
                                     "mean_first_divergence", "mean_abs_logprob_delta"]),
        ]  # fmt: skip
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
