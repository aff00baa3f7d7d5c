"""KV block transfer between two processes, side by side in one run: NIXL READ (decode pulls),
NIXL WRITE (prefill pushes into blocks decode pre-allocated), the gRPC block stream (the
fallback; host memory only), CUDA IPC (GPU pools of one host), and an in-process copy of the
same scattered blocks as the baseline (on GPUs: a PyTorch copy from the peer's GPU, which is
this one with ``--peer-device cuda:0``). Every transport is the production class
(`NixlTransport`, `NixlBlockServer`, `GrpcStreamTransport`, `CudaIpcTransport`, the prefill
gRPC servicer).

For each block size, ``--total-mib`` move in requests of ``--request-mib`` at random
(scattered) block indices on both sides; bandwidth is the best of ``--repeats`` timed passes
after a warm-up request, the methods' passes interleaved. Latency is one single-block
request, median of ``--latency-reps``. The last request of every transport is checked byte for
byte.

    python -m bench.kv_transfer [--device cpu|cuda] [--peer-device cuda:1] [--total-mib 1024]
        [--grpc-total-mib 256] [--nixl-total-mib N] [--methods nixl-read cuda-ipc ...]

Prints a markdown table; writes ``kv_transfer_<device>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench import kv_peer
from libkv.transfer import AgentInfo, StaticPeers, agent_name
from libkv.transfer.cuda_ipc import CudaIpcTransport
from libkv.transfer.grpc_stream import GrpcStreamTransport
from libkv.transfer.nixl import NixlTransport
from libkv.transfer.nixl_agent import NixlEndpoint

KIB = 1024
BLOCK_KIB = (16, 64, 128, 256, 512, 1024, 2048)
Move = Callable[[np.ndarray, np.ndarray], Awaitable[None]]


@dataclass(frozen=True)
class Source:  # a KVSource for the bench's peer
    worker_id: str
    incarnation: str
    address: str
    block_bytes: int
    block_ids: tuple[int, ...] = ()
    lease_expires_unix_ms: int = 0


@dataclass
class Row:
    block_kib: int
    method: str
    gb_per_s: float
    moved_mib: int
    latency_us_p50: float
    latency_us_p90: float
    vs_baseline: float = 0.0


class TorchStore:
    """BlockStore over a torch pool, for the gRPC transport's copies into the pool."""

    def __init__(self, pool: torch.Tensor, block_bytes: int) -> None:
        self.blocks = pool.view(-1, block_bytes)
        self.region = kv_peer.region(pool, block_bytes)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        rows = self.blocks[torch.tensor(block_ids, device=self.blocks.device)].cpu()
        return [row.numpy().tobytes() for row in rows]

    def write_blocks(self, block_ids: list[int], data: list[bytes]) -> None:
        raw = torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8)
        self.blocks[torch.tensor(block_ids, device=self.blocks.device)] = raw.view(
            len(data), -1
        ).to(self.blocks.device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan(n: int, per_req: int, rng) -> list[tuple[np.ndarray, np.ndarray]]:
    """Requests of ``per_req`` blocks at random (scattered) indices on both sides."""
    src, dst = rng.permutation(n), rng.permutation(n)
    return [(src[i : i + per_req], dst[i : i + per_req]) for i in range(0, n, per_req)]


async def one_pass(move: Move, requests, device) -> float:
    t0 = time.perf_counter()
    for s, d in requests:
        await move(s, d)
    sync(device)
    return time.perf_counter() - t0


async def latency(move: Move, n: int, reps: int, rng, device) -> list[float]:
    out = []
    for _ in range(reps):
        s, d = rng.integers(0, n, 1), rng.integers(0, n, 1)
        t0 = time.perf_counter()
        await move(s, d)
        sync(device)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def check(pool: torch.Tensor, block_bytes: int, src, dst, method: str) -> None:
    blocks = pool.view(-1, block_bytes)
    for s, d in list(zip(src, dst, strict=True))[:8]:
        want = kv_peer.expected_block(int(s), block_bytes, pool.device)
        if not torch.equal(blocks[int(d)].view(torch.int64), want):
            raise AssertionError(f"{method}: block {s} arrived wrong at {d} ({block_bytes} B)")


class Bench:
    def __init__(self, args, pool: torch.Tensor, base_src: torch.Tensor, peer_grpc: str):
        self.args, self.pool, self.base_src, self.peer_grpc = args, pool, base_src, peer_grpc
        self.device = pool.device
        self.rid = 0

    def moves(self, bs: int, peer_info, transports) -> dict[str, Move]:
        src_t = self.base_src.view(-1, bs)
        dst_t = self.pool.view(-1, bs)
        source = Source("peer", f"bs{bs}", self.peer_grpc, bs)

        def via(transport) -> Move:
            async def move(s, d) -> None:
                self.rid += 1
                rid = f"r{self.rid}"
                await transport.fetch(rid, source, s.tolist(), d.tolist(), timeout=300)
                await transport.release(rid, source)
                self.last = (s, d)

            return move

        async def copy(s, d) -> None:  # the same scattered blocks, in process
            if self.device.type == "cuda":  # gather on the peer GPU, one P2P copy, scatter
                dst_t[torch.from_numpy(d).to(self.device)] = src_t[
                    torch.from_numpy(s).to(src_t.device)
                ].to(self.device)
                return
            # One memcpy per block: torch's advanced indexing of uint8 rows runs an element
            # kernel (0.3 GB/s here), numpy slice assignment is a plain memcpy (3-6 GB/s).
            src_n, dst_n = src_t.numpy(), dst_t.numpy()
            for i, j in zip(s.tolist(), d.tolist(), strict=True):
                dst_n[j] = src_n[i]

        out = {m if m == "cuda-ipc" else f"nixl-{m}": via(t) for m, t in transports.items()}
        out["grpc"] = out.pop("nixl-grpc")
        out["p2p-copy" if self.device.type == "cuda" else "copy"] = copy
        gpu = self.device.type == "cuda"  # the gRPC stream never carries GPU memory
        wanted = {m for m in self.args.methods if not (gpu and m == "grpc")}
        return {m: move for m, move in out.items() if m in wanted or "copy" in m}

    async def block_size(self, bs: int, peer_extra: dict[str, str]) -> list[Row]:
        a, rng = self.args, np.random.default_rng(bs)
        region = kv_peer.region(self.pool, bs)
        peer_info = AgentInfo.from_extra(peer_extra)
        assert peer_info is not None
        peers = StaticPeers({"peer": peer_info})
        transports: dict = {}
        for mode in ("read", "write"):
            if f"nixl-{mode}" in a.methods:
                ep = await NixlEndpoint.start(f"bench-{mode}-{bs}", region)
                transports[mode] = NixlTransport(ep, peers, mode)
        transports["grpc"] = GrpcStreamTransport(TorchStore(self.pool, bs))
        if "cuda-ipc" in a.methods and self.device.type == "cuda":
            records = kv_peer.StaticRecords({"peer": peer_extra})
            transports["cuda-ipc"] = CudaIpcTransport(self.pool.view(-1, bs), bs, records)
        assert peer_info.name == agent_name("peer", f"bs{bs}")
        moves = self.moves(bs, peer_info, transports)
        plans = {}
        for method, move in moves.items():
            total = {"grpc": a.grpc_total_mib, "nixl-read": a.nixl_total_mib,
                     "nixl-write": a.nixl_total_mib}.get(method, a.total_mib) * 1024**2  # fmt: skip
            plans[method] = plan(total // bs, max(1, a.request_mib * 1024**2 // bs), rng)
            await move(*plans[method][0])  # warm-up: connections, registrations, page faults
        best = dict.fromkeys(moves, float("inf"))
        for _ in range(a.repeats):  # interleaved, so drifts of a shared host hit every method
            for method, move in moves.items():
                best[method] = min(best[method], await one_pass(move, plans[method], self.device))
                if not method.endswith("copy"):
                    check(self.pool, bs, *self.last, method)
        rows = []
        for method, move in moves.items():
            total = sum(len(s) for s, _ in plans[method]) * bs
            lat = sorted(await latency(move, total // bs, a.latency_reps, rng, self.device))
            rows.append(Row(bs // KIB, method, total / best[method] / 1e9, total // 1024**2,
                            statistics.median(lat), lat[int(0.9 * (len(lat) - 1))]))  # fmt: skip
            print(f"{bs // KIB:>6} KiB {method:<10} {rows[-1].gb_per_s:8.2f} GB/s "
                  f"{rows[-1].latency_us_p50:9.0f} us", flush=True)  # fmt: skip
        for t in transports.values():
            await t.close()
        base = max(r.gb_per_s for r in rows if r.method.endswith("copy"))
        for r in rows:
            r.vs_baseline = r.gb_per_s / base
        return rows


def contiguous_baseline(pool: torch.Tensor, base_src: torch.Tensor) -> float:
    """Best-case bandwidth of one contiguous copy of the whole pool (memcpy or P2P)."""
    pool.copy_(base_src)
    sync(pool.device)
    t0 = time.perf_counter()
    pool.copy_(base_src)
    sync(pool.device)
    return pool.numel() / (time.perf_counter() - t0) / 1e9


async def run(args) -> tuple[list[Row], float]:
    on_gpu = args.device == "cuda"
    dev = torch.device("cuda:0" if on_gpu else "cpu")
    peer_dev = args.peer_device if on_gpu else "cpu"
    total = args.total_mib * 1024**2
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=kv_peer.serve, args=(child, peer_dev, total), daemon=True)
    proc.start()
    peer_grpc = conn.recv()
    pool = torch.zeros(total, dtype=torch.uint8, device=dev)
    base_src = torch.empty(total, dtype=torch.uint8, device=peer_dev)
    kv_peer.fill_pattern(base_src)
    contiguous = contiguous_baseline(pool, base_src)
    print(f"contiguous {'P2P' if on_gpu else 'memcpy'} copy: {contiguous:.2f} GB/s", flush=True)
    bench = Bench(args, pool, base_src, peer_grpc)
    rows: list[Row] = []
    for kib in args.block_kib:
        conn.send(("setup", kib * KIB))
        rows += await bench.block_size(kib * KIB, conn.recv())
    conn.send(("stop",))
    conn.recv()
    proc.join(10)
    return rows, contiguous


def markdown(rows: list[Row], args, contiguous: float, machine: str) -> str:
    methods = list(dict.fromkeys(r.method for r in rows))
    head = "| block | " + " | ".join(f"{m} GB/s (x base) | {m} 1-block us" for m in methods)
    lines = [head + " |", "|---" * (1 + 2 * len(methods)) + "|"]
    for kib in dict.fromkeys(r.block_kib for r in rows):
        cells = []
        for m in methods:
            r = next(x for x in rows if x.block_kib == kib and x.method == m)
            cells.append(f"{r.gb_per_s:.2f} ({r.vs_baseline:.2f}) | {r.latency_us_p50:.0f}")
        lines.append(f"| {kib} KiB | " + " | ".join(cells) + " |")
    return "\n".join(
        [
            f"# KV transfer ({args.device})",
            "",
            f"- machine: {machine}",
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
            f"- command: `{command()}`",
            f"- moved per measurement: {args.total_mib} MiB (gRPC {args.grpc_total_mib} MiB) in "
            f"requests of {args.request_mib} MiB at scattered block indices; best of "
            f"{args.repeats} interleaved passes; latency: one block, median of {args.latency_reps}",
            f"- contiguous {'P2P' if args.device == 'cuda' else 'memcpy'} copy of the whole "
            f"pool: {contiguous:.2f} GB/s; (x base) = share of the scattered in-process copy",
            "",
            *lines,
            "",
        ]
    )


def command() -> str:
    return shlex.join(["python", "-m", "bench.kv_transfer", *sys.argv[1:]])


def machine_name(device: str) -> str:
    if device == "cuda":
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{platform.node()}: {' + '.join(names)}, torch {torch.__version__}"
    return f"{platform.node()}: {os.cpu_count()} CPUs ({platform.processor() or 'x86_64'})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.kv_transfer", description=__doc__)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--grpc-total-mib", type=int, default=256)
    p.add_argument(
        "--peer-device",
        default="cuda:1",
        help="the prefill process's GPU (cuda:0: both processes on one GPU)",
    )
    p.add_argument("--nixl-total-mib", type=int, default=None, help="default: --total-mib")
    p.add_argument(
        "--methods",
        nargs="+",
        default=["nixl-read", "nixl-write", "grpc", "cuda-ipc"],
        help="transports to measure (grpc: host memory only; cuda-ipc: GPUs only)",
    )
    p.add_argument("--request-mib", type=int, default=64)
    p.add_argument("--block-kib", type=int, nargs="+", default=list(BLOCK_KIB))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--latency-reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.nixl_total_mib = args.nixl_total_mib or args.total_mib
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # both processes on this host
    rows, contiguous = asyncio.run(run(args))
    machine = machine_name(args.device)
    md = markdown(rows, args, contiguous, machine)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"kv_transfer_{args.device}"
    stem.with_suffix(".md").write_text(md)
    meta = {"machine": machine, "argv": sys.argv, "contiguous_copy_gb_per_s": contiguous}
    payload = {**meta, "args": {k: str(v) for k, v in vars(args).items()}}
    payload["rows"] = [asdict(r) for r in rows]
    stem.with_suffix(".json").write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
