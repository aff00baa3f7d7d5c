"""Wall time of the CUDA IPC hand-off with its check against without, A/B interleaved in one
run (`lab.kv_checksum` calls it for each prompt size and prints the table).

Two pairs of arms, each timed over many repeats whose order alternates (A B, B A, ...), so
drift, clocks and caches favour neither; each arm's median, and the median (and quartiles) of
the pairwise difference B - A, which is the check's cost:

- ``kernels``: the transport's device work by hand. A: the block ids go up from a pinned
  buffer, the plain copy kernel (``kernels.copy_blocks_between``: what the transport runs for
  scattered blocks), one event wait. B: the ids, the sender's sums and the zeroed sums go up
  together from a pinned buffer, the one fused kernel that copies, sums, compares and counts
  (``kernels.copy_sum_check_blocks_between``; its count stored straight into the pinned
  buffer where the device maps it, else copied back), one event wait, the count read.
- ``transport``: `CudaIpcTransport.fetch` then ``verify`` as the decode worker calls them, with
  ``sums`` off (A) and on (B), the handle carrying the sender's ``wsum64`` (a `KVHandle` as
  the prefill worker sends it). The peer's pool is exported as a prefill worker exports it,
  but mapped as itself: CUDA IPC cannot open an allocation in the process that exported it
  (the tests do the same; two processes: ``tests/gpu/test_serving_gpu.py``).

Off CUDA (``--dry-run`` of `lab.kv_checksum`) the kernel arms run the torch references, so
the code is checked on any machine; the transport arms need CUDA."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import kernels
from lab.timing import device_time
from libkv.transfer.fetch_checks import MASK, WSUM64, signed64


def paired(run_a: Callable[[], float], run_b: Callable[[], float], repeat: int) -> dict:
    """``repeat`` interleaved pairs of two runs (each returns its own wall seconds), after a
    few of each to warm up: medians in ms, and the pairwise difference B - A."""
    for _ in range(3):
        run_a(), run_b()
    a: list[float] = []
    b: list[float] = []
    for i in range(repeat):
        if i % 2:
            b.append(run_b())
            a.append(run_a())
        else:
            a.append(run_a())
            b.append(run_b())
    diff = [y - x for x, y in zip(a, b, strict=True)]
    q1, _, q3 = statistics.quantiles(diff, n=4) if len(diff) > 1 else (diff[0],) * 3
    return {
        "pairs": repeat,
        "a_ms": round(statistics.median(a) * 1e3, 4),
        "b_ms": round(statistics.median(b) * 1e3, 4),
        "overhead_ms": round(statistics.median(diff) * 1e3, 4),
        "overhead_q1_ms": round(q1 * 1e3, 4),
        "overhead_q3_ms": round(q3 * 1e3, 4),
    }


def shares(row: dict, stack_ms: float) -> dict:
    """``row`` with the overhead as a share of arm A and of the stack's hand-off time."""
    return {
        **row,
        "of_a": round(row["overhead_ms"] / row["a_ms"], 4),
        "stack_handoff_ms": stack_ms,
        "of_stack_handoff": round(row["overhead_ms"] / stack_ms, 4),
    }


