"""Host time of one launch of the CUDA IPC hand-off's Triton copies, on a machine without a
GPU: Triton 3.6's ``kernel[grid](...)`` path against `kernels.triton_launch.FastLaunch` (the
compiled kernel's launcher called directly), with the launcher itself (the C extension that
calls ``cuLaunchKernel``) replaced by a no-op, so both paths are timed up to the same point.

What a launch does on the host before the copy can start, per call (both kernels, ``n``
scattered blocks): the tensor views of the one upload, the dispatcher's checks, and in
Triton's path binding and specialising every argument, the cache key (which formats the
options dict), the used-globals check and the launch hooks' metadata. The direct path
computes the variant's key from a few values (words, alignment, dtypes) and passes pointers
as ints (the launcher then skips ``cuPointerGetAttribute`` for them).

    PYTHONPATH=/tmp/triton-N python -m lab.kv_launch_host [--blocks 64] [--calls 20000]

Needs triton (3.6, installed apart: see the README); refuses to run where CUDA is present
(there ``lab.kv_checksum`` times the real launches). Patches torch's current-device and
stream lookups and Triton's active driver in this process only."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """This thread's CPU time per call (not wall time: on a loaded machine the time this
    thread waits descheduled would swamp a few microseconds)."""
    for _ in range(min(calls, 500)):
        fn()
    t0 = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - t0) / calls / 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--block-bytes", type=int, default=64 * 1024)
    args = p.parse_args(argv)
    if torch.cuda.is_available():
        raise SystemExit("CUDA is here: lab.kv_checksum times the real launches")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.driver import driver
    from triton.runtime.jit import create_function_from_signature

    import kernels
    from kernels import triton_copy as tc
    from kernels import triton_copy_check as tcc

    target = GPUTarget("cuda", 90, 32)  # an H100's

    class Driver:  # what Triton asks its active driver for on a launch
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return target

    class NoLaunch:  # a CompiledKernel whose launcher does nothing
        function = 1
        packed_metadata = (8, 1, 0)

        def run(self, *a: object) -> None:
            pass

        def launch_metadata(self, grid: object, stream: int, *a: object) -> dict:
            return {"name": "k", "function": 1, "stream": stream}

    class Compiled(dict):  # Triton's per-device kernel cache, holding it for every key
        def get(self, key: object, default: object = None) -> NoLaunch:
            return NoLaunch()

    driver.set_active(Driver())  # type: ignore[arg-type]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch._C._cuda_getCurrentRawStream = lambda d: 0  # type: ignore[attr-defined]
    kernels.use_triton = lambda t: True  # type: ignore[assignment]
    backend = make_backend(target)
    for fl in (tc._COPY, tcc._CHECK):
        binder = create_function_from_signature(fl.kernel.signature, fl.kernel.params, backend)
        fl.kernel.device_caches[0] = (Compiled(), {}, target, backend, binder)

    n = args.blocks
    pool = torch.zeros(2 * n + 2, args.block_bytes, dtype=torch.uint8)
    src = torch.zeros_like(pool)
    up = torch.zeros(4 * n + 1, dtype=torch.int64)
    work = torch.zeros(n + 1, dtype=torch.int64)
    out = up[4 * n]

    def copy() -> None:  # sums off: the transport's scattered copy
        kernels.copy_blocks_between(pool, src, up[:n], up[n : 2 * n])

    def check_views() -> None:  # sums on, as the transport launched it before
        kernels.copy_sum_check_blocks_between(
            pool, src, up[:n], up[n : 2 * n], up[3 * n : 4 * n], up[2 * n : 3 * n], work[1:],
            work[:1], out,
        )  # fmt: skip

    def check_packed() -> None:  # sums on, as the transport launches it now
        kernels.copy_sum_check_packed(pool, src, up, n, work, out)

    rows = []
    for name, fn in (("copy (sums off)", copy), ("check, views", check_views),
                     ("check, packed (sums on)", check_packed)):  # fmt: skip
        tc._COPY.broken = tcc._CHECK.broken = True  # every call through kernel[grid]
        slow = per_call_us(fn, args.calls)
        tc._COPY.broken = tcc._CHECK.broken = False
        fn()  # kernel[grid] once: FastLaunch keeps the (no-op) compiled kernel
        fast = per_call_us(fn, args.calls)
        rows.append((name, slow, fast))
    print(f"host us per launch, {n} blocks, launcher a no-op (CPU time, mean of {args.calls})")
    print(f"{'launch':<26} {'kernel[grid]':>13} {'FastLaunch':>11}")
    for name, slow, fast in rows:
        print(f"{name:<26} {slow:>13.2f} {fast:>11.2f}")
    print(f"sums on over sums off: kernel[grid] with views {rows[1][1] - rows[0][1]:+.2f} us; "
          f"FastLaunch packed {rows[2][2] - rows[0][2]:+.2f} us")  # fmt: skip
    print(
        f"\nthe transport's own host work per fetch of n blocks in ONE contiguous run, "
        f"FastLaunch's launcher a no-op (CPU time, median of 9 rounds of {args.calls // 10})"
    )
    print(f"{'n':>5} {'sums off: runs + copy_':>23} {'sums on: sums + _copy_sum':>26} "
          f"{'on - off':>9}")  # fmt: skip
    for k in (64, 128, 256):
        off, on = transport_us(k, args.calls // 10)
        print(f"{k:>5} {off:>23.2f} {on:>26.2f} {on - off:>+9.2f}")
    return 0


def transport_us(n: int, calls: int) -> tuple[float, float]:
    """Host us per fetch of ``n`` blocks in one contiguous run, as `CudaIpcTransport` runs it
    minus the device calls common to both arms (device, stream and event): sums off, the runs
    and one ``copy_`` per run (tiny blocks here: the bytes are the device's); sums on, the
    sender's sums from the handle, then ``_copy_sum`` (staging buffer, numpy fill, the upload,
    the fused check through FastLaunch). The upload is a no-op ``.to`` on CPU: its
    ``cudaMemcpyAsync`` is not counted, nor the copy's. Rounds alternate the arms."""
    import statistics

    from libkv.transfer import block_runs
    from libkv.transfer.cuda_ipc import CudaIpcTransport
    from libkv.transfer.fetch_checks import WSUM64, sender_sums
    from services.common.codec import KVHandle

    bb = 64
    pool = torch.zeros(2 * n + 8, bb, dtype=torch.uint8)
    src = torch.zeros_like(pool)
    ids = tuple(range(n))
    dst = tuple(range(n, 2 * n))
    sums = tuple((0x9E3779B97F4A7C15 * (i + 1)) & ((1 << 64) - 1) for i in range(n))
    handle = KVHandle(
        worker_id="p0", incarnation="i1", address="", block_ids=ids, num_tokens=16 * n,
        block_size=16, block_bytes=bb, dtype="uint8", lease_expires_unix_ms=0,
        block_checksums=sums, checksum_algorithm=WSUM64,
    )  # fmt: skip
    t = CudaIpcTransport(pool, bb, None, sums=False)  # type: ignore[arg-type]
    t.sums, t._cuda, t.mapped_count = True, True, True  # the CUDA path's host code
    t._staged.append(torch.zeros(max(4 * n + 1, 1024), dtype=torch.int64))

    def off() -> None:
        for s, d, k in block_runs(ids, dst):
            t.pool[d : d + k].copy_(src[s : s + k], non_blocking=True)

    def on() -> None:
        want = sender_sums(handle, ids)
        _, _, staged = t._copy_sum(src, ids, dst, want)
        t._staged.append(staged)  # back, as the fetch gives it once waited for

    a: list[float] = []
    b: list[float] = []
    for _ in range(9):
        a.append(per_call_us(off, calls))
        b.append(per_call_us(on, calls))
    return statistics.median(a), statistics.median(b)


if __name__ == "__main__":
    raise SystemExit(main())
