"""Each Triton kernel against its reference on fresh random inputs, before anything is timed;
and the attention kernels timed alone against the ceilings."""

from __future__ import annotations

import torch

from bench.gpu_common import Ceilings, graph_time_ms
from kernels import reference
from kernels.triton_cache import write_kv
from kernels.triton_decode import decode_attention
from kernels.triton_norm import rms_norm, silu_and_mul
from kernels.triton_prefill import prefill_attention
from kernels.triton_rope import rotary_embedding
from kernels.triton_rope_kv import rope_write_kv
from kernels.triton_skinny import SkinnyPlan, linear
from tests.kernel_cases import make_paged_batch, reference_attention, rel_err

TOL = 1e-2


def check_kernels(seed: int) -> list[dict]:
    """Relative errors of every kernel on Llama-3.1-8B head shapes (fresh inputs per seed)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    lens = torch.randint(1, 5000, (8,), generator=g).tolist()
    q, kv, meta = make_paged_batch(
        lens, [1] * 8, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, seed=seed
    )
    out = decode_attention(q, kv, 1, meta.block_tables, meta.seq_lens, 128**-0.5)
    rows.append(("decode_attention", rel_err(out, reference_attention(q, kv, 1, meta, 128**-0.5))))
    q_lens = [700, 1, 300]
    lens = [
        q + int(p) for q, p in zip(q_lens, torch.randint(0, 900, (3,), generator=g), strict=True)
    ]
    q, kv, meta = make_paged_batch(
        lens, q_lens, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128, seed=seed + 1
    )
    out = prefill_attention(
        q, kv, 0, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len, 0.088
    )
    rows.append(("prefill_attention", rel_err(out, reference_attention(q, kv, 0, meta, 0.088))))
    t = int(meta.query_start_loc[-1])
    k = torch.randn(t, 8, 128, device="cuda").to(torch.bfloat16)
    expected = kv.clone()
    reference.write_kv(expected, 1, k, k, meta)
    write_kv(kv, 1, k, k, meta.slot_blocks, meta.slot_offsets)
    rows.append(("write_kv", 0.0 if torch.equal(kv, expected) else float("inf")))
    x, r = (torch.randn(t, 4096, device="cuda").to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    rows.append(
        ("rms_norm", rel_err(rms_norm(x, w, 1e-5, r)[0], reference.rms_norm(x, w, 1e-5, r)[0]))
    )
    y = torch.randn(t, 2 * 14336, device="cuda").to(torch.bfloat16)
    rows.append(("silu_and_mul", rel_err(silu_and_mul(y), reference.silu_and_mul(y))))
    qq = torch.randn(t, 32, 128, device="cuda").to(torch.bfloat16)
    ang = torch.rand(t, 64, device="cuda") * 1000
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    got, want = rotary_embedding(qq, k, cos, sin), reference.rotary_embedding(qq, k, cos, sin)
    rows.append(("rotary_embedding", max(rel_err(got[0], want[0]), rel_err(got[1], want[1]))))
    # RoPE with the KV write fused in: bit for bit the unfused Triton pair, and so as close to
    # the references as they are.
    cache, unfused = kv.clone(), kv.clone()
    got_q = rope_write_kv(qq, k, k, cos, sin, cache, 1, meta.slot_blocks, meta.slot_offsets)
    write_kv(unfused, 1, got[1], k, meta.slot_blocks, meta.slot_offsets)
    exact = torch.equal(got_q, got[0]) and torch.equal(cache, unfused)
    rows.append(("rope_write_kv", rel_err(got_q, want[0]) if exact else float("inf")))
    for m in (1, 3, 8):  # the skinny kernel's rows (more take cuBLAS)
        xm, wm = torch.randn(m, 4096, device="cuda"), torch.randn(6144, 4096, device="cuda")
        bias = torch.randn(6144, device="cuda")
        got = linear(xm.bfloat16(), wm.bfloat16(), bias.bfloat16())
        want = torch.nn.functional.linear(
            xm.bfloat16().float(), wm.bfloat16().float(), bias.bfloat16().float()
        )
        rows.append((f"linear_rows{m}", rel_err(got, want)))
    return [{"kernel": n, "rel_err": e, "ok": e < TOL} for n, e in rows]


def _decode_ms(b: int, ctx: int) -> float:
    per_layer = b * ctx * 2 * 8 * 128 * 2
    layers = min(16, max(1, -(-(256 << 20) // per_layer)))  # keep the KV read past the L2
    q, kv, meta = make_paged_batch(
        [ctx] * b,
        [1] * b,
        block_size=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_layers=layers,
        draw_on_device=True,
    )
    calls = [
        lambda i=i: decode_attention(q, kv, i % layers, meta.block_tables, meta.seq_lens, 0.1)
        for i in range(max(layers, 4))
    ]
    return graph_time_ms(calls)


def _prefill_ms(t: int) -> float:
    q, kv, meta = make_paged_batch(
        [t],
        [t],
        block_size=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        num_layers=1,
        draw_on_device=True,
    )
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, t, 0.1)
    return graph_time_ms([lambda: prefill_attention(q, kv, 0, *args)] * 4)


def time_attention(ceil: Ceilings) -> list[dict]:
    """Decode attention alone (8B heads, graph replays) against the copy bandwidth, and
    prefill attention at 4k against the matrix rate."""
    rows = []
    for b, ctx in [(1, 8192), (8, 8192), (32, 8192), (128, 1024)]:
        ms = _decode_ms(b, ctx)
        frac = b * ctx * 2 * 8 * 128 * 2 / ceil.copy_bytes_per_s / (ms / 1e3)
        rows.append(
            {"kernel": "decode_attention", "batch": b, "ctx": ctx, "ms": ms, "frac_copy_bw": frac}
        )
        torch.cuda.empty_cache()
    t = 4096
    ms = _prefill_ms(t)
    flops = 2 * t * t * 128 * 32  # causal: half of 4*T^2*D per head
    frac = flops / ceil.matmul_flops_per_s / (ms / 1e3)
    rows.append(
        {"kernel": "prefill_attention", "batch": 1, "ctx": t, "ms": ms, "frac_matmul": frac}
    )
    return rows


GEMV_SHAPES = {  # Llama-3.1-8B weights: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


GEMV_VARIANTS = {
    "triton": None,  # the installed (measured) plan, else the heuristic
    "triton_fma_n8": SkinnyPlan(block_n=8, block_k=1024),  # CUDA cores
    "triton_dot_n64": SkinnyPlan(block_n=64, block_k=128, num_stages=6, dot=True),  # tensor cores
    "cublas": "cublas",
}


def time_gemv(ceil: Ceilings) -> list[dict]:
    """Skinny products of the 8B weights: the Triton kernel (a few plans) against cuBLAS
    (F.linear), over enough distinct weight copies that the L2 cannot serve them."""
    rows = []
    for name, (n, k) in GEMV_SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in (1, 4, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row: dict = {"weight": name, "rows": m}
            for label, plan in GEMV_VARIANTS.items():
                if plan == "cublas":
                    calls = [lambda w=w, x=x: torch.nn.functional.linear(x, w) for w in ws]
                else:
                    calls = [lambda w=w, x=x, p=plan: linear(x, w, plan=p) for w in ws]
                ms = graph_time_ms(calls * 2)
                row[f"{label}_us"] = ms * 1e3
                row[f"{label}_frac_copy_bw"] = nbytes / ceil.copy_bytes_per_s / (ms / 1e3)
            rows.append(row)
        del ws
        torch.cuda.empty_cache()
    return rows
