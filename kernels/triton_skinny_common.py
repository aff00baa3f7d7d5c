"""What the skinny products share (``kernels.triton_skinny``, and its FP8 one-row kernel in
bf16 pairs, ``kernels.triton_skinny_fp8``): the launch plan, the weight tiles asked into L2
before the PDL wait, and the epilogue with its split-K finish. Both kernel modules import it;
it imports neither."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

# Rows per row tile in the sums of squares a product's epilogue leaves for the next folded
# norm (``linear_sums``, ``rms_linear(sums=)``): ``[row tiles, SUMS_STRIDE]`` float32.
SUMS_ROWS = 16
SUMS_STRIDE = tl.constexpr(SUMS_ROWS)


@dataclass(frozen=True, slots=True)
class SkinnyPlan:
    """``block_n`` weight rows per program, ``block_k`` weights per row and step, ``split_k``
    programs along K per row tile, tensor cores or not (``dot``)."""

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1
    dot: bool = False
    prefetch: bool = True  # CUDA cores: the next step's weight loads issued before this step's math
    qx: bool = False  # FP8 weights on the tensor cores: x quantized to e4m3 per step (W8A8)
    # weight tiles asked into L2 before the PDL wait (-1: the tensor cores' pipeline depth, none
    # on the CUDA cores, whose first tile is loaded into registers there)
    l2: int = -1
    # one row of FP8 weights on the CUDA cores in bf16 pairs (``triton_skinny_fp8``): about
    # three instructions a weight instead of seven; other products take the plain path
    pairs: bool = False

    def label(self) -> str:
        fma = ("fmap" if self.pairs else "fma") if self.prefetch else "fma_nopf"
        kind = ("qdot" if self.qx else "dot") if self.dot else fma
        return (f"{kind}_n{self.block_n}_k{self.block_k}_w{self.num_warps}_s{self.num_stages}"
                f"_sk{self.split_k}" + (f"_l2{self.l2}" if self.l2 >= 0 else ""))  # fmt: skip


@triton.jit
def _prefetch_l2(w_ptr, w_rows, k_start, K, stride_wn, STEPS: tl.constexpr,
                 BLOCK_K: tl.constexpr, LINE: tl.constexpr):  # fmt: skip
    """``prefetch.global.L2`` of the first ``STEPS`` weight tiles of this program, one per
    ``LINE`` weights (128 bytes): nothing waits for it, it only warms the L2."""
    offs = tl.minimum(k_start + tl.arange(0, STEPS * BLOCK_K // LINE) * LINE, K - 1)
    ptrs = w_ptr + w_rows.to(tl.int64)[:, None] * stride_wn + offs[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, scale_ptr, bias_ptr, out_ptr, stride_om,
              HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, UNIT: tl.constexpr = 1.0,
              pid_n=0, add_ptr=None, stride_am=0, ADD: tl.constexpr = False,
              SILU: tl.constexpr = False, BLOCK_N: tl.constexpr = 1,
              BLOCK_M: tl.constexpr = 1, sums_ptr=None,
              SUMS_OUT: tl.constexpr = False, add_tile=None):  # fmt: skip
    """``acc`` is ``[BLOCK_N, BLOCK_M]`` (output columns by rows). ``SILU``: the tile's first
    half of rows is gate's, the second up's (``_skinny_kernel``), stored as ``silu(gate) * up``
    in columns ``pid_n * BLOCK_N / 2 + ...`` of an ``[M, N / 2]`` output. ``ADD``: plus the
    ``[M, N]`` tensor at ``add_ptr`` (the residual stream), rounded once. ``SUMS_OUT``: each
    row's sum of the squares of the tile's stored (rounded) outputs, at
    ``sums_ptr[pid_n, row]`` (``SUMS_STRIDE`` rows per tile): the next folded norm's.
    ``add_tile``: the tile of ``add_ptr`` already loaded (``[BLOCK_N, BLOCK_M]``)."""
    n_mask = offs_n < N
    if HAS_SCALE:  # per output channel (FP8 weights), times the caller's unit
        acc *= (tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0) * UNIT)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if SILU:
        pair = tl.permute(tl.reshape(acc, [2, BLOCK_N // 2, BLOCK_M]), (1, 2, 0))
        gate, up = tl.split(pair)
        acc = gate / (1.0 + tl.exp(-gate)) * up
        offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        N = N // 2
        n_mask = offs_n < N
    mask = (offs_m < M)[None, :] & n_mask[:, None]
    if ADD:
        if SILU or add_tile is None:
            a = tl.load(add_ptr + offs_m[None, :] * stride_am + offs_n[:, None], mask=mask,
                        other=0.0)  # fmt: skip
        else:  # loaded by the kernel before its loop (the same tile)
            a = add_tile
        acc += a.to(tl.float32)
    o = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    y = acc.to(out_ptr.dtype.element_ty)
    if SUMS_OUT:
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(sums_ptr + pid_n * SUMS_STRIDE + offs_m, tl.sum(yf * yf, axis=0),
                 mask=offs_m < M)  # fmt: skip
    tl.store(o, y, mask=mask)


@triton.jit
def _finish(acc, offs_m, offs_n, pid_n, pid_k, M, N, scale_ptr, bias_ptr, out_ptr, part_ptr,
            lock_ptr, stride_om, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
            SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
            UNIT: tl.constexpr = 1.0, add_ptr=None, stride_am=0, ADD: tl.constexpr = False,
            SILU: tl.constexpr = False, sums_ptr=None, SUMS_OUT: tl.constexpr = False,
            add_tile=None):  # fmt: skip
    """The epilogue of one program's ``[BLOCK_N, BLOCK_M]`` sums (times ``UNIT``); with split-K
    the last program of the row tile adds the parts in a fixed order first."""
    if SPLIT_K == 1:
        _epilogue(acc, offs_m, offs_n, M, N, scale_ptr, bias_ptr, out_ptr, stride_om,
                  HAS_SCALE, HAS_BIAS, UNIT, pid_n, add_ptr, stride_am, ADD, SILU, BLOCK_N,
                  BLOCK_M, sums_ptr, SUMS_OUT, add_tile)  # fmt: skip
    else:
        # This part's sums; the last program of the row tile adds the parts in a fixed order.
        n_mask = offs_n < N
        p_mask = n_mask[:, None] & (offs_m < M)[None, :]
        p_ptrs = part_ptr + (pid_k * N + offs_n[:, None]) * BLOCK_M + offs_m[None, :]
        tl.store(p_ptrs, acc, mask=p_mask)
        tl.debug_barrier()  # every thread's stores before the release below
        done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in tl.static_range(SPLIT_K):
                q_ptrs = part_ptr + (s * N + offs_n[:, None]) * BLOCK_M + offs_m[None, :]
                acc += tl.load(q_ptrs, mask=p_mask, other=0.0, cache_modifier=".cg")
            _epilogue(acc, offs_m, offs_n, M, N, scale_ptr, bias_ptr, out_ptr, stride_om,
                      HAS_SCALE, HAS_BIAS, UNIT, pid_n, add_ptr, stride_am, ADD, SILU,
                      BLOCK_N, BLOCK_M, sums_ptr, SUMS_OUT, add_tile)  # fmt: skip
            tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # for the next call


def _prefetch_steps(plan: SkinnyPlan, k_split: int, line: int) -> int:
    """Weight tiles a program asks into L2 before its PDL wait (``plan.l2``; by default those
    the tensor cores' pipeline loads first), a power of two, at most the program's steps."""
    want = (plan.num_stages - 1 if plan.dot else 0) if plan.l2 < 0 else plan.l2
    steps = min(want, k_split // plan.block_k - (0 if plan.dot else 1))
    steps = 1 << (steps.bit_length() - 1) if steps > 0 else 0
    return steps if steps * plan.block_k >= line else 0
