"""Triton block copy between two pools: ``dst[dst_idx[i]] = src[src_idx[i]]`` for whole blocks,
in one launch (the KV hand-off over CUDA IPC, where ``src`` is a peer's pool mapped into this
process). One copy call per block is launch-bound (20 GB/s for 256 KiB blocks on an H100);
here every program moves one ``CHUNK`` of one block with 16-byte accesses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from kernels._triton import num_sms
from kernels.triton_launch import FastLaunch, aligned16, launch_device

CHUNK = 2048  # int64 words (16 KiB) a step of a program
# The fused checks give each program several chunks of its block in a loop when a fetch has
# many more chunks than the GPU runs programs at once, so that fewer programs each pay the
# check's tail (its ordered atomics wait for the program's stores): about this many programs
# per SM in all (`split`). 16: on an H100 the check of a contiguous run took 1.064-1.101x a
# cudaMemcpy's device time with 16, 1.072-1.113x with 8, 1.074-1.115x with one chunk a program
# (bench/results/kv_checksum_cpu.md, session 7).
PROGRAMS_PER_SM = 16


def split(chunks: int, n: int, device: int) -> tuple[int, int]:
    """How a fused check of ``n`` blocks of ``chunks`` chunks each is cut: chunks a program
    (``per``, looped over) and programs a block (what its ticket counts to)."""
    sms = num_sms(device) if device >= 0 else 1  # the interpreter: one
    per = max(1, min(chunks, chunks * n // (sms * PROGRAMS_PER_SM)))
    return per, -(-chunks // per)


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


def check_pools(
    dst: torch.Tensor,
    src: torch.Tensor,
    src_idx: torch.Tensor | None = None,
    dst_idx: torch.Tensor | None = None,
) -> None:
    """What both block copies need: two ``[N, block_bytes]`` contiguous pools alike, blocks of
    whole 64-bit words, index tensors of one length."""
    if dst.dim() != 2 or src.dim() != 2 or dst.shape[1] != src.shape[1]:
        raise ValueError(
            f"pools must be [N, block_bytes] alike: {list(dst.shape)}, {list(src.shape)}"
        )
    if dst.shape[1] % 8 or not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("pools must be contiguous with blocks of a multiple of 8 bytes")
    if src_idx is not None and dst_idx is not None and src_idx.shape != dst_idx.shape:
        raise ValueError("src_idx and dst_idx differ in length")


def copy_blocks_between(
    dst: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """``dst``/``src``: ``[num_blocks, block_bytes]`` uint8, contiguous, block bytes a multiple
    of 8; ``src_idx``/``dst_idx``: int tensors of equal length on the same device."""
    check_pools(dst, src, src_idx, dst_idx)
    n = src_idx.numel()
    if n == 0:
        return
    words = dst.shape[1] // 8
    # The variant: the words, each pointer's 16-byte alignment, the index dtypes.
    key = (
        launch_device(dst), words, aligned16(src), aligned16(dst), aligned16(src_idx),
        aligned16(dst_idx), src_idx.dtype, dst_idx.dtype,
    )  # fmt: skip
    _COPY(
        key,
        (n, -(-words // CHUNK)),
        lambda: (
            src.data_ptr(),
            dst.data_ptr(),
            src_idx.data_ptr(),
            dst_idx.data_ptr(),
            words,
            CHUNK,
        ),
        lambda: (
            (src.view(torch.int64), dst.view(torch.int64), src_idx, dst_idx, words),
            {"CHUNK": CHUNK},
        ),
        num_warps=8,
    )


@triton.jit
def copy_chunk_sum(src, dst, src_idx, dst_idx, words, offset, per, CHUNK: tl.constexpr):
    """Copy this program's ``per`` chunks of its block (program ids: block, part); its part of
    the block's ``wsum64`` (wraps modulo 2^64)."""
    i = tl.program_id(0)
    s = tl.load(src_idx + i).to(tl.int64)
    d = tl.load(dst_idx + i).to(tl.int64)
    return _copy_sum_part(src, dst, s, d, words, offset, per, CHUNK, False)