def kernel_arms(
    dst: torch.Tensor, src: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int],
    expected: Sequence[int],
) -> tuple[Callable[[], float], Callable[[], float]]:  # fmt: skip
    """(bare, checked) for two ``[N, block_bytes]`` uint8 pools of one device; ``expected``:
    the sender's unsigned ``wsum64`` of ``src_ids``. The checked arm fails on a mismatch. It
    runs as the transport does: where the device reads pinned memory (and off CUDA), the ids
    go up, the copy and sum is queued, then the sender's sums are written behind the ids and
    the compare is queued behind the copy (`kernels.compare_sums`); elsewhere the fused check
    with everything uploaded before it."""
    dev = dst.device
    cuda = dev.type == "cuda"
    stream = torch.cuda.Stream(dev) if cuda else None
    n = len(src_ids)
    staged = torch.empty(4 * n + 1, dtype=torch.int64)
    staged = staged.pin_memory() if cuda else staged
    rows = staged.numpy()
    work = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    mapped = cuda and _maps_pinned(dst)
    sums = torch.zeros(n, dtype=torch.int64, device=dev)
    copy_sum = kernels.packed_copy_sum(dst, src, sums)
    if cuda:  # the zeroed workspace before the arms' stream uses it
        torch.cuda.synchronize(dev)

    def on_stream() -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if cuda else contextlib.nullcontext()

    def wait() -> None:  # the transport's one wait: an event behind the stream's work
        if cuda:
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()

    def bare() -> float:
        t0 = time.perf_counter()
        with on_stream():
            rows[:n], rows[n : 2 * n] = src_ids, dst_ids
            idx = staged[: 2 * n].to(dev, non_blocking=cuda)
            kernels.copy_blocks_between(dst, src, idx[:n], idx[n:])
            host_a.append(time.perf_counter() - t0)
            wait()
        return time.perf_counter() - t0

    def checked() -> float:
        t0 = time.perf_counter()
        with on_stream():
            rows[:n], rows[n : 2 * n] = src_ids, dst_ids
            if mapped or not cuda:  # the compare behind the copy
                idx = staged[: 2 * n].to(dev, non_blocking=cuda)
                copy_sum(idx, n)
                rows.view("uint64")[2 * n : 3 * n] = expected
                kernels.compare_sums(sums, staged[2 * n :], n)
                host_b.append(time.perf_counter() - t0)
                wait()
                bad = int(staged[3 * n])
            else:
                rows.view("uint64")[2 * n : 3 * n] = expected
                rows[3 * n : 4 * n] = 0
                up = staged.to(dev, non_blocking=cuda)
                kernels.copy_sum_check_packed(dst, src, up, n, work, up[4 * n])
                staged[4 * n].copy_(up[4 * n], non_blocking=True)
                host_b.append(time.perf_counter() - t0)
                wait()
                bad = int(staged[4 * n])
        elapsed = time.perf_counter() - t0
        if bad:
            raise AssertionError(f"{bad} blocks mismatched in an exact copy")
        return elapsed

    host_a: list[float] = []  # each call's host time up to its wait (launches included)
    host_b: list[float] = []
    bare.host, checked.host = host_a, host_b  # type: ignore[attr-defined]
    return bare, checked


def _maps_pinned(dst: torch.Tensor) -> bool:
    """Whether the fused check stores into pinned host memory here (as the transport's
    warm-up finds out)."""
    from libkv.transfer.cuda_ipc import CudaIpcTransport

    probe = torch.zeros(1, dst.shape[1], dtype=torch.uint8, device=dst.device)
    return CudaIpcTransport(probe, dst.shape[1], None, sums=True).mapped_count  # type: ignore[arg-type]


def sm_check(
    dst: torch.Tensor, src: torch.Tensor, start: int, n: int, want: list[int], pdl: bool = True
) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """The check of one run the transport takes on one GPU, ``src[start:start + n]`` into
    ``dst[:n]``: the SM copy that sums on its way (`kernels.runs_copy_sum`, nothing uploaded),
    the compare behind it reading the sender's sums (``want``, unsigned) from pinned memory
    and writing the count there. Returns (launch it on the current stream, its device sums,
    the pinned sums with the count behind them). ``pdl`` False: the same kernels launched
    plainly, without programmatic dependent launch (what the transport takes has it where the
    GPU does)."""
    sums = torch.zeros(n, dtype=torch.int64, device=dst.device)
    host = torch.zeros(n + 1, dtype=torch.int64, pin_memory=True)
    host.numpy().view("uint64")[:n] = want
    if pdl:
        copy, compare = kernels.runs_copy_sum(dst, src, sums), kernels.compare_sums
    else:
        from kernels import triton_copy

        copy = triton_copy.RunsCopySum(dst, src, sums, False, 0, False)

        def compare(sums: torch.Tensor, host: torch.Tensor, n: int) -> None:
            triton_copy.compare_sums(sums, host, n, False)

    def check() -> None:
        copy([(start, 0, n)])
        compare(sums, host, n)

    return check, sums, host


