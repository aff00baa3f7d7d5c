"""Triton skinny matrix product for decode: ``x @ w.T (+ bias)`` with a few rows of ``x``.

A decode step of a small batch is a chain of matrix-vector products that read every weight
once; this kernel streams ``w`` (``[N, K]``, row-major) in tiles of ``BLOCK_N`` rows, deeply
pipelined, with the whole of ``x`` (at most 16 rows, padded) against each tile. cuBLAS is used
for larger batches.

Two prologues fold the small kernel before a product into it (one launch instead of two, and
the normalised rows never go through memory):

- ``norm_linear``: ``rms_norm(x + residual) * g`` then the product (the QKV and gate/up
  products). The norm's 1/rms factors out of each output row, so one pass over ``K`` computes
  ``(x * g) @ w.T`` and the sum of squares together, and the epilogue scales by ``rsqrt``. The
  programs of the first row tile also store ``x + residual`` (the next residual).
- ``silu_mul_linear``: ``silu(gate) * up`` of the fused gate/up output, then the product (the
  down product), rounded where ``silu_and_mul`` rounds, so the result is the unfused pair's.

Split-K (``GemvPlan.split_k``): the ``K`` range is cut in ``split_k`` parts, one program each,
so a product with few row tiles (``o_proj``, ``qkv``) keeps more loads in flight. Each program
writes its partial sums to a float32 workspace; the last program of a row tile to finish
(counted with an atomic) adds the parts in a fixed order and runs the epilogue, so results
stay deterministic and one launch does it all. Its counter is reset for the next call (CUDA
graphs replay it as is).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x the kernel handles (the tile is padded to 16)
_LOCKS: dict[torch.device, torch.Tensor] = {}  # one counter per row tile, zero between calls
_MAX_TILES = 1 << 16


@dataclass(frozen=True, slots=True)
class GemvPlan:
    """Tile sizes of one call: ``BLOCK_N`` weight rows per program, ``BLOCK_K`` per step, and
    ``split_k`` programs per row tile along ``K``."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1


@dataclass(frozen=True, slots=True)
class Prologue:
    """What is done to ``x`` on its way into the product (see the module docstring)."""

    kind: int = 0  # 0: none; 1: RMSNorm (with ``norm``); 2: SiLU-and-multiply of [gate | up]
    norm: torch.Tensor | None = None  # the norm's weight [K]
    eps: float = 1e-6
    residual: torch.Tensor | None = None  # added to x before the norm