@triton.jit
def _copy_sum_part(src, dst, s, d, words, offset, per, CHUNK: tl.constexpr, FAULT: tl.constexpr):
    """Copy chunks ``part * per`` to ``part * per + per - 1`` (``part``: program id 1) of
    source block ``s`` into destination block ``d``; their part of the block's ``wsum64``.
    ``FAULT`` (the test-only hook): one bit of program 0's block is flipped on its way through
    registers, in the middle of the block (byte ``4 * words``, bit 0), before it is written and
    summed."""
    j = tl.program_id(1)
    acc = tl.zeros([CHUNK], tl.int64)
    for c in range(per):
        offs = (j * per + c) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
        mask = offs < words
        v = tl.load(src + s * words + offs, mask=mask, other=0)
        if FAULT:
            bit = tl.full([CHUNK], 1, tl.int64) << (32 * (words % 2))
            v = v ^ tl.where((offs == words // 2) & (tl.program_id(0) == 0), bit, 0)
        tl.store(dst + d * words + offs, v, mask=mask)
        acc += v * (2 * (offs + offset) + 1)
    return tl.sum(acc, axis=0)


# One compiled variant per pool pair: nothing specialised on the chunks a program, nor on where
# the ids and the sums start (slices of one upload, a reused buffer).
@triton.jit(
    do_not_specialize=["per"], do_not_specialize_on_alignment=["src_idx", "dst_idx", "sums"]
)
def _copy_sum_blocks_kernel(
    src, dst, src_idx, dst_idx, sums, words, offset, per, CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Copy blocks ``src_idx[i]`` to ``dst_idx[i]`` and add their ``wsum64`` into ``sums[i]``
    (relaxed: what reads them runs behind this kernel on the stream). ``PDL``: the compare
    behind it may launch at once (it waits in the kernel for this one's end)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    part = copy_chunk_sum(src, dst, src_idx, dst_idx, words, offset, per, CHUNK)
    tl.atomic_add(sums + tl.program_id(0), part, sem="relaxed", scope="gpu")


def copy_sum_blocks_between(
    dst: torch.Tensor,
    src: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``copy_blocks_between`` that also returns each moved block's ``wsum64``
    (``engine.kv_checksum``, weights from ``2 * offset + 1`` on), taken over the words as they
    pass through registers: the copy's one read serves the checksum too (int64, on the
    device, not waited for). ``out``: added into (zero before) and returned, instead of a
    new tensor."""
    check_pools(dst, src, src_idx, dst_idx)
    n = src_idx.numel()
    sums = torch.zeros(n, dtype=torch.int64, device=dst.device) if out is None else out
    if sums.dtype != torch.int64 or sums.shape != (n,):
        raise ValueError(f"{n} blocks need {n} int64 sums, got {tuple(sums.shape)}")
    if n == 0:
        return sums
    words = dst.shape[1] // 8
    chunks = -(-words // CHUNK)
    per, progs = split(chunks, n, launch_device(dst))
    _copy_sum_blocks_kernel[(n, progs)](
        src.view(torch.int64), dst.view(torch.int64), src_idx, dst_idx, sums, words, offset,
        per, CHUNK=CHUNK, num_warps=8,
    )  # fmt: skip
    return sums


class PackedCopySum:
    """The copy and sum of a fetch of scattered blocks between one pair of pools, its ids in
    one upload (``up``: the ``n`` source ids then the ``n`` destination ids, int64 on the
    device), its sums added into ``sums`` (int64, device, zero before: a reused buffer that
    `compare_sums` leaves zero); once compiled, launched straight with addresses by
    arithmetic (no tensor views made on the host)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, sums: torch.Tensor,
                 offset: int = 0, pdl: bool = False) -> None:  # fmt: skip
        check_pools(dst, src)
        if sums.dtype != torch.int64 or sums.dim() != 1:
            raise ValueError("the sums must be a 1-D int64 tensor")
        self.pdl = pdl
        self.dst, self.src, self.sums = dst, src, sums
        self.words = dst.shape[1] // 8
        self.chunks = -(-self.words // CHUNK)
        self.offset = offset
        self._ptrs = (src.data_ptr(), dst.data_ptr(), sums.data_ptr())
        self._dev = launch_device(dst)
        self._key = ("packed", self._dev, self.words, offset, aligned16(src), aligned16(dst), pdl)

    def __call__(self, up: torch.Tensor, n: int) -> None:
        """Launch on the current stream for the ``n`` blocks whose ids ``up`` holds."""
        if n <= 0:
            return
        if n > self.sums.numel() or up.numel() < 2 * n or up.dtype != torch.int64:
            raise ValueError(f"{n} blocks need 2n uploaded int64 ids and n sums")
        s, d, u = self._ptrs
        p = up.data_ptr()
        words, offset = self.words, self.offset
        per, progs = split(self.chunks, n, self._dev)

        def fast() -> tuple[Any, ...]:
            return (s, d, p, p + 8 * n, u, words, offset, per, CHUNK, self.pdl)

        def slow() -> tuple[tuple[Any, ...], dict[str, Any]]:
            return (
                (self.src.view(torch.int64), self.dst.view(torch.int64), up[:n],
                 up[n : 2 * n], self.sums, words, offset, per),
                {"CHUNK": CHUNK, "PDL": self.pdl},
            )  # fmt: skip

        _SUM(self._key, (n, progs), fast, slow, num_warps=8)


RUNS = 4  # most contiguous runs one `RunsCopySum` launch takes (as scalar arguments)
_RUN_SCALARS = ["per", "a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3", "e1", "e2", "e3"]


# One compiled variant per pool pair for any fetch of up to ``RUNS`` runs: nothing specialised
# on the runs or the counts, nor on the sums buffer's alignment.
@triton.jit(do_not_specialize=_RUN_SCALARS, do_not_specialize_on_alignment=["sums"])
def _copy_sum_runs_kernel(
    src, dst, sums, words, offset, per, a0, a1, a2, a3, b0, b1, b2, b3, e1, e2, e3,
    CHUNK: tl.constexpr, FAULT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The copy and sum of a fetch of a few contiguous runs, with nothing uploaded: program
    ``(i, j)`` moves chunks ``j * per`` to ``j * per + per - 1`` of source block ``i + a_r`` to
    ``i + b_r`` (``r`` the run that holds the fetch's ``i``-th block; runs end at
    ``e1 <= e2 <= e3``) and adds their part of its ``wsum64`` into ``sums[i]``. No ordering:
    `compare_sums`, behind it on the stream, reads the sums (``PDL``: it may launch at once
    and waits in the kernel for this one's end). ``FAULT``: the test-only hook
    (`_copy_sum_part`)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0)
    s = (i + tl.where(i < e1, a0, tl.where(i < e2, a1, tl.where(i < e3, a2, a3)))).to(tl.int64)
    d = (i + tl.where(i < e1, b0, tl.where(i < e2, b1, tl.where(i < e3, b2, b3)))).to(tl.int64)
    part = _copy_sum_part(src, dst, s, d, words, offset, per, CHUNK, FAULT)
    tl.atomic_add(sums + i, part, sem="relaxed", scope="gpu")


def run_scalars(runs: Sequence[tuple[int, int, int]]) -> tuple[tuple[int, ...], int]:
    """`_copy_sum_runs_kernel`'s run arguments for ``runs`` (``block_runs``' (source start,
    destination start, count), 1 to ``RUNS``): the source offsets, the destination offsets,
    the ends of the first three runs (unused runs: past every program); and the blocks in
    all."""
    if not 0 < len(runs) <= RUNS:
        raise ValueError(f"{len(runs)} runs: one launch takes 1 to {RUNS}")
    a, b, e = [0] * RUNS, [0] * RUNS, []
    start = 0
    for r, (s, d, k) in enumerate(runs):
        if k <= 0:
            raise ValueError(f"a run of {k} blocks")
        a[r], b[r] = s - start, d - start
        start += k
        e.append(start)
    e += [start] * (RUNS - len(e))
    return (*a, *b, *e[:3]), start


class RunsCopySum:
    """The copy and sum of a fetch of up to ``RUNS`` contiguous runs between one pair of
    pools, with nothing uploaded and nothing allocated per fetch: the runs go as scalar
    arguments, the sums add into ``sums`` (int64, device, zero before, at least as many as the
    blocks: a reused buffer that `compare_sums` leaves zero). ``fault``: the test-only flipped
    bit in transit."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, sums: torch.Tensor,
                 fault: bool = False, offset: int = 0, pdl: bool = False) -> None:  # fmt: skip
        check_pools(dst, src)
        if sums.dtype != torch.int64 or sums.dim() != 1:
            raise ValueError("the sums must be a 1-D int64 tensor")
        self.pdl = pdl
        if max(dst.shape[0], src.shape[0]) >> 31:
            raise ValueError("pools of 2^31 blocks or more")
        self.dst, self.src, self.sums = dst, src, sums
        self.words = dst.shape[1] // 8
        self.chunks = -(-self.words // CHUNK)
        self.offset, self.fault = offset, bool(fault)
        self._ptrs = (src.data_ptr(), dst.data_ptr(), sums.data_ptr())
        self._dev = launch_device(dst)
        self._key = ("runs", self._dev, self.words, offset, aligned16(src), aligned16(dst),
                     self.fault, pdl)  # fmt: skip

    def __call__(self, runs: Sequence[tuple[int, int, int]]) -> None:
        """Launch on the current stream for the blocks of ``runs``."""
        scalars, n = run_scalars(runs)
        if n > self.sums.numel():
            raise ValueError(f"{n} blocks, sums for {self.sums.numel()}")
        s, d, u = self._ptrs
        words, offset = self.words, self.offset
        per, progs = split(self.chunks, n, self._dev)

        def fast() -> tuple[Any, ...]:
            return (s, d, u, words, offset, per, *scalars, CHUNK, self.fault, self.pdl)

        def slow() -> tuple[tuple[Any, ...], dict[str, Any]]:
            return (
                (self.src.view(torch.int64), self.dst.view(torch.int64), self.sums, words,
                 offset, per, *scalars),
                {"CHUNK": CHUNK, "FAULT": self.fault, "PDL": self.pdl},
            )  # fmt: skip

        _RUNS(self._key, (n, progs), fast, slow, num_warps=8)


COMPARE_BLOCK = 1024  # sums a step of the compare's one program


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["sums", "want", "out"])
def _compare_sums_kernel(sums, want, out, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program: how many of ``sums[:n]`` differ from ``want[:n]`` (into ``out``), and the
    sums left zero. ``want`` and ``out`` may be host memory mapped into the device. ``PDL``
    (launched early, programmatic dependent launch): the first ``BLOCK`` of ``want`` are read
    while the copy still runs, the sums once it has ended (``griddepcontrol.wait``)."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    first = tl.load(want + offs, mask=m, other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    got = tl.load(sums + offs, mask=m, other=0)
    acc = (got != first).to(tl.int32)
    tl.store(sums + offs, tl.zeros([BLOCK], tl.int64), mask=m)
    for start in range(BLOCK, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        got = tl.load(sums + offs, mask=m, other=0)
        acc += (got != tl.load(want + offs, mask=m, other=0)).to(tl.int32)
        tl.store(sums + offs, tl.zeros([BLOCK], tl.int64), mask=m)
    tl.store(out, tl.sum(acc, axis=0).to(tl.int64))


def compare_sums(sums: torch.Tensor, host: torch.Tensor, n: int, pdl: bool = False) -> None:
    """`kernels.compare_sums` on CUDA: ``host`` pinned (the device reads the sender's sums and
    writes the count by the host address: CUDA's unified addressing maps pinned memory at the
    same address; the transport's warm-up checks that it works here). ``pdl``: launched as a
    programmatic dependent of the copy before it (which lets it start early)."""
    h = host.data_ptr()

    def fast() -> tuple[Any, ...]:
        return (sums.data_ptr(), h, h + 8 * n, n, COMPARE_BLOCK, pdl)

    def slow() -> tuple[tuple[Any, ...], dict[str, Any]]:
        options = {"BLOCK": COMPARE_BLOCK, "PDL": pdl} | ({"launch_pdl": True} if pdl else {})
        return (sums, host[:n], host[n], n), options

    _COMPARE(("compare", launch_device(sums), pdl), (1, 1), fast, slow, num_warps=4)


_COPY = FastLaunch(_copy_blocks_kernel, "the block copy")
_SUM = FastLaunch(_copy_sum_blocks_kernel, "the copy and sum of scattered blocks")
_RUNS = FastLaunch(_copy_sum_runs_kernel, "the copy and sum of contiguous runs")
_COMPARE = FastLaunch(_compare_sums_kernel, "the compare behind a copy")
