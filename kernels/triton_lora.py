"""Triton batched LoRA: ``y[t] += (x[t] @ A[s].T) @ B[s].T * scale[s]`` for a mixed batch.

Tokens of many adapters (and of none) share one step. ``LoRAMetadata`` groups the adapted
tokens by slot into tiles of at most ``BLOCK_M`` rows of one slot (a segmented product with a
row gather, so a slot's tokens need not be contiguous). Two launches per projection:

* shrink: one program per (tile, ``K_SPLIT`` slice of the input), ``part[split, tile rows] =
  x[rows, slice] @ A[s, :, slice].T`` (``[BLOCK_M, R]`` in float32). Splitting K keeps a
  decode batch's few tiles from running on a few SMs through all of K (the down projection's
  K is 14,336 in the 8B shape);
* expand: one program per (tile, BLOCK_N columns): the partial products summed in split order,
  rounded to the weights' dtype, then ``y[rows, cols] += tmp @ B[s, cols].T * scale[s]``.

The projections of one input (q/k/v, gate/up) go through the same two launches
(``lora_add_fused``): A stacked along the rank, so the shrink reads x once for all of them,
and B in the fused output's column order; each expand program's column block lies in one
projection, whose ranks it reads from the shrunk rows.

Both take part in programmatic dependent launch (``KernelChoices.pdl``): ``griddepcontrol.wait``
before anything is read.

Every token appears in one tile and every (tile, split) and (tile, column block) is one
program, so no two programs write the same element and partial sums are added in a fixed
order: deterministic, no atomics, the same result whatever else shares the batch. Tiles of
length 0 are padding (the fixed-size tables a decode CUDA graph reads) and return at once.
Slots hold matrices padded to the buffer's rank R with zeros, so the padding adds exact zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import dot_precision, next_pow2, pdl_kwargs
from kernels.reference import LORA_TILE_M, LoRAMetadata

BLOCK_M = LORA_TILE_M  # tile rows
BLOCK_K = 128
K_SPLIT = 1024  # input columns per shrink program (a multiple of BLOCK_K)
BLOCK_N = 128


@triton.jit
def _tile(rows_ptr, start_ptr, len_ptr, slot_ptr, BLOCK_M: tl.constexpr):
    """This program's tile: its length (0: padding), first position in the sorted rows, slot,
    row mask and token rows."""
    tile = tl.program_id(0)
    n_rows = tl.load(len_ptr + tile)
    start = tl.load(start_ptr + tile)
    m_mask = tl.arange(0, BLOCK_M) < n_rows
    rows = tl.load(rows_ptr + start + tl.arange(0, BLOCK_M), mask=m_mask, other=0).to(tl.int64)
    return n_rows, start, tl.load(slot_ptr + tile).to(tl.int64), m_mask, rows


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, part_ptr, rows_ptr, start_ptr, len_ptr, slot_ptr, K, R,
    stride_xm, stride_as, stride_ar, stride_ps, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    K_SPLIT: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n_rows, start, slot, m_mask, rows = _tile(rows_ptr, start_ptr, len_ptr, slot_ptr, BLOCK_M)
    if n_rows == 0:  # a padding tile
        return
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = split * K_SPLIT + tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    x_rows = x_ptr + rows[:, None] * stride_xm
    a_ptrs = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        cols = offs_k + k0
        k_mask = cols < K
        mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0)
        a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision=PREC)
        a_ptrs += BLOCK_K
    p_ptrs = part_ptr + split * stride_ps + (start + offs_m)[:, None] * stride_pm + offs_r[None, :]
    tl.store(p_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    part_ptr, b_ptr, y_ptr, rows_ptr, start_ptr, len_ptr, slot_ptr, scale_ptr, R,
    W0, W1, W2, NB0, NB1,
    stride_ps, stride_pm, stride_bs, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    PREC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    n_rows, start, slot, m_mask, rows = _tile(rows_ptr, start_ptr, len_ptr, slot_ptr, BLOCK_M)
    if n_rows == 0:  # a padding tile
        return
    # This program's column block lies in one segment (a projection of the fused output:
    # columns [lo, hi) of y and of B, ranks [seg * R, seg * R + R) of the shrunk rows).
    pid = tl.program_id(1)
    seg = (pid >= NB0).to(tl.int32) + (pid >= NB0 + NB1).to(tl.int32)
    first = tl.where(seg == 0, 0, tl.where(seg == 1, NB0, NB0 + NB1))
    lo = tl.where(seg == 0, 0, tl.where(seg == 1, W0, W0 + W1))
    hi = tl.where(seg == 0, W0, tl.where(seg == 1, W0 + W1, W0 + W1 + W2))
    scale = tl.load(scale_ptr + slot)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = lo + (pid - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = offs_r < R
    n_mask = offs_n < hi
    t_mask = m_mask[:, None] & r_mask[None, :]
    p_ptrs = part_ptr + (start + offs_m)[:, None] * stride_pm + (seg * R + offs_r)[None, :]
    t = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for s in tl.static_range(SPLITS):  # in split order: the same sum on every run
        t += tl.load(p_ptrs + s * stride_ps, mask=t_mask, other=0.0)
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
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata,
    pdl: bool = True,
) -> None:  # fmt: skip
    """Triton form of ``kernels.reference.lora_add`` (same arguments; ``meta`` in the tile
    form, on CUDA: built per step, or the fixed-size tables of a decode CUDA graph). Launches
    depend on shapes only, never on the tables' contents, so they can be captured."""
    lora_add_fused(y, x, a, b, [b.shape[1]], meta, pdl=pdl)


