"""Decode-step variants on the GPU (issue 19): the 8B shape's decode step (random weights,
CUDA-graph replay, ctx 1k) with one change at a time against the installed plans
(``kernels/skinny_plans.json``), all in one run, so that the step, not a product alone, says
what helps:

- other skinny plans for the layers' four products (every product of the step takes the plan);
- the LM head in FP8 too (``--quantization fp8`` keeps it in bf16, as vLLM does, unless
  ``--quantize-lm-head``);
- other kernel choices (``KernelChoices``: programmatic dependent launch off, RoPE in its own
  kernel, the norms folded or not, their sums of squares from the product before or not), each
  taken by a model built over the same weights;
- what-ifs: upper bounds with a kernel left out (wrong logits), what fusing it could save.

Then a per-kernel profile of the plain step with PDL off (with PDL on a kernel's time includes
its wait for the previous one). Prints a table; writes ``decode_variants_<device>.md``/``.json``.

    bash bench/device/run.sh bench lab.decode_variants --out $OUT
    python -m lab.decode_variants --dry-run --out /tmp/dry   # off the GPU: the script only
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import kernels
from bench.gpu_common import measure_ceilings, parse_bench_args, table
from bench.gpu_llama import BLOCK, LlamaBench
from engine.config import ModelConfig
from engine.fp8 import quantize_layer
from engine.model import DecoderModel
from engine.shapes import SHAPES
from kernels import reference
from kernels.choices import DEFAULT
from lab.skinny_gpu import shapes

COLS = [
    "weights",
    "batch",
    "variant",
    "step_ms",
    "vs_installed",
    "frac_roofline",
    "logits_rel_diff",
    "argmax_same",
]
LAYER = ("qkv", "o_proj", "gate_up", "down")
PROF_COLS = ["kernel", "us_per_step", "calls_per_step"]
# (weights, batch) -> changes to every installed layer plan, one variant each
CHANGES: dict[tuple[str, int], list[dict[str, object]]] = {
    ("fp8", 1): [{"l2": 2}, {"l2": 4}, {"num_stages": 4}, {"num_stages": 4, "l2": 2}],
    ("bf16", 1): [{"l2": 2}],
}


def plan_variants() -> dict[tuple[str, int], dict[str, object]]:
    """(weights, batch) -> variant name -> the plan every layer product takes (Triton's
    module, imported only on a GPU host)."""
    from kernels.triton_skinny import SkinnyPlan as P

    return {
        ("fp8", 1): {
            "fma_n4_k1024_l2_2": P(block_n=4, block_k=1024, l2=2),
            "fma_n2_k1024_l2_4": P(block_n=2, block_k=1024, l2=4),
            "fma_n8_k512": P(block_n=8, block_k=512),
            "qdot_n128_k128_sk4": P(block_n=128, block_k=128, split_k=4, dot=True, qx=True),
        },
        ("bf16", 1): {
            "fma_n4_k2048_w8_l2_2": P(block_n=4, block_k=2048, num_warps=8, l2=2),
            "fma_n4_k1024": P(block_n=4, block_k=1024),
        },
        ("bf16", 8): {
            "dot_n32_k256_s4": P(block_n=32, block_k=256, num_stages=4, dot=True),
            "dot_n64_k128_s6_no_l2": P(block_n=64, block_k=128, num_stages=6, dot=True, l2=0),
            "dot_n64_k128_s6_sk2": P(block_n=64, block_k=128, num_stages=6, split_k=2, dot=True),
        },
    }


@contextlib.contextmanager
def swapped_plans(
    c: ModelConfig, b: int, wdtype: torch.dtype, make: Callable[[object], object]
) -> Iterator[None]:
    """Every layer product of the step at batch ``b`` takes ``make(its installed plan)``; the
    installed plans come back after."""
    from kernels import triton_skinny

    shapes_of = [(n, k) for name, (n, k) in shapes(c).items() if name in LAYER]
    keys = [triton_skinny.plan_key(b, n, k, wdtype) for n, k in shapes_of]
    saved = {key: triton_skinny._TUNED.get(key) for key in keys}
    try:
        for key, (n, k) in zip(keys, shapes_of, strict=True):
            triton_skinny.set_plan(key, make(triton_skinny.plan_for(b, n, k, wdtype)))  # type: ignore[arg-type]
        yield
    finally:
        for key, p in saved.items():
            triton_skinny.set_plan(key, p)


def layer_plans(
    c: ModelConfig, b: int, wdtype: torch.dtype, plan: object
) -> contextlib.AbstractContextManager:
    """Every layer product of the step at batch ``b`` takes ``plan``."""
    return swapped_plans(c, b, wdtype, lambda _: plan)


def installed_with(
    c: ModelConfig, b: int, wdtype: torch.dtype, **change: object
) -> contextlib.AbstractContextManager:
    """The installed plan of every layer product at batch ``b``, with ``change`` (``l2``...)."""
    return swapped_plans(c, b, wdtype, lambda p: dataclasses.replace(p, **change))  # type: ignore[call-overload]


@contextlib.contextmanager
def lm_head_fp8(bench: LlamaBench) -> Iterator[None]:
    head = bench.w.lm_head
    bench.w.lm_head = reference.quantize_fp8_rows(head)  # type: ignore[assignment]
    try:
        yield
    finally:
        bench.w.lm_head = head


@contextlib.contextmanager
def attention_plans(paths: list[Path], b: int) -> Iterator[None]:
    """Decode attention at batch ``b`` takes the plan of ``paths`` (``--only-attention``'s
    ``decode_attention_plans.json`` files: batch size -> ``DecodePlan`` knobs; a later file
    wins) instead of the rule."""
    from kernels import triton_decode

    plans = {int(k): v for path in paths for k, v in json.loads(path.read_text()).items()}
    if b not in plans:
        raise ValueError(f"{[str(p) for p in paths]} have no plan for batch {b}")
    saved = triton_decode.install_plans({b: plans[b]})
    try:
        yield
    finally:
        triton_decode.install_plans(saved)


@contextlib.contextmanager
def attention_plan(b: int, **knobs: object) -> Iterator[None]:
    """Decode attention at batch ``b`` takes the plan of ``knobs`` (``DecodePlan``'s)."""
    from kernels import triton_decode

    saved = triton_decode.install_plans({b: knobs})
    try:
        yield
    finally:
        triton_decode.install_plans(saved)


# The folded step with other decode-attention plans at batch 8 (RoPE inside changes the
# split kernel's start; labels as DecodePlan.label)
ATTENTION_B8 = {
    "s8_n32_w4_st2": {"num_splits": 8, "block_n": 32},
    "s4_n64_w4_st2": {"num_splits": 4},
    "s16_n32_w4_st2": {"num_splits": 16, "block_n": 32},
    "s8_n64_w4_st2_m": {"num_splits": 8, "merge": True},
    "s4_n64_w4_pfe_m": {"num_splits": 4, "merge": True, "prefetch": True, "early": True},
    "s8_n64_w4_pfe_m": {"num_splits": 8, "merge": True, "prefetch": True, "early": True},
    "s8_n64_w4_pfe": {"num_splits": 8, "prefetch": True, "early": True},
}


@contextlib.contextmanager
def choosing(bench: LlamaBench, **change: object) -> Iterator[None]:
    """The step taken by a model over the bench's weights whose kernel choices are the current
    model's with ``change`` (``KernelChoices`` fields); the bench's model comes back after."""
    model = bench.model
    choices = dataclasses.replace(model.choices, **change)  # type: ignore[arg-type]
    bench.model = DecoderModel(bench.c, bench.w, bench.max_len, choices=choices)
    try:
        yield
    finally:
        bench.model = model


@contextlib.contextmanager
def kernels_patched(**functions: Callable[..., object]) -> Iterator[None]:
    """``kernels``' functions replaced for the block (the what-ifs below), put back after."""
    saved = {name: getattr(kernels, name) for name in functions}
    for name, fn in functions.items():
        setattr(kernels, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(kernels, name, fn)


def what_if_without(name: str) -> contextlib.AbstractContextManager:
    """An upper bound, not a model: the step with the RMSNorm kernels (``rms_norm``) or the
    SiLU-and-multiply kernels (``silu``) left out (the products read their input unchanged, so
    the logits are wrong): what folding them into the products could save at most."""
    if name == "rms_norm":
        return kernels_patched(rms_norm=lambda x, weight, eps, residual=None, choices=None: (x, x))
    return kernels_patched(silu_and_mul=lambda x, choices=None: x[:, : x.shape[1] // 2])


def what_if_no_rope() -> contextlib.AbstractContextManager:
    """An upper bound: the step without RoPE and the KV write (attention reads the unrotated q
    and the cache as it was): what fusing them into attention could save at most."""

    def attention(q, k, v, cos, sin, kv_cache, layer, meta, scale, k_scale=1.0, v_scale=1.0,  # noqa: ANN001, ANN202
                  choices=DEFAULT):  # fmt: skip
        return kernels.paged_attention(q, kv_cache, layer, meta, scale, k_scale, v_scale, choices)

    return kernels_patched(rope_attention=attention)


@contextlib.contextmanager
def what_if_no_merge() -> Iterator[None]:
    """An upper bound: decode attention without its merge kernel (the output is left as
    allocated): what merging the splits elsewhere could save."""
    from kernels import triton_decode

    class _Skip:
        def __getitem__(self, grid: object) -> Callable[..., None]:
            return lambda *args, **kwargs: None

    saved = triton_decode._decode_merge_kernel
    triton_decode._decode_merge_kernel = _Skip()  # type: ignore[assignment]
    try:
        yield
    finally:
        triton_decode._decode_merge_kernel = saved


@contextlib.contextmanager
def combined(*changes: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for change in changes:
            stack.enter_context(change())
        yield


@contextlib.contextmanager
def folded(bench: LlamaBench, **change: object) -> Iterator[None]:
    """The norms folded into the products (``engine.model.fold_norms``, what the engine does
    on CUDA): the step takes ``kernels.rms_linear``/``linear_add_sums``, six launches a layer
    instead of ten, with the current model's kernel choices and ``change`` (``fold_sums``: the
    norms' sums of squares from the products before them, ...). The folded matrices are
    copies; the bench's own come back after."""
    from engine.model import fold_norms

    layers = bench.w.layers
    copies = [dataclasses.replace(lw, qkv=lw.qkv.clone(), gate_up=lw.gate_up.clone())
              for lw in layers]  # fmt: skip
    bench.w.layers = copies
    fold_norms(bench.w)
    try:
        with choosing(bench, **change):  # a model over the folded copies
            yield
    finally:
        bench.w.layers = layers
        del copies
        torch.cuda.empty_cache()


def pdl_off(bench: LlamaBench) -> contextlib.AbstractContextManager:
    return choosing(bench, pdl=False)


def run(args: argparse.Namespace) -> dict:
    dry = args.dry_run
    device = "cuda" if torch.cuda.is_available() and not dry else "cpu"
    if not dry and device != "cuda":
        raise SystemExit("no CUDA device: use --dry-run to check the script off the GPU")
    shape = "smollm2-135m" if dry else args.shape
    c = ModelConfig.from_dict(SHAPES[shape])
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    if args.plans is not None and device == "cuda":
        from kernels import triton_skinny

        triton_skinny.load_plans()
        triton_skinny.install_plans(args.plans, name)
    ceil = measure_ceilings(small=dry)
    ctx = 64 if dry else 1024
    res: dict = {"device": name, "date": args.date, "command": args.command, "shape": shape,
                 "torch": torch.__version__, "copy_TBps": ceil.copy_bytes_per_s / 1e12,
                 "rows": [], "profiles": []}  # fmt: skip
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # a dry run through the interpreter
    if (device == "cuda" or interpret) and (args.attention or args.only_attention):
        from lab import decode_attention_gpu

        ctxs = args.ctxs if device == "cuda" else [40]
        res.update(decode_attention_gpu.run(c, ceil, args.batches, ctxs, device,
                                            args.attention_labels, args.ctx_spread,
                                            tuple(args.kv)))  # fmt: skip
        if args.only_attention:
            args.out.mkdir(parents=True, exist_ok=True)
            best = {b: r["knobs"] for b, r in res["best"].items()}
            (args.out / "decode_attention_plans.json").write_text(json.dumps(best, indent=1))
    bench = (
        None
        if args.only_attention
        else LlamaBench(c, 16 * -(-(ctx + 1) // BLOCK), max_len=2 * ctx, device=device)
    )
    for weights in () if bench is None else args.weights:
        if weights == "fp8":
            bench.w.layers[:] = [quantize_layer(lw) for lw in bench.w.layers]
        wdtype = torch.float8_e4m3fn if weights == "fp8" else torch.bfloat16
        for b in args.batches:
            variants: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
                "installed": contextlib.nullcontext,
                "pdl_off": lambda: pdl_off(bench),
            }
            if weights == "fp8":
                variants["lm_head_fp8"] = lambda: lm_head_fp8(bench)
            # RoPE and the KV write in their own kernel, as before session 15
            variants["rope_unfused"] = lambda: choosing(bench, rope_in_attention=False)
            if weights == "bf16":
                # What the engine runs on CUDA: the norms folded, their sums of squares from
                # the products before them, RoPE in attention
                variants["folded"] = lambda: folded(bench)
                variants["folded_no_sums"] = lambda: folded(bench, fold_sums=False)
                variants["folded_sums_one_row"] = lambda: folded(bench, fold_sums_min_rows=1)
                variants["folded_rope_unfused"] = functools.partial(
                    combined, lambda: folded(bench), variants["rope_unfused"]
                )
                for label, knobs in ATTENTION_B8.items() if b == 8 else ():
                    variants[f"folded_attn_{label}"] = functools.partial(
                        combined,
                        lambda: folded(bench),
                        functools.partial(attention_plan, b, **knobs),
                    )
                variants["what_if_folded_no_merge"] = functools.partial(
                    combined, lambda: folded(bench), what_if_no_merge
                )
                # the engine's step of session 14
                variants["folded_s14"] = functools.partial(
                    combined, variants["folded_no_sums"], variants["rope_unfused"]
                )
            variants["what_if_no_rope"] = what_if_no_rope
            variants["what_if_no_merge"] = what_if_no_merge
            variants["what_if_no_rms_norm"] = lambda: what_if_without("rms_norm")
            variants["what_if_no_silu"] = lambda: what_if_without("silu")
            for change in CHANGES.get((weights, b), []) if device == "cuda" else []:
                label = "installed_" + "_".join(f"{k}{v}" for k, v in change.items())
                variants[label] = lambda change=change, b=b, wdtype=wdtype: installed_with(
                    c, b, wdtype, **change
                )
            if args.attention_plans is not None:
                variants["attention_plans"] = lambda b=b: attention_plans(args.attention_plans, b)
            more = plan_variants() if device == "cuda" else {}
            for vname, plan in more.get((weights, b), {}).items():
                variants[vname] = lambda plan=plan, b=b, wdtype=wdtype: layer_plans(
                    c, b, wdtype, plan
                )
            base = None
            base_logits = None
            for vname, change in variants.items():
                if args.variants and vname not in args.variants and vname != "installed":
                    continue
                try:
                    with change():
                        r = bench.decode(b, ctx, ceil)
                except Exception as e:  # recorded; the next variant still runs
                    res["rows"].append({"weights": weights, "batch": b, "variant": vname,
                                        "error": f"{type(e).__name__}: {e}"})  # fmt: skip
                    print(res["rows"][-1], flush=True)
                    continue
                base = r["step_ms"] if vname == "installed" else base
                logits = bench.last_logits.float()
                base_logits = logits if vname == "installed" else base_logits
                diff = (logits - base_logits).abs().max() / base_logits.abs().max()
                same = (logits.argmax(-1) == base_logits.argmax(-1)).float().mean()
                row = {"weights": weights, "batch": b, "variant": vname, **r,
                       "vs_installed": r["step_ms"] / base if base else None,
                       "logits_rel_diff": diff.item(), "argmax_same": same.item()}  # fmt: skip
                res["rows"].append(row)
                print({k: row.get(k) for k in COLS}, flush=True)
            if device == "cuda" and not args.no_profile:
                for vname in ("installed", "folded") if "folded" in variants else ("installed",):
                    if args.variants and vname not in args.variants and vname != "installed":
                        continue
                    with pdl_off(bench), variants[vname]():
                        prof = bench.profile_graph(b, ctx)
                    res["profiles"].append({"weights": weights, "variant": vname, **prof})
                    print(table(prof.get("rows", []), PROF_COLS))
    return res


def report(res: dict) -> str:
    lines = [f"# Decode-step variants: {res['device']}", "",
             f"- date: {res['date']}; command: `{res['command']}`; torch {res['torch']}; "
             f"shape {res['shape']}; copy bandwidth {res['copy_TBps']:.3f} TB/s", "",
             table(res["rows"], COLS + ["error"]), ""]  # fmt: skip
    if res.get("attention"):
        from lab import decode_attention_gpu

        lines += decode_attention_gpu.report(res)
    for p in res["profiles"]:
        lines += [f"## Profile, {p['weights']} batch {p.get('batch')}, "
                  f"{p.get('variant', 'installed')}, PDL off "
                  f"(kernels {p.get('kernels_us', 0):.0f} us per step)", "",
                  table(p.get("rows", []), PROF_COLS), ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--plans", type=Path, default=None,
                   help="install these plans first (lab.skinny_gpu's _plans.json)")  # fmt: skip
    p.add_argument(
        "--attention",
        action="store_true",
        help="also time decode attention alone for launch plans around the default",
    )
    p.add_argument(
        "--only-attention",
        action="store_true",
        help="the attention section only (writes decode_attention_plans.json)",
    )
    p.add_argument(
        "--ctxs",
        type=int,
        nargs="+",
        default=[1024, 4096],
        help="context lengths of the attention section",
    )
    p.add_argument(
        "--ctx-spread",
        type=float,
        default=0.0,
        help="the attention section draws each sequence's context from ctx * (1 +- this)",
    )
    p.add_argument("--kv", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"],
                   help="the attention section's KV dtypes")  # fmt: skip
    p.add_argument(
        "--attention-plans",
        type=Path,
        nargs="+",
        default=None,
        help="a step variant with these decode-attention plans (--only-attention's "
        "decode_attention_plans.json)",
    )
    p.add_argument(
        "--attention-labels",
        nargs="+",
        default=None,
        help="the attention section times only candidates whose label starts with one of "
        "these (DecodePlan.label: s1_, s8_n32, ...), beside the default",
    )
    p.add_argument("--weights", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    p.add_argument(
        "--variants", nargs="+", default=None, help="run only these step variants (and installed)"
    )
    p.add_argument("--no-profile", action="store_true", help="skip the per-kernel profiles")
    args = parse_bench_args(p, "lab.decode_variants", argv)
    res = run(args)
    md = report(res)
    print(md)
    stem = "decode_variants_" + res["device"].lower().replace("nvidia ", "").replace(" ", "_")
    out = args.out / stem.replace("(", "").replace(")", "")
    args.out.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
