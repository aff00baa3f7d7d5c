"""Random paged batches for kernel tests: factories shared by the GPU tests and the
interpreter check (``TRITON_INTERPRET=1``), so both draw the same kinds of inputs."""

from __future__ import annotations

import torch

from kernels.reference import AttentionMetadata


def make_paged_batch(
    seq_lens: list[int],
    q_lens: list[int],
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_layers: int = 2,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    seed: int = 0,
    draw_on_device: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``(q [T, H, D], kv_cache, meta)``: each sequence's blocks are a random, scattered set of
    pool blocks, the pool is filled with random K/V (new tokens' included), and the new tokens
    of sequence ``i`` are its last ``q_lens[i]`` positions (a cached prefix sits before them)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 3  # spare blocks that no table names
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in nblk:
        tables.append(perm[at : at + n])
        at += n
    width = max(max(nblk), 1)
    padded = [t + [0] * (width - len(t)) for t in tables]
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    if draw_on_device:
        kv_cache = torch.randn(shape, device=device, dtype=dtype)
    else:
        kv_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    slots_b, slots_o, starts = [], [], [0]
    for s, q, t in zip(seq_lens, q_lens, tables, strict=True):
        for p in range(s - q, s):
            slots_b.append(t[p // block_size])
            slots_o.append(p % block_size)
        starts.append(starts[-1] + q)
    q = torch.randn((starts[-1], num_heads, head_dim), generator=g).to(dtype=dtype, device=device)

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    meta = AttentionMetadata(
        slot_blocks=dev(slots_b),
        slot_offsets=dev(slots_o),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device),
        seq_lens=dev(seq_lens),
        query_start_loc=dev(starts),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
    )
    return q, kv_cache, meta


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; inf if ``out`` holds a NaN."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """The reference in float32 on the CPU, on the upcast inputs (a higher-precision target
    for bf16 kernels; an FP8 cache stays FP8, read with its scales); returned on ``q``'s
    device."""
    from kernels import reference

    cpu = AttentionMetadata(
        meta.slot_blocks.cpu(),
        meta.slot_offsets.cpu(),
        meta.block_tables.cpu().long(),
        meta.seq_lens.cpu().long(),
        meta.query_start_loc.cpu().long(),
        meta.max_query_len,
        meta.max_seq_len,
        meta.block_size,
    )
    fp8 = kv_cache.dtype == reference.FP8
    kv = kv_cache.view(torch.uint8).cpu().view(reference.FP8) if fp8 else kv_cache.float().cpu()
    out = reference.paged_attention(q.float().cpu(), kv, layer, cpu, scale, k_scale, v_scale)
    return out.to(q.device)


def rope_attention_cases(
    device: str,
    dtype: torch.dtype,
    knobs: list[dict],
    fp8: bool = False,
    heads: tuple[int, int, int] = (8, 2, 64),
    lens: tuple[int, ...] = (1, 17, 200, 0, 64, 33),
) -> list[tuple[str, float, bool]]:
    """Decode attention with RoPE and the KV write inside (``triton_decode``'s ``rope``)
    against the two kernels it replaces (``triton_rope_kv.rope_write_kv``, then the same
    plan without ``rope``), on a batch whose q, k and v are views of one QKV product's rows:
    ``(case, relative error of the outputs, caches equal bit for bit)`` per plan. Lengths 1
    (only the new token), a padding row (length 0, no slot) and lengths that end inside and
    at the end of a split and a block (``lens``, the fourth a padding row; ``heads``: q heads,
    KV heads, head size)."""
    from kernels import triton_decode as T
    from kernels import triton_rope_kv
    from kernels.triton_cache import PagedLayer

    h, hkv, d = heads
    bs = 16
    q0, kv, meta = make_paged_batch([max(n, 1) for n in lens], [1] * len(lens), block_size=bs,
                                    num_heads=h, num_kv_heads=hkv, head_dim=d, dtype=dtype,
                                    device=device, seed=3)  # fmt: skip
    meta.seq_lens[3] = 0
    meta.slot_blocks[3] = -1
    g = torch.Generator().manual_seed(5)
    b = len(lens)
    qkv = torch.randn(b, (h + 2 * hkv) * d, generator=g).to(device, dtype)
    q, k, v = (t.view(b, -1, d) for t in qkv.split([h * d, hkv * d, hkv * d], -1))
    ang = torch.rand(b, d // 2, generator=g) * 6
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(device, dtype) for f in (torch.cos, torch.sin))
    ks, vs = (0.5, 2.0) if fp8 else (1.0, 1.0)
    if fp8:
        kv = (kv.float() / 2).to(torch.float8_e4m3fn)
    rows = []
    for kn in knobs:
        plan = (
            T.DecodePlan(b, h, hkv, d, **kn) if kn else T.DecodePlan.make(q, PagedLayer.of(kv, 1))
        )
        want_kv, got_kv = kv.clone(), kv.clone()
        qr = triton_rope_kv.rope_write_kv(q, k, v, cos, sin, want_kv, 1, meta.slot_blocks,
                                          meta.slot_offsets, ks, vs)  # fmt: skip
        want = T.decode_attention(qr, want_kv, 1, meta.block_tables, meta.seq_lens, 0.1, plan,
                                  ks, vs)  # fmt: skip
        rope = T.Rope(k, v, cos, sin, meta.slot_blocks, meta.slot_offsets)
        got = T.decode_attention(q, got_kv, 1, meta.block_tables, meta.seq_lens, 0.1, plan,
                                 ks, vs, rope=rope)  # fmt: skip
        same = torch.equal(got_kv.view(torch.uint8), want_kv.view(torch.uint8))
        zero = got[3].abs().max().item() == 0.0
        rows.append((f"fp8 {fp8} {plan.label()}", rel_err(got, want), same and zero))
    return rows
