"""Triton skinny products for decode, bf16/fp16 or FP8 (e4m3) weights: ``x @ w.T`` for at most
eight rows of ``x``, one pass over the weight.

The product is bound by reading ``w`` (``[N, K]``, K contiguous), so everything here is about
the loads:

- each program streams a ``[BLOCK_N, BLOCK_K]`` tile per step along the contiguous axis: 16
  bytes per thread per load (8 bf16 or 16 FP8 weights), with no mask on the weight where ``K``
  divides into ``BLOCK_K`` (``EVEN_K``) and out-of-range rows clamped to row 0 instead of masked
  (the old kernel's ``k < min(K, ...)`` mask could cost the wide loads);
- ``BLOCK_N`` goes down to 4 rows, so a 4096-row product has 512-1024 programs: every SM holds
  several and the loads in flight cover the memory latency; split-K (``SkinnyPlan.split_k``)
  where that is not enough;
- FP8 weights are converted in registers and multiplied in float32; the per-output-channel
  scale (and bias) is applied once in the epilogue.

Two ways to multiply, per plan: ``dot=False`` multiplies on the CUDA cores (one row: ``x``
shares the weight tile's register layout, so nothing goes through shared memory per step: where
``BLOCK_K`` is a multiple of 256 x num_warps one row of ``x`` has that layout and is loaded and
converted once per step, else it is loaded as a tile shaped like the weight's; each thread
adds its 8 products per step in registers into a
``[BLOCK_N, BLOCK_K / 8]`` float32 accumulator reduced once at the end, and the next step's
weights are loaded before this step's math; more rows: one reduction per row and step),
``dot=True`` on the tensor cores (``tl.dot`` of the weight tile, as the left operand in its
natural layout, with the ``x`` tile padded to 16 rows; Triton pipelines those loads).
The compiled code was checked off the GPU (``triton.compile`` for sm_90): 16-byte (bf16) or
8-byte (FP8) weight loads, no layout conversion inside the loop, 31-116 registers.

Prologues: 0 = none; 3 = the folded norm (``rms_linear``): the norm's weight is in ``w``'s
columns, so ``x`` goes into the product unchanged and the loads stay pipelined; only its squares
are summed beside it, and the norm's ``1/rms`` factors out of each output row (the epilogue
applies it).
Epilogues: ``add`` (the residual stream added before the one rounding) and ``silu`` (each
program takes matching rows of gate and up, and stores ``silu(gate) * up``).

Plans: ``plan_for`` picks one per (rows, N, K, weight dtype, prologue): a measured table
(``set_plan``, filled by ``lab.skinny_gpu`` and kept in ``kernels/skinny_plans.json`` per
device name) or else a heuristic. Nothing is tuned at run time, so nothing tunes inside a
CUDA graph capture.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels._triton import pdl_kwargs
from kernels.triton_skinny_common import (
    SUMS_ROWS,
    SUMS_STRIDE,
    SkinnyPlan,
    _finish,
    _prefetch_l2,
    _prefetch_steps,
)

__all__ = ["SUMS_ROWS", "SUMS_STRIDE", "SkinnyPlan", "candidates", "linear", "linear_sums",
           "plan_for", "rms_linear"]  # fmt: skip

MAX_ROWS = 8
_MAX_TILES = 1 << 17
_LOCKS: dict[torch.device, torch.Tensor] = {}
PLANS_FILE = Path(__file__).with_name("skinny_plans.json")


@triton.jit
def _x_tile(x_ptr, rows, offs_k, M, K, stride_xm, PROLOGUE: tl.constexpr):
    """Rows ``rows`` of the product's left side over columns ``offs_k`` (a tile shaped like the
    weight's, so both share one register layout and nothing is shuffled through shared memory
    per step); and the elementwise squares of ``x`` (the folded norm's; zeros otherwise)."""
    mask = (rows < M)[:, None] & (offs_k < K)[None, :]
    xp = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    sq = tl.zeros([rows.shape[0], offs_k.shape[0]], tl.float32)
    x = tl.load(xp, mask=mask, other=0.0)
    if PROLOGUE == 3:  # the folded norm: x as it is (the norm's weight is in w's columns)
        xf = x.to(tl.float32)
        sq = xf * xf
    return x, sq


@triton.jit
def _row_part(wf, x_ptr, rows, offs_k, M, K, stride_xm, PROLOGUE: tl.constexpr,
              BLOCK_N: tl.constexpr, VEC: tl.constexpr):  # fmt: skip
    """One row of ``x`` (tile rows ``rows``, all the same row; no norm) times the
    float32 weight tile ``wf``: each thread's ``VEC`` products summed in registers,
    ``[BLOCK_N, BLOCK_K / VEC]``."""
    x, sq = _x_tile(x_ptr, rows, offs_k, M, K, stride_xm, PROLOGUE)
    prod = wf * x.to(tl.float32)
    return tl.sum(tl.reshape(prod, [BLOCK_N, offs_k.shape[0] // VEC, VEC]), axis=2)


@triton.jit
def _put(acc, part, offs_m, m: tl.constexpr):
    """``acc`` (``[BLOCK_N, BLOCK_M]``, zero in column ``m``) with ``part``'s row sums there."""
    return acc + tl.where(offs_m[None, :] == m, tl.sum(part, axis=1)[:, None], 0.0)


@triton.jit
def _skinny_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om, eps,
    PROLOGUE: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    PREFETCH: tl.constexpr, VEC: tl.constexpr, XR: tl.constexpr, PDL: tl.constexpr,
    QX: tl.constexpr = False, N_PREFETCH: tl.constexpr = 0, LINE: tl.constexpr = 64,
    add_ptr=None, stride_am=0, NORM: tl.constexpr = False, ADD: tl.constexpr = False,
    SILU: tl.constexpr = False, NORM_FIRST: tl.constexpr = False, sums_ptr=None, sums_tiles=0,
    SUMS_IN: tl.constexpr = False, SUMS_T: tl.constexpr = 1, SUMS_OUT: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SILU:  # the tile's first half: gate's rows; the second: the same rows of up (N / 2 on)
        j = tl.arange(0, BLOCK_N)
        half = BLOCK_N // 2
        w_rows = tl.where(j < half, pid_n * half + j, N // 2 + pid_n * half + j - half)
    else:  # rows past N read row 0 (no mask on the loads); their sums are never stored
        w_rows = offs_n if EVEN_N else tl.where(offs_n < N, offs_n, 0)
    w_base = w_ptr + w_rows.to(tl.int64)[:, None] * stride_wn
    offs_kb = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    k_start = pid_k * K_SPLIT
    # CUDA cores: x is loaded broadcast over the weight tile's rows, VEC = 8 weights per thread
    # and load (16 bytes of x; 8 or 16 of the weight), so x and w share one register layout.
    # x tile rows: XR = 1 where one row of x has the weight tile's register layout (BLOCK_K a
    # multiple of 8 x 32 x num_warps: every thread holds whole rows' worth of its columns), so
    # x is loaded and converted once and broadcast in registers; else XR = BLOCK_N copies.
    bcast = tl.zeros([XR], tl.int32)  # every tile row reads x's row 0 (+ m)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    ssq = tl.zeros([BLOCK_M], tl.float32)
    # One row on the CUDA cores: each thread sums its VEC products in registers, so the
    # accumulator is VEC times smaller than the tile (registers for more programs per SM).
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    sq2 = tl.zeros([XR, BLOCK_K // VEC], tl.float32)  # its norm's squares
    # Several rows on the CUDA cores (up to 8, BLOCK_M a power of two): one such accumulator
    # per row, so each weight tile is loaded and converted once for all rows.
    a0 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a1 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a2 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a3 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a4 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a5 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a6 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    a7 = tl.zeros([BLOCK_N, BLOCK_K // VEC], tl.float32)
    n_iter = K_SPLIT // BLOCK_K  # steps past K are masked (not EVEN_K)
    if PREFETCH:
        offs_k = tl.max_contiguous(tl.multiple_of(k_start + offs_kb, 16), VEC)
        if EVEN_K:
            w_next = tl.load(w_base + offs_k[None, :])
        else:
            w_next = tl.load(w_base + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
    if PDL and N_PREFETCH > 0:  # the loop's loads come after the wait below (the tensor cores'
        # pipeline), or all but the first (CUDA cores): ask for the next tiles in L2 now
        k_pf = k_start if DOT else k_start + BLOCK_K
        _prefetch_l2(w_ptr, w_rows, k_pf, K, stride_wn, N_PREFETCH, BLOCK_K, LINE)
    if PDL:  # launched early (programmatic dependent launch): the first weights are in flight,
        # now wait for the previous kernel's results (x), then let the next start
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Loads that only the epilogue needs are issued here and wait there (their latency is
    # the loop's, not the program's tail): the residual to add, and the folded norm's sums of
    # squares from the previous product's epilogue (``SUMS_OUT``: one per row and row tile of
    # x's columns), added in a fixed order after the loop.
    add_tile = acc
    if ADD and not SILU:
        add_tile = tl.load(add_ptr + offs_m[None, :] * stride_am + offs_n[:, None],
                           mask=(offs_m < M)[None, :] & (offs_n < N)[:, None],
                           other=0.0)  # fmt: skip
    if SUMS_IN:
        offs_t = tl.arange(0, SUMS_T)
        sums = tl.load(sums_ptr + offs_t[:, None] * SUMS_STRIDE + offs_m[None, :],
                       mask=(offs_t < sums_tiles)[:, None] & (offs_m < M)[None, :],
                       other=0.0)  # fmt: skip
    elif NORM_FIRST:  # the folded norm's sums of squares before the loop, while the first
        # weight tiles are in flight (x is a few KiB per row, read from L2), not in every step
        for kk in range(0, K, BLOCK_K):
            offs_x = kk + tl.arange(0, BLOCK_K)
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_x[None, :],
                         mask=(offs_m < M)[:, None] & (offs_x < K)[None, :],
                         other=0.0).to(tl.float32)  # fmt: skip
            ssq += tl.sum(xs * xs, axis=1)
    for i in range(0, n_iter):
        offs_k = tl.max_contiguous(tl.multiple_of(k_start + i * BLOCK_K + offs_kb, 16), VEC)
        if PREFETCH:  # the next step's weights are in flight while this step computes
            w = w_next
            nk = tl.max_contiguous(tl.multiple_of(offs_k + BLOCK_K, 16), VEC)
            more = i + 1 < n_iter
            if EVEN_K:
                w_next = tl.load(w_base + nk[None, :], mask=more, other=0.0)
            else:
                w_next = tl.load(w_base + nk[None, :], mask=more & (nk < K)[None, :], other=0.0)
        elif EVEN_K:
            w = tl.load(w_base + offs_k[None, :])
        else:
            w = tl.load(w_base + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
        if DOT:
            x, sq = _x_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, PROLOGUE)
            if NORM and not NORM_FIRST and not SUMS_IN:
                ssq += tl.sum(sq, axis=1)
            if QX:  # x in e4m3 with one scale per row and step: FP8 x FP8 on the tensor cores
                xf = x.to(tl.float32)
                sx = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30) * (1.0 / 448.0)
                xq = (xf * (1.0 / sx)[:, None]).to(w.dtype)
                acc += tl.dot(w, tl.trans(xq)) * sx[None, :]
            else:
                acc += tl.dot(w.to(x.dtype), tl.trans(x))
        elif BLOCK_M == 1:
            x, sq = _x_tile(x_ptr, bcast, offs_k, M, K, stride_xm, PROLOGUE)
            if NORM and not NORM_FIRST and not SUMS_IN:
                sq2 += tl.sum(tl.reshape(sq, [XR, BLOCK_K // VEC, VEC]), axis=2)
            prod = w.to(tl.float32) * x.to(tl.float32)
            acc2 += tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // VEC, VEC]), axis=2)
        elif not NORM:  # several rows: each row's products summed per thread (no shuffles)
            wf = w.to(tl.float32)  # converted once, used for every row
            a0 += _row_part(wf, x_ptr, bcast, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N, VEC)
            if BLOCK_M > 1:
                a1 += _row_part(wf, x_ptr, bcast + 1, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N,
                                VEC)  # fmt: skip
            if BLOCK_M > 2:
                a2 += _row_part(wf, x_ptr, bcast + 2, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N,
                                VEC)  # fmt: skip
                a3 += _row_part(wf, x_ptr, bcast + 3, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N,
                                VEC)  # fmt: skip
            if BLOCK_M > 4:
                a4 += _row_part(wf, x_ptr, bcast + 4, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N,
                                VEC)  # fmt: skip
                a5 += _row_part(wf, x_ptr, bcast + 5, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N,
                                VEC)  # fmt: skip
                a6 += _row_part(wf, x_ptr, bcast + 6, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N,
                                VEC)  # fmt: skip
                a7 += _row_part(wf, x_ptr, bcast + 7, offs_k, M, K, stride_xm, PROLOGUE, BLOCK_N,
                                VEC)  # fmt: skip
        else:  # several rows with the norm: one reduction per row and step
            wf = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                x, sq = _x_tile(x_ptr, bcast + m, offs_k, M, K, stride_xm, PROLOGUE)
                s = tl.sum(wf * x.to(tl.float32), axis=1)
                acc += tl.where(offs_m[None, :] == m, s[:, None], 0.0)
                if NORM and not NORM_FIRST and not SUMS_IN:
                    ssq += tl.where(offs_m == m, tl.max(tl.sum(sq, axis=1), axis=0), 0.0)
    if SUMS_IN:
        ssq = tl.sum(sums, axis=0)
    if not DOT and BLOCK_M > 1 and not NORM:  # the rows' sums as [BLOCK_N, BLOCK_M]
        acc = _put(_put(acc, a0, offs_m, 0), a1, offs_m, 1)
        if BLOCK_M > 2:
            acc = _put(_put(acc, a2, offs_m, 2), a3, offs_m, 3)
        if BLOCK_M > 4:
            acc = _put(_put(_put(_put(acc, a4, offs_m, 4), a5, offs_m, 5), a6, offs_m, 6), a7,
                       offs_m, 7)  # fmt: skip
    if not DOT and BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[:, None]
        if NORM and (NORM_FIRST or SUMS_IN):
            acc *= tl.rsqrt(ssq / K + eps)[None, :]
        elif NORM:  # the norm's 1/rms (every tile row holds the same sum)
            acc *= tl.rsqrt(tl.sum(sq2, axis=1) / K + eps)[:, None]
    elif NORM:
        acc *= tl.rsqrt(ssq / K + eps)[None, :]
    _finish(acc, offs_m, offs_n, pid_n, pid_k, M, N, scale_ptr, bias_ptr, out_ptr, part_ptr,
            lock_ptr, stride_om, HAS_SCALE, HAS_BIAS, SPLIT_K, BLOCK_N, BLOCK_M, 1.0, add_ptr,
            stride_am, ADD, SILU, sums_ptr, SUMS_OUT, add_tile)  # fmt: skip


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    plan: SkinnyPlan | None = None,
    add: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """``x @ w.T (* scale) + bias (+ add)`` for ``x`` ``[M <= 8, K]`` and ``w`` ``[N, K]``
    (bf16/fp16, or float8_e4m3fn with a float32 ``scale`` ``[N]``: weight-only FP8); ``add``
    ``[M, N]`` (the residual stream) is added in float32 before the one rounding. ``pdl``:
    programmatic dependent launch where the GPU has it (every function here)."""
    return _launch(x, w, bias, scale, plan, 0, 1e-6, add=add, pdl=pdl)[0]


def linear_sums(
    x: torch.Tensor, w: torch.Tensor, add: torch.Tensor, plan: SkinnyPlan | None = None,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``linear(x, w, add=add)`` and, from its epilogue, each output row's sums of squares per
    row tile (``[tiles, SUMS_STRIDE]`` float32, of the rounded outputs): what a folded norm
    after it (``rms_linear(sums=)``) needs instead of summing the squares itself."""
    return _launch(x, w, None, None, plan, 0, 1e-6, add=add, sums_out=True, pdl=pdl)


def rms_linear(
    x: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    plan: SkinnyPlan | None = None,
    silu: bool = False,
    sums: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """``linear(rms_norm(x), w) + bias`` for a ``w`` that holds the norm's weight in its
    columns (``engine.model.fold_norms``): ``x`` goes into the product as it is (the loads stay
    pipelined), its squares are summed beside it (or come as ``sums``, what `linear_sums` left
    for this ``x``), and the epilogue scales each row by its ``1/rms``. ``silu``: ``w`` is
    ``[gate; up]`` and the result ``silu(gate) * up`` (the SiLU-and-multiply made in the
    epilogue: each program takes matching rows of both)."""
    return _launch(x, w, bias, scale, plan, 3, eps, silu=silu, sums_in=sums, pdl=pdl)[0]


def silu_fits(m: int, n: int, k: int, w_dtype: torch.dtype) -> bool:
    """Whether ``rms_linear(..., silu=True)`` takes ``[gate; up]`` of ``[n, k]`` at ``m`` rows:
    its plan's tile holds whole halves (N / 2 a multiple of half the tile's rows)."""
    half = plan_for(m, n, k, w_dtype, 3).block_n // 2
    return half >= 1 and n % 2 == 0 and (n // 2) % half == 0


def _launch(x, w, bias, scale, plan, prologue, eps, add=None, silu=False,  # noqa: ANN001, ANN202
            sums_in=None, sums_out=False, pdl=True):  # fmt: skip
    m = x.shape[0]
    n, k = w.shape
    if x.dim() != 2 or m > MAX_ROWS or x.shape[1] != k or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"x {list(x.shape)} / w {list(w.shape)}: need M <= 8, unit strides")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    if w.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError("an FP8 weight needs its per-channel scale")
    elif w.dtype != x.dtype:
        raise ValueError(f"w is {w.dtype}, x is {x.dtype}")
    if plan is not None and plan.qx and not (plan.dot and w.dtype == torch.float8_e4m3fn):
        raise ValueError("a qx plan is for FP8 weights on the tensor cores (dot)")
    if plan is not None and plan.qx and (prologue or add is not None or silu):
        raise ValueError("a qx plan takes no prologue or epilogue")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32):
        raise ValueError("scale must be float32 [N]")
    if bias is not None and bias.shape != (n,):
        raise ValueError("bias must be [N]")
    n_out = n // 2 if silu else n
    if silu and (n % 2 or scale is not None or bias is not None):
        raise ValueError("the SiLU epilogue takes an even N and no scale or bias")
    if add is not None and (add.shape != (m, n_out) or add.stride(-1) != 1 or add.dtype != x.dtype):
        raise ValueError(f"add must be [{m}, {n_out}] of x's dtype with unit stride")
    if sums_in is not None and (
        prologue != 3 or sums_in.dim() != 2 or sums_in.shape[1] != SUMS_ROWS
        or sums_in.dtype != torch.float32 or not sums_in.is_contiguous()
    ):  # fmt: skip
        raise ValueError(f"sums must be [tiles, {SUMS_ROWS}] float32 (linear_sums) for "
                         "rms_linear")  # fmt: skip
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    plan = plan or plan_for(m, n, k, w.dtype, prologue)
    tiles = triton.cdiv(n, plan.block_n)
    f32 = torch.float32
    sums = torch.empty((tiles, SUMS_ROWS), dtype=f32, device=x.device) if sums_out else None
    if m == 0:
        return out, sums
    norm_k = prologue == 3
    split = plan.split_k if not norm_k else 1  # the norm needs each row's whole K
    block_m = 16 if plan.dot else triton.next_power_of_2(m)
    block_k = plan.block_k
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_split)
    if silu and (plan.block_n < 2 or (n // 2) % (plan.block_n // 2)):
        raise ValueError(f"the SiLU epilogue needs N / 2 a multiple of {plan.block_n // 2}")
    launch = pdl_kwargs(x, pdl)
    line = 128 // w.element_size()
    part = locks = x
    if split > 1:
        if tiles > _MAX_TILES:
            raise ValueError(f"split-K takes at most {_MAX_TILES} row tiles")
        part = torch.empty((split, n, block_m), dtype=torch.float32, device=x.device)
        locks = _locks(x.device)
    if plan.pairs and not plan.dot and add is None and not silu and not sums_out:
        from kernels import triton_skinny_fp8

        if triton_skinny_fp8.fits(m, k, prologue, w, x):
            triton_skinny_fp8.launch(x, w, scale, bias, out, plan, k_split, split, part, locks,
                                     launch)  # fmt: skip
            return out, sums
    _skinny_kernel[(tiles, split)](
        x, w, scale if scale is not None else x, bias if bias is not None else x, out, part, locks,
        m, n, k, k_split, x.stride(0), w.stride(0), out.stride(0), eps,
        PROLOGUE=prologue, HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=plan.block_n,
        BLOCK_K=block_k, DOT=plan.dot, EVEN_K=k % block_k == 0 and k_split * split == k,
        EVEN_N=n % plan.block_n == 0, PREFETCH=plan.prefetch and not plan.dot,
        VEC=block_k if plan.dot else 8,
        XR=1 if block_k % (256 * plan.num_warps) == 0 else plan.block_n,
        QX=plan.qx, N_PREFETCH=_prefetch_steps(plan, k_split, line) if launch["PDL"] else 0,
        LINE=line, add_ptr=add if add is not None else x,
        stride_am=add.stride(0) if add is not None else 0, NORM=norm_k, ADD=add is not None,
        # the folded norm's squares in a pass before the loop on the CUDA cores (one row on an
        # H100: 0.988x the unfolded step, 1.007x in the loop), in the loop on the tensor cores
        # (8 rows: 0.997x, 1.25x for the pass before the pipeline)
        SILU=silu, NORM_FIRST=prologue == 3 and not plan.dot,
        sums_ptr=next(t for t in (sums_in, sums, x) if t is not None),
        sums_tiles=sums_in.shape[0] if sums_in is not None else 0, SUMS_IN=sums_in is not None,
        SUMS_T=triton.next_power_of_2(sums_in.shape[0]) if sums_in is not None else 1,
        SUMS_OUT=sums_out, **launch,
        # the folded norm's x goes into the product as it is: the pipeline keeps its stages
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return out, sums


def _locks(device: torch.device) -> torch.Tensor:
    """Row-tile counters of split-K (zeroed once; every call leaves them zero). Made by the
    first split-K call, which must not be inside a CUDA graph capture (warm-ups run first)."""
    if device not in _LOCKS:
        _LOCKS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _LOCKS[device]


# -- plans -------------------------------------------------------------------------------------
PlanKey = tuple[int, int, int, int, int]  # (rows bucket, N, K, weight bytes, prologue)
_TUNED: dict[PlanKey, SkinnyPlan] = {}
_LOADED: set[str] = set()


def rows_bucket(m: int) -> int:
    return 1 if m <= 1 else triton.next_power_of_2(m)


def plan_key(m: int, n: int, k: int, w_dtype: torch.dtype, prologue: int = 0) -> PlanKey:
    return (rows_bucket(m), n, k, 1 if w_dtype == torch.float8_e4m3fn else 2, prologue)


def set_plan(key: PlanKey, plan: SkinnyPlan | None) -> None:
    """Install a measured plan (``None``: back to the heuristic)."""
    if plan is None:
        _TUNED.pop(key, None)
    else:
        _TUNED[key] = plan


def plans_json(device_name: str) -> dict:
    """The installed plans, as ``kernels/skinny_plans.json`` keeps them for one device."""
    return {device_name: [[list(key), asdict(p)] for key, p in sorted(_TUNED.items())]}


def load_plans() -> None:
    """Measured plans of this device from ``skinny_plans.json`` (once per process)."""
    if not torch.cuda.is_available():
        return
    name = torch.cuda.get_device_name()
    if name in _LOADED:
        return
    _LOADED.add(name)
    if PLANS_FILE.exists():
        install_plans(PLANS_FILE, name, replace=False)


def install_plans(path: Path, device_name: str, replace: bool = True) -> None:
    """The plans ``path`` (``skinny_plans.json``'s format) holds for ``device_name``; with
    ``replace`` they take the place of plans already installed."""
    for key, p in json.loads(path.read_text()).get(device_name, []):
        if replace or tuple(key) not in _TUNED:
            _TUNED[tuple(key)] = SkinnyPlan(**p)


def plan_for(m: int, n: int, k: int, w_dtype: torch.dtype, prologue: int = 0) -> SkinnyPlan:
    """A measured plan where there is one, else the heuristic: one row on the CUDA cores with
    1 KiB of each weight row per step, more rows on the tensor cores; rows per program so that
    the product has about four programs per SM or more, split-K where it has fewer. Products
    of an 8B-class model (N a multiple of 128, K of 1024) on a GPU without measured plans take
    what H100 and H200 measured best for them (FP8 at one row in bf16 pairs; 2-8 rows on
    warpgroup MMA, FP8 with x in e4m3): on an H200 before its plans were measured, the
    heuristic's FP8 step at batch 8 took 2.6x the measured plans' (bench/results)."""
    load_plans()
    tuned = _TUNED.get(plan_key(m, n, k, w_dtype, prologue))
    if tuned is None and prologue:  # the plain product's plan (the norm's takes no split-K)
        tuned = _TUNED.get(plan_key(m, n, k, w_dtype, 0))
        tuned = None if tuned is not None and tuned.qx else tuned  # qx takes no prologue
    if tuned is not None:
        return tuned
    wbytes = 1 if w_dtype == torch.float8_e4m3fn else 2
    big = n % 128 == 0 and k % 1024 == 0  # an 8B-class product
    if m <= 1:
        if big and wbytes == 1:  # FP8 in bf16 pairs: the best or near it on H100 and H200
            return SkinnyPlan(block_n=2, block_k=1024, num_warps=2, pairs=True)
        # 4 rows of 1024 weights per step: 1024 programs at N = 4096
        return SkinnyPlan(block_n=4, block_k=max(16, min(1024, triton.next_power_of_2(k))))
    if big:  # the tensor cores' deep pipelines, split along K where there are few row tiles:
        # what H100 and H200 measured best or near it for the 8B shape (skinny_plans.json)
        if wbytes == 1:  # x in e4m3 too (W8A8), as the measured FP8 plans at 2-8 rows
            return SkinnyPlan(block_n=128, block_k=128, num_stages=4, dot=True, qx=True,
                              split_k=4 if n <= 8192 else 2)  # fmt: skip
        return SkinnyPlan(block_n=64, block_k=128, num_stages=6, dot=True,
                          split_k=2 if n <= 8192 else 1)  # fmt: skip
    block_k = max(16, min(512 if wbytes == 1 else 256, triton.next_power_of_2(k)))
    split = 2 if n <= 8192 and k >= 2048 else 1
    return SkinnyPlan(block_n=16, block_k=block_k, num_warps=4, num_stages=4, split_k=split,
                      dot=True)  # fmt: skip


def candidates(m: int, w_dtype: torch.dtype, prologue: int = 0) -> list[SkinnyPlan]:
    """The plans ``lab.skinny_gpu`` measures for one product (a bounded set: each is a
    compile): for one row, the CUDA cores with 2-8 weight rows of 512-2048 weights per
    program and step; for more rows, the tensor cores with 16-32 weight rows; split-K 2 too."""
    wbytes = 1 if w_dtype == torch.float8_e4m3fn else 2
    kb = 1024 // wbytes  # 1 KiB of each weight row per step
    split = 2
    # FP8 on the FP8 tensor cores (warpgroup MMA from 64 weight rows up), x quantized per step:
    # no per-weight conversion instructions, which bound the CUDA-core FP8 plans
    qx = (
        []
        if wbytes == 2 or prologue
        else [
            SkinnyPlan(block_n=64, block_k=256, num_stages=4, dot=True, qx=True),
            SkinnyPlan(block_n=64, block_k=256, num_stages=4, split_k=2, dot=True, qx=True),
            SkinnyPlan(block_n=64, block_k=128, num_stages=6, split_k=2, dot=True, qx=True),
            SkinnyPlan(block_n=128, block_k=128, num_stages=4, split_k=2, dot=True, qx=True),
            SkinnyPlan(block_n=128, block_k=128, num_stages=4, split_k=4, dot=True, qx=True),
        ]
    )
    # FP8, one row, in bf16 pairs (``triton_skinny_fp8``; 512 x num_warps weights per row and
    # step: one row of x has the weight tile's layout)
    pairs = (
        []
        if wbytes == 2 or prologue
        else [
            SkinnyPlan(block_n=2, block_k=2048, pairs=True),
            SkinnyPlan(block_n=4, block_k=2048, pairs=True),
            SkinnyPlan(block_n=8, block_k=2048, pairs=True),
            SkinnyPlan(block_n=2, block_k=1024, num_warps=2, pairs=True),
            SkinnyPlan(block_n=4, block_k=1024, num_warps=2, pairs=True),
            SkinnyPlan(block_n=2, block_k=2048, split_k=2, pairs=True),
            # num_stages 4: two weight tiles in flight in registers; l2: more tiles into L2
            # before the PDL wait
            SkinnyPlan(block_n=2, block_k=1024, num_warps=2, num_stages=4, pairs=True),
            SkinnyPlan(block_n=2, block_k=2048, num_stages=4, pairs=True),
            SkinnyPlan(block_n=4, block_k=2048, num_stages=4, pairs=True),
            SkinnyPlan(block_n=2, block_k=1024, num_warps=2, num_stages=4, l2=2, pairs=True),
        ]
    )
    if m <= 1:  # 1024 (4 warps) or 2048 (8 warps) columns: one row of x fits the weight's layout
        return [SkinnyPlan(block_n=4, block_k=1024), SkinnyPlan(block_n=8, block_k=1024),
                SkinnyPlan(block_n=2, block_k=1024), SkinnyPlan(block_n=8, block_k=kb // 2),
                SkinnyPlan(block_n=4, block_k=2048, num_warps=8),
                SkinnyPlan(block_n=4, block_k=1024, split_k=split),
                SkinnyPlan(block_n=4, block_k=1024, l2=2)] + qx + pairs  # fmt: skip
    # 2-8 rows on the CUDA cores too: each weight tile loaded and converted once for every row
    # (FP8 on the tensor cores converts each tile to bf16 through shared memory first).
    fma = [SkinnyPlan(block_n=2, block_k=1024), SkinnyPlan(block_n=4, block_k=1024),
           SkinnyPlan(block_n=8, block_k=1024), SkinnyPlan(block_n=4, block_k=2048, num_warps=8),
           SkinnyPlan(block_n=4, block_k=1024, split_k=split)]  # fmt: skip
    dot = [SkinnyPlan(block_n=16, block_k=kb // 2, num_stages=4, dot=True),
           SkinnyPlan(block_n=16, block_k=kb // 2, num_stages=4, split_k=split, dot=True),
           SkinnyPlan(block_n=32, block_k=kb // 2, num_stages=4, dot=True)]  # fmt: skip
    if wbytes == 2:  # warpgroup MMA (64 weight rows and up), deeper pipelines
        dot += [
            SkinnyPlan(block_n=64, block_k=128, num_stages=4, dot=True),
            SkinnyPlan(block_n=64, block_k=128, num_stages=6, dot=True),
            SkinnyPlan(block_n=64, block_k=256, num_stages=3, dot=True),
            SkinnyPlan(block_n=128, block_k=64, num_stages=6, dot=True),
            SkinnyPlan(block_n=64, block_k=128, num_stages=4, split_k=split, dot=True),
            SkinnyPlan(block_n=64, block_k=64, num_stages=8, dot=True),
            SkinnyPlan(block_n=128, block_k=128, num_stages=4, dot=True),
        ]
        # more programs for the products with few 64-row tiles (o_proj and down: N = 4096 is
        # 64 tiles for 132 SMs): split-K with the deep pipelines
        dot += [
            SkinnyPlan(block_n=64, block_k=128, num_stages=6, split_k=2, dot=True),
            SkinnyPlan(block_n=64, block_k=256, num_stages=3, split_k=2, dot=True),
            SkinnyPlan(block_n=64, block_k=128, num_stages=6, split_k=4, dot=True),
        ]
    return fma + dot + qx
