"""Kernels behind one torch-level API.

Each public function here dispatches to a Triton kernel when the tensors live on CUDA and
Triton imports, and to the pure-PyTorch reference in ``kernels.reference`` otherwise. The engine
imports only this module, so swapping implementations needs no other change. Triton modules are
imported on first use only, so CPU hosts without Triton never touch them. Where there is more
than one kernel for a call, the caller's `KernelChoices` (``choices``, fixed when its model
loads) says which; the default is what the engine serves with.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TypeGuard

import torch

from kernels import flash_attn, reference
from kernels._triton import pdl_on, use_triton
from kernels.choices import DEFAULT, KernelChoices
from kernels.reference import (
    FP8,
    AttentionMetadata,
    Fp8Weight,
    LoRAMetadata,
    copy_blocks,
    quantize_fp8_rows,
)

__all__ = [
    "FP8",
    "AttentionMetadata",
    "KernelChoices",
    "attention_variant",
    "Fp8Weight",
    "LoRAMetadata",
    "block_wsum64",
    "copy_blocks",
    "copy_blocks_between",
    "copy_sum_blocks_between",
    "copy_sum_check_blocks_between",
    "copy_sum_check_packed",
    "packed_check",
    "runs_copy_sum",
    "run_wsum64",
    "packed_copy_sum",
    "compare_sums",
    "count_mismatches",
    "linear",
    "linear_add",
    "linear_add_sums",
    "lora_add",
    "lora_add_fused",
    "paged_attention",
    "rope_attention",
    "quantize_fp8_rows",
    "rms_linear",
    "rms_norm",
    "rope_write_kv",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]


def linear(
    x: torch.Tensor,
    w: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    choices: KernelChoices = DEFAULT,
) -> torch.Tensor:
    """``x @ w.T + bias`` (``F.linear``) for ``x`` of shape ``[T, K]``.

    On CUDA, up to ``choices.skinny_rows`` rows take the skinny Triton kernel (an FP8 weight,
    ``Fp8Weight``, read as is: weight-only FP8, half the bytes of bf16); more rows of an FP8
    weight quantize ``x`` per row to FP8 too and use the FP8 tensor cores (``torch._scaled_mm``,
    row-wise scales), of a bf16/fp16 one cuBLAS.
    """
    if isinstance(w, Fp8Weight):
        return _fp8_linear(x, w, bias, choices)
    if _skinny(x, w, choices):
        from kernels import triton_skinny

        return triton_skinny.linear(x, w, bias, pdl=choices.pdl)
    return reference.linear(x, w, bias)


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata,
    choices: KernelChoices = DEFAULT,
) -> None:  # fmt: skip
    """``y[t] += (x[t] @ a[s].T) @ b[s].T * scale[s]`` for the tokens of each LoRA slot ``s``
    (``meta``); ``a``: [S, R, in], ``b``: [S, out, R]. In place; base-only tokens untouched."""
    if use_triton(x):
        from kernels import triton_lora

        triton_lora.lora_add(y, x, a, b, meta, pdl=choices.pdl)
        return
    reference.lora_add(y, x, a, b, meta)


def lora_add_fused(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, widths: list[int],
    meta: LoRAMetadata, choices: KernelChoices = DEFAULT,
) -> None:  # fmt: skip
    """``lora_add`` for projections of one input sharing a fused output (q/k/v, gate/up):
    ``a`` [S, len(widths) * R, in] (their A stacked), ``b`` [S, sum(widths), R] (their B in
    the output's column order), ``y`` [T, sum(widths)]. Two launches on CUDA, whatever the
    number of projections."""
    if use_triton(x):
        from kernels import triton_lora

        triton_lora.lora_add_fused(y, x, a, b, widths, meta, pdl=choices.pdl)
        return
    reference.lora_add_fused(y, x, a, b, widths, meta)


def _skinny(x: torch.Tensor, w: torch.Tensor | Fp8Weight, choices: KernelChoices) -> bool:
    """Whether the product takes the skinny Triton kernel (see `linear`)."""
    weight = w.weight if isinstance(w, Fp8Weight) else w
    return (
        x.shape[0] <= choices.skinny_rows
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and use_triton(x)
    )


def _skinny_16(
    w: torch.Tensor | Fp8Weight, x: torch.Tensor, choices: KernelChoices
) -> TypeGuard[torch.Tensor]:
    """Whether a bf16/fp16 weight's product takes ``triton_skinny`` (the folded decode's
    kernels: its epilogues add the stream, apply the norm, leave the sums); so ``w`` is a
    plain tensor where it does."""
    return not isinstance(w, Fp8Weight) and _skinny(x, w, choices)


def rms_linear(
    x: torch.Tensor,
    unit_norm: torch.Tensor,
    eps: float,
    w: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    silu: bool = False,
    sums: torch.Tensor | None = None,
    choices: KernelChoices = DEFAULT,
) -> torch.Tensor:
    """``linear(rms_norm(x), w, bias)`` for a ``w`` that holds the norm's weight in its columns
    (``engine.model.fold_norms``); ``silu``: ``w`` is ``[gate; up]`` and the result is
    ``silu_and_mul`` of the product. One launch (``triton_skinny.rms_linear``: ``x`` unchanged
    into the product, ``1/rms`` and SiLU in the epilogue) where the product takes the skinny
    kernel on the CUDA cores, or on the tensor cores with ``sums``: what `linear_add_sums` left
    for ``x`` (``choices.fold_sums``), taken instead of summing ``x``'s squares; elsewhere
    `rms_norm` with ``unit_norm`` (the folded norm's weight: ones), then `linear` (then
    `silu_and_mul`)."""
    if _skinny_16(w, x, choices) and (bias is None or not silu):
        from kernels import triton_skinny

        n, k = w.shape
        dot = triton_skinny.plan_for(x.shape[0], n, k, w.dtype, 3).dot
        fits = not silu or triton_skinny.silu_fits(x.shape[0], n, k, w.dtype)
        if fits and choices.fold_sums and sums is not None:
            return triton_skinny.rms_linear(x, eps, w, bias, silu=silu, sums=sums, pdl=choices.pdl)
        if fits and not dot:
            return triton_skinny.rms_linear(x, eps, w, bias, silu=silu, pdl=choices.pdl)
    h, _ = rms_norm(x, unit_norm, eps, choices=choices)
    out = linear(h, w, bias, choices)
    return silu_and_mul(out, choices) if silu else out


def linear_add(
    x: torch.Tensor, w: torch.Tensor | Fp8Weight, add: torch.Tensor,
    choices: KernelChoices = DEFAULT,
) -> torch.Tensor:  # fmt: skip
    """``linear(x, w) + add`` (the residual stream), added in the product's epilogue before
    its one rounding: the skinny kernel's where it takes the product, else the BLAS's
    (``addmm``: on CUDA cuBLAS reads ``add`` as its C operand, so no second kernel reads and
    writes the stream); an FP8 weight's product adds it after."""
    if _skinny_16(w, x, choices):
        from kernels import triton_skinny

        return triton_skinny.linear(x, w, add=add, pdl=choices.pdl)
    if (
        isinstance(w, torch.Tensor)
        and x.dim() == 2
        and add.dtype == x.dtype == w.dtype
        and add.shape == (x.shape[0], w.shape[0])
    ):
        return torch.addmm(add, x, w.t())
    return linear(x, w, choices=choices).add_(add)


