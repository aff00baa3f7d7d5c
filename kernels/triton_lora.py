"""Triton batched LoRA: ``y[t] += (x[t] @ A[s].T) @ B[s].T * scale[s]`` for a mixed batch.

Tokens of many adapters (and of none) share one step. ``LoRAMetadata`` groups the adapted
tokens by slot into tiles of at most ``BLOCK_M`` rows of one slot (a segmented product with a
row gather, so a slot's tokens need not be contiguous). Two launches per projection:

* shrink: one program per tile, ``tmp[tile rows] = x[rows] @ A[s].T`` over K in steps
  (``[BLOCK_M, R]`` in float32, rounded to the weights' dtype for the second product);
* expand: one program per (tile, BLOCK_N columns), ``y[rows, cols] += tmp @ B[s, cols].T *
  scale[s]``.

Every token appears in one tile and every (tile, column block) is one program, so no two
programs write the same element: deterministic, no atomics. Slots hold matrices padded to the
buffer's rank R with zeros, so the padding adds exact zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import dot_precision, next_pow2
from kernels.reference import LoRAMetadata

BLOCK_M = 16  # tile rows; LoRAMetadata.build(tile_m=BLOCK_M)


@triton.jit
def _tile(rows_ptr, start_ptr, len_ptr, slot_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its first position in the sorted rows, row mask, rows and slot."""
    tile = tl.program_id(0)
    start = tl.load(start_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < tl.load(len_ptr + tile)
    rows = tl.load(rows_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return start, m_mask, rows, tl.load(slot_ptr + tile).to(tl.int64)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, tmp_ptr, rows_ptr, start_ptr, len_ptr, slot_ptr, K, R,
    stride_xm, stride_as, stride_ar, stride_tm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    start, m_mask, rows, slot = _tile(rows_ptr, start_ptr, len_ptr, slot_ptr, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision=PREC)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    t_ptrs = tmp_ptr + (start + offs_m)[:, None] * stride_tm + offs_r[None, :]
    tl.store(t_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    tmp_ptr, b_ptr, y_ptr, rows_ptr, start_ptr, len_ptr, slot_ptr, scale_ptr, N, R,
    stride_tm, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    start, m_mask, rows, slot = _tile(rows_ptr, start_ptr, len_ptr, slot_ptr, BLOCK_M)
    scale = tl.load(scale_ptr + slot)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = offs_r < R
    n_mask = offs_n < N
    t = tl.load(
        tmp_ptr + (start + offs_m)[:, None] * stride_tm + offs_r[None, :],
        mask=m_mask[:, None] & r_mask[None, :], other=0.0,
    )  # fmt: skip
    b = tl.load(
        b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
        mask=n_mask[:, None] & r_mask[None, :], other=0.0,
    )  # fmt: skip
    delta = tl.dot(t.to(b.dtype), tl.trans(b), input_precision=PREC) * scale
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata
) -> None:
    """Triton form of ``kernels.reference.lora_add`` (same arguments; ``meta`` built on CUDA)."""
    if meta.rows is None or meta.tile_slot is None or meta.tile_start is None:
        raise ValueError("LoRAMetadata was built for the reference path (not on CUDA)")
    if meta.tile_len is None or meta.scales_t is None:
        raise ValueError("LoRAMetadata lacks its tiles")
    tiles = meta.tile_slot.numel()
    if tiles == 0:
        return
    s, r, k = a.shape
    n = b.shape[1]
    if b.shape != (s, n, r) or x.shape[1] != k or y.shape[1] != n or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"x {list(x.shape)}, A {list(a.shape)}, B {list(b.shape)}, y {list(y.shape)}"
        )
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("lora_add needs unit strides along the last dimension")
    prec = dot_precision(x.dtype)
    block_r = max(16, next_pow2(r))
    tmp = torch.empty((meta.rows.numel(), block_r), dtype=torch.float32, device=x.device)
    _shrink_kernel[(tiles,)](
        x, a, tmp, meta.rows, meta.tile_start, meta.tile_len, meta.tile_slot, k, r,
        x.stride(0), a.stride(0), a.stride(1), tmp.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=64, PREC=prec, num_warps=4,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(tiles, triton.cdiv(n, block_n))](
        tmp, b, y, meta.rows, meta.tile_start, meta.tile_len, meta.tile_slot, meta.scales_t, n, r,
        tmp.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=block_n, PREC=prec, num_warps=4,
    )  # fmt: skip
