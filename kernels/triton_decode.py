"""Triton paged decode attention: one query token per sequence, split over the KV length.

FlashDecoding-style: a first kernel gives each (sequence, KV head, split) one contiguous range
of the sequence's KV and computes the attention of all the KV head's query heads (GQA: the K/V
tile is read once for the whole group) over that range, writing an unnormalised partial output
and its log-sum-exp; a second kernel merges the splits. The number of splits depends only on
the batch shape and the GPU (never on sequence lengths), so a captured CUDA graph stays valid
for any lengths: each split takes ``ceil(seq_len / num_splits)`` tokens, rounded to the tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._triton import dot_precision, next_pow2, num_sms, pdl_kwargs
from kernels.triton_cache import PagedLayer

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Launch shape of one decode-attention call (a function of the batch shape only)."""

    num_seqs: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_splits: int
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def make(cls, q: torch.Tensor, paged: PagedLayer, max_splits: int = 32) -> DecodePlan:
        b, h, d = q.shape
        hkv = paged.num_kv_heads
        # About two programs per multiprocessor: on an H100 (bench.decode_variants --attention,
        # ctx 1k) that took batch 8 from 20.8 to 19.2 us a layer against four, and batch 1
        # (capped at 32 splits) is the same either way.
        target = 2 * num_sms(q.device.index or 0)
        splits = min(max_splits, next_pow2(max(1, math.ceil(target / max(b * hkv, 1)))))
        return cls(b, h, hkv, d, splits)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, part_ptr, lse_ptr, scale_log2, v_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, block_size, num_splits,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(seq_len, start + per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    gd_mask = (offs_g[:, None] < GROUP) & d_mask[None, :]
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gd_mask,
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + b * stride_tb
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
        row = blk * stride_kb + (pos % block_size).to(tl.int64) * stride_kt + kvh * stride_kh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # An FP8 cache is read as is and upcast here; its scales are in scale_log2 and v_scale.
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc * v_scale / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    p_off = b * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part_ptr + p_off[:, None] + offs_d[None, :], out, mask=gd_mask)
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=offs_g < GROUP)


@triton.jit
def _decode_merge_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    lse = tl.load(
        lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=-float("inf")
    )
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (a padding row): output 0
    w = tl.exp2(lse - m)
    total = tl.sum(w, 0)
    p_off = b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :]
    part = tl.load(part_ptr + p_off, mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    o_ptr = out_ptr + b * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Attention of one new token per sequence (``q``: ``[B, H, D]``) over its paged KV (an
    FP8 cache holds ``k / k_scale`` and ``v / v_scale``).

    ``seq_lens[b]`` counts the KV of sequence ``b`` including the new token, already written;
    ``seq_lens[b] == 0`` gives a zero output (padding rows of a captured batch).
    """
    paged = PagedLayer.of(kv_cache, layer)
    b, h, d = q.shape
    if d != paged.head_dim or h % paged.num_kv_heads or q.stride(-1) != 1:
        raise ValueError(f"q {list(q.shape)} does not fit the cache's heads")
    if block_tables.stride(-1) != 1 or block_tables.shape[0] < b or seq_lens.shape[0] < b:
        raise ValueError("block_tables must be [B, max_blocks] with unit last stride")
    plan = plan or DecodePlan.make(q, paged)
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part = torch.empty((b, h, plan.num_splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, plan.num_splits), dtype=torch.float32, device=q.device)
    block_d = max(next_pow2(d), 16)
    _decode_split_kernel[(b, plan.num_kv_heads, plan.num_splits)](
        q, paged.k, paged.v, block_tables, seq_lens, part, lse, scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1), paged.stride_block, paged.stride_token, paged.stride_head,
        block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1), paged.block_size, plan.num_splits,
        GROUP=plan.group, BLOCK_G=max(next_pow2(plan.group), 16), BLOCK_N=plan.block_n,
        HEAD_DIM=d, BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_kwargs(q),
    )  # fmt: skip
    _decode_merge_kernel[(b, h)](
        part, lse, out, plan.num_splits,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_S=max(next_pow2(plan.num_splits), 2), BLOCK_D=block_d, num_warps=4,
        **pdl_kwargs(q),
    )  # fmt: skip
    return out
