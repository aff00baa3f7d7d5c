"""Triton prefill attention over paged KV for a varlen batch (FlashAttention-2 style).

Each program takes one tile of ``BLOCK_M`` query rows of one sequence and one head. The
sequence's new tokens are the last ``q_len`` of its ``seq_len`` positions (a cached prefix sits
before them) and their K/V are already in the pool, so keys are read only from paged blocks.
Tiles entirely below the causal diagonal run unmasked; only the last tiles are masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._triton import dot_precision, next_pow2
from kernels.triton_cache import PagedLayer

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """Tile sizes and launch shape of one prefill-attention call."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def make(cls, head_dim: int, max_query_len: int) -> PrefillPlan:
        if max_query_len <= 16:
            return cls(16, 64, 4, 2)
        if head_dim > 128:
            return cls(64, 32, 4, 2)
        return cls(128, 64, 8, 3)


@triton.jit
def _attend(q, acc, m_i, l_i, k_ptr, v_ptr, table, n0, kvh, q_pos, seq_len, scale_log2,
            block_size, stride_kb, stride_kt, stride_kh, offs_n, offs_d, d_mask,
            MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    pos = n0 + offs_n
    n_mask = pos < seq_len
    blk = tl.load(table + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    row = blk * stride_kb + (pos % block_size).to(tl.int64) * stride_kt + kvh * stride_kh
    kv_mask = n_mask[:, None] & d_mask[None, :]
    # An FP8 cache is read as is and upcast here; its scales are in scale_log2 and v_scale.
    k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Lengths and table widths change from step to step: not specialised on (``== 1``, ``% 16``),
# so one compiled variant per plan serves every batch (``engine.warmup`` compiles each plan).
@triton.jit(do_not_specialize=["stride_tb", "num_m_tiles"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, scale_log2, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kt, stride_kh, stride_tb,
    block_size, num_m_tiles,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # Largest tiles (most keys) first: the grid's tail is then made of short programs.
    m_tile = num_m_tiles - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    q_start = tl.load(q_start_ptr + b).to(tl.int32)
    q_len = tl.load(q_start_ptr + b + 1).to(tl.int32) - q_start
    if m_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    prefix = seq_len - q_len
    kvh = h // GROUP

    offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    qd_mask = (offs_m[:, None] < q_len) & d_mask[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0
    )
    q_pos = prefix + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables_ptr + b * stride_tb
    # Keys before the tile's first query position are visible to every row of the tile.
    full_end = ((prefix + m_tile * BLOCK_M) // BLOCK_N) * BLOCK_N
    end = tl.minimum(seq_len, prefix + (m_tile + 1) * BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr, v_ptr, table, n0, kvh, q_pos, seq_len,
                                scale_log2, block_size, stride_kb, stride_kt, stride_kh, offs_n,
                                offs_d, d_mask, False, DOT_PRECISION)  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend(q, acc, m_i, l_i, k_ptr, v_ptr, table, n0, kvh, q_pos, seq_len,
                                scale_log2, block_size, stride_kb, stride_kt, stride_kh, offs_n,
                                offs_d, d_mask, True, DOT_PRECISION)  # fmt: skip
    out = acc * v_scale / l_i[:, None]
    o_ptr = out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=qd_mask)


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    plan: PrefillPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a flattened varlen batch ``q`` (``[T, H, D]``) over paged KV (an FP8
    cache holds ``k / k_scale`` and ``v / v_scale``).

    Rows ``query_start_loc[i]:query_start_loc[i+1]`` are the last positions of sequence ``i``,
    whose KV (``seq_lens[i]`` tokens, the new ones included) is already in the pool.
    """
    paged = PagedLayer.of(kv_cache, layer)
    t, h, d = q.shape
    if d != paged.head_dim or h % paged.num_kv_heads or q.stride(-1) != 1:
        raise ValueError(f"q {list(q.shape)} does not fit the cache's heads")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must have unit last stride")
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    b = seq_lens.shape[0]
    if t == 0 or b == 0:
        return out
    plan = plan or PrefillPlan.make(d, max_query_len)
    num_m_tiles = triton.cdiv(max_query_len, plan.block_m)
    _prefill_kernel[(num_m_tiles, h, b)](
        q, paged.k, paged.v, out, block_tables, seq_lens, query_start_loc,
        scale * k_scale * LOG2E, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        paged.stride_block, paged.stride_token, paged.stride_head, block_tables.stride(0),
        paged.block_size, num_m_tiles,
        GROUP=h // paged.num_kv_heads, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HEAD_DIM=d, BLOCK_D=max(next_pow2(d), 16), DOT_PRECISION=dot_precision(q.dtype),
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return out
