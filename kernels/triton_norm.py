"""Triton pointwise kernels: fused residual add + RMSNorm, and SiLU-and-multiply.

Both round where the references round (the sum and the normalised value to the input dtype,
then the product with the weight), so in bf16 they match ``kernels.reference`` bit for bit up
to the last-ulp differences of ``rsqrt``/``exp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2, pdl_kwargs


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(norm(x + residual) * weight, x + residual)`` over the last dim of ``[T, N]`` rows
    (``pdl``: programmatic dependent launch where the GPU has it)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, N] with unit last stride, weight [N]; got {x.shape}")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError("residual must match x")
    t, n = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((t, n), dtype=out_dtype, device=x.device)
    res_out = torch.empty_like(x) if residual is not None else x
    if t == 0:
        return out, res_out
    block = next_pow2(n)
    _rms_norm_kernel[(t,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        res_out.stride(0),
        n,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 512, 1), 16),
        **pdl_kwargs(x, pdl),
    )
    return out, res_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):  # fmt: skip
    if PDL:  # programmatic dependent launch: the previous kernel's results first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + offs, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, (act.to(tl.float32) * u).to(act.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` of shape ``[T, 2n]`` (``pdl``: as `rms_norm`)."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2n] with unit last stride, got {list(x.shape)}")
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = min(next_pow2(n), 2048)
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4, **pdl_kwargs(x, pdl)
    )
    return out
