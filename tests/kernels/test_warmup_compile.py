"""What the warm-up rests on costs nothing in the kernels: prefill and decode attention take
the block tables' width and the number of query tiles as plain runtime integers
(``do_not_specialize``, so one compiled variant serves every step of a plan), and compiled for
sm_90 off the GPU their PTX is the same, instruction for instruction, as with those arguments
specialised as divisible by 16 (what Triton did before for widths like 16 or 32; the block ids
are gathered one by one either way).

Skipped unless Triton (and its ptxas) imports; see ``tests/kernels/test_pdl_compile.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (see the docstring)")

from tests.skinny_cases import compiled_rows  # noqa: E402

COMPILE = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_decode, triton_prefill

def ptr(name):
    if name in ("part_ptr", "lse_ptr"):
        return "*fp32"
    if name in ("tables_ptr", "seq_lens_ptr", "q_start_ptr", "tickets_ptr", "slot_blocks_ptr",
                "slot_offsets_ptr"):
        return "*i64"
    return "*bf16"

def ptx(fn, consts, divisible, opts):
    names = fn.arg_names
    sig = {n: "constexpr" if n in consts else ptr(n) if n.endswith("_ptr") else
           "fp32" if n in ("scale_log2", "v_scale", "k_inv", "v_inv") else "i32" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in divisible}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    return out[out.index(".entry"):]

CASES = {
    "prefill": (triton_prefill._prefill_kernel, ["stride_tb", "num_m_tiles"], dict(
        GROUP=3, BLOCK_M=128, BLOCK_N=64, HEAD_DIM=64, BLOCK_D=64, DOT_PRECISION="tf32"),
        {"num_warps": 8, "num_stages": 3}),
    "decode_rope": (triton_decode._decode_split_kernel, ["stride_tb"], dict(
        GROUP=3, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=64, BLOCK_D=64, DOT_PRECISION="tf32", PDL=True,
        MERGE=0, PREFETCH=False, BLOCK_S=2, EARLY=False, ROPE=True, FP8=False),
        {"num_warps": 4, "launch_pdl": True}),
}
rows = []
for name, (fn, runtime, consts, opts) in CASES.items():
    fixed = [n for n in fn.arg_names if n.startswith("stride_") and n not in runtime]
    fixed += ["block_size", "num_splits"]
    a = ptx(fn, consts, fixed + runtime, opts)
    b = ptx(fn, consts, fixed, opts)
    ops = len(re.findall(r"^\\s+[a-z]", b, re.M))
    rows.append({"kernel": name, "same": a == b, "instructions": ops,
                 "dns": sorted(p.name for p in fn.params if p.do_not_specialize)})
print(json.dumps(rows))
"""


def test_runtime_lengths_compile_to_the_same_ptx_as_specialised_ones():
    rows = compiled_rows(COMPILE)
    assert [r["kernel"] for r in rows] == ["prefill", "decode_rope"]
    for r in rows:
        assert r["same"] and r["instructions"] > 500, r
    assert rows[0]["dns"] == ["num_m_tiles", "stride_tb"]
    assert rows[1]["dns"] == ["stride_tb"]
