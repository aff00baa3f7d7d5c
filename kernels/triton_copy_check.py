"""The fused copy, sum and check of a CUDA IPC hand-off in one kernel, for a device that cannot
read pinned host memory (where it can, `kernels.triton_copy`'s copy and sum goes first and
`compare_sums` behind it): the block ids, the sender's sums and the zeroed sums are uploaded
before the launch; the last program to finish a block (a ticket per block, as split-K takes
one) compares its sum, and the fetch's last block stores how many differed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.triton_copy import CHUNK, check_pools, copy_chunk_sum, split
from kernels.triton_launch import FastLaunch, aligned16, launch_device, pointer_arg


# One compiled variant for every hand-off of a pool (compiled at the transport's warm-up): no
# specialisation on the block count, on the chunks per block, or on where the small vectors
# start (slices of one upload); the pools' words stay specialised (16-byte accesses).
@triton.jit(
    do_not_specialize=["chunks", "total", "per"],
    do_not_specialize_on_alignment=[
        "src_idx", "dst_idx", "sums", "want", "tickets", "state", "out",
    ],
)  # fmt: skip
def _copy_sum_check_kernel(
    src, dst, src_idx, dst_idx, sums, want, tickets, state, out, words, offset, chunks, total,
    per, CHUNK: tl.constexpr,
):  # fmt: skip
    """``chunks``: programs a block (each copies ``per`` chunks of it)."""
    part = copy_chunk_sum(src, dst, src_idx, dst_idx, words, offset, per, CHUNK)
    _settle(part, sums, want, tickets, state, out, chunks, total)


@triton.jit
def _settle(part, sums, want, tickets, state, out, chunks, total):
    """Add this program's ``part`` to its block's sum; the block's last program (of ``chunks``,
    split-K's ticket) compares the whole sum with the sender's (``want``), and the fetch's last
    block brings the count out (to ``out``: device or mapped host). The sum's add is relaxed:
    the ticket's release (the same thread, after it) orders it before the ticket, and the last
    program's acquire then sees every part."""
    i = tl.program_id(0)
    tl.atomic_add(sums + i, part, sem="relaxed", scope="gpu")
    tl.debug_barrier()
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
    check_pools(dst, src, src_idx, dst_idx)
    n = src_idx.numel()
    if n == 0:
        return
    small = (src_idx, dst_idx, sums, want, tickets, state, out)
    _check(
        dst, src, n, total, offset, small,
        lambda: (src_idx.data_ptr(), dst_idx.data_ptr(), sums.data_ptr(), want.data_ptr(),
                 tickets.data_ptr(), state.data_ptr(), pointer_arg(out)),
    )  # fmt: skip


def copy_sum_check_packed(
    dst: torch.Tensor, src: torch.Tensor, up: torch.Tensor, n: int, work: torch.Tensor,
    out: torch.Tensor, total: int, offset: int = 0,
) -> None:  # fmt: skip
    """`copy_sum_check_blocks_between` with its vectors in two buffers, as the CUDA IPC
    transport uploads them: ``up`` (int64, on the device) holds the ``n`` source ids, the
    destination ids, the sender's sums and the zeroed sums, one after another; ``work`` the
    state word then the tickets. Once compiled, its launch takes their addresses by
    arithmetic: no tensor views made on the host."""
    check_pools(dst, src)
    if n == 0:
        return
    if up.dtype != torch.int64 or work.dtype != torch.int64:
        raise ValueError("the upload and the workspace must be int64")
    if up.numel() < 4 * n or work.numel() < n + 1:
        raise ValueError(f"{n} blocks need 4n uploaded words and n + 1 workspace words")
    u, w = up.data_ptr(), work.data_ptr()

    def slices() -> tuple[torch.Tensor, ...]:
        return up[:n], up[n : 2 * n], up[3 * n : 4 * n], up[2 * n : 3 * n], work[1:], work[:1], out

    _check(
        dst, src, n, total, offset, (up, up, up, up, work, work, out),
        lambda: (u, u + 8 * n, u + 24 * n, u + 16 * n, w + 8, w, pointer_arg(out)),
        slices,
    )  # fmt: skip