def linear_add_sums(
    x: torch.Tensor, w: torch.Tensor | Fp8Weight, add: torch.Tensor,
    choices: KernelChoices = DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """`linear_add`, and the sums of squares of the result's rows that the folded norm after
    it takes (`rms_linear`'s ``sums``), made in the skinny kernel's epilogue
    (``choices.fold_sums``, from ``choices.fold_sums_min_rows`` rows); ``None`` where the
    product takes another path."""
    if choices.fold_sums and x.shape[0] >= choices.fold_sums_min_rows and _skinny_16(w, x, choices):
        from kernels import triton_skinny

        return triton_skinny.linear_sums(x, w, add, pdl=choices.pdl)
    return linear_add(x, w, add, choices), None


def _fp8_linear(
    x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, choices: KernelChoices
) -> torch.Tensor:
    if use_triton(x) and x.stride(-1) == 1:
        if x.shape[0] <= choices.skinny_rows and x.dtype in (torch.bfloat16, torch.float16):
            from kernels import triton_skinny

            return triton_skinny.linear(x, w.weight, bias, scale=w.scale, pdl=choices.pdl)
        n, k = w.shape
        if x.dtype in (torch.bfloat16, torch.float16) and n % 16 == 0 and k % 16 == 0:
            from kernels import fp8_gemm

            return fp8_gemm.scaled_mm_linear(x, w, bias)
    return reference.linear(x, w, bias)


def copy_blocks_between(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for whole blocks of two ``[N, block_bytes]`` uint8
    pools (one launch on CUDA; ``src`` may be a peer's pool mapped over CUDA IPC)."""
    if use_triton(dst):
        from kernels import triton_copy

        triton_copy.copy_blocks_between(dst, src, src_idx, dst_idx)
        return
    reference.copy_blocks_between(dst, src, src_idx, dst_idx)


def copy_sum_blocks_between(
    dst: torch.Tensor,
    src: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``copy_blocks_between``, returning each moved block's ``wsum64`` (``block_wsum64`` of
    what was written) as int64 on ``dst``'s device: on CUDA one launch, the checksum taken
    from the words the copy reads (no second read of the blocks). ``out`` (int64, one per
    block, zero): the sums are added into it and it is returned."""
    if use_triton(dst):
        from kernels import triton_copy

        return triton_copy.copy_sum_blocks_between(dst, src, src_idx, dst_idx, offset, out)
    reference.copy_blocks_between(dst, src, src_idx, dst_idx)
    sums = reference.block_wsum64(dst.view(torch.int64), dst_idx, offset)
    if out is None:
        return sums
    if out.shape != sums.shape or out.dtype != torch.int64:
        raise ValueError(f"{sums.numel()} blocks need {sums.numel()} int64 sums")
    return out.add_(sums)


def packed_copy_sum(
    dst: torch.Tensor, src: torch.Tensor, sums: torch.Tensor, offset: int = 0
) -> Callable[[torch.Tensor, int], None]:
    """`copy_sum_blocks_between` bound to two pools and a reused sums buffer (int64, zero,
    left zero by `compare_sums`): the returned ``copy(up, n)`` copies the ``n`` blocks whose
    source then destination ids ``up`` holds (int64, on the device) and adds the ``k``-th
    block's ``wsum64`` into ``sums[k]``. On CUDA ``triton_copy.PackedCopySum`` (launched
    straight once compiled); elsewhere the same in torch."""
    if use_triton(dst):
        from kernels import triton_copy

        return triton_copy.PackedCopySum(dst, src, sums, offset, pdl_on(dst))

    def copy(up: torch.Tensor, n: int) -> None:
        if n > sums.numel() or up.numel() < 2 * n:
            raise ValueError(f"{n} blocks need 2n uploaded ids and n sums")
        copy_sum_blocks_between(dst, src, up[:n], up[n : 2 * n], offset, sums[:n])

    return copy


def copy_sum_check_blocks_between(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
    sums: torch.Tensor, want: torch.Tensor, tickets: torch.Tensor, state: torch.Tensor,
    out: torch.Tensor, total: int | None = None, offset: int = 0,
) -> None:  # fmt: skip
    """`copy_sum_blocks_between` with the compare in the same launch (the CUDA IPC check):
    adds each moved block's ``wsum64`` into ``sums`` (zeroed), and once the ``total``-th block
    (default: this call's) is done, stores how many sums differ from ``want`` in ``out`` (a
    0-dim int64: on the device, or pinned host memory mapped for it). ``tickets`` (int64, one
    per block) and ``state`` (one int64) must be zero and are left zero: a workspace reused by
    every call on one stream. Not waited for."""
    n = src_idx.numel()
    if sums.shape != (n,) or want.shape != (n,) or tickets.numel() < n or state.numel() != 1:
        raise ValueError(
            f"{n} blocks need {n} sums, {n} expected sums, {n} tickets and one state word"
        )
    total = n if total is None else total
    if use_triton(dst):
        from kernels import triton_copy_check

        triton_copy_check.copy_sum_check_blocks_between(
            dst, src, src_idx, dst_idx, sums, want, tickets, state, out, total, offset
        )
        return
    reference.copy_sum_check_blocks_between(
        dst, src, src_idx, dst_idx, sums, want, tickets[:n], state, out, total, offset
    )


def copy_sum_check_packed(
    dst: torch.Tensor, src: torch.Tensor, up: torch.Tensor, n: int, work: torch.Tensor,
    out: torch.Tensor, total: int | None = None, offset: int = 0,
) -> None:  # fmt: skip
    """`copy_sum_check_blocks_between` with its vectors as the CUDA IPC transport uploads them:
    ``up`` (int64, at least ``4 * n``) holds the source ids, the destination ids, the sender's
    sums and the zeroed sums, one after another; ``work`` (int64, at least ``n + 1``, zero)
    the state word then the tickets. On CUDA, once compiled, launched with no tensor views
    made (``triton_launch.FastLaunch``)."""
    if up.numel() < 4 * n or work.numel() < n + 1:
        raise ValueError(f"{n} blocks need {4 * n} uploaded words and {n + 1} workspace words")
    total = n if total is None else total
    if use_triton(dst):
        from kernels import triton_copy_check

        triton_copy_check.copy_sum_check_packed(dst, src, up, n, work, out, total, offset)
        return
    copy_sum_check_blocks_between(
        dst, src, up[:n], up[n : 2 * n], up[3 * n : 4 * n], up[2 * n : 3 * n], work[1 : n + 1],
        work[:1], out, total, offset,
    )  # fmt: skip


def packed_check(
    dst: torch.Tensor, src: torch.Tensor, work: torch.Tensor, offset: int = 0
) -> Callable[..., None]:
    """`copy_sum_check_packed` bound to two pools and a workspace, checked once: the returned
    ``check(up, n, out, total=0)`` launches it for ``n`` blocks (``total`` 0: ``n``). On CUDA
    ``triton_copy_check.PackedCheck`` (a fetch's launch computes no views, keys or checks of the
    pools); elsewhere the same call through `copy_sum_check_packed`."""
    if use_triton(dst):
        from kernels import triton_copy_check

        return triton_copy_check.PackedCheck(dst, src, work, offset)

    def check(up: torch.Tensor, n: int, out: torch.Tensor, total: int = 0) -> None:
        copy_sum_check_packed(dst, src, up, n, work, out, total or None, offset)

    return check


def runs_copy_sum(
    dst: torch.Tensor, src: torch.Tensor, sums: torch.Tensor, fault: bool = False,
    offset: int = 0,
) -> Callable[[Sequence[tuple[int, int, int]]], None]:  # fmt: skip
    """The copy and sum of a fetch of a few contiguous runs (1 to ``triton_copy.RUNS``, as
    ``libkv.transfer.block_runs`` finds them) with nothing uploaded: the returned
    ``copy(runs)`` copies the runs' blocks from ``src`` into ``dst`` and adds the ``k``-th
    block's ``wsum64`` into ``sums[k]`` (int64 on the device, zero before: `compare_sums`
    leaves it zero again). ``fault`` (test only): one bit of the first block is flipped in
    transit (byte ``block_bytes // 2``, bit 0: what lands and is summed; ``src`` is
    untouched). On CUDA ``triton_copy.RunsCopySum``; elsewhere the same in torch."""
    if use_triton(dst):
        from kernels import triton_copy

        return triton_copy.RunsCopySum(dst, src, sums, fault, offset, pdl_on(dst))

    def copy(runs: Sequence[tuple[int, int, int]]) -> None:
        if not 0 < len(runs) <= 4:
            raise ValueError(f"{len(runs)} runs: one launch takes 1 to 4")
        si = torch.cat([torch.arange(s, s + k) for s, _, k in runs]).to(dst.device)
        di = torch.cat([torch.arange(d, d + k) for _, d, k in runs]).to(dst.device)
        n = si.numel()
        if n > sums.numel():
            raise ValueError(f"{n} blocks, sums for {sums.numel()}")
        reference.copy_blocks_between(dst, src, si, di)
        if fault:
            dst[di[0], dst.shape[1] // 2] ^= 1
        sums[:n] += reference.block_wsum64(dst.view(torch.int64), di, offset)

    return copy


def run_wsum64(
    pool: torch.Tensor, sums: torch.Tensor, offset: int = 0, programs: int = 0
) -> Callable[[int, int, int], None]:
    """A read-only ``wsum64`` of contiguous blocks of ``pool`` (``[N, block_bytes]``, whole
    64-bit words) bound to a reused sums buffer (int64, on the device): the returned
    ``run_sum(first, count, at)`` adds block ``first + k``'s sum into ``sums[at + k]``, with
    nothing uploaded. On CUDA ``triton_checksum.RunSum`` (each block read once in place; with
    ``programs`` by at most that many programs, to leave a copy beside it bandwidth);
    elsewhere the same in torch."""
    if pool.dim() != 2 or not pool.is_contiguous() or pool.shape[1] % 8:
        raise ValueError("the pool must be [N, block_bytes] contiguous, whole 64-bit words")
    if sums.dtype != torch.int64 or sums.dim() != 1:
        raise ValueError("the sums must be a 1-D int64 tensor")
    launch: Callable[[int, int, int], None]
    if use_triton(pool):
        from kernels import triton_checksum

        launch = triton_checksum.RunSum(pool, sums, offset, programs)
    else:

        def torch_sum(first: int, count: int, at: int) -> None:
            ids = torch.arange(first, first + count, device=pool.device)
            sums[at : at + count] += reference.block_wsum64(pool.view(torch.int64), ids, offset)

        launch = torch_sum

    def run_sum(first: int, count: int, at: int) -> None:
        if first < 0 or count < 0 or first + count > pool.shape[0]:
            raise ValueError(f"blocks {first}..{first + count - 1} of {pool.shape[0]}")
        if at < 0 or at + count > sums.numel():
            raise ValueError(f"sums {at}..{at + count - 1} of {sums.numel()}")
        if count:
            launch(first, count, at)

    return run_sum


def compare_sums(sums: torch.Tensor, host: torch.Tensor, n: int) -> None:
    """Behind the copy on the current stream: how many of ``sums[:n]`` (int64, on the device,
    what the copy took) differ from ``host[:n]`` (the sender's, the same bits as int64; on
    CUDA pinned host memory, read by the device where it lies), stored in ``host[n]``; and
    ``sums[:n]`` left zero for the next copy. Not waited for. On CUDA one Triton program
    (on Hopper launched early, by programmatic dependent launch: it reads the sender's sums
    while the copy still runs, and waits in the kernel for the copy's end); elsewhere torch."""
    if sums.dtype != torch.int64 or host.dtype != torch.int64:
        raise ValueError("the sums and the host words must be int64")
    if n > sums.numel() or host.numel() < n + 1:
        raise ValueError(f"{n} blocks need n sums and n + 1 host words")
    if use_triton(sums):
        from kernels import triton_copy

        triton_copy.compare_sums(sums, host, n, pdl_on(sums))
        return
    host[n] = int((sums[:n] != host[:n].to(sums.device)).sum())
    sums[:n] = 0


def count_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many entries of two 1-D int64 tensors of one length on one device differ (the sums
    a copy took against the sender's), as a 0-dim int64 there, not waited for: on CUDA one
    single-program launch that queues behind the copy on the current stream."""
    if got.dim() != 1 or got.shape != want.shape or got.device != want.device:
        raise ValueError(f"expected two 1-D tensors alike, got {got.shape} and {want.shape}")
    if got.dtype != torch.int64 or want.dtype != torch.int64:
        raise ValueError(f"expected int64 sums, got {got.dtype} and {want.dtype}")
    if use_triton(got):
        from kernels import triton_checksum

        return triton_checksum.count_mismatches(got, want)
    return reference.count_mismatches(got, want)


def block_wsum64(words: torch.Tensor, block_idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Per-block ``wsum64`` (``engine.kv_checksum``) of ``words[block_idx[b]]`` (a pool as
    ``[num_blocks, words]`` int64), weights from ``2 * offset + 1`` on; one int64 per block, on
    the pool's device (one read of each block in place on CUDA)."""
    if use_triton(words):
        from kernels import triton_checksum

        return triton_checksum.block_wsum64(words, block_idx, offset)
    return reference.block_wsum64(words, block_idx, offset)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    choices: KernelChoices = DEFAULT,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(norm(x + residual) * weight, x + residual)``."""
    if use_triton(x):
        from kernels import triton_norm

        return triton_norm.rms_norm(x, weight, eps, residual, pdl=choices.pdl)
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor, choices: KernelChoices = DEFAULT) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[T, 2n]`` gate/up projection."""
    if use_triton(x):
        from kernels import triton_norm

        return triton_norm.silu_and_mul(x, pdl=choices.pdl)
    return reference.silu_and_mul(x)


def rotary_embedding(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE of q ``[T, H, D]`` and k ``[T, Hkv, D]`` with per-token cos/sin."""
    if use_triton(q):
        from kernels import triton_rope

        return triton_rope.rotary_embedding(q, k, cos, sin)
    return reference.rotary_embedding(q, k, cos, sin)


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new K/V rows into their paged slots of ``layer`` (an FP8 cache stores
    ``k / k_scale`` and ``v / v_scale``, saturated)."""
    if use_triton(kv_cache):
        from kernels import triton_cache

        triton_cache.write_kv(
            kv_cache, layer, k, v, meta.slot_blocks, meta.slot_offsets, k_scale, v_scale
        )
        return
    reference.write_kv(kv_cache, layer, k, v, meta, k_scale, v_scale)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    choices: KernelChoices = DEFAULT,
) -> torch.Tensor:
    """``rotary_embedding`` of q and k, then ``write_kv`` of the rotated k and v; returns the
    rotated q. On CUDA one kernel does both (the rotated k never goes through memory)."""
    if use_triton(q):
        from kernels import triton_rope_kv

        return triton_rope_kv.rope_write_kv(
            q, k, v, cos, sin, kv_cache, layer, meta.slot_blocks, meta.slot_offsets,
            k_scale, v_scale, pdl=choices.pdl,
        )  # fmt: skip
    return reference.rope_write_kv(q, k, v, cos, sin, kv_cache, layer, meta, k_scale, v_scale)


def rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    choices: KernelChoices = DEFAULT,
) -> torch.Tensor:
    """`rope_write_kv` then `paged_attention`: the attention output of the new tokens' unrotated
    q, k and v. A decode batch on CUDA takes one kernel (``choices.rope_in_attention``)."""
    if (
        choices.rope_in_attention
        and use_triton(q)
        and _decode_batch(q, meta)
        and not _flash(kv_cache, True, choices)
    ):
        from kernels import triton_decode

        rope = triton_decode.Rope(k, v, cos, sin, meta.slot_blocks, meta.slot_offsets)
        return triton_decode.decode_attention(
            q, kv_cache, layer, meta.block_tables, meta.seq_lens, scale,
            k_scale=k_scale, v_scale=v_scale, rope=rope, pdl=choices.pdl,
        )  # fmt: skip
    q = rope_write_kv(q, k, v, cos, sin, kv_cache, layer, meta, k_scale, v_scale, choices)
    return paged_attention(q, kv_cache, layer, meta, scale, k_scale, v_scale, choices)


def _decode_batch(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """One new token per sequence (what the decode kernel takes)."""
    return meta.max_query_len == 1 and q.shape[0] == meta.num_seqs


def _flash(kv_cache: torch.Tensor, decode: bool, choices: KernelChoices) -> bool:
    """Whether FlashAttention 3 takes this step's attention (``choices.flash_attention``, and
    ``choices.flash_decode`` for a decode batch) over this pool (bf16/fp16 on CUDA)."""
    wanted = choices.flash_decode if decode else choices.flash_attention
    return wanted and kv_cache.is_cuda and kv_cache.dtype in flash_attn.DTYPES


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    choices: KernelChoices = DEFAULT,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over their sequences' paged KV (an FP8 cache
    is read as ``k * k_scale``, ``v * v_scale``).

    On CUDA, a batch of single-token queries (decode) takes the split-KV decode kernel, which
    reads no host-side lengths and so can be captured in a CUDA graph; anything else takes the
    varlen prefill kernel. Where the model's choices say so (a Hopper with FlashAttention 3
    installed, a bf16/fp16 pool), FA3 takes the steps that are not a decode batch, and with
    ``flash_decode`` the decode batches too (`kernels.flash_attn`).
    """
    decode = _decode_batch(q, meta)
    if _flash(kv_cache, decode, choices):
        return flash_attn.paged_attention(q, kv_cache, layer, meta, scale)
    if use_triton(q):
        if decode:
            from kernels import triton_decode

            return triton_decode.decode_attention(
                q, kv_cache, layer, meta.block_tables, meta.seq_lens, scale,
                k_scale=k_scale, v_scale=v_scale, pdl=choices.pdl,
            )  # fmt: skip
        from kernels import triton_prefill

        return triton_prefill.prefill_attention(
            q, kv_cache, layer, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, scale, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
    return reference.paged_attention(q, kv_cache, layer, meta, scale, k_scale, v_scale)


def attention_variant(
    num_seqs: int, max_query_len: int, num_heads: int, kv_cache: torch.Tensor
) -> Hashable | None:
    """What `rope_attention` (and `paged_attention`) on CUDA is compiled for, for a step of
    ``num_seqs`` sequences whose longest query is ``max_query_len`` tokens, with ``num_heads``
    query heads over ``kv_cache``, besides what the model fixes (head sizes, dtypes, the pool's
    layout): the decode plan of a batch of single-token queries, else the prefill plan. Steps
    of one variant share one compiled kernel (lengths, tile counts and block-table widths are
    not specialised on), so a warm-up runs a step of each (``engine.warmup``). None where
    nothing is compiled (off CUDA or without Triton)."""
    if not use_triton(kv_cache):
        return None
    head_dim = kv_cache.shape[-1]
    if max_query_len <= 1:
        from kernels import triton_decode
        from kernels.triton_cache import PagedLayer

        paged = PagedLayer.of(kv_cache, 0)
        device = kv_cache.device.index or 0
        plan = triton_decode.DecodePlan.of(num_seqs, num_heads, head_dim, paged, device)
        return dataclasses.replace(plan, num_seqs=0)
    from kernels import triton_prefill

    return triton_prefill.PrefillPlan.make(head_dim, max_query_len)


@contextlib.contextmanager
def decode_split_floor(splits: int) -> Iterator[None]:
    """Inside, decode attention's plans split every sequence at least ``splits`` ways
    (`triton_decode.split_floor`): what a CUDA graph is captured with for batches of spread
    lengths. Nothing changes where Triton is not installed (no plan to change)."""
    try:
        from kernels import triton_decode
    except ImportError:
        yield
        return
    with triton_decode.split_floor(splits):
        yield
