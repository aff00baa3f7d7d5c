"""Triton block copy between two pools: ``dst[dst_idx[i]] = src[src_idx[i]]`` for whole blocks,
in one launch (the KV hand-off over CUDA IPC, where ``src`` is a peer's pool mapped into this
process). One copy call per block is launch-bound (20 GB/s for 256 KiB blocks on an H100);
here every program moves one ``CHUNK`` of one block with 16-byte accesses."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048  # int64 words (16 KiB) per program


@triton.jit
def _copy_blocks_kernel(src, dst, src_idx, dst_idx, words, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(src_idx + i).to(tl.int64)
    d = tl.load(dst_idx + i).to(tl.int64)
    offs = j * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words
    v = tl.load(src + s * words + offs, mask=mask)
    tl.store(dst + d * words + offs, v, mask=mask)


def _check_pools(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """What both block copies need: two ``[N, block_bytes]`` contiguous pools alike, blocks of
    whole 64-bit words, index tensors of one length."""
    if dst.dim() != 2 or src.dim() != 2 or dst.shape[1] != src.shape[1]:
        raise ValueError(
            f"pools must be [N, block_bytes] alike: {list(dst.shape)}, {list(src.shape)}"
        )
    if dst.shape[1] % 8 or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("pools must be contiguous with blocks of a multiple of 8 bytes")
    if src_idx.shape != dst_idx.shape:
        raise ValueError("src_idx and dst_idx differ in length")


def copy_blocks_between(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """``dst``/``src``: ``[num_blocks, block_bytes]`` uint8, contiguous, block bytes a multiple
    of 8; ``src_idx``/``dst_idx``: int tensors of equal length on the same device."""
    _check_pools(dst, src, src_idx, dst_idx)
    n = src_idx.numel()
    if n == 0:
        return
    words = dst.shape[1] // 8
    grid = (n, triton.cdiv(words, CHUNK))
    _copy_blocks_kernel[grid](
        src.view(torch.int64), dst.view(torch.int64), src_idx, dst_idx, words, CHUNK=CHUNK,
        num_warps=8,
    )  # fmt: skip


@triton.jit
def _copy_chunk_sum(src, dst, src_idx, dst_idx, words, offset, CHUNK: tl.constexpr):
    """Copy this program's chunk of its block (program ids: block, chunk); its part of the
    block's ``wsum64`` (wraps modulo 2^64)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(src_idx + i).to(tl.int64)
    d = tl.load(dst_idx + i).to(tl.int64)
    offs = j * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    mask = offs < words
    v = tl.load(src + s * words + offs, mask=mask, other=0)
    tl.store(dst + d * words + offs, v, mask=mask)
    return tl.sum(v * (2 * (offs + offset) + 1), axis=0)


@triton.jit
def _copy_sum_blocks_kernel(src, dst, src_idx, dst_idx, sums, words, offset, CHUNK: tl.constexpr):
    part = _copy_chunk_sum(src, dst, src_idx, dst_idx, words, offset, CHUNK)
    tl.atomic_add(sums + tl.program_id(0), part)


def copy_sum_blocks_between(
    dst: torch.Tensor,
    src: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """``copy_blocks_between`` that also returns each moved block's ``wsum64``
    (``engine.kv_checksum``, weights from ``2 * offset + 1`` on), taken over the words as they
    pass through registers: the copy's one read serves the checksum too (int64, on the
    device, not waited for)."""
    _check_pools(dst, src, src_idx, dst_idx)
    n = src_idx.numel()
    sums = torch.zeros(n, dtype=torch.int64, device=dst.device)
    if n == 0:
        return sums
    words = dst.shape[1] // 8
    grid = (n, triton.cdiv(words, CHUNK))
    _copy_sum_blocks_kernel[grid](
        src.view(torch.int64), dst.view(torch.int64), src_idx, dst_idx, sums, words, offset,
        CHUNK=CHUNK, num_warps=8,
    )  # fmt: skip
    return sums


# One compiled variant for every hand-off of a pool (compiled at the transport's warm-up): no
# specialisation on the block count, on the chunks per block, or on where the small vectors
# start (slices of one upload); the pools' words stay specialised (16-byte accesses).
@triton.jit(
    do_not_specialize=["chunks", "total"],
    do_not_specialize_on_alignment=[
        "src_idx", "dst_idx", "sums", "want", "tickets", "state", "out",
    ],
)  # fmt: skip
def _copy_sum_check_kernel(
    src, dst, src_idx, dst_idx, sums, want, tickets, state, out, words, offset, chunks, total,
    CHUNK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    part = _copy_chunk_sum(src, dst, src_idx, dst_idx, words, offset, CHUNK)
    tl.atomic_add(sums + i, part, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # this program's part is in ``sums`` before its ticket below
    # The block's last program (split-K's ticket) compares its whole sum with the sender's,
    # and the fetch's last block brings the count out (to ``out``: device or mapped host).
    if tl.atomic_add(tickets + i, 1, sem="acq_rel", scope="gpu") == chunks - 1:
        got = tl.atomic_add(sums + i, 0, sem="acquire", scope="gpu")
        bad = (got != tl.load(want + i)).to(tl.int64)
        tl.atomic_xchg(tickets + i, 0, sem="relaxed", scope="gpu")  # for the next call
        # One word: blocks done (high 32 bits) and mismatches (low 32 bits).
        seen = tl.atomic_add(state, bad + 4294967296, sem="acq_rel", scope="gpu") + bad
        if (seen >> 32) == total - 1:
            tl.store(out, seen & 4294967295)
            tl.atomic_xchg(state, 0, sem="relaxed", scope="gpu")  # for the next call


def copy_sum_check_blocks_between(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
    sums: torch.Tensor, want: torch.Tensor, tickets: torch.Tensor, state: torch.Tensor,
    out: torch.Tensor, total: int, offset: int = 0,
) -> None:  # fmt: skip
    """`copy_sum_blocks_between` that also compares, in the same launch: ``sums`` (int64,
    zeroed, one per block) receive the moved blocks' ``wsum64``; the last program of each block
    compares its sum with ``want`` and the last block of ``total`` (this launch's blocks, or
    several launches' on one stream that share ``state``) stores how many differed in ``out``
    (a 0-dim int64 on the device, or pinned host memory the device can write). ``tickets``
    (one per block) and ``state`` (one word) are zero before and left zero after."""
    _check_pools(dst, src, src_idx, dst_idx)
    n = src_idx.numel()
    if n == 0:
        return
    words = dst.shape[1] // 8
    chunks = triton.cdiv(words, CHUNK)
    _copy_sum_check_kernel[(n, chunks)](
        src.view(torch.int64), dst.view(torch.int64), src_idx, dst_idx, sums, want, tickets,
        state, out, words, offset, chunks, total, CHUNK=CHUNK, num_warps=8,
    )  # fmt: skip
