"""One row of ``x`` times an FP8 (e4m3) weight on the CUDA cores in bf16 pairs: the skinny
kernel's ``SkinnyPlan.pairs`` plans (``kernels.triton_skinny``), for decode at batch 1.

The plain CUDA-core path converts every weight e4m3 -> f16 -> f32 and multiplies in float32:
about seven instructions a weight, so at one byte a weight the product is bound by instruction
issue, not by HBM (``bench/results/decode_gpu_h100.md``). Here each 32-bit word of four weights
becomes two bf16 pairs by placing bits (a byte permute that replicates each byte's sign, a
shift, a mask: e4m3's sign, exponent and mantissa land where bf16 keeps them, so each weight
arrives exact, times 2**-120), and two packed bf16 multiply-adds take the four products with
``x``, which is scaled by 2**64 (exact) so that nothing comes near bf16's smallest normal;
the pair is then added in float32. About three instructions a weight. The epilogue applies
2**56 with the per-channel scale.

Rounding: each product is rounded to bf16 (8 bits) and two are added in bf16 before float32
takes over: relative errors of a few 1e-3 on an output, against about 2.7% for the weights'
own e4m3 rounding (tests: ``tests/gpu/test_skinny_gpu.py``). Needs sm_90 (``mul.rn.bf16x2``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_skinny_common import _finish, _prefetch_l2, _prefetch_steps

UNIT = tl.constexpr(2.0**56)  # 2**120 of the weights' bit placement, less 2**64 of x's scale


@triton.jit
def _scale_x(x):
    """bf16 pairs (int32 words) times 2**64, exactly."""
    return tl.inline_asm_elementwise(
        asm="{ .reg .b32 s; mov.b32 s, 0x5F805F80; mul.rn.bf16x2 $0, $1, s; }",
        constraints="=r,r",
        args=[x],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _dot4(w, xa, xb):
    """Four e4m3 weights (one int32 word) times four x values (two bf16 pairs, scaled by
    2**64), summed: float32, times 2**-56."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, p;
        prmt.b32 t0, $1, 0, 0x9180;
        prmt.b32 t1, $1, 0, 0xB3A2;
        shl.b32 t0, t0, 4;
        shl.b32 t1, t1, 4;
        and.b32 t0, t0, 0x87F087F0;
        and.b32 t1, t1, 0x87F087F0;
        mul.rn.bf16x2 p, t0, $2;
        fma.rn.bf16x2 p, t1, $3, p;
        shl.b32 t0, p, 16;
        and.b32 t1, p, 0xFFFF0000;
        add.f32 $0, t0, t1;
        }""",
        constraints="=r,r,r,r",
        args=[w, xa, xb],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _fp8_row_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr, N, K, K_SPLIT, stride_wn,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr,
    DEEP: tl.constexpr = False, N_PREFETCH: tl.constexpr = 0,
):  # fmt: skip
    KW: tl.constexpr = BLOCK_K // 4  # weight words per row and step
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = offs_n if EVEN_N else tl.where(offs_n < N, offs_n, 0)  # sums never stored
    w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    # x as 64-bit words of four bf16 each: word j pairs with weight word j in one layout
    x64 = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    w_base = w32 + w_rows.to(tl.int64)[:, None] * (stride_wn // 4)
    kw = K // 4
    j0 = pid_k * (K_SPLIT // 4)
    offs_j = tl.arange(0, KW)
    n_iter = K_SPLIT // BLOCK_K
    j = tl.max_contiguous(tl.multiple_of(j0 + offs_j, 4), 4)
    if EVEN_K:
        w_next = tl.load(w_base + j[None, :])
    else:
        w_next = tl.load(w_base + j[None, :], mask=(j < kw)[None, :], other=0)
    if DEEP:  # two tiles in flight in registers (the second step's too)
        j2 = tl.max_contiguous(tl.multiple_of(j + KW, 4), 4)
        w_after = tl.load(w_base + j2[None, :], mask=(n_iter > 1) & (j2 < kw)[None, :], other=0)
    if PDL and N_PREFETCH > 0:  # the tiles after those into L2 while the previous kernel ends
        k_pf = pid_k * K_SPLIT + (2 if DEEP else 1) * BLOCK_K
        _prefetch_l2(w_ptr, w_rows, k_pf, K, stride_wn, N_PREFETCH, BLOCK_K, 128)
    if PDL:  # the first weights are in flight: now wait for x, then let the next kernel start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, KW], tl.float32)
    for i in range(0, n_iter):
        j = tl.max_contiguous(tl.multiple_of(j0 + i * KW + offs_j, 4), 4)
        w = w_next
        if DEEP:
            w_next = w_after
            nj = tl.max_contiguous(tl.multiple_of(j + 2 * KW, 4), 4)
            more = i + 2 < n_iter
        else:
            nj = tl.max_contiguous(tl.multiple_of(j + KW, 4), 4)
            more = i + 1 < n_iter
        if DEEP and EVEN_K:
            w_after = tl.load(w_base + nj[None, :], mask=more, other=0)
            xw = tl.load(x64 + j[None, :])
        elif DEEP:
            w_after = tl.load(w_base + nj[None, :], mask=more & (nj < kw)[None, :], other=0)
            xw = tl.load(x64 + j[None, :], mask=(j < kw)[None, :], other=0)
        elif EVEN_K:
            w_next = tl.load(w_base + nj[None, :], mask=more, other=0)
            xw = tl.load(x64 + j[None, :])
        else:
            w_next = tl.load(w_base + nj[None, :], mask=more & (nj < kw)[None, :], other=0)
            xw = tl.load(x64 + j[None, :], mask=(j < kw)[None, :], other=0)
        xa = _scale_x((xw & 0xFFFFFFFF).to(tl.int32))  # x[4j], x[4j + 1]
        xb = _scale_x((xw >> 32).to(tl.int32))  # x[4j + 2], x[4j + 3]
        # a [1, KW] tile: where KW is 128 x num_warps words it has each weight row's layout
        acc += _dot4(w, tl.broadcast_to(xa, [BLOCK_N, KW]), tl.broadcast_to(xb, [BLOCK_N, KW]))
    total = tl.sum(acc, axis=1)[:, None]
    _finish(total, tl.arange(0, 1), offs_n, pid_n, pid_k, 1, N, scale_ptr, bias_ptr, out_ptr,
            part_ptr, lock_ptr, 0, True, HAS_BIAS, SPLIT_K, BLOCK_N, 1, UNIT)  # fmt: skip


def fits(m: int, k: int, prologue: int, w: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a ``pairs`` plan can take the product (else the plain CUDA-core path does)."""
    return (
        m == 1
        and prologue == 0
        and w.dtype == torch.float8_e4m3fn
        and x.dtype == torch.bfloat16
        and k % 16 == 0
        and w.stride(0) % 16 == 0
        and x.is_cuda
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def launch(x, w, scale, bias, out, plan, k_split, split, part, locks, pdl) -> None:  # noqa: ANN001
    """The ``pairs`` product into ``out`` (``[1, N]``; the caller checked `fits`)."""
    n, k = w.shape
    _fp8_row_kernel[(triton.cdiv(n, plan.block_n), split)](
        x, w, scale, bias if bias is not None else x, out, part, locks, n, k, k_split,
        w.stride(0), HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k, EVEN_K=k % plan.block_k == 0 and k_split * split == k,
        EVEN_N=n % plan.block_n == 0, DEEP=plan.num_stages >= 4,
        N_PREFETCH=_prefetch_steps(plan, k_split, 128) if pdl["PDL"] else 0,
        num_warps=plan.num_warps, num_stages=3, **pdl,
    )  # fmt: skip