def device_checked_copy(dst, src, si, di, want) -> Callable[[], None]:
    """The checked arm's device work alone (for CUDA-event timing), as the transport queues it
    where the device reads pinned memory: the copy and sum, then the compare behind it (the
    sender's sums read and the count written in pinned memory; the sums left zero)."""
    n = si.numel()
    sums = torch.zeros(n, dtype=torch.int64, device=si.device)
    host = torch.zeros(n + 1, dtype=torch.int64).pin_memory()
    host[:n] = want.cpu()
    torch.cuda.synchronize(si.device)

    def run() -> None:
        kernels.copy_sum_blocks_between(dst, src, si, di, out=sums)
        kernels.compare_sums(sums, host, n)

    return run


class _Records:
    """The member record of a prefill worker whose pool is ``peer`` (this process's GPU)."""

    def __init__(self, peer: torch.Tensor, block_bytes: int) -> None:
        from libkv.transfer import CUDA_IPC_KEY, DEVICE_KEY, HOST_KEY
        from libkv.transfer.cuda_ipc import device_uuid, export_pool, host_id

        self.extra_ = {
            HOST_KEY: host_id(),
            DEVICE_KEY: device_uuid(peer.device.index or 0),
            CUDA_IPC_KEY: export_pool(peer, block_bytes).to_json(),
        }

    async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict[str, str]:
        return self.extra_


def transport_arms(
    dst: torch.Tensor, src: torch.Tensor | None, src_ids: Sequence[int], dst_ids: Sequence[int],
    expected: Sequence[int], records: Any = None,
) -> tuple[Callable[[], float], Callable[[], float], Callable[[], dict]]:  # fmt: skip
    """(sums off, sums on, counters) over `CudaIpcTransport` (CUDA only): each arm is one
    ``fetch`` + ``verify`` of a handle with the sender's sums, timed inside the event loop.
    ``records``: the member records of a pool another process exported (worker ``p0``;
    `lab.kv_check_peer`), mapped for real; without them ``src``, a pool of this process."""
    from libkv.transfer.cuda_ipc import CudaIpcTransport
    from services.common.codec import KVHandle

    bb = dst.shape[1]
    own = records is None
    if own:
        assert src is not None
        records = _Records(src, bb)
    handle = KVHandle(
        worker_id="p0", incarnation="i1", address="", block_ids=tuple(src_ids),
        num_tokens=16 * len(src_ids), block_size=16, block_bytes=bb, dtype="uint8",
        lease_expires_unix_ms=0, block_checksums=tuple(expected), checksum_algorithm=WSUM64,
    )  # fmt: skip
    plain = CudaIpcTransport(dst, bb, records, sums=False)
    checked = CudaIpcTransport(dst, bb, records, sums=True)
    if not checked.sums:
        raise RuntimeError("the fused copy-and-sum cannot run here (see the warning)")
    launches: dict[int, list[float]] = {id(plain): [], id(checked): []}
    for t in (plain, checked):
        if own:
            t._mapped = lambda name, info: src  # type: ignore[method-assign]  # see the module
        t._launch = _timed(t._launch, launches[id(t)])  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()

    async def one(t: CudaIpcTransport) -> float:
        t0 = time.perf_counter()
        await t.fetch("r", handle, src_ids, dst_ids, 10.0)
        bad = await t.verify("r", handle.block_checksums)
        elapsed = time.perf_counter() - t0
        if bad != (0 if t.sums else None):
            raise AssertionError(f"verify said {bad} (sums {'on' if t.sums else 'off'})")
        return elapsed

    def counters() -> dict:
        loop.close()
        calls = max(checked.fused_fetches, 1)  # each arm's fetches: as many
        return {
            "launch_a_us": round(plain.launch_ns / calls / 1e3, 1),
            "launch_b_us": round(checked.launch_ns / calls / 1e3, 1),
            # medians: the means above take in every stall (a GC pass, a descheduled thread)
            "launch_a_med_us": round(statistics.median(launches[id(plain)]) * 1e6, 1),
            "launch_b_med_us": round(statistics.median(launches[id(checked)]) * 1e6, 1),
            "fused_fetches": checked.fused_fetches,
            "compared_fetches": checked.compared_fetches,
            "device_verifies": checked.device_verifies,
            "mapped_count": checked.mapped_count,
            "behind": checked.behind,
            "behind_fetches": checked.behind_fetches,
            "run_fetches": checked.run_fetches,
            "peer_run_fetches": checked.peer_run_fetches,
            "thread_waits_off": plain.thread_waits,
            "thread_waits_on": checked.thread_waits,
        }

    return (
        lambda: loop.run_until_complete(one(plain)),
        lambda: loop.run_until_complete(one(checked)),
        counters,
    )


