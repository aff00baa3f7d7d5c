"""Checked KV over CUDA IPC between two processes, on one GPU or across two (issue 18).

A child process exports a pool as a GPU prefill worker does (`bench.kv_peer.export`: blocks of
the 8B shape, 2 MiB each, filled with a known pattern). This process maps it through the
decode side's own `CudaIpcTransport`, as a decode worker maps its prefill worker's pool: the
real CUDA IPC mapping, nothing stood in for. For one contiguous run and for scattered blocks
of a prompt of each size it measures:

- **the check on the hand-off's path:** wall time of ``fetch`` + ``verify`` with sums on
  against sums off (one ``cudaMemcpy`` a run, the copy kernel for scattered blocks), A/B
  interleaved (`lab.kv_check_ab.paired`). Sums on, a run from the same GPU takes the SM copy
  that sums on its way, a run from another GPU the copy engines in chunks, each summed where
  it landed (`CudaIpcTransport._check_peer_runs`), and scattered blocks the copy-and-sum
  kernel; the compare goes behind;
- **device time on the run** (CUDA events): one ``copy_`` (what sums off runs: between two
  GPUs a peer copy by the copy engines over the link), the SM checked run (copy, sum,
  compare), a read-only ``wsum64`` of what landed, and the copy-engine chunks with their
  trailing sums and compare.

On one GPU every copy and every sum is bound by HBM, and the SM copy is a few percent slower
than the copy engine's (bench/results/kv_checksum_cpu.md). Between two GPUs the link bounds
the copy, and this GPU reads what landed about ten times faster than the link brings it; but
the link copy slows while a sum reads beside it (two H100s: to about 70%), which is what the
copy-engine path's chunk sizes and side-sum programs trade against (``--trail`` sets them for a
run, ``TRAILS`` sweeps them). ``--timeline N`` profiles N fetches each way and says op by op
where the checked one's time goes (`lab.kv_timeline`).

    python -m lab.kv_check_peer --src cuda:0 --dst cuda:1 --tokens 1024 2048 4096 \\
        --pairs 200 --stack-handoff-ms 2048=0.78 4096=0.94 --out DIR
    python -m lab.kv_check_peer shares DIR/kv_check_peer.json ON/results.json OFF/results.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kernels
from bench import kv_peer
from bench.kv_peer import pattern_sums
from lab import kv_timeline
from lab.kv_check_ab import paired, sm_check, transport_arms
from lab.timing import device_time
from libkv.transfer import CUDA_IPC_KEY, cuda_ipc_checks

BLOCK_SIZE = 16  # tokens a block
# (last chunk MiB, ratio, largest chunk MiB or 0, side-sum programs per multiprocessor) of
# the copy-engine path, tried beside the installed ones (`cuda_ipc_checks`: TRAIL_BYTES,
# TRAIL_RATIO, TRAIL_MAX_BYTES, SIDE_PER_SM; 0 a multiprocessor: as fast as the device reads).
# Session 12 on two H100s: the link copy slows to ~70% while a full-speed sum reads beside it;
# sums by fewer programs on uncapped chunks could not keep up (1.15-2.6x the copy_), equal
# chunks at full speed gained nothing, and 2 programs a multiprocessor on chunks of at most
# 64-128 MiB gained 20-45 us of device time (128 MiB installed since).
TRAILS = ((16, 4, 0, 0), (16, 4, 64, 2), (16, 4, 64, 1), (16, 4, 128, 1), (16, 4, 128, 2),
          (8, 4, 64, 2), (16, 4, 64, 0))  # fmt: skip
# One 16-token block of the Llama-3.1-8B shape: 32 layers x 8 KV heads x 128 x (K, V) x bf16.
BLOCK_BYTES_8B = 16 * 32 * 8 * 128 * 2 * 2


def device_times(
    dst: torch.Tensor, src: torch.Tensor, start: int, n: int, want: list[int], repeat: int
) -> dict:
    """Device ms on one run of ``n`` blocks from ``src[start:]`` to ``dst[:n]``: the plain
    ``copy_``; the SM check of runs (`sm_check`); a read-only ``wsum64`` of the landed
    blocks; the copy-engine path (`trailing_check`), its chunked copies without the sums, and
    that path by other (last chunk, ratio, largest chunk, side-sum programs a multiprocessor)
    choices (``TRAILS``); ratios over the ``copy_``."""
    dev = dst.device
    copy_s = device_time(lambda: dst[:n].copy_(src[start : start + n], non_blocking=True),
                         "cuda", repeat)  # fmt: skip
    check, sums, host = sm_check(dst, src, start, n, want)
    check_s = device_time(check, "cuda", repeat)
    if int(host[n]) != 0 or int(sums.count_nonzero()):
        raise AssertionError(f"the check of a clean run counted {int(host[n])}")
    ids = torch.arange(n, device=dev)
    sum_s = device_time(lambda: kernels.block_wsum64(dst.view(torch.int64), ids), "cuda", repeat)
    trail_s = device_time(trailing_check(dst, src, start, n, want), "cuda", repeat)
    nbytes = n * dst.shape[1]
    chunks = cuda_ipc_checks.peer_chunks(n, dst.shape[1])

    def chunked() -> None:  # the same copies without the sums
        for off, c in chunks:
            dst[off : off + c].copy_(src[start + off : start + off + c], non_blocking=True)

    chunked_s = device_time(chunked, "cuda", repeat)
    sweep = {}
    kept = trail_config()
    try:
        for trail in TRAILS:
            set_trail(*trail)
            secs = device_time(trailing_check(dst, src, start, n, want), "cuda", repeat)
            sweep["{}MiB_x{}_max{}_{}sm".format(*trail)] = round(secs / copy_s, 4)
    finally:
        set_trail(*kept)
    return {
        "peer_chunks": [c for _, c in chunks],
        "chunked_copy_over_copy": round(chunked_s / copy_s, 4),
        "trailing_check_by_trail_and_ratio": sweep,
        "device_trailing_check_ms": round(trail_s * 1e3, 4),
        "trailing_check_over_copy": round(trail_s / copy_s, 4),
        "device_copy_ms": round(copy_s * 1e3, 4),
        "copy_gb_s": round(nbytes / copy_s / 1e9, 1),
        "device_checked_run_ms": round(check_s * 1e3, 4),
        "checked_run_over_copy": round(check_s / copy_s, 4),
        "device_landed_sum_ms": round(sum_s * 1e3, 4),
        "landed_sum_over_copy": round(sum_s / copy_s, 4),
    }


def trail_config() -> tuple[int, int, int, int]:
    """The copy-engine path's (last chunk MiB, ratio, largest chunk MiB, side-sum programs a
    multiprocessor)."""
    c = cuda_ipc_checks
    return c.TRAIL_BYTES >> 20, c.TRAIL_RATIO, c.TRAIL_MAX_BYTES >> 20, c.SIDE_PER_SM


def set_trail(trail_mib: int, ratio: int, max_mib: int, per_sm: int) -> None:
    c = cuda_ipc_checks
    c.TRAIL_BYTES, c.TRAIL_RATIO, c.TRAIL_MAX_BYTES = trail_mib << 20, ratio, max_mib << 20
    c.SIDE_PER_SM = per_sm


def trailing_check(
    dst: torch.Tensor, src: torch.Tensor, start: int, n: int, want: list[int]
) -> Callable[[], Any]:
    """The checked run as `CudaIpcTransport` takes it from a pool on another GPU
    (`_check_peer_runs`: copy-engine copies in chunks, each summed where it landed on a side
    stream, the compare behind, the current stream joined to it), on the current stream."""
    from libkv.transfer.cuda_ipc import CudaIpcTransport

    t = CudaIpcTransport(dst, dst.shape[1], None, sums=True)  # type: ignore[arg-type]
    runs = [(start, 0, n)]

    def check() -> Any:
        _, count, staged = t._check_peer_runs(src, runs, n, want)
        t._staged.append(staged)  # the same pinned buffer every time: the same sums go in
        return count

    count = check()
    torch.cuda.synchronize(dst.device)
    if int(count) != 0:
        raise AssertionError(f"the trailing check of a clean run counted {int(count)}")
    return check


def interference(
    dst: torch.Tensor, src: torch.Tensor, start: int, n: int, want: list[int], reps: int
) -> dict:
    """What a hand-off of the run costs the decode worker's own work meanwhile: a stand-in for
    its decode steps (a CUDA graph of 8-row products with a 4096 x 14336 bf16 weight, the 8B
    shape's down projection at batch 8, memory-bound like a decode step) replayed on its own
    stream, timed alone and while a hand-off runs on another: the plain ``copy_`` (copy
    engines), the SM copy that sums (`kernels.runs_copy_sum`, the one-GPU check) and the
    copy-engine chunks with their trailing sums (`trailing_check`, the two-GPU check). Median
    of ``reps`` of each; the stand-in is queued first, the hand-off right behind it."""
    dev = dst.device
    w = torch.randn(14336, 4096, device=dev, dtype=torch.bfloat16)
    x = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16)
    victim, handoff = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(victim):
        torch.nn.functional.linear(x, w)  # cuBLAS's workspace before the capture
        with torch.cuda.graph(graph, stream=victim):
            for _ in range(32):
                torch.nn.functional.linear(x, w)
    arms: dict[str, Callable[[], object] | None] = {
        "alone": None,
        "copy_": lambda: dst[:n].copy_(src[start : start + n], non_blocking=True),
        "sm_check": sm_check(dst, src, start, n, want)[0],
        "ce_check": trailing_check(dst, src, start, n, want),
    }
    out = {}
    for name, arm in arms.items():
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(dev)
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(victim):
                t0.record()
                graph.replay()
                t1.record()
            if arm is not None:  # queued while the stand-in runs, as a hand-off arrives
                with torch.cuda.stream(handoff):
                    arm()
            torch.cuda.synchronize(dev)
            times.append(t0.elapsed_time(t1))
        out[name] = statistics.median(times[1:])
    alone = out["alone"]
    return {"victim_alone_ms": round(alone, 4)} | {
        f"victim_with_{k}": round(v / alone, 4) for k, v in out.items() if k != "alone"
    }


# (largest chunk MiB or 0, side-sum programs a multiprocessor or 0) of the pushed checks
# (`push_times`), the last chunk and ratio as installed.
PUSHES = ((128, 2), (128, 1), (128, 0), (64, 1), (0, 0), (0, 1))


def push_times(
    dst: torch.Tensor, src: torch.Tensor, local: torch.Tensor, start: int, n: int,
    want: list[int], repeat: int,
) -> dict:  # fmt: skip
    """Pull against push for one run between two GPUs, device time over a pulled ``copy_``.

    The transport pulls: its ``copy_`` from the mapped pool runs on this GPU's copy engines,
    and while this GPU's sums read the landed chunks that copy slows (two H100s: to ~70%). A
    push queues the copy on a stream of the *source* GPU (``local``: a pool of this process
    there, filled as the peer's), so that GPU's copy engines write over the link into this
    one's memory; each chunk's landing is an event this GPU's side stream waits for before
    its sum, the last chunk summed on the current stream behind the side stream's, as
    `trailing_check` does. Arms: the plain copy each way, the chunked copies without sums
    each way, the installed check pulled and pushed, and the pushed check by ``PUSHES``
    (largest chunk, side-sum programs a multiprocessor). Each arm starts behind the previous
    call's work (an event of this GPU's current stream) and ends on it; each checked arm's
    sums are compared with the sender's first."""
    from libkv.transfer.fetch_checks import signed64

    dev, sdev = dst.device, local.device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    main = torch.cuda.current_stream(dev)
    pull_stream, push_stream = torch.cuda.Stream(dev), torch.cuda.Stream(sdev)
    side, idle = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    sums = torch.zeros(n, dtype=torch.int64, device=dev)
    expect = torch.tensor(signed64(want), dtype=torch.int64, device=dev)
    full = kernels.run_wsum64(dst, sums)

    def arm(push: bool, chunks: list[tuple[int, int]] | None, per_sm: int = -1):
        copier = push_stream if push else pull_stream
        source = local if push else src
        side_sum = None if per_sm < 0 else kernels.run_wsum64(dst, sums, programs=per_sm * sms)
        parts = chunks or [(0, n)]

        def go() -> None:
            if side_sum is not None:
                sums.zero_()
            ready = torch.cuda.Event()
            ready.record(main)
            copier.wait_event(ready)
            for i, (off, c) in enumerate(parts):
                with torch.cuda.stream(copier):
                    if push:  # torch copies between GPUs on the source's current stream;
                        with torch.cuda.stream(idle):  # an idle one here: no barrier on main
                            dst[off : off + c].copy_(source[start + off : start + off + c],
                                                     non_blocking=True)  # fmt: skip
                    else:
                        dst[off : off + c].copy_(source[start + off : start + off + c],
                                                 non_blocking=True)  # fmt: skip
                landed = torch.cuda.Event()
                landed.record(copier)
                if side_sum is None:
                    continue
                if i < len(parts) - 1:
                    side.wait_event(landed)
                    with torch.cuda.stream(side):
                        side_sum(off, c, off)
                else:
                    main.wait_event(landed)
                    main.wait_stream(side)
                    with torch.cuda.stream(main):
                        full(off, c, off)
            if side_sum is None:
                main.wait_event(landed)

        return go

    def chunks(max_mib: int) -> list[tuple[int, int]]:
        kept = trail_config()
        try:
            set_trail(kept[0], kept[1], max_mib, kept[3])
            return cuda_ipc_checks.peer_chunks(n, dst.shape[1])
        finally:
            set_trail(*kept)

    installed = trail_config()
    arms = {
        "pull_copy": arm(False, None),
        "push_copy": arm(True, None),
        "pull_chunks": arm(False, chunks(installed[2])),
        "push_chunks": arm(True, chunks(installed[2])),
        "pull_check": arm(False, chunks(installed[2]), installed[3]),
        "push_check": arm(True, chunks(installed[2]), installed[3]),
    }
    for max_mib, per_sm in PUSHES:
        arms[f"push_check_max{max_mib}_{per_sm}sm"] = arm(True, chunks(max_mib), per_sm)
    with torch.cuda.device(dev):
        for name, go in arms.items():  # first: what each checked arm sums is what was sent
            if "check" in name:
                dst[:n].zero_()
                go()
                torch.cuda.synchronize(dev)
                if not torch.equal(sums, expect):
                    raise AssertionError(f"{name}: the sums of what landed differ from sent")
        secs = {name: device_time(go, "cuda", repeat) for name, go in arms.items()}
    base = secs["pull_copy"]
    return {"pull_copy_ms": round(base * 1e3, 4)} | {
        f"{name}_over_pull_copy": round(s / base, 4) for name, s in secs.items()
    }


def measure(
    args: argparse.Namespace, extra: dict[str, str], dst_pool: torch.Tensor,
    local: torch.Tensor | None = None,
) -> list[dict]:  # fmt: skip
    from libkv.transfer.cuda_ipc import IpcPool, open_pool

    dev, bb = dst_pool.device, args.block_bytes
    records = kv_peer.StaticRecords({"p0": extra})
    # The same mapping the transports open (torch keeps one per handle and process).
    src = open_pool(IpcPool.from_json(extra[CUDA_IPC_KEY]), dev)
    most = max(args.tokens) // BLOCK_SIZE
    rng = np.random.default_rng(0)
    rows = []
    for tokens in args.tokens:
        n = tokens // BLOCK_SIZE
        run = list(range(most, most + n))
        scattered = rng.choice(2 * most, n, replace=False).tolist()
        row: dict = {"tokens": tokens, "blocks": n, "block_bytes": bb}
        for key, ids, dst_ids in (
            ("ab_run", run, list(range(n))),
            ("ab_scattered", scattered, rng.choice(most, n, replace=False).tolist()),
        ):
            want = pattern_sums(ids, bb, dev)
            off, on, counters = transport_arms(dst_pool, None, ids, dst_ids, want, records)
            row[key] = paired(off, on, args.pairs)
            if args.timeline and key == "ab_run":
                row["timeline"] = timeline(off, on, tokens, args)
            row[key] |= counters()
            row[key]["of_a"] = round(row[key]["overhead_ms"] / row[key]["a_ms"], 4)
            landed = dst_pool[torch.tensor(dst_ids, device=dev)].view(torch.int64)
            first = kv_peer.expected_block(ids[0], bb, dev)
            if not torch.equal(landed[0], first):
                raise AssertionError(f"{key}: the first block did not land as sent")
        row |= device_times(dst_pool, src, most, n, pattern_sums(run, bb, dev), args.repeat)
        if local is not None:
            row["push"] = push_times(dst_pool, src, local, most, n, pattern_sums(run, bb, dev),
                                     args.repeat)  # fmt: skip
            print(f"  {tokens}: pull / push, x a pulled copy_: {row['push']}", file=sys.stderr,
                  flush=True)  # fmt: skip
        if args.interference:
            row["interference"] = interference(
                dst_pool, src, most, n, pattern_sums(run, bb, dev), args.interference
            )
            print(f"  {tokens}: decode stand-in beside the hand-off: {row['interference']}",
                  file=sys.stderr, flush=True)  # fmt: skip
        stack = args.stack_handoff_ms.get(tokens)
        if stack:
            row["stack_handoff_ms"] = stack
            for key in ("ab_run", "ab_scattered"):
                row[key]["of_stack_handoff"] = round(row[key]["overhead_ms"] / stack, 4)
        rows.append(row)
        print(line(row), flush=True)
        sweep = row["trailing_check_by_trail_and_ratio"]
        print(f"  {tokens}: chunks {row['peer_chunks']}, the chunked copy_ alone x "
              f"{row['chunked_copy_over_copy']}, the trailing check by (last chunk, ratio, "
              f"max, per SM) x {sweep}", file=sys.stderr, flush=True)  # fmt: skip
    return rows


HEADER = (
    "| tokens | copy_ ms (GB/s) | SM checked run, x copy_ | landed sum, x copy_ "
    "| copy_ chunks + trailing sums, x copy_ | run: off / on ms "
    "| run: check +ms [q1, q3] | of off | of stack | scattered: off / on ms "
    "| scattered: +ms [q1, q3] | of off | of stack |"
)


def timeline(off: Callable[[], float], on: Callable[[], float], tokens: int,
             args: argparse.Namespace) -> dict:  # fmt: skip
    """Op by op, where the checked run's ``fetch`` + ``verify`` spends its time against the
    plain one's (`lab.kv_timeline`), ``args.timeline`` windows of each; the trace goes
    beside the results, gzipped."""
    import gzip

    trace = (args.out or Path("/tmp")) / f"timeline_{tokens}.json"
    wins = kv_timeline.profile({"off": off, "on": on}, args.timeline, trace)
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as z:
        z.write(f.read())
    trace.unlink()
    out = {name: kv_timeline.summary(w) for name, w in wins.items()}
    for name, s in out.items():
        print(kv_timeline.table(f"  {tokens} tokens, sums {name}", s), file=sys.stderr,
              flush=True)  # fmt: skip
    return out


def line(r: dict) -> str:
    cells = [
        str(r["tokens"]),
        f"{r['device_copy_ms']:.4f} ({r['copy_gb_s']:.0f})",
        f"{r['device_checked_run_ms']:.4f}, {r['checked_run_over_copy']:.3f}",
        f"{r['device_landed_sum_ms']:.4f}, {r['landed_sum_over_copy']:.3f}",
        f"{r['device_trailing_check_ms']:.4f}, {r['trailing_check_over_copy']:.3f}",
    ]
    for key in ("ab_run", "ab_scattered"):
        a = r[key]
        stack = a.get("of_stack_handoff")
        cells += [
            f"{a['a_ms']:.4f} / {a['b_ms']:.4f}",
            f"{a['overhead_ms']:+.4f} [{a['overhead_q1_ms']:+.4f}, {a['overhead_q3_ms']:+.4f}]",
            f"{a['of_a']:.1%}",
            "-" if stack is None else f"{stack:.1%}",
        ]
    return "| " + " | ".join(cells) + " |"


def handoff_ms(items: list[str]) -> dict[int, float]:
    """``TOKENS=MS`` pairs: the stack's hand-off mean per prompt size (the shares' base)."""
    out = {}
    for item in items:
        tokens, _, ms = item.partition("=")
        out[int(tokens)] = float(ms)
    return out


def stack_handoffs(path: Path) -> dict[int, dict]:
    """Prompt tokens -> the hand-off report (`bench.handoff`) of each run of a ``tandem bench``
    results file whose workloads have fixed lengths, one rate each."""
    d = json.loads(path.read_text())
    lengths = [w["input_len"] for w in d["workloads"]]
    runs = [r for r in d["runs"] if r.get("handoff")]
    return {n: r["handoff"] for n, r in zip(lengths, runs, strict=False)}


def shares(peer: Path, stack_on: Path, stack_off: Path) -> str:
    """The check's cost at the transport (``peer``, this bench's JSON) as a share of the
    stack's hand-off with checksums on, beside the stack's own figures on and off."""
    rows = {r["tokens"]: r for r in json.loads(peer.read_text())["rows"]}
    on, off = stack_handoffs(stack_on), stack_handoffs(stack_off)
    out = [
        "| tokens | stack hand-off mean ms, on / off | p50 ms, on / off | GB/s, on / off "
        "| first gap p50 ms, on / off | transfers (failed, recomputed), on / off "
        "| run: check +ms, of hand-off | scattered: check +ms, of hand-off |",
        "|" + "---|" * 8,
    ]
    for tokens in sorted(set(on) & set(rows)):
        a, b, r = on[tokens], off.get(tokens, {}), rows[tokens]
        mean = a["mean_ms"]

        def pair(key: str, fmt: str, a=a, b=b) -> str:
            return " / ".join("-" if x.get(key) is None else format(x[key], fmt) for x in (a, b))

        done = " / ".join(f"{x.get('transfers', '-')} ({x.get('failures', '-')}, "
                          f"{x.get('recomputed', '-')})" for x in (a, b))  # fmt: skip
        cells = [str(tokens), pair("mean_ms", ".3f"), pair("p50_ms", ".3f"),
                 pair("gbytes_per_s", ".1f"), pair("first_gap_p50_ms", ".1f"), done]  # fmt: skip
        for key in ("ab_run", "ab_scattered"):
            ms = r[key]["overhead_ms"]
            cells.append(f"{ms * 1e3:+.1f} us, {ms / mean:.1%}" if mean else f"{ms * 1e3:+.1f} us")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["shares"]:  # shares PEER_JSON STACK_ON_JSON STACK_OFF_JSON
        print(shares(*map(Path, argv[1:4])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--src", default="cuda:0", help="the exporting (prefill) process's GPU")
    p.add_argument("--dst", default=None, help="this (decode) process's GPU; default: cuda:1 "
                   "where there are two, else cuda:0 (two processes on one GPU)")  # fmt: skip
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--block-bytes", type=int, default=BLOCK_BYTES_8B)
    p.add_argument("--pairs", type=int, default=200, help="interleaved A/B pairs a row")
    p.add_argument("--repeat", type=int, default=20, help="calls a device-time measurement")
    p.add_argument("--stack-handoff-ms", nargs="*", default=[], metavar="TOKENS=MS",
                   help="the stack's hand-off mean per prompt size (bench/handoff.py)")  # fmt: skip
    p.add_argument("--interference", type=int, default=0, metavar="REPS",
                   help="also time a decode stand-in beside each kind of hand-off")  # fmt: skip
    p.add_argument("--trail", type=int, nargs=4, default=None,
                   metavar=("MIB", "RATIO", "MAX_MIB", "PER_SM"),
                   help="the copy-engine path's last chunk, ratio, largest chunk and side-sum "
                   "programs per SM for this run (default: cuda_ipc_checks')")  # fmt: skip
    p.add_argument("--timeline", type=int, default=0, metavar="REPS",
                   help="also profile REPS fetches of the run each way, op by op")  # fmt: skip
    p.add_argument(
        "--push",
        action="store_true",
        help="also time copies pushed by the source GPU's copy engines (push_times)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.stack_handoff_ms = handoff_ms(args.stack_handoff_ms)
    if args.trail:
        set_trail(*args.trail)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dst = torch.device(args.dst or ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"))
    torch.cuda.set_device(dst)
    most = max(args.tokens) // BLOCK_SIZE
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=kv_peer.export, args=(child, args.src, 2 * most, args.block_bytes), daemon=True
    )
    proc.start()
    try:
        extra = conn.recv()
        pool = torch.zeros(most, args.block_bytes, dtype=torch.uint8, device=dst)
        where = f"{args.src} -> {dst} ({torch.cuda.get_device_name(dst)})"
        print(f"checked KV over CUDA IPC between two processes, {where}", flush=True)
        print(HEADER, flush=True)
        local = None
        if args.push and torch.device(args.src) != dst:
            local = torch.empty(2 * most, args.block_bytes, dtype=torch.uint8, device=args.src)
            kv_peer.fill_pattern(local.view(-1))
        rows = measure(args, extra, pool, local)
    finally:
        conn.send("stop")
        conn.recv()
        proc.join(10)
    summary = {
        "src": args.src, "dst": str(dst), "device": torch.cuda.get_device_name(dst),
        "trail_mib_ratio_max_per_sm": trail_config(),
        "torch": torch.__version__, "pairs": args.pairs, "rows": rows,
        "median_run_of_off": statistics.median(r["ab_run"]["of_a"] for r in rows),
    }  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_check_peer.json").write_text(json.dumps(summary, indent=1))
        rule = "|" + "---|" * (HEADER.count("|") - 1)
        md = [f"# Checked KV over CUDA IPC, {where}", "", HEADER, rule, *map(line, rows)]
        (args.out / "kv_check_peer.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
