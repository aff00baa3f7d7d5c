"""The skinny decode products (``kernels.triton_skinny``) run on the CPU through Triton's
interpreter, against the references: every path (one row and several on the CUDA cores, the
tensor-core path, split-K, uneven tiles, FP8 weights, the folded norm) on small shapes.

Skipped unless Triton is importable; the repository does not depend on it on CPU hosts:

    pip install --target /tmp/triton-3.6 triton==3.6.0 "numpy<2.3"
    PYTHONPATH=/tmp/triton-3.6 .venv/bin/python -m pytest -q tests/kernels/test_skinny_interpret.py

(Triton 3.6's interpreter indexes 1-element arrays as scalars, which numpy 2.3 refused.)"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (see the docstring)")

from tests.skinny_cases import compiled_rows, interpreted_json  # noqa: E402

SCRIPT = """
import json, torch
from tests.skinny_cases import fold_sums_cases, product_cases, small_plans
fma, dot = small_plans(dot_ok=False), [p for p in small_plans() if p.dot]
rows = product_cases("cpu", torch.bfloat16, fma, shapes=((40, 96),), rows=(1, 3))
# 2 and 8 rows on the CUDA cores (one accumulator per row), FP8 weights included
rows += product_cases("cpu", torch.bfloat16, fma[2:4], shapes=((40, 96),), rows=(2, 8))
# The interpreter's bf16 tl.dot is wrong (fp16 is right): the tensor-core path in fp16 here.
rows += product_cases("cpu", torch.float16, dot, shapes=((40, 96),), rows=(2,))
# the folded norm's sums of squares from the product before it (KernelChoices.fold_sums)
rows += fold_sums_cases("cpu", torch.bfloat16, fma[:1] + fma[2:3] + fma[-1:], rows=(1, 3))
rows += fold_sums_cases("cpu", torch.float16, dot, rows=(2,))
print(json.dumps(rows))
"""


def test_interpreter_matches_references():
    rows = interpreted_json(SCRIPT)
    assert isinstance(rows, list)
    assert len(rows) >= 32 + 44
    assert sum(n.startswith("sums_") for n, _ in rows) == 44
    bad = [(n, e) for n, e in rows if not e < 1e-2]
    assert not bad, bad[:10]


COMPILE = """
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_skinny as S

fn = S._skinny_kernel
PTRS = {"x_ptr": "*bf16", "scale_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16",
        "part_ptr": "*fp32", "lock_ptr": "*i32", "add_ptr": "*bf16", "sums_ptr": "*fp32"}
out = []
for wt in ("*bf16", "*fp8e4nv"):
    for plan, prologue, rows, pdl in (
            (S.SkinnyPlan(block_n=4, block_k=1024), 0, 1, False),
            (S.SkinnyPlan(block_n=16, block_k=256, dot=True, num_stages=4), 0, 16, False),
            (S.SkinnyPlan(block_n=4, block_k=1024), 0, 8, False),  # 8 rows on the CUDA cores
            (S.SkinnyPlan(block_n=4, block_k=1024), 0, 1, True),  # programmatic launch
            # the folded norm: one row with its pass before the loop, and SiLU's epilogue;
            # 16 rows on the tensor cores with the sums in the loop; the residual's epilogue
            (S.SkinnyPlan(block_n=4, block_k=1024), 3, 1, False),
            (S.SkinnyPlan(block_n=128, block_k=128, dot=True, num_stages=4), 3, 16, False),
            (S.SkinnyPlan(block_n=64, block_k=128, dot=True, num_stages=6), 0, 16, False),
            # the norm's sums of squares from the product before (FOLD_SUMS), and for the next
            (S.SkinnyPlan(block_n=64, block_k=256, dot=True, num_stages=3), 3, 16, True),
            (S.SkinnyPlan(block_n=4, block_k=1024), 3, 1, True)):
        if (prologue == 3 or plan.block_n == 64) and wt != "*bf16":  # the folded model's
            continue  # paths take no FP8 weights
        sums = prologue == 3 and pdl  # (the cases above with the sums are the ones with PDL)
        fold = dict(NORM=prologue == 3, SILU=prologue == 3 and plan.dot and not sums,
                    ADD=plan.block_n == 64, NORM_FIRST=prologue == 3 and not plan.dot and not sums,
                    SUMS_IN=sums, SUMS_T=64 if sums else 1,
                    SUMS_OUT=sums and plan.block_n == 64)
        consts = dict(PROLOGUE=prologue, HAS_SCALE=wt == "*fp8e4nv",
                      HAS_BIAS=False, SPLIT_K=1, BLOCK_M=rows, PDL=pdl,
                      BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, DOT=plan.dot, EVEN_K=True,
                      EVEN_N=True, PREFETCH=not plan.dot, VEC=plan.block_k if plan.dot else 8,
                      XR=1 if plan.block_k % (256 * plan.num_warps) == 0 else plan.block_n,
                      QX=False, N_PREFETCH=0, LINE=64, **fold)
        sig = {n: "constexpr" if n in consts else PTRS.get(n, wt if n == "w_ptr" else
               "fp32" if n == "eps" else "i32") for n in fn.arg_names}
        div = [i for i, n in enumerate(fn.arg_names) if n not in consts and n not in ("M", "eps")]
        src = ASTSource(fn=fn, signature=sig,
                        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                        attrs={(i,): [["tt.divisibility", 16]] for i in div})
        opts = {"num_warps": plan.num_warps, "num_stages": plan.num_stages}
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={**opts, "launch_pdl": True} if pdl else opts)
        ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
        loop = ttgir[ttgir.index("scf.for"):ttgir.rindex("scf.yield")]
        out.append({"case": f"{wt} {plan.label()} prologue {prologue} rows {rows} pdl {pdl}",
                    "pdl": pdl, "gdc": ptx.count("griddepcontrol.wait"),
                    "loop_converts": loop.count("convert_layout"),
                    "wide_loads": ptx.count("ld.global.v4.b32") + ptx.count("ld.global.v2.b32")
                    + ptx.count("cp.async.cg.shared.global")})
print(json.dumps(out))
"""


def test_compiled_for_hopper_without_shuffles_in_the_loop():
    """The kernel compiled for sm_90 off the GPU (Triton's compiler and ptxas need no device):
    the weight and x share one register layout in the loop (no ``convert_layout``, which goes
    through shared memory every step: what the first version did), also with 8 rows on the
    CUDA cores and with the folded norm's paths, and loads are wide; ``griddepcontrol.wait`` only
    with ``PDL``."""
    rows = compiled_rows(COMPILE)
    assert len(rows) == 13
    for r in rows:
        assert r["loop_converts"] == 0 and r["wide_loads"] > 0, r
        assert (r["gdc"] > 0) == r["pdl"], r  # griddepcontrol only where asked for
