"""What checked KV costs: the block checksums of a hand-off (sender and receiver,
``engine.kv_checksum``) against the hand-off's own data movement, on the pool's device.

The hand-off is timed as the bytes it moves without any network: on CPU the gRPC-stream
transport's work (the sender gathers the blocks into bytes, the receiver copies them into its
pool); on a GPU a device-to-device copy of the blocks from one pool to another (what the CUDA
IPC path does on one GPU; to a second GPU when there is one). A real hand-off also crosses a
network or NVLink, so the share measured here is an upper bound.

    python -m bench.kv_checksum                     # CPU, SmolLM2-135M shape, float32
    python -m bench.kv_checksum --shape llama-3.1-8b --device cuda   # bf16 on the GPU

Prints a table; ``--out DIR`` also writes ``kv_checksum_<device>.json`` there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kv_checksum import ALGORITHMS, BlockChecksums

# (layers, kv heads, head dim) of the model shapes the benches use.
SHAPES = {"smollm2-135m": (30, 3, 64), "llama-3.1-8b": (32, 8, 128)}
BLOCK_SIZE = 16


def pool(shape: str, blocks: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    layers, heads, dim = SHAPES[shape]  # head-major, as the engine's pools (engine.kv_pool)
    return torch.randn(blocks, heads, layers, 2, BLOCK_SIZE, dim, device=device).to(dtype)


def timed(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Median seconds of ``fn`` (synchronised on a GPU)."""
    times = []
    for _ in range(repeat + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first run warms up


def measure(
    shape: str, tokens: int, device: str, dtype: torch.dtype, repeat: int, algorithm: str | None
) -> dict:
    n = -(-tokens // BLOCK_SIZE)
    src = pool(shape, 2 * n, device, dtype)
    dst_device = "cuda:1" if device == "cuda" and torch.cuda.device_count() > 1 else device
    dst = torch.zeros_like(src, device=dst_device)
    src_ids = list(range(0, 2 * n, 2))  # scattered, as a pool's free list hands them out
    dst_ids = list(range(1, 2 * n, 2))
    si = torch.tensor(src_ids, device=device)
    di = torch.tensor(dst_ids, device=dst_device)

    if device == "cpu":

        def handoff() -> None:
            data = [b.numpy().tobytes() for b in src.index_select(0, si).view(torch.uint8)]
            for i, raw in zip(dst_ids, data, strict=True):
                dst[i].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
                             .view(dst.shape[1:]))  # fmt: skip
    else:

        def handoff() -> None:
            dst.index_copy_(0, di, src.index_select(0, si).to(dst_device, non_blocking=True))

    send, receive = BlockChecksums(src, algorithm), BlockChecksums(dst, algorithm)
    handoff()
    assert send(src_ids) == receive(dst_ids)  # the copy is exact, and so are the checksums
    t_handoff = timed(handoff, device, repeat)
    t_send = timed(lambda: send(src_ids), device, repeat)
    t_receive = timed(lambda: receive(dst_ids), device, repeat)
    block_bytes = src[0].numel() * src.element_size()
    return {
        "algorithm": send.algorithm, "shape": shape,
        "dtype": str(dtype).removeprefix("torch."), "device": device,
        "dst_device": dst_device, "tokens": tokens, "blocks": n, "block_bytes": block_bytes,
        "handoff_ms": round(t_handoff * 1e3, 3), "checksum_send_ms": round(t_send * 1e3, 3),
        "checksum_receive_ms": round(t_receive * 1e3, 3),
        "overhead": round((t_send + t_receive) / t_handoff, 4),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default=None,
        help="the block checksum (default: the device's own, as workers send it)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    rows = [
        measure(args.shape, t, args.device, dtype, args.repeat, args.algorithm) for t in args.tokens
    ]
    print(f"checksum: {rows[0]['algorithm']}")
    print(f"{'tokens':>7} {'blocks':>6} {'hand-off ms':>12} {'send ms':>8} {'recv ms':>8} "
          f"{'overhead':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>7} {r['blocks']:>6} {r['handoff_ms']:>12.3f} "
              f"{r['checksum_send_ms']:>8.3f} {r['checksum_receive_ms']:>8.3f} "
              f"{r['overhead']:>9.1%}")  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"kv_checksum_{args.device}_{rows[0]['algorithm']}.json"
        path.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
