"""Triton skinny matrix product for decode: ``x @ w.T (+ bias)`` with a few rows of ``x``.

A decode step of a small batch is a chain of matrix-vector products that read every weight
once; this kernel streams ``w`` (``[N, K]``, row-major) in tiles of ``BLOCK_N`` rows, deeply
pipelined, with the whole of ``x`` (at most 16 rows, padded) against each tile. One program per
row tile, no split over K, so results are deterministic. cuBLAS is used for larger batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x the kernel handles (the tile is padded to 16)


@dataclass(frozen=True, slots=True)
class GemvPlan:
    """Tile sizes of one call: ``BLOCK_N`` weight rows per program, ``BLOCK_K`` per step."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # FP8 weights: exact in bf16/fp16
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if HAS_SCALE:  # per output channel (FP8 weights)
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: GemvPlan | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x`` of shape ``[M <= 16, K]`` and ``w`` of shape ``[N, K]``.

    With ``scale`` (float32 ``[N]``), ``w`` is an FP8 weight and the product is
    ``(x @ w.T) * scale + bias``: weight-only FP8, read at one byte per weight."""
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"x {list(x.shape)} / w {list(w.shape)}: need M <= 16, unit strides")
    if bias is not None and bias.shape != (n,):
        raise ValueError("bias must be [N]")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32):
        raise ValueError("scale must be float32 [N]")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    plan = plan or GemvPlan()
    _gemv_kernel[(triton.cdiv(n, plan.block_n),)](
        x, w, bias if bias is not None else x, scale if scale is not None else x, out, m, n, k,
        x.stride(0), w.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None, BLOCK_M=16, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return out
