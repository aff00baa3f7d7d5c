"""Triton RoPE with the KV-cache write fused in: one launch per layer rotates q, rotates k and
writes k and v straight into their paged slots (FP8 caches scaled and saturated), where the
unfused path launches RoPE and then the KV write, and round-trips the rotated k through
memory. The reference is ``reference.rope_write_kv`` (RoPE, then the write)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, pdl_kwargs
from kernels.triton_cache import PagedLayer
from kernels.triton_rope import rope_mix


@triton.jit
def _rotated(x_ptr, stride_h, num_heads, c1, c2, s1, s2, HALF: tl.constexpr,
             BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Both halves of the rotated heads of one token, rounded like the reference."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    src = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    return rope_mix(x1, c1, -x2, s1), rope_mix(x2, c2, x1, s2), mask


@triton.jit
def to_cache(x, inv, FP8: tl.constexpr):
    if FP8:  # scaled and saturated like reference.to_fp8
        x = tl.clamp(x.to(tl.float32) * inv, -448.0, 448.0)
    return x


@triton.jit
def _rope_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
    slot_blocks_ptr, slot_offsets_ptr, k_inv, v_inv,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    stride_qot, stride_qoh, stride_cb, stride_ct, stride_ch, num_q_heads, num_kv_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    c1 = tl.load(cos_ptr + t * stride_cos + offs_d, mask=dmask, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_cos + HALF + offs_d, mask=dmask, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_sin + offs_d, mask=dmask, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_sin + HALF + offs_d, mask=dmask, other=0.0)[None, :]
    q1, q2, qmask = _rotated(q_ptr + t * stride_qt, stride_qh, num_q_heads, c1, c2, s1, s2,
                             HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    dst = q_out_ptr + t * stride_qot + tl.arange(0, BLOCK_HQ)[:, None] * stride_qoh
    dst += offs_d[None, :]
    tl.store(dst, q1.to(q_out_ptr.dtype.element_ty), mask=qmask)
    tl.store(dst + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=qmask)
    blk = tl.load(slot_blocks_ptr + t).to(tl.int64)
    if blk < 0:  # a padding row of a captured decode graph: writes no KV
        return
    off = tl.load(slot_offsets_ptr + t).to(tl.int64)
    k1, k2, kmask = _rotated(k_ptr + t * stride_kt, stride_kh, num_kv_heads, c1, c2, s1, s2,
                             HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip
    offs_h = tl.arange(0, BLOCK_HK)
    slot = blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + slot, to_cache(k1, k_inv, FP8).to(ty), mask=kmask)
    tl.store(k_cache_ptr + slot + HALF, to_cache(k2, k_inv, FP8).to(ty), mask=kmask)
    v_src = v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    v1 = tl.load(v_src, mask=kmask, other=0.0)
    v2 = tl.load(v_src + HALF, mask=kmask, other=0.0)
    tl.store(v_cache_ptr + slot, to_cache(v1, v_inv, FP8).to(ty), mask=kmask)
    tl.store(v_cache_ptr + slot + HALF, to_cache(v2, v_inv, FP8).to(ty), mask=kmask)


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    paged: PagedLayer,
) -> None:
    """ValueError unless q ``[T, H, D]``, k and v ``[T, Hkv, D]`` fit the cache's heads and cos
    and sin are ``[T, D]`` (D even), all with unit stride in the last dim."""
    t, _, d = q.shape
    if k.shape != (t, paged.num_kv_heads, d) or v.shape != k.shape or d != paged.head_dim:
        raise ValueError(f"q {list(q.shape)} k {list(k.shape)} v {list(v.shape)} vs the cache")
    if d % 2 or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"cos/sin must be [T, D] with D even, got {list(cos.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, v, cos, sin)):
        raise ValueError("q, k, v, cos and sin must have unit stride in the last dim")


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    pdl: bool = True,
) -> torch.Tensor:
    """Rotate ``q`` ``[T, H, D]`` (returned, a new tensor) and ``k`` ``[T, Hkv, D]``, and write
    the rotated ``k`` and ``v`` into their slots of ``layer`` (negative block: no write).
    ``pdl``: programmatic dependent launch where the GPU has it."""
    paged = PagedLayer.of(kv_cache, layer)
    check_inputs(q, k, v, cos, sin, paged)
    t, h, d = q.shape
    hk = k.shape[1]
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    _rope_write_kernel[(t,)](
        q, k, v, cos, sin, q_out, paged.k, paged.v, slot_blocks, slot_offsets,
        1.0 / k_scale, 1.0 / v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1),
        paged.stride_block, paged.stride_token, paged.stride_head, h, hk,
        HALF=d // 2, BLOCK_HQ=next_pow2(h), BLOCK_HK=next_pow2(hk), BLOCK_HALF=next_pow2(d // 2),
        FP8=kv_cache.dtype == torch.float8_e4m3fn, num_warps=4, **pdl_kwargs(q, pdl),
    )  # fmt: skip
    return q_out