def _timed(launch: Callable, into: list[float]) -> Callable:
    """``launch`` that appends each call's wall seconds to ``into``."""

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return launch(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)

    return timed


def checked_copy(src, dst, src_ids, dst_ids, expected, repeat, pairs, stack_ms) -> dict:
    """The receiver's check as the CUDA IPC transport runs it: device time of the fused
    copy+sum, and of it with the compare and count, over the plain copy kernel; and the wall
    time of the hand-off with the check against without, A/B (`lab.kv_check_ab`)."""
    dev = src.device
    s8 = src.view(src.shape[0], -1).view(torch.uint8)
    d8 = dst.view(dst.shape[0], -1).view(torch.uint8)
    bare, checked = kernel_arms(d8, s8, src_ids, dst_ids, expected)
    out: dict = {"ab_kernels": shares(paired(bare, checked, pairs), stack_ms)}
    out["ab_kernels"].update(
        host_a_us=round(statistics.median(bare.host) * 1e6, 1),  # type: ignore[attr-defined]
        host_b_us=round(statistics.median(checked.host) * 1e6, 1),  # type: ignore[attr-defined]
    )
    if dev.type != "cuda":  # --dry-run: the code paths, on the references
        return out
    si, di = torch.tensor(src_ids, device=dev), torch.tensor(dst_ids, device=dev)
    want = torch.tensor(signed64(expected), dtype=torch.int64, device=dev)
    d_copy = device_time(lambda: kernels.copy_blocks_between(d8, s8, si, di), "cuda", repeat)
    d_fused = device_time(lambda: kernels.copy_sum_blocks_between(d8, s8, si, di), "cuda", repeat)
    d_checked = device_time(device_checked_copy(d8, s8, si, di, want), "cuda", repeat)
    # The transport on these scattered blocks (without the check: the plain copy kernel), and
    # on one contiguous run each side (without the check: one cudaMemcpy, no ids uploaded).
    n = len(src_ids)
    words = s8.view(torch.int64)
    first = torch.arange(n, device=dev)
    run_sums = kernels.block_wsum64(words, first)
    run = [s & MASK for s in run_sums.tolist()]
    # Device time on that run: what sums off runs (one copy_) against the fused check.
    d_memcpy_run = device_time(lambda: d8[:n].copy_(s8[:n], non_blocking=True), "cuda", repeat)
    d_checked_run = device_time(device_checked_copy(d8, s8, first, first, run_sums), "cuda", repeat)
    # And the check of runs the transport takes there (`sm_check`).
    runs_check, zeros, host = sm_check(d8, s8, 0, n, run)
    d_runs_run = device_time(runs_check, "cuda", repeat)
    if int(host[n]) != 0 or int(zeros.count_nonzero()):
        raise AssertionError(f"the check of runs counted {int(host[n])} on a clean run")
    d_runs_nopdl = device_time(sm_check(d8, s8, 0, n, run, pdl=False)[0], "cuda", repeat)
    sweep = per_sm_sweep(runs_check, d_memcpy_run, max(repeat, 20))
    if int(host[n]) != 0 or int(zeros.count_nonzero()):
        raise AssertionError(f"the check of runs counted {int(host[n])} in the sweep")
    for key, ids, sums in (
        ("ab_transport", (src_ids, dst_ids), expected),
        ("ab_transport_runs", (list(range(n)), list(range(n))), run),
    ):
        off, on, counters = transport_arms(d8, s8, *ids, sums)
        out[key] = shares(paired(off, on, pairs), stack_ms)
        out[key].update(counters())
        if out[key]["device_verifies"]:
            raise AssertionError("verify compared on the device: not the path under test")
    return out | {
        "device_fused_copy_ms": round(d_fused * 1e3, 4),
        "device_checked_copy_ms": round(d_checked * 1e3, 4),
        # What the check adds on the GPU: the copy kernel with the sums (and compare, count).
        "fused_device_overhead": round(d_fused / d_copy - 1, 4),
        "checked_device_overhead": round(d_checked / d_copy - 1, 4),
        "device_memcpy_run_ms": round(d_memcpy_run * 1e3, 4),
        "device_checked_run_ms": round(d_checked_run * 1e3, 4),
        "device_runs_check_ms": round(d_runs_run * 1e3, 4),
        "device_runs_check_no_pdl_ms": round(d_runs_nopdl * 1e3, 4),
        "runs_check_by_programs_per_sm": sweep,
    }