def lora_add_fused(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, widths: list[int],
    meta: LoRAMetadata, pdl: bool = True,
) -> None:  # fmt: skip
    """Triton form of ``kernels.reference.lora_add_fused``: the projections of one input
    (q/k/v, gate/up) in two launches. ``a``: [S, len(widths) * R, in] (each projection's A
    stacked), ``b``: [S, sum(widths), R] (each projection's B, in the output's column order),
    ``y``: [T, sum(widths)]. One shrink computes every projection's ``x @ A.T`` (x read once);
    one expand adds each column block's delta from its own projection's ranks. ``pdl``:
    programmatic dependent launch where the GPU has it."""
    if meta.rows is None or meta.tile_slot is None or meta.tile_start is None:
        raise ValueError("LoRAMetadata was built for the reference path (not on CUDA)")
    if meta.tile_len is None or meta.scales_t is None:
        raise ValueError("LoRAMetadata lacks its tiles")
    tiles = meta.tile_slot.numel()
    if tiles == 0:
        return
    segs = len(widths)
    if not 1 <= segs <= 3:
        raise ValueError(f"1 to 3 fused projections, not {segs}")
    s, rt, k = a.shape
    n = sum(widths)
    r = rt // segs
    if (
        rt != segs * r or b.shape != (s, n, r) or x.shape[1] != k
        or y.shape[1] != n
        or x.shape[0] != y.shape[0]
    ):  # fmt: skip
        raise ValueError(
            f"x {list(x.shape)}, A {list(a.shape)}, B {list(b.shape)}, y {list(y.shape)}, "
            f"widths {widths}"
        )
    if x.stride(1) != 1 or y.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("lora_add needs unit strides along the last dimension")
    prec = dot_precision(x.dtype)
    block_rt = max(16, next_pow2(rt))
    block_k = BLOCK_K if block_rt <= 64 else BLOCK_K // 2
    splits = triton.cdiv(k, K_SPLIT)
    part = torch.empty((splits, meta.rows.numel(), block_rt), dtype=torch.float32, device=x.device)
    _shrink_kernel[(tiles, splits)](
        x, a, part, meta.rows, meta.tile_start, meta.tile_len, meta.tile_slot, k, rt,
        x.stride(0), a.stride(0), a.stride(1), part.stride(0), part.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_R=block_rt, BLOCK_K=block_k, K_SPLIT=K_SPLIT, PREC=prec,
        num_warps=4, **pdl_kwargs(x, pdl),
    )  # fmt: skip
    w = [*widths, 0, 0][:3]
    nb = [triton.cdiv(v, BLOCK_N) for v in w]
    _expand_kernel[(tiles, sum(nb))](
        part, b, y, meta.rows, meta.tile_start, meta.tile_len, meta.tile_slot, meta.scales_t, r,
        w[0], w[1], w[2], nb[0], nb[1],
        part.stride(0), part.stride(1), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=max(16, next_pow2(r)), BLOCK_N=BLOCK_N, SPLITS=splits,
        PREC=prec, num_warps=4, **pdl_kwargs(x, pdl),
    )  # fmt: skip
