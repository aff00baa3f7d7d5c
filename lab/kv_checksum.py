"""What checked KV costs: the block checksums of a hand-off (``engine.kv_checksum``) against the
hand-off's own data movement, on the pool's device.

The hand-off is timed as the bytes it moves without any network: on CPU the gRPC-stream
transport's work (the sender gathers the blocks into bytes, the receiver copies them into its
pool); on one GPU the CUDA IPC transport's copy (``kernels.copy_blocks_between``, one Triton
launch that reads each block once and writes it once); to a second GPU, when there is one, a
gather and a peer copy. Every real transport is at most that fast, so each share below is an
upper bound. Two figures per prompt size:

- ``all sums``: the checksum of every block on the sender *and* on the receiver, against the
  copy: what checked KV costs in all (the sender's part now runs when blocks are sealed, spread
  over the prefill's steps; on a GPU it is the kernel at ``sum GB/s``).
- ``on path``: what checked KV adds to the hand-off itself now. Sender: the blocks the prefill's
  last step sealed (``--chunk-tokens`` of them at most: the hand-off reads the sums after them),
  reading every kept sum and summing a partial last block. Receiver: summing every block that
  arrived and comparing (the verification, which has to read every byte once).

On one GPU, with ``wsum64``, also the check the CUDA IPC transport runs: the device time of
its fused copy+sum (and with the compare and count) over the plain copy kernel, and its wall
time against the bare copy, A/B interleaved in the same run (`lab.kv_check_ab`: the device
work by hand, and `CudaIpcTransport.fetch` + ``verify`` with sums off and on), as a share of
the bare copy and of the serving stack's CUDA IPC hand-off (``--stack-handoff-ms``).

    python -m lab.kv_checksum                     # CPU, SmolLM2-135M shape, float32
    python -m lab.kv_checksum --shape llama-3.1-8b --device cuda   # bf16 on the GPU
    python -m lab.kv_checksum --dry-run           # every path this machine can run, tiny

Prints a table; ``--out DIR`` also writes ``kv_checksum_<device>_<algorithm>.json`` there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

import kernels
from engine.kv_checksum import ALGORITHMS, WSUM64, BlockChecksums, SealedSums
from lab import kv_check_ab
from lab.timing import device_time, timed

# (layers, kv heads, head dim) of the model shapes the benches use.
SHAPES = {"smollm2-135m": (30, 3, 64), "llama-3.1-8b": (32, 8, 128)}
BLOCK_SIZE = 16


def pool(shape: str, blocks: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    layers, heads, dim = SHAPES[shape]  # head-major, as the engine's pools (engine.kv_pool)
    return torch.randn(blocks, heads, layers, 2, BLOCK_SIZE, dim, device=device).to(dtype)


def last_step_blocks(tokens: int, chunk: int) -> list[int]:
    """Full blocks of a ``tokens`` prompt that its last prefill step (``chunk`` tokens a step)
    completes: their seals run just before the hand-off reads the sums."""
    last = tokens % chunk or chunk
    return [i for i in range(tokens // BLOCK_SIZE) if (i + 1) * BLOCK_SIZE > tokens - last]


def handoff_fn(src, dst, src_ids, dst_ids, device: str) -> Callable[[], None]:
    si = torch.tensor(src_ids, device=src.device)
    di = torch.tensor(dst_ids, device=dst.device)
    if device == "cpu":

        def handoff() -> None:
            data = [b.numpy().tobytes() for b in src.index_select(0, si).view(torch.uint8)]
            for i, raw in zip(dst_ids, data, strict=True):
                dst[i].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(src.dtype)
                             .view(dst.shape[1:]))  # fmt: skip

        return handoff
    if dst.device == src.device:  # what CudaIpcTransport runs (its source a mapped peer pool)
        s8, d8 = src.view(src.shape[0], -1).view(torch.uint8), dst.view(dst.shape[0], -1)
        return lambda: kernels.copy_blocks_between(d8.view(torch.uint8), s8, si, di)
    return lambda: dst.index_copy_(0, di, src.index_select(0, si).to(dst.device))


def measure(
    shape: str,
    tokens: int,
    device: str,
    dtype: torch.dtype,
    repeat: int,
    algorithm: str | None,
    chunk: int,
    ab: tuple[int, float] = (0, 0.0),
) -> dict:
    """One prompt size's figures; ``ab``: (pairs, the stack's hand-off ms) of the A/B of the
    CUDA IPC check (no pairs: not run; off CUDA only its kernel arms, on the references)."""
    n = -(-tokens // BLOCK_SIZE)
    src = pool(shape, 2 * n, device, dtype)
    dst_device = "cuda:1" if device == "cuda" and torch.cuda.device_count() > 1 else device
    dst = torch.zeros_like(src, device=dst_device)
    src_ids = list(range(0, 2 * n, 2))  # scattered, as a pool's free list hands them out
    dst_ids = list(range(1, 2 * n, 2))
    handoff = handoff_fn(src, dst, src_ids, dst_ids, device)
    send, receive = BlockChecksums(src, algorithm), BlockChecksums(dst, algorithm)
    handoff()
    assert send(src_ids) == receive(dst_ids)  # the copy is exact, and so are the checksums
    sealed = SealedSums(send, src.shape[0])
    full = [src_ids[i] for i in range(tokens // BLOCK_SIZE)]
    mask = [i < len(full) for i in range(n)]
    last = [src_ids[i] for i in last_step_blocks(tokens, chunk)]
    sealed.seal(full)
    assert sealed.read(src_ids, mask) == send(src_ids)  # kept sums and the partial block

    def at_handoff() -> list[int]:  # the sender, once the prefill's last step is done
        sealed.seal(last)
        return sealed.read(src_ids, mask)

    t_handoff = timed(handoff, device, repeat)
    t_send = timed(lambda: send(src_ids), device, repeat)
    t_receive = timed(lambda: receive(dst_ids), device, repeat)
    t_at_handoff = timed(at_handoff, device, repeat)
    si = torch.tensor(src_ids, device=device)
    d_copy = device_time(handoff, device, repeat)
    d_sum = device_time(lambda: send.on_device(si), device, repeat)
    row = {
        "algorithm": send.algorithm, "shape": shape,
        "dtype": str(dtype).removeprefix("torch."), "device": device,
        "dst_device": dst_device, "tokens": tokens, "blocks": n,
        "block_bytes": src[0].numel() * src.element_size(), "chunk_tokens": chunk,
        "handoff_ms": round(t_handoff * 1e3, 3), "checksum_send_ms": round(t_send * 1e3, 3),
        "checksum_receive_ms": round(t_receive * 1e3, 3),
        "sender_at_handoff_ms": round(t_at_handoff * 1e3, 3),
        "blocks_sealed_in_last_step": len(last), "partial_last_block": n > len(full),
        "all_sums": round((t_send + t_receive) / t_handoff, 4),
        "on_path": round((t_at_handoff + t_receive) / t_handoff, 4),
        "device_copy_ms": round(d_copy * 1e3, 4), "device_sum_ms": round(d_sum * 1e3, 4),
        "sum_gb_s": round(n * src[0].numel() * src.element_size() / d_sum / 1e9, 1),
    }  # fmt: skip
    if send.algorithm == WSUM64 and device == "cuda":  # the torch version it replaced
        words = src.view(src.shape[0], -1).view(torch.uint8).view(torch.int64)
        d_ref = device_time(lambda: kernels.reference.block_wsum64(words, si), device, repeat)
        row["device_torch_sum_ms"] = round(d_ref * 1e3, 4)
    pairs, stack_ms = ab
    if send.algorithm == WSUM64 and dst.device == src.device and pairs:
        row.update(
            kv_check_ab.checked_copy(
                src, dst, src_ids, dst_ids, send(src_ids), repeat, pairs, stack_ms
            )
        )
    return row


def measure_engine(model_dir: str, tokens: int, repeat: int, chunk: int) -> dict:
    """The same figures inside real engines (a prefill engine that seals, as a prefill worker
    runs it, and a decode engine): one prompt prefilled in steps of ``chunk`` tokens, then the
    hand-off's byte work on the gRPC stream's path (``read_blocks`` on the sender,
    ``write_blocks`` on the receiver) against the sender's checksums at hand-off
    (``handoff_checksums``: kept sums, a partial last block summed) and the receiver's check."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    def engine(seal: bool) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model_dir=model_dir, max_num_batched_tokens=chunk, seal_checksums=seal,
                num_kv_blocks=2 * -(-tokens // BLOCK_SIZE) + 8,
            )
        )  # fmt: skip

    prefill, decode = engine(True), engine(False)
    prompt = [(7 * i) % 1000 + 100 for i in range(tokens)]
    prefill.add_request("b", prompt, SamplingParams(max_tokens=2), hold_kv=True)
    while prefill.has_unfinished():
        prefill.step()
    src = prefill.handoff.held_block_ids("b")
    dst, _ = decode.handoff.reserve("b", prompt)

    def handoff() -> None:
        decode.handoff.write_blocks(dst, prefill.handoff.read_blocks(src))

    handoff()
    full = [i for i in src if prefill.pool.blocks[i].sealed]
    assert prefill.handoff.handoff_checksums(src) == decode.handoff.block_checksums(dst)
    t_handoff = timed(handoff, "cpu", repeat)
    t_at_handoff = timed(lambda: prefill.handoff.handoff_checksums(src), "cpu", repeat)
    t_receive = timed(lambda: decode.handoff.block_checksums(dst), "cpu", repeat)
    t_seal = timed(lambda: prefill.runner.seal_checksums(full), "cpu", repeat)
    last = [src[i] for i in last_step_blocks(tokens, chunk)]  # sealed in the prefill's last step
    t_last = timed(lambda: prefill.runner.seal_checksums(last), "cpu", repeat)
    return {
        "model_dir": model_dir, "tokens": tokens, "blocks": len(src), "sealed": len(full),
        "algorithm": prefill.runner.checksum_algorithm, "chunk_tokens": chunk,
        "handoff_ms": round(t_handoff * 1e3, 3),
        "sender_at_handoff_ms": round(t_at_handoff * 1e3, 3),
        "checksum_receive_ms": round(t_receive * 1e3, 3),
        "seal_all_ms": round(t_seal * 1e3, 3), "seal_last_step_ms": round(t_last * 1e3, 3),
        "on_path": round((t_last + t_at_handoff + t_receive) / t_handoff, 4),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1000, 4096])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=512,
        help="tokens of one prefill step (the engine's --max-num-batched-tokens): the blocks "
        "of the last step are sealed just before the hand-off",
    )
    p.add_argument(
        "--algorithm",
        choices=ALGORITHMS,
        default=None,
        help="the block checksum (default: the device's own, as workers send it)",
    )
    p.add_argument(
        "--engine",
        metavar="MODEL_DIR",
        default=None,
        help="CPU: measure inside real engines of this model instead (bytes of the gRPC path)",
    )
    p.add_argument(
        "--ab-repeat",
        type=int,
        default=400,
        help="GPU: interleaved pairs of the A/B of the CUDA IPC check (with against without)",
    )
    p.add_argument(
        "--stack-handoff-ms",
        type=float,
        default=0.78,
        help="the serving stack's CUDA IPC hand-off time the check's cost is also set against "
        "(0.78 ms: 2,048-token prompts of the 8B shape on an H100, session 7's stack run in "
        "bench/results/kv_checksum_cpu.md; 1.44 ms before the transport's polling and launch "
        "changes, which earlier sessions' figures use)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny prompts, few repeats: check every path this machine can run (off CUDA the "
        "A/B's kernel arms on the torch references, with wsum64)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.engine is not None:
        return engine_main(args)
    if args.dry_run:
        args.tokens, args.repeat, args.ab_repeat = [40, 100], 2, 6
        args.algorithm = args.algorithm or WSUM64
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    ab = (args.ab_repeat if args.device == "cuda" or args.dry_run else 0, args.stack_handoff_ms)
    rows = [
        measure(
            args.shape, t, args.device, dtype, args.repeat, args.algorithm, args.chunk_tokens, ab
        )
        for t in args.tokens
    ]
    print(f"checksum: {rows[0]['algorithm']}; hand-off: {describe(rows[0])}")
    print(f"{'tokens':>7} {'blocks':>6} {'hand-off ms':>12} {'send ms':>8} {'recv ms':>8} "
          f"{'all sums':>9} {'at hand-off ms':>15} {'on path':>8} {'sum GB/s':>9}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>7} {r['blocks']:>6} {r['handoff_ms']:>12.3f} "
              f"{r['checksum_send_ms']:>8.3f} {r['checksum_receive_ms']:>8.3f} "
              f"{r['all_sums']:>9.1%} {r['sender_at_handoff_ms']:>15.3f} {r['on_path']:>8.1%} "
              f"{r['sum_gb_s']:>9.1f}")  # fmt: skip
    if "device_torch_sum_ms" in rows[0]:
        print("device ms (CUDA events), copy / Triton sum / torch sum: " + "; ".join(
            f"{r['tokens']}: {r['device_copy_ms']:.3f} / {r['device_sum_ms']:.3f} / "
            f"{r['device_torch_sum_ms']:.3f}" for r in rows))  # fmt: skip
    kv_check_ab.print_check(rows)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"kv_checksum_{args.device}_{rows[0]['algorithm']}.json"
        path.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def engine_main(args: argparse.Namespace) -> int:
    rows = [measure_engine(args.engine, t, args.repeat, args.chunk_tokens) for t in args.tokens]
    print(f"in engines, checksum: {rows[0]['algorithm']}; hand-off: read_blocks + write_blocks")
    print(f"{'tokens':>7} {'blocks':>6} {'hand-off ms':>12} {'seal last ms':>13} "
          f"{'at hand-off ms':>15} {'recv ms':>8} {'on path':>8} {'seal all ms':>12}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>7} {r['blocks']:>6} {r['handoff_ms']:>12.3f} "
              f"{r['seal_last_step_ms']:>13.3f} {r['sender_at_handoff_ms']:>15.3f} "
              f"{r['checksum_receive_ms']:>8.3f} {r['on_path']:>8.1%} "
              f"{r['seal_all_ms']:>12.3f}")  # fmt: skip
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"kv_checksum_engine_{rows[0]['algorithm']}.json"
        path.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def describe(row: dict) -> str:
    if row["device"] == "cpu":
        return "the gRPC stream's byte work (gather to bytes, copy into the pool)"
    if row["dst_device"] == row["device"]:
        return "the CUDA IPC transport's one-launch block copy on one GPU"
    return f"a gather and a peer copy {row['device']} -> {row['dst_device']}"


if __name__ == "__main__":
    raise SystemExit(main())