def _check(
    dst: torch.Tensor, src: torch.Tensor, n: int, total: int, offset: int,
    small: Sequence[torch.Tensor], pointers: Callable[[], tuple[Any, ...]],
    tensors: Callable[[], Sequence[torch.Tensor]] | None = None,
) -> None:  # fmt: skip
    """Launch the fused check: ``small`` (src_idx, dst_idx, sums, want, tickets, state, out
    or what holds them: only their dtypes name the variant), ``pointers()`` their addresses
    (or tensors) for the direct launch, ``tensors()`` the tensors themselves (default
    ``small``)."""
    words = dst.shape[1] // 8
    chunks = -(-words // CHUNK)  # not triton.cdiv: a jit function, microseconds on the host
    per, progs = split(chunks, n, launch_device(dst))
    # The variant: the words and the offset (specialised on), the pools' 16-byte alignment,
    # the small vectors' dtypes (their alignment and the counts' values are not specialised
    # on, only whether the counts fit 32 bits).
    key = (
        launch_device(dst), words, offset, aligned16(src), aligned16(dst), (chunks | total) >> 31,
        *(t.dtype for t in small),
    )  # fmt: skip

    def fast() -> tuple[Any, ...]:
        return (src.data_ptr(), dst.data_ptr(), *pointers(), words, offset, progs, total, per,
                CHUNK)  # fmt: skip

    def slow() -> tuple[tuple[Any, ...], dict[str, int]]:
        vectors = tuple(small) if tensors is None else tuple(tensors())
        return (
            (src.view(torch.int64), dst.view(torch.int64), *vectors, words, offset, progs, total,
             per),
            {"CHUNK": CHUNK},
        )  # fmt: skip

    _CHECK(key, (n, progs), fast, slow, num_warps=8)


class PackedCheck:
    """`copy_sum_check_packed` for one pair of pools and one workspace, checked once here: a
    fetch's launch then only checks its counts and names its variant from two precomputed
    keys (the pools' words, alignment and addresses do not change; the same keys as
    ``_check``'s, so both share the compiled variant). What the CUDA IPC transport keeps per
    mapped peer pool (its check's host time before the copy is queued)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, work: torch.Tensor,
                 offset: int = 0) -> None:  # fmt: skip
        check_pools(dst, src)
        if work.dtype != torch.int64 or work.dim() != 1:
            raise ValueError("the workspace must be a 1-D int64 tensor")
        self.dst, self.src, self.work = dst, src, work
        self.words = dst.shape[1] // 8
        self.chunks = -(-self.words // CHUNK)
        self.offset = offset
        self.blocks = work.numel() - 1  # most blocks one launch can check
        self._ptrs = (src.data_ptr(), dst.data_ptr(), work.data_ptr())
        self._dev = launch_device(dst)
        base = (self._dev, self.words, offset, aligned16(src), aligned16(dst))
        self._keys = tuple((*base, big, *(torch.int64,) * 7) for big in (0, 1))

    def __call__(self, up: torch.Tensor, n: int, out: torch.Tensor, total: int = 0) -> None:
        """Launch on the current stream for ``n`` blocks whose vectors ``up`` holds (int64,
        at least ``4 * n``, on the pools' device); the count to ``out`` (0-dim int64)
        once ``total`` blocks (default ``n``) are done."""
        if n <= 0:
            return
        total = total or n
        if n > self.blocks or up.numel() < 4 * n or up.dtype != torch.int64:
            raise ValueError(f"{n} blocks need 4n uploaded int64 words and n + 1 workspace words")
        if out.dtype != torch.int64:
            raise ValueError("the count must be int64")
        s, d, w = self._ptrs
        u = up.data_ptr()
        words, offset, chunks, work = self.words, self.offset, self.chunks, self.work
        dst, src = self.dst, self.src
        per, progs = split(chunks, n, self._dev)

        def fast() -> tuple[Any, ...]:
            return (s, d, u, u + 8 * n, u + 24 * n, u + 16 * n, w + 8, w, pointer_arg(out),
                    words, offset, progs, total, per, CHUNK)  # fmt: skip

        def slow() -> tuple[tuple[Any, ...], dict[str, int]]:
            vectors = (up[:n], up[n : 2 * n], up[3 * n : 4 * n], up[2 * n : 3 * n], work[1:],
                       work[:1], out)  # fmt: skip
            return (
                (src.view(torch.int64), dst.view(torch.int64), *vectors, words, offset, progs,
                 total, per),
                {"CHUNK": CHUNK},
            )  # fmt: skip

        _CHECK(self._keys[(chunks | total) >> 31 != 0], (n, progs), fast, slow, num_warps=8)


_CHECK = FastLaunch(_copy_sum_check_kernel, "the fused copy, sum and check")
