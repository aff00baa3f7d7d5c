"""The checked half of the CUDA IPC hand-off (`CudaIpcTransport` takes it as a base): the
warm-up that compiles the checks and finds out what the device can do, the fused copy-and-sum
of a fetch with its compare (behind the copy where the device reads pinned memory, else in
one fused kernel), and the reused buffers they work in (pinned uploads, device sums, the
fused check's workspace). `cuda_ipc`'s module docstring describes the paths."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import kernels
from libkv.transfer import block_runs

if TYPE_CHECKING:
    from libkv.transfer.fetch_checks import FetchChecks

log = logging.getLogger(__name__)
# The sender's sums of a fetch's blocks (unsigned, in its order), or a function that gives them
# when the check needs them (None: the handle carries none).
Want = Sequence[int] | Callable[[], Sequence[int] | None] | None
MEMCPY_RUNS = 4  # up to this many contiguous runs: cudaMemcpy each; more: one copy kernel
STAGING_MIN = 1024  # entries of the smallest pinned upload buffer and device workspace


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
    behind: bool
    behind_fetches: int
    run_fetches: int
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
            with torch.cuda.stream(self._stream):  # the workspace lives on the fetches' stream
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
            for kind, fault in [("runs", False), ("packed", False)] + (
                [("runs", True)] if self.fault else []
            ):
                sums = self._sums_buffer(1)
                if kind == "runs":
                    copy = functools.partial(
                        kernels.runs_copy_sum(scratch, scratch, sums, fault), [(0, 0, 1)]
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
        `_check_scattered`): with the sender's sums, no sums are returned (None)."""
        n = len(src_blocks)
        if self.behind:
            runs = block_runs(src_blocks, dst_blocks)
            if len(runs) <= MEMCPY_RUNS:
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
