"""Which Triton copy of a contiguous run of KV blocks comes closest to one ``copy_`` on this
GPU (issue 18's checked KV on a contiguous run): the copy alone and the copy with its per-block
``wsum64``, by chunk size, warps, chunks a program and cache hints, as device time over one
``copy_`` of the same bytes (CUDA events, rounds interleaved). Exploration: the variants live
here; the winner goes into ``kernels.triton_copy``.

    python -m lab.kv_copy_sweep --tokens 1024 2048 4096 --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import kernels
from kernels import reference
from lab.timing import device_time

BLOCK_BYTES = (
    2 * 1024 * 1024
)  # the 8B shape's block: 16 tokens x 32 layers x 8 heads x 2 x 128 x 2 B


@triton.jit
def _sweep_kernel(src, dst, sums, words, per, CHUNK: tl.constexpr, SUM: tl.constexpr,
                  HINT: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    acc = tl.zeros([CHUNK], tl.int64)
    for c in range(per):
        offs = (j * per + c) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
        mask = offs < words
        if HINT:
            v = tl.load(src + i * words + offs, mask=mask, other=0, eviction_policy="evict_first")
            tl.store(dst + i * words + offs, v, mask=mask, cache_modifier=".cs")
        else:
            v = tl.load(src + i * words + offs, mask=mask, other=0)
            tl.store(dst + i * words + offs, v, mask=mask)
        if SUM:
            acc += v * (2 * offs + 1)
    if SUM:
        tl.atomic_add(sums + i, tl.sum(acc, axis=0), sem="relaxed")


@triton.jit
def _tma_kernel(src_desc, dst_desc, sums, rows, per, BR: tl.constexpr, W: tl.constexpr,
                SUM: tl.constexpr):  # fmt: skip
    """The same through the Tensor Memory Accelerator: ``BR`` rows of ``W`` words a step,
    global to shared to global by bulk copies (host-made descriptors over the pools seen as
    ``[blocks * rows, W]``)."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    acc = tl.zeros([BR, W], tl.int64)
    pos = (tl.arange(0, BR)[:, None] * W + tl.arange(0, W)[None, :]).to(tl.int64)
    for c in range(per):
        r = (j * per + c) * BR
        v = src_desc.load([i * rows + r, 0])
        dst_desc.store([i * rows + r, 0], v)
        if SUM:
            acc += v * (2 * (pos + r * W) + 1)
    if SUM:
        tl.atomic_add(sums + i, tl.sum(tl.sum(acc, axis=1), axis=0), sem="relaxed")


TMA = {  # name: (rows a step, num_warps, steps a program)
    "tma_r8_w4": (8, 4, 1),
    "tma_r8_w4_per4": (8, 4, 4),
    "tma_r16_w4": (16, 4, 1),
    "tma_r16_w8_per2": (16, 8, 2),
    "tma_r32_w8": (32, 8, 1),
}
TMA_W = 256  # words a row (the most one box dimension takes)


