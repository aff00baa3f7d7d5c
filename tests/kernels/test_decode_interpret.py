"""Decode attention (``kernels.triton_decode``) on the CPU through Triton's interpreter, against
the reference: the merge kernel and the last split merging by ticket, the register prefetch,
one split and many, FP8 KV, padding rows, and the tickets left zero; then every plan that
a benchmark times (``triton_decode.candidates``) compiled for sm_90 off the GPU.

Skipped unless Triton is importable (see ``tests/kernels/test_skinny_interpret.py``'s docstring)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed (see the docstring)")

from tests.skinny_cases import compiled_rows, interpreted_json  # noqa: E402

SCRIPT = """
import json, torch
from kernels import triton_decode as T
from tests.kernel_cases import make_paged_batch, reference_attention, rel_err
rows = []
for fp8 in (False, True):
    for bs, h, hkv, d, lens in ((16, 8, 2, 64, [1, 17, 200, 5]), (8, 6, 2, 48, [33, 130])):
        # (the interpreter's bf16 tl.dot is wrong, fp16 is right)
        q, kv, meta = make_paged_batch(lens, [1] * len(lens), block_size=bs, num_heads=h,
                                       num_kv_heads=hkv, head_dim=d, dtype=torch.float16,
                                       device="cpu", seed=1)
        ks = vs = 1.0
        if fp8:
            kv, ks, vs = (kv.float() / 2).to(torch.float8_e4m3fn), 2.0, 2.0
        ref = reference_attention(q, kv, 1, meta, 0.1, ks, vs)
        if len(lens) == 4:  # a padding row
            meta.seq_lens[3] = 0
            ref[3] = 0
        for knobs in ({"num_splits": 1, "block_n": 16}, {"num_splits": 3, "block_n": 16},
                      {"num_splits": 3, "block_n": 16, "merge": True},
                      {"num_splits": 1, "block_n": 32, "merge": True, "prefetch": True},
                      {"num_splits": 4, "block_n": 16, "merge": True, "prefetch": True},
                      {"num_splits": 2, "block_n": 32, "prefetch": True},
                      {"num_splits": 8, "block_n": 16, "merge": True},
                      {"num_splits": 2, "block_n": 16, "merge": True, "prefetch": True,
                       "early": True}):
            plan = T.DecodePlan(len(lens), h, hkv, d, **knobs)
            for _ in range(2):  # the second call sees the tickets the first left
                out = T.decode_attention(q, kv, 1, meta.block_tables, meta.seq_lens, 0.1, plan,
                                         ks, vs)
                rows.append([f"fp8 {fp8} bs {bs} {plan.label()}", rel_err(out, ref),
                             out[3].abs().max().item() if len(lens) == 4 else 0.0])
left = int(T._TICKETS[torch.device("cpu")].abs().sum())
print(json.dumps({"rows": rows, "tickets_left": left}))
"""


def test_interpreter_matches_reference():
    res = interpreted_json(SCRIPT)
    assert isinstance(res, dict)
    assert len(res["rows"]) == 64
    bad = [r for r in res["rows"] if not (r[1] < 1e-2 and r[2] == 0.0)]
    assert not bad, bad[:10]
    assert res["tickets_left"] == 0


ROPE = """
import json, torch
from tests.kernel_cases import rope_attention_cases
knobs = [{"num_splits": 1, "block_n": 16}, {"num_splits": 3, "block_n": 16},
         {"num_splits": 3, "block_n": 16, "merge": True},
         {"num_splits": 4, "block_n": 16, "merge": True, "prefetch": True},
         {"num_splits": 2, "block_n": 32, "prefetch": True},
         {"num_splits": 2, "block_n": 16, "merge": True, "prefetch": True, "early": True}]
rows = rope_attention_cases("cpu", torch.float16, knobs)
rows += rope_attention_cases("cpu", torch.float16, knobs[:3] + knobs[-1:], fp8=True)
print(json.dumps(rows))
"""


def test_rope_inside_matches_rope_write_then_attention():
    """``KernelChoices.rope_in_attention``'s kernel against ``rope_write_kv`` then the same plan:
    every kind of plan, bf16-like and FP8 caches, the cache written bit for bit the same, a
    padding row left zero."""
    rows = interpreted_json(ROPE)
    assert isinstance(rows, list) and len(rows) == 10
    bad = [r for r in rows if not (r[1] < 1e-3 and r[2])]
    assert not bad, bad


COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.triton_decode import candidates
from kernels import triton_decode as T

fn = T._decode_split_kernel
PTRS = {"q_ptr": "*bf16", "tables_ptr": "*i32", "seq_lens_ptr": "*i32", "part_ptr": "*fp32",
        "lse_ptr": "*fp32", "out_ptr": "*bf16", "tickets_ptr": "*i32"}
plans = [T.DecodePlan(8, 32, 8, 128, 8)] + [T.DecodePlan(8, 32, 8, 128, **k)
                                            for b in (1, 8) for k in candidates(b)]
out = []
for kv in ("*bf16", "*fp8e4nv"):
    for plan in plans:
        merge = (2 if plan.num_splits == 1 else 1) if plan.merge else 0
        consts = dict(GROUP=4, BLOCK_G=16, BLOCK_N=plan.block_n, HEAD_DIM=128, BLOCK_D=128,
                      DOT_PRECISION="tf32", PDL=True, MERGE=merge, PREFETCH=plan.prefetch,
                      BLOCK_S=max(triton.next_power_of_2(plan.num_splits), 2), EARLY=plan.early,
                      ROPE=False, FP8=False)
        sig = {n: "constexpr" if n in consts else PTRS.get(n, kv if n in ("k_ptr", "v_ptr")
               else "fp32" if n in ("scale_log2", "v_scale") else "i32") for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig,
                        constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": plan.num_warps, "launch_pdl": True,
                                    "num_stages": 1 if plan.prefetch else plan.num_stages})
        ptx = k.asm["ptx"]
        ptx = ptx[ptx.index(".entry"):]
        first = min(ptx.index(s) for s in ("ld.global", "st.global") if s in ptx)
        out.append({"plan": f"{kv} {plan.label()}", "prefetch": plan.prefetch,
                    "early": plan.early, "wait_first": "griddepcontrol.wait" in ptx[:first],
                    "loads_before_wait": ptx.split("griddepcontrol.wait")[0].count("ld.global"),
                    "merge": merge, "smem": k.metadata.shared,
                    "atomics": ptx.count("atom.global"),
                    "cp_async": ptx.count("cp.async.cg"),
                    "gdc": ptx.count("griddepcontrol.wait")})
print(json.dumps(out))
"""


@pytest.mark.slow  # 90 compilations: about two and a half minutes on two cores
def test_plans_compile_for_hopper():
    """Every benched plan compiles for sm_90 (Triton's compiler and ptxas need no device): the
    ticket's atomics only where the last split merges, the prefetch without Triton's
    shared-memory pipeline, within the shared memory of two programs per multiprocessor, and
    before the PDL wait only the sequence's length, or in ``early`` plans K/V and block ids."""
    from kernels.triton_decode import candidates

    rows = compiled_rows(COMPILE)
    assert len(rows) == 2 * (1 + len(candidates(1)) + len(candidates(8)))
    for r in rows:
        assert (r["atomics"] > 0) == (r["merge"] == 1), r
        assert r["gdc"] > 0 and r["smem"] <= 113 * 1024, r
        if r["prefetch"]:
            assert r["cp_async"] == 0, r
        # before the wait: the length; early plans also K/V and block ids (never q)
        assert not r["wait_first"], r
        assert (r["loads_before_wait"] > 1) == r["early"], r