def _per_sm() -> int:
    from kernels import triton_copy

    return triton_copy.PROGRAMS_PER_SM


PER_SM = (1, 2, 4, 8, 16, 10**6)  # 10**6: one chunk a program (no loop), as before the split


def per_sm_sweep(check: Callable[[], None], memcpy_s: float, repeat: int) -> dict:
    """The check of runs' device time on one run by ``triton_copy.PROGRAMS_PER_SM`` (each
    program loops over more chunks when fewer run per SM), as a ratio to one ``copy_``."""
    from kernels import triton_copy

    kept = triton_copy.PROGRAMS_PER_SM
    out = {}
    try:
        for k in PER_SM:
            triton_copy.PROGRAMS_PER_SM = k
            out[str(k)] = round(device_time(check, "cuda", repeat) / memcpy_s, 4)
    finally:
        triton_copy.PROGRAMS_PER_SM = kept
    return out


def launch_counts() -> dict:
    """How the Triton copies were launched in this process: straight through the compiled
    kernel (``fast``) or through ``kernel[grid](...)`` (``slow``: compiles, or the fallback)."""
    if not torch.cuda.is_available():
        return {}
    from kernels import triton_copy, triton_copy_check

    return {
        name: {"fast": lf.fast, "slow": lf.slow, "broken": lf.broken}
        for name, lf in (
            ("copy", triton_copy._COPY),
            ("sum", triton_copy._SUM),
            ("check", triton_copy_check._CHECK),
            ("runs", triton_copy._RUNS),
            ("compare", triton_copy._COMPARE),
        )
    }


