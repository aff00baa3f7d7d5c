"""Triton rotary embedding (neox / Hugging Face layout) of q and k in one launch."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._triton import next_pow2

# PTX for the products of `rope_mix` (Triton's interpreter runs none)
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _mul_f32(a, b):
    a, b = tl.broadcast(a.to(tl.float32), b.to(tl.float32))
    if _PTX:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)  # fmt: skip
    return a * b


@triton.jit
def rope_mix(x, c, rot, s):
    """``x * c + rot * s`` rounded as the reference rounds (torch, in ``x``'s dtype): each
    product, then the sum. The products are PTX ``mul.rn.f32``, which neither LLVM nor ptxas
    fuses into the add: written as ``(x * c).to(dt)`` they became one bf16 FMA (one rounding),
    whose operand order differed from kernel to kernel."""
    dt = x.dtype
    return (_mul_f32(x, c).to(dt).to(tl.float32) + _mul_f32(rot, s).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _rotate(x_ptr, out_ptr, stride_t, stride_h, stride_ot, stride_oh, t, num_heads, c1, c2, s1, s2,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    src = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    # Round each product and the sum like the reference (x * cos + rotate_half(x) * sin).
    o1 = rope_mix(x1, c1, -x2, s1)
    o2 = rope_mix(x2, c2, x1, s2)
    dst = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    stride_qot, stride_qoh, stride_kot, stride_koh, num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    c1 = tl.load(cos_ptr + t * stride_cos + offs_d, mask=dmask, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_cos + HALF + offs_d, mask=dmask, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_sin + offs_d, mask=dmask, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_sin + HALF + offs_d, mask=dmask, other=0.0)[None, :]
    _rotate(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, num_q_heads,
            c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, num_k_heads,
            c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_HALF)  # fmt: skip


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: ``[T, H, D]``, k: ``[T, Hkv, D]`` (any row strides), cos/sin ``[T, D]``; new tensors."""
    t, h, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2 or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"shapes q {list(q.shape)} k {list(k.shape)} cos {list(cos.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("q, k, cos and sin must have unit stride in the last dim")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    hk = k.shape[1]
    _rope_kernel[(t,)](
        q, k, cos, sin, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), h, hk,
        HALF=d // 2, BLOCK_HQ=next_pow2(h), BLOCK_HK=next_pow2(hk), BLOCK_HALF=next_pow2(d // 2),
        num_warps=4,
    )  # fmt: skip
    return q_out, k_out
