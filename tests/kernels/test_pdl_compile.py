"""Programmatic dependent launch (``KernelChoices.pdl``): every Triton kernel of the decode
step that takes part compiles for sm_90 off the GPU with ``griddepcontrol.wait`` (and the
launch of its dependents) before anything else, and without them when off. Triton's compiler
and ptxas need no device; skipped where Triton (or its ptxas) is missing:

    pip install --target /tmp/triton-3.6 triton==3.6.0
    PYTHONPATH=/tmp/triton-3.6 .venv/bin/python -m pytest -q tests/kernels/test_pdl_compile.py

On the GPU, ``tests/gpu/test_skinny_gpu.py::test_pdl_on_is_pdl_off_bit_for_bit_in_a_cuda_graph``
and ``lab.skinny_gpu``'s ``_pdl`` step modes (``same_as_no_pdl``) check the results."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (see the docstring)")

from tests.skinny_cases import compiled_rows  # noqa: E402

COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton_decode, triton_lora, triton_norm, triton_rope_kv, triton_skinny

def ptr(name):
    if name in ("part_ptr", "lse_ptr", "cos_ptr", "sin_ptr", "scale_ptr", "sums_ptr"):
        return "*fp32"
    if name in ("tables_ptr", "seq_lens_ptr", "slot_blocks_ptr", "slot_offsets_ptr", "lock_ptr",
                "rows_ptr", "start_ptr", "len_ptr", "slot_ptr", "tickets_ptr"):
        return "*i32"
    return "*bf16"

CASES = {
    "rms_norm": (triton_norm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK=4096)),
    "silu_and_mul": (triton_norm._silu_and_mul_kernel, dict(BLOCK=2048)),
    "rope_write_kv": (triton_rope_kv._rope_write_kernel, dict(
        HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64, FP8=False)),
    "decode_split": (triton_decode._decode_split_kernel, dict(
        GROUP=4, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32",
        MERGE=0, PREFETCH=False, BLOCK_S=2, EARLY=False, ROPE=False, FP8=False)),
    # RoPE and the new token's KV write inside (KernelChoices.rope_in_attention)
    "decode_split_rope": (triton_decode._decode_split_kernel, dict(
        GROUP=4, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32",
        MERGE=0, PREFETCH=False, BLOCK_S=2, EARLY=False, ROPE=True, FP8=False)),
    # the register prefetch, and the last split merging (its ticket)
    "decode_split_merge": (triton_decode._decode_split_kernel, dict(
        GROUP=4, BLOCK_G=16, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128, DOT_PRECISION="tf32",
        MERGE=1, PREFETCH=True, BLOCK_S=8, EARLY=False, ROPE=False, FP8=False)),
    "decode_merge": (triton_decode._decode_merge_kernel, dict(
        HEAD_DIM=128, BLOCK_S=16, BLOCK_D=128)),
    "skinny": (triton_skinny._skinny_kernel, dict(
        PROLOGUE=0, HAS_SCALE=False, HAS_BIAS=False, SPLIT_K=2, BLOCK_M=8,
        BLOCK_N=4, BLOCK_K=1024, DOT=False, EVEN_K=True, EVEN_N=True, PREFETCH=True, VEC=8,
        XR=1, QX=False, N_PREFETCH=0, LINE=64, NORM=False, ADD=False, SILU=False,
        NORM_FIRST=False, SUMS_IN=False, SUMS_T=1, SUMS_OUT=False)),
    # the tensor cores' loop (pipelined after the wait): its first tiles asked into L2 before
    "skinny_dot": (triton_skinny._skinny_kernel, dict(
        PROLOGUE=0, HAS_SCALE=False, HAS_BIAS=False, SPLIT_K=1, BLOCK_M=16,
        BLOCK_N=32, BLOCK_K=256, DOT=True, EVEN_K=True, EVEN_N=True, PREFETCH=False, VEC=256,
        XR=32, QX=False, N_PREFETCH=2, LINE=64, NORM=False, ADD=False, SILU=False,
        NORM_FIRST=False, SUMS_IN=False, SUMS_T=1, SUMS_OUT=False)),
    # the folded norm's sums of squares from the product before (read after the wait) and
    # for the one after (KernelChoices.fold_sums), with the residual add
    "skinny_dot_sums": (triton_skinny._skinny_kernel, dict(
        PROLOGUE=3, HAS_SCALE=False, HAS_BIAS=False, SPLIT_K=1, BLOCK_M=16,
        BLOCK_N=64, BLOCK_K=128, DOT=True, EVEN_K=True, EVEN_N=True, PREFETCH=False, VEC=128,
        XR=64, QX=False, N_PREFETCH=0, LINE=64, NORM=True, ADD=True, SILU=False,
        NORM_FIRST=False, SUMS_IN=True, SUMS_T=64, SUMS_OUT=True)),
    "lora_shrink": (triton_lora._shrink_kernel, dict(
        BLOCK_M=16, BLOCK_R=64, BLOCK_K=128, K_SPLIT=1024, PREC="tf32")),
    "lora_expand": (triton_lora._expand_kernel, dict(
        BLOCK_M=16, BLOCK_R=16, BLOCK_N=128, SPLITS=4, PREC="tf32")),
}
out = []
for name, (fn, consts) in CASES.items():
    for pdl in (False, True):
        c = {**consts, "PDL": pdl}
        sig = {n: "constexpr" if n in c else ptr(n) if n.endswith("_ptr") else
               "fp32" if n in ("eps", "scale_log2", "v_scale", "k_inv", "v_inv") else "i32"
               for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig,
                        constexprs={(fn.arg_names.index(k),): v for k, v in c.items()})
        opts = {"num_warps": 4, "launch_pdl": pdl}
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        first = min((body.index(s) for s in ("ld.global", "st.global") if s in body),
                    default=len(body))
        out.append({"kernel": name, "pdl": pdl, "wait": body.count("griddepcontrol.wait"),
                    "launch": body.count("griddepcontrol.launch_dependents"),
                    "wait_first": "griddepcontrol.wait" in body[:first],
                    "loads_before_wait": body.split("griddepcontrol.wait")[0].count("ld.global")
                    if pdl else 0,
                    "l2_before_wait": "prefetch.global.L2" in body.split("griddepcontrol.wait")[0]
                    if pdl else "prefetch.global.L2" in body})
print(json.dumps(out))
"""


def test_decode_kernels_compile_with_and_without_pdl_for_hopper():
    rows = compiled_rows(COMPILE)
    assert len(rows) == 24
    for r in rows:
        # only the tensor-core product asks for weights in L2, and only with PDL
        assert r["l2_before_wait"] == (r["kernel"] == "skinny_dot" and r["pdl"]), r
        if r["pdl"]:
            assert r["wait"] == 1 and r["launch"] == 1, r
            # nothing is read or written before the wait, except by the skinny product: its
            # first weight tile (never written by a kernel) is loaded before it, and by decode
            # attention's splits: the sequence's length, and nothing else
            early = r["kernel"] == "skinny" or r["kernel"].startswith("decode_split")
            assert r["wait_first"] == (not early), r
            if r["kernel"].startswith("decode_split"):
                assert r["loads_before_wait"] == 1, r
        else:
            assert r["wait"] == 0 and r["launch"] == 0, r
