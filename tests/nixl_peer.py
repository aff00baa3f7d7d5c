"""A prefill-side NIXL peer in its own process for transfer tests: a pool of random blocks, a
real `NixlEndpoint` + `NixlBlockServer`, and a pipe for commands from the test process."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from libkv.transfer import AgentInfo, PoolRegion, agent_name


def pool_bytes(seed: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """The peer's pool contents: [num_blocks, block_bytes] random bytes from ``seed``
    (seed -1: all ones, for large pools where only timing matters)."""
    if seed == -1:
        return np.ones((num_blocks, block_bytes), dtype=np.uint8)
    raw = bytearray(np.random.default_rng(seed).bytes(num_blocks * block_bytes))
    return np.frombuffer(raw, dtype=np.uint8).reshape(num_blocks, block_bytes)


@dataclass(frozen=True)
class Source:
    """A `libkv.transfer.KVSource`: where a request's blocks live."""

    worker_id: str
    incarnation: str
    block_ids: tuple[int, ...]
    block_bytes: int
    address: str = ""
    lease_expires_unix_ms: int = 0


def region_of(pool: np.ndarray) -> PoolRegion:
    return PoolRegion(pool.ctypes.data, pool.shape[0], pool.shape[1])


@dataclass
class FakeHolder:
    """Which blocks each request holds (the prefill engine's bookkeeping, reduced)."""

    incarnation: str
    held: dict[str, list[int]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)

    def held_blocks(self, request_id: str, incarnation: str, block_ids: Sequence[int]) -> None:
        if incarnation != self.incarnation or request_id not in self.held:
            raise RuntimeError(f"{request_id} is not held by incarnation {incarnation}")
        if not set(block_ids) <= set(self.held[request_id]):
            raise RuntimeError(f"{request_id} does not hold {list(block_ids)}")

    def release(self, request_id: str) -> bool:
        if self.held.pop(request_id, None) is None:
            return False
        self.released.append(request_id)
        return True


def serve(conn, worker_id: str, incarnation: str, num_blocks: int, block_bytes: int, seed: int):
    """Child entry point. Commands: ("hold", rid, blocks), ("state",), ("ignore_pushes",),
    ("stop",)."""
    asyncio.run(_serve(conn, worker_id, incarnation, num_blocks, block_bytes, seed))


async def _serve(conn, worker_id, incarnation, num_blocks, block_bytes, seed) -> None:
    from libkv.transfer.nixl import NixlBlockServer
    from libkv.transfer.nixl_agent import NixlEndpoint

    pool = pool_bytes(seed, num_blocks, block_bytes)
    holder = FakeHolder(incarnation)
    endpoint = await NixlEndpoint.start(agent_name(worker_id, incarnation), region_of(pool))
    server = NixlBlockServer(endpoint, holder, busy=lambda: bool(holder.held))
    assert endpoint.info is not None
    conn.send(endpoint.info.to_json())
    while True:
        if not conn.poll():
            await asyncio.sleep(0.005)
            continue
        cmd, *args = conn.recv()
        if cmd == "hold":
            holder.held[args[0]] = list(args[1])
            conn.send(True)
        elif cmd == "state":
            conn.send({"held": holder.held, "released": holder.released, "stats": server.stats})
        elif cmd == "ignore_pushes":  # a stuck peer: pushes are received but never served
            server._on_notif = lambda peer, raw: None  # type: ignore[method-assign]
            endpoint._pump.cancel()  # type: ignore[union-attr]
            conn.send(True)
        elif cmd == "stop":
            await server.close()
            conn.send(True)
            return


class Peer:
    """Handle on a peer process (spawned, so NIXL/UCX start clean in it)."""

    def __init__(self, worker_id: str, incarnation: str, num_blocks: int, block_bytes: int,
                 seed: int = 0) -> None:  # fmt: skip
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.worker_id, self.incarnation, self.seed = worker_id, incarnation, seed
        self.shape = (num_blocks, block_bytes)
        self.proc = ctx.Process(
            target=serve, args=(child, worker_id, incarnation, num_blocks, block_bytes, seed)
        )
        self.proc.start()
        if not self.conn.poll(60):
            raise TimeoutError("the NIXL peer did not start")
        self.info = AgentInfo.from_json(self.conn.recv())

    def call(self, *cmd):
        self.conn.send(cmd)
        if not self.conn.poll(30):
            raise TimeoutError(f"the NIXL peer did not answer {cmd[0]}")
        return self.conn.recv()

    def expected(self) -> np.ndarray:
        return pool_bytes(self.seed, *self.shape)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(TimeoutError, EOFError, BrokenPipeError):
                self.call("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.kill()
