"""The checked half of the CUDA IPC hand-off (`CudaIpcTransport` takes it as a base): the
warm-up that compiles the checks and finds out what the device can do, the fused copy-and-sum
of a fetch with its compare (behind the copy where the device reads pinned memory, else in
one fused kernel), and the reused buffers they work in (pinned uploads, device sums, the
fused check's workspace). `cuda_ipc`'s module docstring describes the paths."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import kernels
from kernels import compile_counter
from libkv.transfer import block_runs

if TYPE_CHECKING:
    from libkv.transfer.fetch_checks import FetchChecks

log = logging.getLogger(__name__)
# The sender's sums of a fetch's blocks (unsigned, in its order), or a function that gives them
# when the check needs them (None: the handle carries none).
Want = Sequence[int] | Callable[[], Sequence[int] | None] | None
MEMCPY_RUNS = 4  # up to this many contiguous runs: cudaMemcpy each; more: one copy kernel
STAGING_MIN = 1024  # entries of the smallest pinned upload buffer and device workspace
# A run from another GPU is copied in chunks, the last of about this many bytes (its sum is
# what the check adds behind the copy), each earlier one at most ``TRAIL_RATIO`` times the one
# after it: its sum, read from this GPU's memory, must end before the next chunk has come over
# the link. Two H200s: 4.2 TB/s of local reads against 0.39 TB/s over NVLink, 10.7x
# (bench/results/kv_checksum_cpu.md, session 11); H100s about 8x by their datasheets; over
# PCIe more.
TRAIL_BYTES = 16 << 20
TRAIL_RATIO = 4
# No chunk larger than this many bytes (0: no cap), so that the side sums can go slower
# (``SIDE_PER_SM``) and still end before the next chunk has landed.
TRAIL_MAX_BYTES = 128 << 20
# Programs of each sum on the side stream, per multiprocessor (0: one per part of a block, as
# fast as the device reads). Such a sum reads this GPU's memory while the next chunk is
# written into it over the link, and the link copy slows to about 70% while it does. Two
# H100s (bench/results/kv_checksum_cpu.md, session 12), device time of a checked run over one
# ``copy_`` at 2k / 4k tokens: full-speed sums of uncapped chunks 1.073-1.076 / 1.063-1.067;
# 2 programs a multiprocessor on chunks of at most 64 MiB 1.054-1.056 / 1.039-1.040, at most
# 128 MiB 1.0505-1.0509 / 1.031-1.0325 (and fewer chunks). The last chunk's sum, behind the
# copy, always goes at full speed.
SIDE_PER_SM = 2


def peer_chunks(count: int, block_bytes: int) -> list[tuple[int, int]]:
    """(offset, blocks) chunks of a run of ``count`` blocks copied from another GPU: from the
    end, a last chunk of about ``TRAIL_BYTES`` (at least one block), then chunks ``TRAIL_RATIO``
    times the one after up to ``TRAIL_MAX_BYTES``, the first taking what is left. Few chunks:
    each costs the host a copy, an event and a launch, and the copy engines a gap between
    copies."""
    size = max(1, TRAIL_BYTES // block_bytes)
    most = max(size, TRAIL_MAX_BYTES // block_bytes) if TRAIL_MAX_BYTES else count
    sizes: list[int] = []
    left = count
    while left > 0:
        sizes.append(min(size, left))
        left -= sizes[-1]
        size = min(size * TRAIL_RATIO, most)
    sizes.reverse()
    return list(zip(itertools.accumulate(sizes[:-1], initial=0), sizes, strict=True))


class CopyChecks:
    """The checked copies' methods and buffers; the attributes are `CudaIpcTransport`'s (set
    in its ``__init__``)."""

    device: torch.device
    pool: torch.Tensor
    block_bytes: int
    sums: bool
    fault: str
    _cuda: bool
    _stream: Any
    _checks: FetchChecks
    _counts: list[torch.Tensor]
    _staged: list[torch.Tensor]
    _work: torch.Tensor | None
    _checkers: dict[int, tuple[torch.Tensor, Any]]
    _copiers: dict[tuple[str, int], tuple[torch.Tensor, Any]]
    _run_sums: torch.Tensor | None
    _side: Any
    behind: bool
    behind_fetches: int
    run_fetches: int
    peer_run_fetches: int
    mapped_count: bool

    def _warm_up(self) -> None:
        """Compile the fused kernels now, not in the first hand-off's path (a scratch block
        of the pool's size: the same kernel variants), and find out whether the fused check
        can store its count straight into pinned host memory (mapped into the device's
        address space by CUDA's unified addressing): a scratch block of zeros whose expected
        sum is 1 must count 1 there. If not, its count comes back by an 8-byte copy. If the
        kernels cannot run here the decode worker sums the arrived blocks itself, as over the
        network."""
        try:
            torch.cuda.set_device(self.device)  # where Triton launches
            self._stream = torch.cuda.Stream(self.device)
            # the workspace lives on the fetches' stream; its compiles are a warm-up's (the
            # worker is not ready yet), not serving stalls (kernels.compile_counter)
            with torch.cuda.stream(self._stream), compile_counter.COUNTER.warming():
                self._try_kernels()
            self._counts.append(torch.empty((), dtype=torch.int64, pin_memory=True))
        except Exception as e:  # a kernel that does not compile or run here: any kind
            log.warning("the fused CUDA IPC copy-and-sum cannot run (%s): checked apart", e)
            self.sums = False

    def _try_kernels(self) -> None:
        scratch = torch.zeros(1, self.block_bytes, dtype=torch.uint8, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        sums = kernels.copy_sum_blocks_between(scratch, scratch, zero, zero)
        kernels.count_mismatches(sums, sums)
        one = torch.ones(1, dtype=torch.int64, device=self.device)
        work = self._workspace(1)
        host = torch.full((), -1, dtype=torch.int64, pin_memory=True)
        for out in (host, torch.empty((), dtype=torch.int64, device=self.device)):
            try:
                kernels.copy_sum_check_blocks_between(
                    scratch, scratch, zero, zero, zero.clone(), one, work[1:], work[:1], out
                )
                torch.cuda.synchronize(self.device)
            except (RuntimeError, ValueError) as e:  # Triton refused the host pointer
                if out is not host:
                    raise
                log.info("the fused check cannot store into pinned memory (%s)", e)
                continue
            if int(work.count_nonzero()):
                raise RuntimeError("the fused check left its workspace dirty")
            if int(out) == 1:
                self.mapped_count = out is host
                break
            if out is not host:
                raise RuntimeError(f"the fused check counted {int(out)} of 1 in a test")
            log.info("the fused check's store into pinned memory did not arrive")
        # Once more as a fetch launches it (the vectors packed in one upload), which now goes
        # straight to the compiled kernel (`kernels.triton_launch.FastLaunch`; if that fails
        # here it says so once and every launch takes Triton's usual path).
        up = torch.tensor([0, 0, 1, 0], dtype=torch.int64, device=self.device)
        out.fill_(-1)
        kernels.copy_sum_check_packed(scratch, scratch, up, 1, work, out)
        torch.cuda.synchronize(self.device)
        if int(out) != 1 or int(work.count_nonzero()):
            raise RuntimeError(f"the fused check counted {int(out)} of 1 in a second test")
        if self.mapped_count:
            self._try_behind(scratch)

    def _try_behind(self, scratch: torch.Tensor) -> None:
        """Whether the compare behind the copy works here: it reads the sender's sums from
        pinned memory and writes its count there, both by the host address (the device's under
        unified addressing). A zero block whose expected sum is 1, twice (compiled, then
        launched straight), must count 1 each time and leave the sums zero: copied as a run,
        then by ids, then as a run with the fault hook if it is on (all compiled now, not in a
        fetch)."""
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        ids = torch.zeros(2, dtype=torch.int64, device=self.device)
        try:
            kinds = [("runs", False), ("packed", False), ("landed", False)]
            kinds += [("landed_side", False)] if self._side_programs() else []
            for kind, fault in kinds + ([("runs", True)] if self.fault else []):
                sums = self._sums_buffer(1)
                if kind == "runs":
                    copy = functools.partial(
                        kernels.runs_copy_sum(scratch, scratch, sums, fault), [(0, 0, 1)]
                    )
                elif kind.startswith("landed"):  # a landed run's sum (from another GPU)
                    progs = self._side_programs() if kind == "landed_side" else 0
                    copy = functools.partial(
                        kernels.run_wsum64(scratch, sums, programs=progs), 0, 1, 0
                    )
                else:
                    packed = kernels.packed_copy_sum(scratch, scratch, sums)
                    copy = functools.partial(packed, ids, 1)
                for _ in range(2):  # (a flipped bit: a zero block never sums to 1 either)
                    host[0], host[1] = 1, -1
                    copy()
                    kernels.compare_sums(sums, host, 1)
                    torch.cuda.synchronize(self.device)
                    if int(host[1]) != 1:
                        raise RuntimeError(f"counted {int(host[1])} of 1")
                    if int(sums.count_nonzero()):
                        raise RuntimeError("left its sums dirty")
        except (RuntimeError, ValueError) as e:  # any way it fails here: the upload path
            log.warning("the compare behind the copy cannot read pinned memory (%s)", e)
            return
        self.behind = True

    def _workspace(self, n: int) -> torch.Tensor:
        """The fused check's zeroed device words (the blocks-done-and-mismatches word, then
        one ticket per block), kept zero by every kernel that uses them: one per transport,
        shared by every fetch on its one stream (which runs them one after another)."""
        if self._work is None or self._work.numel() < n + 1:
            self._work = torch.zeros(max(n + 1, STAGING_MIN), dtype=torch.int64, device=self.device)
            self._checkers.clear()  # bound to the old workspace
        return self._work

    def _sums_buffer(self, n: int) -> torch.Tensor:
        """The sums of a copy with the compare behind it (device int64, zero, one per block;
        the compare leaves them zero)."""
        if self._run_sums is None or self._run_sums.numel() < n:
            self._run_sums = torch.zeros(max(n, STAGING_MIN), dtype=torch.int64, device=self.device)
            self._copiers.clear()  # bound to the old buffer
        return self._run_sums

    def _copier(self, kind: str, src: torch.Tensor, n: int) -> Any:
        """The copy and sum of up to ``n`` blocks from ``src`` into this pool, of a few runs
        (``kind`` "runs") or scattered ("packed"): one per kind, source pool and sums buffer,
        made on its first fetch."""
        sums = self._sums_buffer(n)
        kept = self._copiers.get((kind, id(src)))
        if kept is None or kept[0] is not src:
            copy: Any
            if kind == "runs":
                copy = kernels.runs_copy_sum(self.pool, src, sums, self.fault == "corrupt")
            else:
                copy = kernels.packed_copy_sum(self.pool, src, sums)
            kept = (src, copy)
            self._copiers[(kind, id(src))] = kept
        return kept[1]

    def _side_programs(self) -> int:
        """Programs of a side stream's sum (``SIDE_PER_SM`` per multiprocessor; off CUDA the
        factor itself, which the torch reference ignores)."""
        if not (SIDE_PER_SM and self._cuda):
            return SIDE_PER_SM
        return SIDE_PER_SM * torch.cuda.get_device_properties(self.device).multi_processor_count

    def _landed_sum(self, n: int, programs: int = 0) -> Any:
        """The read-only sum of landed runs of this pool into the reused sums buffer (for up to
        ``n`` blocks; by at most ``programs`` programs, 0: full speed; bound once per buffer
        and ``programs``)."""
        sums = self._sums_buffer(n)
        kept = self._copiers.get((f"landed{programs}", id(self.pool)))
        if kept is None:
            kept = (self.pool, kernels.run_wsum64(self.pool, sums, programs=programs))
            self._copiers[(f"landed{programs}", id(self.pool))] = kept
        return kept[1]

    def _checker(self, src: torch.Tensor, n: int) -> Any:
        """The fused check from ``src`` into this pool for up to ``n`` blocks (one per source
        pool and workspace, made on its first fetch)."""
        work = self._workspace(n)
        kept = self._checkers.get(id(src))
        if kept is None or kept[0] is not src:
            kept = (src, kernels.packed_check(self.pool, src, work))
            self._checkers[id(src)] = kept
        return kept[1]

    def _copy_sum(
        self,
        src: torch.Tensor,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
        want: Want = None,
        remote: bool = False,
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """The fused copy-and-sum of every block (on the current stream), and with ``want``
        (the sender's sums, unsigned, one per block) the compare in the same kernel: returns
        the sums (int64 on the device), the 0-dim host int64 that holds how many blocks' sums
        differ once the stream's work is done (None without ``want``), and the staging buffer
        it lives in. One upload before the copy: block ids, the sender's sums and the zeroed
        sums, from pinned memory. The kernel writes the count straight into the pinned buffer
        where the warm-up found the device can (``mapped_count``), else into the device and
        8 bytes come back behind it. With the fault hook the first block is read from a
        scratch copy with one bit flipped (see the module). ``want`` may also be a function
        that gives them (or None), called once. Where the warm-up found the device reads
        pinned memory (``behind``) the compare goes behind the copy instead (`_check_runs`,
        `_check_scattered`; a few runs from another GPU, ``remote``: `_check_peer_runs`):
        with the sender's sums, no sums are returned (None)."""
        n = len(src_blocks)
        if self.behind:
            runs = block_runs(src_blocks, dst_blocks)
            if len(runs) <= MEMCPY_RUNS:
                if remote:
                    return self._check_peer_runs(src, runs, n, want)
                return self._check_runs(src, runs, n, want)
            return self._check_scattered(src, src_blocks, dst_blocks, want)
        if callable(want):
            want = want()
        if want is None:
            staged = self._staging(2 * n)
            rows = staged.numpy()
            rows[:n], rows[n : 2 * n] = src_blocks, dst_blocks
            idx = staged[: 2 * n].to(self.device, non_blocking=True)
            si, di = idx[:n], idx[n:]
            if self.fault != "corrupt":
                return kernels.copy_sum_blocks_between(self.pool, src, si, di), None, staged
            flipped = self._flipped(src, src_blocks[0])
            head = kernels.copy_sum_blocks_between(self.pool, flipped, si[:1] * 0, di[:1])
            rest = kernels.copy_sum_blocks_between(self.pool, src, si[1:], di[1:])
            return torch.cat([head, rest]), None, staged
        staged = self._staging(4 * n + 1)
        rows = staged.numpy()
        rows[:n], rows[n : 2 * n] = src_blocks, dst_blocks
        rows.view(np.uint64)[2 * n : 3 * n] = want  # as int64: the same bits
        rows[3 * n : 4 * n] = 0  # the sums, added to by the kernel
        up = staged[: 4 * n + 1].to(self.device, non_blocking=True)
        host = staged[4 * n]
        out = host if self.mapped_count or not self._cuda else up[4 * n]
        if self.fault != "corrupt":  # launched with no views of ``up`` made before it
            self._checker(src, n)(up, n, out)
        else:  # two launches, one count: the first block from the damaged scratch copy
            work = self._workspace(n)
            si, di, expected = up[:n], up[n : 2 * n], up[2 * n : 3 * n]
            sums, state, tickets = up[3 * n : 4 * n], work[:1], work[1:]
            check = kernels.copy_sum_check_blocks_between
            flipped = self._flipped(src, src_blocks[0])
            check(self.pool, flipped, si[:1] * 0, di[:1], sums[:1], expected[:1], tickets,
                  state, out, n)  # fmt: skip
            check(self.pool, src, si[1:], di[1:], sums[1:], expected[1:], tickets[1:], state,
                  out, n)  # fmt: skip
        if out is not host:  # 8 bytes back behind the kernel, into the pinned buffer
            host.copy_(out, non_blocking=True)
        return up[3 * n : 4 * n], host, staged

    def _check_runs(
        self, src: torch.Tensor, runs: list[tuple[int, int, int]], n: int, want: Want
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """`_copy_sum` for a few contiguous runs, with nothing uploaded and nothing allocated
        on the device: the copy and sum is queued first (the runs as scalars, the sums into a
        reused zeroed buffer); then, while it runs, the sender's sums are written into a
        reused pinned buffer and the compare queued behind it, which reads them in place,
        writes the count behind them (returned as a 0-dim view of it) and zeroes the sums: not
        kept (`verify` compares nothing later: the count answers). Without the sender's sums
        the copy's are kept (a device copy of them; the buffer zeroed) for `verify`. With the
        fault hook the copy flips one bit of the first block on its way (see the module)."""
        sums = self._sums_buffer(n)
        self._copier("runs", src, n)(runs)
        self.run_fetches += 1
        return self._compare_behind(sums, n, want, self._staging(n + 1), 0)

    def _check_peer_runs(
        self, src: torch.Tensor, runs: list[tuple[int, int, int]], n: int, want: Want
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """`_check_runs` for runs from a pool on another GPU, checked behind the copy engines
        rather than in an SM copy. Between two GPUs the link bounds the copy, and an SM copy
        over it is about 6% slower than the copy engines' (as within one GPU); but this GPU
        reads its own memory about ten times faster than the link delivers (H200s over
        NVLink: bench/results/kv_checksum_cpu.md, session 11). So each run goes by
        ``cudaMemcpy`` in chunks (`peer_chunks`); each chunk but the last, once landed, is
        summed from this GPU's memory on a side stream (`kernels.run_wsum64`, by
        ``SIDE_PER_SM`` programs a multiprocessor: a full-speed sum slows the link copy beside
        it more) while the next one comes; the last chunk is summed on the copy stream behind
        its copy, once the side stream is done, and the compare goes behind that sum
        (`_compare_behind`). What the check adds to the hand-off is the last, small chunk's
        sum and the compare. With the fault hook the first block lands damaged (written again
        from a scratch copy with one bit flipped, behind its chunk's copy and before its sum;
        the peer's pool untouched)."""
        starts = itertools.accumulate((k for *_, k in runs[:-1]), initial=0)  # in the fetch
        chunks = [
            (s + off, d + off, c, at + off)
            for (s, d, k), at in zip(runs, starts, strict=True)
            for off, c in peer_chunks(k, self.block_bytes)
        ]
        for i, (a, b, c, at) in enumerate(chunks):
            self.pool[b : b + c].copy_(src[a : a + c], non_blocking=True)
            if i == 0:  # the rest of the set-up once the first copy is on its way
                side, last = self._landed_sum(n, self._side_programs()), self._landed_sum(n)
                sums = self._sums_buffer(n)
                if self.fault == "corrupt":
                    self.pool[b].copy_(self._flipped(src, a)[0], non_blocking=True)
            if i < len(chunks) - 1:
                self._on_side(functools.partial(side, b, c, at))
            else:  # the last chunk on the copy stream, once the side stream's sums are done
                if self._side is not None and self._cuda:
                    torch.cuda.current_stream(self.device).wait_stream(self._side)
                last(b, c, at)
        self.peer_run_fetches += 1
        return self._compare_behind(sums, n, want, self._staging(n + 1), 0)

    def _on_side(self, work: Callable[[], Any]) -> Any:
        """``work`` queued on the side stream behind what the current stream has queued so far
        (off CUDA: run now)."""
        if not self._cuda:
            return work()
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            return work()

    def _check_scattered(
        self, src: torch.Tensor, src_blocks: Sequence[int], dst_blocks: Sequence[int], want: Want
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor | None]:
        """`_copy_sum` for scattered blocks with the compare behind the copy: the block ids go
        up from a reused pinned buffer (as the plain copy's do), the copy and sum is queued
        (`kernels.packed_copy_sum`, its sums into the reused zeroed buffer), then the rest as
        `_check_runs` does, the sender's sums written behind the ids. With the fault hook the
        first block is copied from a scratch copy with one bit flipped (see the module)."""
        n = len(src_blocks)
        staged = self._staging(3 * n + 1)
        rows = staged.numpy()
        rows[:n], rows[n : 2 * n] = src_blocks, dst_blocks
        up = staged[: 2 * n].to(self.device, non_blocking=True)
        sums = self._sums_buffer(n)
        if self.fault != "corrupt":
            self._copier("packed", src, n)(up, n)
        else:  # two launches: the first block from the damaged scratch copy
            flipped = self._flipped(src, src_blocks[0])
            copy = kernels.copy_sum_blocks_between
            copy(self.pool, flipped, up[:1] * 0, up[n : n + 1], out=sums[:1])
            copy(self.pool, src, up[1:n], up[n + 1 : 2 * n], out=sums[1:n])
        return self._compare_behind(sums, n, want, staged, 2 * n)

    def _compare_behind(
        self, sums: torch.Tensor, n: int, want: Want, staged: torch.Tensor, at: int
    ) -> tuple[torch.Tensor | None, Any, torch.Tensor]:
        """While the queued copy runs: the sender's sums into ``staged[at : at + n]`` and the
        compare queued behind the copy, its count landing at ``staged[at + n]`` (returned as a
        0-dim view of it), the sums zeroed by it. Without the sender's sums, the copy's sums
        (a device copy of them; the buffer zeroed) for `verify`."""
        self.behind_fetches += 1
        got = want() if callable(want) else want  # host work while the copy runs
        if got is None:
            kept = sums[:n].clone()
            sums[:n].zero_()
            return kept, None, staged
        rows = staged.numpy()
        rows.view(np.uint64)[at : at + n] = got  # as int64: the same bits
        kernels.compare_sums(sums, staged[at:] if at else staged, n)
        return None, rows[at + n, ...], staged

    @staticmethod
    def _flipped(src: torch.Tensor, block: int) -> torch.Tensor:
        """The fault hook's scratch copy of ``src``'s ``block`` with one bit flipped in the
        middle (the peer's pool stays intact)."""
        flipped = src[block : block + 1].clone()
        flipped[0, flipped.shape[1] // 2] ^= 1
        return flipped

    def _pinned_count(self) -> torch.Tensor:
        """A pinned int64 scalar for a count (kept for reuse: pinning one costs more than the
        whole check)."""
        return (
            self._counts.pop() if self._counts else torch.empty((), dtype=torch.int64).pin_memory()
        )

    def _staging(self, size: int) -> torch.Tensor:
        """A host int64 buffer of at least ``size`` entries for one fetch's upload (and its
        count): pinned and reused on CUDA (it goes back once the fetch's wait is over), a new
        one on CPU (the tests: there the "upload" is the buffer itself)."""
        if not self._cuda:
            return torch.empty(size, dtype=torch.int64)
        for i, b in enumerate(self._staged):
            if b.numel() >= size:
                return self._staged.pop(i)
        return torch.empty(max(size, STAGING_MIN), dtype=torch.int64, pin_memory=True)