def print_check(rows: list[dict]) -> None:
    """The CUDA IPC check's lines: device time over the plain copy, and the A/B tables."""
    counts = launch_counts()
    if counts:
        rows[-1]["triton_launches"] = counts  # into the JSON the bench writes
        print("Triton launches, both arms alike: once compiled, straight through the compiled "
              "kernel (kernels.triton_launch.FastLaunch), the plain copy (A) as the fused check "
              "(B): " + ", ".join(f"{k} {v['fast']} direct / {v['slow']} via kernel[grid]"
                                  f"{' (direct path BROKEN)' if v['broken'] else ''}"
                                  for k, v in counts.items()))  # fmt: skip
    if "fused_device_overhead" in rows[0]:
        print("CUDA IPC check, device time over the plain copy kernel (CUDA events), fused "
              "copy+sum / with the compare behind it: " + "; ".join(
            f"{r['tokens']}: {r['fused_device_overhead']:+.1%} / "
            f"{r['checked_device_overhead']:+.1%}" for r in rows))  # fmt: skip
    for key, a, b in (
        ("ab_kernels", "bare copy + 1 wait", "copy+sum+compare+count + 1 wait"),
        ("ab_transport", "fetch+verify, sums off", "fetch+verify, sums on"),
        ("ab_transport_runs", "fetch+verify of one contiguous run, sums off (one cudaMemcpy)",
         "the same, sums on"),
    ):  # fmt: skip
        if key not in rows[0]:
            continue
        r0 = rows[0][key]
        print(f"{key}: A = {a}, B = {b}; wall ms, medians of {r0['pairs']} interleaved pairs; "
              f"overhead = median of B - A [quartiles]")  # fmt: skip
        print(f"{'tokens':>7} {'A ms':>8} {'B ms':>8} {'overhead ms':>12} {'[q1, q3]':>18} "
              f"{'of A':>7} {'of ' + str(r0['stack_handoff_ms']) + ' ms':>10}")  # fmt: skip
        for row in rows:
            r = row[key]
            quartiles = f"[{r['overhead_q1_ms']:.4f}, {r['overhead_q3_ms']:.4f}]"
            print(f"{row['tokens']:>7} {r['a_ms']:>8.4f} {r['b_ms']:>8.4f} "
                  f"{r['overhead_ms']:>12.4f} {quartiles:>18} {r['of_a']:>7.1%} "
                  f"{r['of_stack_handoff']:>10.1%}")  # fmt: skip
        if "host_a_us" in r0:
            print("  host time up to the wait (launches included), median us, A / B: " + "; ".join(
                f"{row['tokens']}: {row[key]['host_a_us']} / {row[key]['host_b_us']}"
                for row in rows))  # fmt: skip
        if "launch_a_us" in r0:
            print("  host time in the transport's _launch, mean us per fetch, A / B: " + "; ".join(
                f"{row['tokens']}: {row[key]['launch_a_us']} / {row[key]['launch_b_us']}"
                for row in rows))  # fmt: skip
        if "launch_a_med_us" in r0:
            print("  the same, median us per fetch, A / B: " + "; ".join(
                f"{row['tokens']}: {row[key]['launch_a_med_us']} / {row[key]['launch_b_med_us']}"
                for row in rows))  # fmt: skip
        if key == "ab_transport_runs" and "device_memcpy_run_ms" in rows[0]:
            print("  device ms (CUDA events) on that run, one copy_ (A) / the copy+sum by ids "
                  "and the compare / the check of runs (B: nothing uploaded): "
                  + "; ".join(f"{row['tokens']}: {row['device_memcpy_run_ms']:.4f} / "
                              f"{row['device_checked_run_ms']:.4f} / "
                              f"{row.get('device_runs_check_ms', float('nan')):.4f} "
                              f"(PDL off: {row.get('device_runs_check_no_pdl_ms', 0.0):.4f})"
                              for row in rows))  # fmt: skip
        if key == "ab_transport_runs" and "runs_check_by_programs_per_sm" in rows[0]:
            print("  the check of runs' device time over one copy_, by programs per SM "
                  f"(kernels.triton_copy.PROGRAMS_PER_SM, now {_per_sm()}; 1000000: one chunk a "
                  "program): " + "; ".join(f"{row['tokens']}: " + " ".join(
                      f"{k}={v:.3f}" for k, v in row["runs_check_by_programs_per_sm"].items())
                      for row in rows))  # fmt: skip
        if "compared_fetches" in r0:
            print("  transport counters (sums on, last size): " + ", ".join(
                f"{k} {rows[-1][key][k]}" for k in
                ("fused_fetches", "compared_fetches", "device_verifies", "mapped_count",
                 "behind", "behind_fetches", "run_fetches", "thread_waits_off",
                 "thread_waits_on")))  # fmt: skip
