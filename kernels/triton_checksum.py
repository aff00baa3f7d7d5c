"""Triton ``wsum64`` of whole KV blocks (``engine.kv_checksum``): ``out[b] = sum_i (2(i + o) + 1)
* x_i mod 2^64`` over the 64-bit words ``x_i`` of block ``block_idx[b]``, read once, in place.

Each program sums one ``CHUNK`` of one block: the weights are made in registers, products and
sums wrap around in 64 bits, and the chunk's sum is added to ``out[b]`` atomically (integer
addition modulo 2^64 is associative and commutative, so the order of the chunks never matters
and the result equals the reference bit for bit). No gather copy, no int64 temporary: one
read of each block's bytes, one 8-byte word written per block, all on the device."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from kernels._triton import pdl_on
from kernels.triton_launch import FastLaunch, aligned16, launch_device

TILE = 1024  # int64 words per inner step (8 KiB)
CHUNK = 8 * TILE  # words per program (64 KiB): a 2 MiB block is 32 programs


@triton.jit
def _part(base, words, offset, which, TILE: tl.constexpr, ITERS: tl.constexpr):
    """Part ``which`` (the ``which``-th ``TILE * ITERS`` words) of the ``wsum64`` of the block
    whose words start at ``base``."""
    start = which.to(tl.int64) * (TILE * ITERS)
    lane = tl.arange(0, TILE).to(tl.int64)
    acc = tl.zeros((TILE,), dtype=tl.int64)
    for k in range(ITERS):
        i = start + k * TILE + lane
        mask = i < words
        x = tl.load(base + i, mask=mask, other=0)
        acc += x * (2 * (i + offset) + 1)  # wraps modulo 2^64
    return tl.sum(acc, axis=0)


@triton.jit
def _wsum64_kernel(
    words_ptr, idx_ptr, out_ptr, words, offset, TILE: tl.constexpr, ITERS: tl.constexpr
):
    b = tl.program_id(0)
    block = tl.load(idx_ptr + b).to(tl.int64)
    part = _part(words_ptr + block * words, words, offset, tl.program_id(1), TILE, ITERS)
    tl.atomic_add(out_ptr + b, part)


# One compiled variant per pool for any run: nothing specialised on where it starts.
@triton.jit(do_not_specialize=["first", "at", "count"], do_not_specialize_on_alignment=["out_ptr"])
def _wsum64_run_kernel(
    words_ptr, out_ptr, first, at, words, offset, count, TILE: tl.constexpr,
    ITERS: tl.constexpr, PARTS: tl.constexpr, PROGRAMS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``out[at + b] +=`` the ``wsum64`` of block ``first + b`` for ``b < count`` (relaxed:
    what reads the sums runs behind this kernel on its stream). ``PROGRAMS`` 0: one program a
    part of a block (grid ``(count, PARTS)``, as fast as the device reads); else that many
    programs, each taking every ``PROGRAMS``-th part (a 1-D grid): fewer loads in flight, so a
    sum that runs beside a copy into the same memory leaves the copy its bandwidth. ``PDL``:
    the compare behind it may launch at once (it reads the sender's sums meanwhile and waits
    in the kernel for this one's end)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PROGRAMS == 0:
        b = tl.program_id(0)
        base = words_ptr + (first + b).to(tl.int64) * words
        part = _part(base, words, offset, tl.program_id(1), TILE, ITERS)
        tl.atomic_add(out_ptr + at + b, part, sem="relaxed", scope="gpu")
    else:
        for unit in range(tl.program_id(0), count * PARTS, PROGRAMS):
            b = unit // PARTS
            base = words_ptr + (first + b).to(tl.int64) * words
            part = _part(base, words, offset, unit % PARTS, TILE, ITERS)
            tl.atomic_add(out_ptr + at + b, part, sem="relaxed", scope="gpu")


class RunSum:
    """A read-only ``wsum64`` of contiguous blocks of one pool into a reused sums buffer (int64,
    on the device): ``run_sum(first, count, at)`` adds block ``first + k``'s sum into
    ``sums[at + k]``, reading each block once in place, with nothing uploaded; once compiled,
    launched straight (`kernels.triton_launch.FastLaunch`). Arguments are checked by
    ``kernels.run_wsum64``. ``programs``: 0, as fast as the device reads; else at most that
    many programs (``_wsum64_run_kernel``). The CUDA IPC hand-off between two GPUs sums each
    landed chunk of a run with it while the copy engines bring the next."""

    def __init__(
        self, pool: torch.Tensor, sums: torch.Tensor, offset: int = 0, programs: int = 0
    ) -> None:
        self.pool, self.sums, self.offset, self.programs = pool, sums, offset, programs
        self.words = pool.shape[1] // 8
        self.iters = min(CHUNK // TILE, triton.cdiv(self.words, TILE))
        self.parts = triton.cdiv(self.words, TILE * self.iters)
        self._ptrs = (pool.data_ptr(), sums.data_ptr())
        self.pdl = pdl_on(pool)
        self._key = ("run", launch_device(pool), self.words, offset, aligned16(pool), self.pdl,
                     programs)  # fmt: skip

    def __call__(self, first: int, count: int, at: int) -> None:
        """Launch on the current stream."""
        p, u = self._ptrs
        words, offset, iters, parts, programs = (
            self.words, self.offset, self.iters, self.parts, self.programs
        )  # fmt: skip

        def fast() -> tuple:
            return (p, u, first, at, words, offset, count, TILE, iters, parts, programs, self.pdl)

        def slow() -> tuple[tuple, dict]:
            args = (self.pool.view(torch.int64), self.sums, first, at, words, offset, count)
            return args, {"TILE": TILE, "ITERS": iters, "PARTS": parts, "PROGRAMS": programs,
                          "PDL": self.pdl}  # fmt: skip

        grid = (min(programs, count * parts), 1) if programs else (count, parts)
        _RUN(self._key, grid, fast, slow, num_warps=8)


_RUN = FastLaunch(_wsum64_run_kernel, "the sum of a run of landed blocks")


def block_wsum64(words: torch.Tensor, block_idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """``words``: a pool as ``[num_blocks, words_per_block]`` int64, contiguous; ``block_idx``:
    block ids (int32 or int64) on the same device. Returns one int64 per block (the unsigned
    sum's bits) on the device, without waiting for it."""
    if words.dim() != 2 or words.dtype != torch.int64 or not words.is_contiguous():
        raise ValueError(f"expected a contiguous [blocks, words] int64 pool, got {words.shape}")
    if block_idx.dim() != 1 or block_idx.device != words.device:
        raise ValueError("block_idx must be a 1-D tensor on the pool's device")
    n, per_block = block_idx.numel(), words.shape[1]
    out = torch.zeros(n, dtype=torch.int64, device=words.device)
    if n == 0 or per_block == 0:
        return out
    iters = min(CHUNK // TILE, triton.cdiv(per_block, TILE))
    grid = (n, triton.cdiv(per_block, TILE * iters))
    # On the pool's device whatever the current one is (CPU tensors: TRITON_INTERPRET=1 tests).
    guard = torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext()
    with guard:
        _wsum64_kernel[grid](
            words, block_idx, out, per_block, offset, TILE=TILE, ITERS=iters, num_warps=8
        )
    return out


COUNT_TILE = 1024  # entries per step of the one program that counts mismatches


# One compiled variant for every hand-off (compiled at the transport's warm-up): no
# specialisation on the count or on where the sums start.
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["got_ptr", "want_ptr"])
def _count_mismatches_kernel(got_ptr, want_ptr, out_ptr, n, TILE: tl.constexpr):
    lane = tl.arange(0, TILE)
    acc = tl.zeros((TILE,), dtype=tl.int64)
    for start in range(0, n, TILE):
        i = start + lane
        mask = i < n
        got = tl.load(got_ptr + i, mask=mask, other=0)
        want = tl.load(want_ptr + i, mask=mask, other=0)
        acc += (got != want).to(tl.int64)
    tl.store(out_ptr, tl.sum(acc, axis=0))  # a plain store: no zeroed output to launch first


def count_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many entries of two contiguous int64 vectors of one length differ, as a 0-dim int64
    on their device, not waited for: one program (a hand-off's few thousand block sums at
    most), one launch, so it queues right behind the copy whose sums it checks."""
    if got.dim() != 1 or got.shape != want.shape or got.device != want.device:
        raise ValueError(f"expected two 1-D tensors alike, got {got.shape} and {want.shape}")
    if got.dtype != torch.int64 or want.dtype != torch.int64:
        raise ValueError(f"expected int64 sums, got {got.dtype} and {want.dtype}")
    got, want = got.contiguous(), want.contiguous()
    out = torch.empty((), dtype=torch.int64, device=got.device)
    guard = torch.cuda.device(got.device) if got.is_cuda else contextlib.nullcontext()
    with guard:
        _count_mismatches_kernel[(1,)](got, want, out, got.numel(), TILE=COUNT_TILE, num_warps=4)
    return out