@triton.jit
def _load_x(x_ptrs, r_ptrs, ro_ptrs, g_ptr, offs_k, xm, km, K, ssq, store_res,
            PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_K]`` tile of the product's left side, after the prologue."""
    if PROLOGUE == 1:
        x = tl.load(x_ptrs, mask=xm, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptrs, mask=xm, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(ro_ptrs, x, mask=xm & store_res)
        xf = x.to(tl.float32)
        ssq += tl.sum(xf * xf, axis=1)
        g = tl.load(g_ptr + offs_k, mask=km, other=0.0).to(tl.float32)
        x = (xf * g[None, :]).to(x.dtype)
    elif PROLOGUE == 2:
        gate = tl.load(x_ptrs, mask=xm, other=0.0)
        up = tl.load(x_ptrs + K, mask=xm, other=0.0).to(tl.float32)
        gf = gate.to(tl.float32)
        act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
        x = (act.to(tl.float32) * up).to(gate.dtype)
    else:
        x = tl.load(x_ptrs, mask=xm, other=0.0)
    return x, ssq


@triton.jit
def _epilogue(acc, ssq, offs_m, offs_n, m_mask, n_mask, K, eps, bias_ptr, scale_ptr, out_ptr,
              stride_om, PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_SCALE: tl.constexpr):  # fmt: skip
    if PROLOGUE == 1:  # the norm's 1/rms, per row
        acc *= tl.rsqrt(ssq / K + eps)[:, None]
    if HAS_SCALE:  # per output channel (FP8 weights)
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, res_ptr, res_out_ptr, g_ptr, part_ptr, ssq_ptr,
    lock_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps,
    PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(K, k_start + K_SPLIT)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    r_ptrs = res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :]
    ro_ptrs = res_out_ptr + offs_m[:, None] * stride_rom + offs_k[None, :]
    store_res = pid_n == 0  # one row tile writes x + residual
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ssq = tl.zeros([BLOCK_M], tl.float32)
    for _k0 in range(k_start, k_end, BLOCK_K):
        k_mask = offs_k < k_end
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x, ssq = _load_x(x_ptrs, r_ptrs, ro_ptrs, g_ptr, offs_k, m_mask[:, None] & k_mask[None, :],
                         k_mask, K, ssq, store_res, PROLOGUE, HAS_RES)  # fmt: skip
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # FP8 weights: exact in bf16/fp16
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        r_ptrs += BLOCK_K
        ro_ptrs += BLOCK_K
        offs_k += BLOCK_K
    if SPLIT_K == 1:
        _epilogue(acc, ssq, offs_m, offs_n, m_mask, n_mask, K, eps, bias_ptr, scale_ptr, out_ptr,
                  stride_om, PROLOGUE, HAS_BIAS, HAS_SCALE)  # fmt: skip
    else:
        # This part's sums, then the last program of the row tile adds all parts in order.
        tiles = tl.num_programs(0)
        p_ptrs = part_ptr + (pid_k * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=n_mask[None, :])
        tl.store(ssq_ptr + (pid_k * tiles + pid_n) * BLOCK_M + offs_m, ssq)
        tl.debug_barrier()  # every thread's stores before the release below
        done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            ssq = tl.zeros([BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):
                p_ptrs = part_ptr + (s * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :]
                acc += tl.load(p_ptrs, mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
                s_ptrs = ssq_ptr + (s * tiles + pid_n) * BLOCK_M + offs_m
                ssq += tl.load(s_ptrs, cache_modifier=".cg")
            _epilogue(acc, ssq, offs_m, offs_n, m_mask, n_mask, K, eps, bias_ptr, scale_ptr,
                      out_ptr, stride_om, PROLOGUE, HAS_BIAS, HAS_SCALE)  # fmt: skip
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # for the next call


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
    return _launch(x, w, bias, plan, scale, Prologue())[0]


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: GemvPlan | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``linear(rms_norm(x + residual) * norm, w)`` and ``x + residual`` (``x`` itself without
    a residual), in one launch; ``x`` is ``[M <= 16, K]``."""
    if norm.shape != (w.shape[1],):
        raise ValueError("the norm's weight must be [K]")
    return _launch(x, w, bias, plan, scale, Prologue(1, norm, eps, residual))


def silu_mul_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: GemvPlan | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(silu(x[:, :K]) * x[:, K:], w)`` for the fused gate/up output ``x`` of shape
    ``[M <= 16, 2K]``, in one launch."""
    return _launch(x, w, bias, plan, scale, Prologue(2))[0]


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    plan: GemvPlan | None,
    scale: torch.Tensor | None,
    p: Prologue,
) -> tuple[torch.Tensor, torch.Tensor]:
    m = x.shape[0]
    n, k = w.shape
    kx = 2 * k if p.kind == 2 else k
    if x.dim() != 2 or m > MAX_ROWS or x.shape[1] != kx or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"x {list(x.shape)} / w {list(w.shape)}: need M <= 16, unit strides")
    if bias is not None and bias.shape != (n,):
        raise ValueError("bias must be [N]")
    if scale is not None and (scale.shape != (n,) or scale.dtype != torch.float32):
        raise ValueError("scale must be float32 [N]")
    res = p.residual
    if res is not None and (res.shape != x.shape or res.stride(-1) != 1):
        raise ValueError("residual must match x")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x) if res is not None else x
    if m == 0:
        return out, res_out
    plan = plan or plan_for(n, k, x.device)
    tiles = triton.cdiv(n, plan.block_n)
    k_split = triton.cdiv(triton.cdiv(k, max(plan.split_k, 1)), plan.block_k) * plan.block_k
    split = triton.cdiv(k, k_split)
    part = ssq = locks = x
    if split > 1:
        if tiles > _MAX_TILES:
            raise ValueError(f"split-K takes at most {_MAX_TILES} row tiles")
        part = torch.empty((split, MAX_ROWS, n), dtype=torch.float32, device=x.device)
        ssq = torch.empty((split, tiles, MAX_ROWS), dtype=torch.float32, device=x.device)
        locks = _locks(x.device)
    _gemv_kernel[(tiles, split)](
        x, w, bias if bias is not None else x, scale if scale is not None else x, out,
        res if res is not None else x, res_out, p.norm if p.norm is not None else x, part, ssq,
        locks, m, n, k, k_split, x.stride(0), w.stride(0), out.stride(0),
        res.stride(0) if res is not None else 0, res_out.stride(0), p.eps,
        PROLOGUE=p.kind, HAS_RES=res is not None, HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None, SPLIT_K=split, BLOCK_M=MAX_ROWS, BLOCK_N=plan.block_n,
        BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return out, res_out


# Split-K where a product has fewer row tiles than this many per SM (0: never). Off until a GPU
# run says it pays (lab.decode_gpu measures both); o_proj and qkv of the 8B shape have ~2-3.
SPLIT_K_TILES_PER_SM = 0
SPLIT_K = 2
SPLIT_K_MIN_K = 2048  # shallower products gain nothing from splitting


def plan_for(n: int, k: int, device: torch.device) -> GemvPlan:
    """The tile plan of an ``[N, K]`` product: split-K for short, deep ones (see above)."""
    if SPLIT_K_TILES_PER_SM and device.type == "cuda" and k >= SPLIT_K_MIN_K:
        from kernels._triton import num_sms

        sms = num_sms(device.index if device.index is not None else torch.cuda.current_device())
        if triton.cdiv(n, GemvPlan().block_n) < SPLIT_K_TILES_PER_SM * sms:
            return GemvPlan(split_k=SPLIT_K)
    return GemvPlan()


def _locks(device: torch.device) -> torch.Tensor:
    """The device's row-tile counters (zeroed once; every split-K call leaves them zero)."""
    if device not in _LOCKS:
        _LOCKS[device] = torch.zeros(_MAX_TILES, dtype=torch.int32, device=device)
    return _LOCKS[device]
