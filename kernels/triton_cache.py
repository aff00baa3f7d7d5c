"""Triton KV-cache write: new K/V rows of a step into their paged slots.

Also holds ``PagedLayer``, the launch-side description of one layer of the block-major pool
(``[num_blocks, num_layers, 2, block_size, Hkv, D]``) that the attention kernels share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """K and V views of one layer (``[num_blocks, block_size, Hkv, D]`` each, equal strides)."""

    k: torch.Tensor
    v: torch.Tensor
    stride_block: int
    stride_token: int
    stride_head: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, kv_cache: torch.Tensor, layer: int) -> PagedLayer:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(f"kv_cache must be [N, L, 2, bs, Hkv, D], got {list(kv_cache.shape)}")
        if kv_cache.stride(-1) != 1:
            raise ValueError("kv_cache must be contiguous in head_dim")
        layer_kv = kv_cache.select(1, layer)
        k, v = layer_kv.select(1, 0), layer_kv.select(1, 1)
        _, bs, hkv, d = k.shape
        return cls(k, v, k.stride(0), k.stride(1), k.stride(2), bs, hkv, d)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_blocks_ptr,
    slot_offsets_ptr,
    k_inv,
    v_inv,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.load(slot_blocks_ptr + t).to(tl.int64)
    if blk < 0:  # a padding row of a captured decode graph: writes nothing
        return
    off = tl.load(slot_offsets_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_DIM)
    dst = blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:  # scaled and saturated like reference.to_fp8
        k = tl.clamp(k.to(tl.float32) * k_inv, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) * v_inv, -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store ``k``/``v`` (``[T, Hkv, D]``, unit stride in D) into their slots of ``layer``;
    an FP8 cache gets ``k / k_scale`` and ``v / v_scale``, saturated at +-448.

    A negative block id in ``slot_blocks`` marks a padding row, which writes nothing.
    """
    paged = PagedLayer.of(kv_cache, layer)
    t, hkv, d = k.shape
    if v.shape != k.shape or hkv != paged.num_kv_heads or d != paged.head_dim:
        raise ValueError(f"k/v {list(k.shape)}/{list(v.shape)} do not fit the cache")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must have unit stride in head_dim")
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k,
        v,
        paged.k,
        paged.v,
        slot_blocks,
        slot_offsets,
        1.0 / k_scale,
        1.0 / v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        paged.stride_block,
        paged.stride_token,
        paged.stride_head,
        hkv,
        HEAD_DIM=d,
        BLOCK_H=next_pow2(hkv),
        BLOCK_D=next_pow2(d),
        FP8=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
    )