def tma_launcher(dst, src, sums, n, name, with_sum):
    from triton.tools.tensor_descriptor import TensorDescriptor

    br, warps, per = TMA[name]
    words = dst.shape[1] // 8
    rows = words // TMA_W
    s2 = src.view(torch.int64).view(-1, TMA_W)
    d2 = dst.view(torch.int64).view(-1, TMA_W)
    sd = TensorDescriptor.from_tensor(s2, [br, TMA_W])
    dd = TensorDescriptor.from_tensor(d2, [br, TMA_W])
    grid = (n, rows // (br * per))

    def run() -> None:
        _tma_kernel[grid](sd, dd, sums, rows, per, BR=br, W=TMA_W, SUM=with_sum,
                          num_warps=warps)  # fmt: skip

    return run


VARIANTS = {  # name: (CHUNK words, num_warps, chunks a program, hints)
    "c2048_w8": (2048, 8, 1, False),
    "c2048_w4_hint": (2048, 4, 1, True),
    "c2048_w8_per4": (2048, 8, 4, False),
}
ALL = [*VARIANTS, *TMA]


@triton.jit
def _l2_sum_kernel(words_ptr, sums, first, words, per, CHUNK: tl.constexpr):
    """Read-only ``wsum64`` of block ``first + i`` (program ``(i, j)``: its chunks ``j * per``
    on), added into ``sums[first + i]``: behind a DMA copy of those blocks, while they are
    still in L2."""
    i = (tl.program_id(0) + first).to(tl.int64)
    j = tl.program_id(1)
    acc = tl.zeros([CHUNK], tl.int64)
    for c in range(per):
        offs = (j * per + c) * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
        mask = offs < words
        v = tl.load(words_ptr + i * words + offs, mask=mask, other=0)
        acc += v * (2 * offs + 1)
    tl.atomic_add(sums + i, tl.sum(acc, axis=0), sem="relaxed")


L2_CHUNK, L2_PER = 2048, 4


def dma_l2_launcher(dst, src, sums, n, chunk_blocks, with_sum, side):
    """One ``copy_`` (DMA) per ``chunk_blocks`` blocks on the current stream, each followed on
    ``side`` (a second stream) by the read-only sum of the blocks it landed, so the sum of one
    chunk runs beside the copy of the next; the current stream then waits for ``side``."""
    from kernels.triton_launch import FastLaunch

    words = dst.shape[1] // 8
    d64 = dst.view(torch.int64)
    launch = FastLaunch(_l2_sum_kernel, "l2_sum")
    per_prog = L2_CHUNK * L2_PER
    cols = -(-words // per_prog)
    starts = list(range(0, n, chunk_blocks))
    events = [torch.cuda.Event() for _ in starts]
    dptr, sptr = d64.data_ptr(), sums.data_ptr()

    def run() -> None:
        main = torch.cuda.current_stream()
        for a, ev in zip(starts, events, strict=True):
            b = min(a + chunk_blocks, n)
            dst[a:b].copy_(src[a:b], non_blocking=True)
            if not with_sum:
                continue
            ev.record(main)
            side.wait_event(ev)
            with torch.cuda.stream(side):
                launch(
                    ("l2", words), (b - a, cols),
                    lambda a=a: (dptr, sptr, a, words, L2_PER, L2_CHUNK),
                    lambda a=a: ((d64, sums, a, words, L2_PER), {"CHUNK": L2_CHUNK}),
                    num_warps=8,
                )  # fmt: skip
        if with_sum:
            main.wait_stream(side)

    return run


DMA_CHUNKS = (2, 4, 8, 16, 0)  # blocks a DMA chunk (2 MiB each); 0: the whole run


def wall_time(fn, repeat: int) -> float:
    """Milliseconds from the host call to the device's end, one call at a time (launch and
    host overhead included), median of ``repeat``."""
    out = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def launcher(dst, src, sums, n, name, with_sum):
    chunk, warps, per, hint = VARIANTS[name]
    words = dst.shape[1] // 8
    grid = (n, -(-words // (chunk * per)))
    s64, d64 = src.view(torch.int64), dst.view(torch.int64)

    def run() -> None:
        _sweep_kernel[grid](s64, d64, sums, words, per, CHUNK=chunk, SUM=with_sum, HINT=hint,
                            num_warps=warps)  # fmt: skip

    return run


def measure(tokens: int, repeat: int, rounds: int, only: str | None = None) -> dict:
    n = tokens // 16
    src = torch.randint(0, 256, (n, BLOCK_BYTES), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    want = reference.block_wsum64(src.view(torch.int64), torch.arange(n, device="cuda"))
    sums = torch.zeros(n, dtype=torch.int64, device="cuda")
    arms = {"copy_": lambda: dst.copy_(src, non_blocking=True)}
    runs = kernels.runs_copy_sum(dst, src, sums)
    arms["runs_copy_sum"] = lambda: runs([(0, 0, n)])
    for name in [a for a in ALL if only is None or only in a]:
        for with_sum in (False, True):
            dst.zero_()
            sums.zero_()
            make = launcher if name in VARIANTS else tma_launcher
            try:
                fn = make(dst, src, sums, n, name, with_sum)
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # a variant this Triton or GPU refuses: say so, go on
                print(f"{name} (sum {with_sum}): {type(e).__name__}: {str(e)[:200]}")
                continue
            if not torch.equal(dst, src) or (with_sum and not torch.equal(sums, want)):
                raise AssertionError(f"{name} (sum {with_sum}) copied or summed wrong")
            arms[name + ("+sum" if with_sum else "")] = fn
    side = torch.cuda.Stream()
    for k in DMA_CHUNKS:
        for with_sum in (False, True):
            dst.zero_()
            sums.zero_()
            fn = dma_l2_launcher(dst, src, sums, n, k or n, with_sum, side)
            fn()
            torch.cuda.synchronize()
            if not torch.equal(dst, src) or (with_sum and not torch.equal(sums, want)):
                raise AssertionError(f"dma b{k} (sum {with_sum}) copied or summed wrong")
            arms[f"dma_b{k}" + ("+l2sum" if with_sum else "")] = fn
    times: dict[str, list[float]] = {k: [] for k in arms}
    walls: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(rounds):
        for k, fn in arms.items():
            times[k].append(device_time(fn, "cuda", repeat) * 1e3)
            walls[k].append(wall_time(fn, repeat))
    base = statistics.median(times["copy_"])
    ratio = {k: round(statistics.median(v) / base, 4) for k, v in times.items()}
    wbase = statistics.median(walls["copy_"])
    wall = {k: round(statistics.median(v) - wbase, 4) for k, v in walls.items()}
    return {"tokens": tokens, "blocks": n, "copy_ms": round(base, 4), "ratio": ratio,
            "copy_wall_ms": round(wbase, 4), "wall_over_ms": wall}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--only", default=None, help="only the SM variants whose name has this")
    args = p.parse_args(argv)
    rows = [measure(tokens, args.repeat, args.rounds, args.only) for tokens in args.tokens]
    names = list(dict.fromkeys(k for r in rows for k in r["ratio"]))
    print("device time over one copy_ of the same run (2 MiB blocks), medians of "
          f"{args.rounds} rounds of {args.repeat}")  # fmt: skip
    print(f"{'variant':<22}" + "".join(f"{r['tokens']:>9}" for r in rows))
    print(f"{'copy_ ms':<22}" + "".join(f"{r['copy_ms']:>9.4f}" for r in rows))
    for k in names:
        print(f"{k:<22}" + "".join(f"{r['ratio'].get(k, float('nan')):>9.3f}" for r in rows))
    print("\nwall time (host call to device end, one at a time) over one copy_'s, in us")
    print(f"{'copy_ wall ms':<22}" + "".join(f"{r['copy_wall_ms']:>9.4f}" for r in rows))
    for k in names:
        over = [r["wall_over_ms"].get(k, float("nan")) * 1e3 for r in rows]
        print(f"{k:<22}" + "".join(f"{x:>9.1f}" for x in over))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_copy_sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
