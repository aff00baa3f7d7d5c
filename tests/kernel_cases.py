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
