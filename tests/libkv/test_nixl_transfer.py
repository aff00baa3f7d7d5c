"""NIXL transfers between two real processes over UCX on loopback (``UCX_NET_DEVICES=lo``, set in
conftest and inherited by the spawned peers): this process is the decode side (`NixlTransport`),
a spawned peer is the prefill side (`NixlBlockServer`) with a pool of random bytes."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from libkv.transfer import KVTransferError, StalePeerError, StaticPeers, agent_name
from libkv.transfer.nixl import NixlTransport
from libkv.transfer.nixl_agent import NixlEndpoint, nixl_available
from tests.nixl_peer import Peer, Source, region_of

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")


class Decode:
    """This process's side: a zeroed pool, an endpoint and a transport in one mode."""

    def __init__(self, num_blocks: int, block_bytes: int, mode: str, peers: list[Peer]) -> None:
        self.pool = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
        self.mode = mode
        self.directory = StaticPeers({p.worker_id: p.info for p in peers})

    async def __aenter__(self) -> NixlTransport:
        endpoint = await NixlEndpoint.start(f"decode@{self.mode}", region_of(self.pool))
        self.transport = NixlTransport(endpoint, self.directory, self.mode, probe_interval=0.1)
        return self.transport

    async def __aexit__(self, *exc) -> None:
        await self.transport.close()


def wait_released(peer: Peer, rid: str, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while rid not in peer.call("state")["released"]:
        assert time.monotonic() < deadline, f"{rid} was never released on the peer"
        time.sleep(0.02)


@pytest.fixture
def peers():
    started: list[Peer] = []

    def start(*args, **kwargs) -> Peer:
        started.append(Peer(*args, **kwargs))
        return started[-1]

    yield start
    for p in started:
        p.stop()


@pytest.mark.parametrize("mode", ["read", "write"])
@pytest.mark.parametrize("block_bytes", [16 * 1024, 2 * 1024**2])
def test_random_blocks_arrive_byte_exact_at_scattered_indices(peers, mode, block_bytes):
    rng = np.random.default_rng(7)
    peer = peers("prefill-0", "inc-a", 48, block_bytes, seed=11)
    expected = peer.expected()
    decode = Decode(40, block_bytes, mode, [peer])

    async def go(transport: NixlTransport) -> None:
        for i, n in enumerate((1, 7, 23)):
            src = rng.choice(48, n, replace=False).tolist()
            dst = rng.choice(40, n, replace=False).tolist()
            before = decode.pool.copy()
            peer.call("hold", f"r{i}", src)
            handle = Source("prefill-0", "inc-a", tuple(src), block_bytes)
            await transport.fetch(f"r{i}", handle, src, dst, timeout=10)
            await transport.release(f"r{i}", handle)
            assert decode.pool[dst].tobytes() == expected[src].tobytes()
            untouched = np.setdiff1d(np.arange(40), dst)
            assert decode.pool[untouched].tobytes() == before[untouched].tobytes()
            wait_released(peer, f"r{i}")
        assert transport.stats.blocks == 31 and transport.stats.failures == 0

    async def main() -> None:
        async with decode as transport:
            await go(transport)

    asyncio.run(main())
    assert peer.call("state")["held"] == {}


@pytest.mark.parametrize("mode", ["read", "write"])
def test_contiguous_runs_move_as_merged_descriptors(peers, mode):
    block_bytes = 64 * 1024
    peer = peers("prefill-0", "inc-a", 32, block_bytes, seed=5)
    expected = peer.expected()
    decode = Decode(32, block_bytes, mode, [peer])
    src, dst = [*range(4, 12), 20, 21, 22], [*range(10, 18), 2, 3, 4]  # two runs

    async def main() -> None:
        async with decode as transport:
            peer.call("hold", "runs", src)
            handle = Source("prefill-0", "inc-a", tuple(src), block_bytes)
            await transport.fetch("runs", handle, src, dst, timeout=10)
            await transport.release("runs", handle)
            if mode == "read":  # posted here, as two descriptors instead of eleven
                assert transport.endpoint.merged == 1

    asyncio.run(main())
    assert decode.pool[dst].tobytes() == expected[src].tobytes()


def test_release_without_transfer_frees_the_peer_blocks(peers):
    peer = peers("prefill-0", "inc-a", 8, 4096)
    peer.call("hold", "cached", [1, 2])

    async def main() -> None:
        async with Decode(8, 4096, "read", [peer]) as transport:
            handle = Source("prefill-0", "inc-a", (1, 2), 4096)
            await transport.fetch("cached", handle, [], [], timeout=5)  # all cached locally
            await transport.release("cached", handle)

    asyncio.run(main())
    wait_released(peer, "cached")


@pytest.mark.parametrize("mode", ["read", "write"])
def test_peer_killed_mid_transfer_fails_fast(peers, mode):
    # 1 GiB in scattered 16 KiB blocks: ~0.2 s even on a quiet machine (256 MiB could finish
    # before the kill), so the kill after 30 ms lands inside the transfer.
    nb, bb = 65536, 16 * 1024
    peer = peers("prefill-0", "inc-a", nb, bb, seed=-1)
    src = np.random.default_rng(1).permutation(nb).tolist()
    peer.call("hold", "big", src)
    decode = Decode(nb, bb, mode, [peer])

    async def main() -> float:
        async with decode as transport:
            handle = Source("prefill-0", "inc-a", tuple(src), bb)
            task = asyncio.ensure_future(transport.fetch("big", handle, src, src, timeout=60))
            await asyncio.sleep(0.03)
            assert not task.done()
            peer.kill()
            t0 = time.monotonic()
            with pytest.raises(KVTransferError):
                await task
            elapsed = time.monotonic() - t0
            # The transport is usable afterwards and reports the dead peer at once.
            with pytest.raises(KVTransferError):
                await transport.fetch("again", handle, src[:1], [0], timeout=5)
            return elapsed

    # Detected, not timed out: far below the 60 s transfer timeout even on a loaded machine
    # (about 1 s alone on 2 cores).
    assert asyncio.run(main()) < 15.0


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_peer_dead_before_the_first_connect_is_a_transfer_failure(peers, mode):
    # UCX connects while loading the peer's metadata: a peer that died after publishing it
    # fails there (NIXL_ERR_BACKEND), which must reach the caller as a KVTransferError (the
    # decode worker then recomputes), not as NIXL's own exception.
    peer = peers("prefill-0", "inc-a", 16, 8192, seed=1)
    peer.call("hold", "a", [3])
    decode = Decode(16, 8192, mode, [peer])
    peer.kill()

    async def main() -> int:
        async with decode as transport:
            with pytest.raises(KVTransferError):
                await transport.fetch("a", Source("prefill-0", "inc-a", (3,), 8192), [3], [0], 5)
            return transport.stats.failures

    assert asyncio.run(main()) == 1


def test_restarted_peer_is_reached_through_its_new_agent(peers):
    old = peers("prefill-0", "inc-1", 16, 8192, seed=1)
    decode = Decode(16, 8192, "read", [old])

    async def main() -> None:
        async with decode as transport:
            h1 = Source("prefill-0", "inc-1", (3,), 8192)
            old.call("hold", "a", [3])
            await transport.fetch("a", h1, [3], [0], timeout=5)
            assert decode.pool[0].tobytes() == old.expected()[3].tobytes()
            old.kill()
            new = peers("prefill-0", "inc-2", 16, 8192, seed=2)
            decode.directory.agents["prefill-0"] = new.info  # what etcd now holds
            with pytest.raises(StalePeerError):
                await transport.fetch("b", h1, [3], [1], timeout=5)
            new.call("hold", "c", [5])
            h2 = Source("prefill-0", "inc-2", (5,), 8192)
            await transport.fetch("c", h2, [5], [2], timeout=5)
            assert decode.pool[2].tobytes() == new.expected()[5].tobytes()
            assert transport.endpoint.knows(agent_name("prefill-0", "inc-2"))
            assert not transport.endpoint.knows(agent_name("prefill-0", "inc-1"))

    asyncio.run(main())


def test_stuck_push_is_cancelled_after_the_timeout(peers):
    peer = peers("prefill-0", "inc-a", 8, 4096)
    peer.call("hold", "stuck", [1])
    peer.call("ignore_pushes")

    async def main() -> float:
        async with Decode(8, 4096, "write", [peer]) as transport:
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match="timed out"):
                await transport.fetch(
                    "stuck", Source("prefill-0", "inc-a", (1,), 4096), [1], [0], timeout=1.0
                )
            return time.monotonic() - t0

    assert 1.0 <= asyncio.run(main()) < 3.5


def test_push_for_blocks_not_held_fails_cleanly(peers):
    peer = peers("prefill-0", "inc-a", 8, 4096)

    async def main() -> None:
        async with Decode(8, 4096, "write", [peer]) as transport:
            with pytest.raises(KVTransferError, match="could not push"):
                await transport.fetch(
                    "nope", Source("prefill-0", "inc-a", (1,), 4096), [1], [0], timeout=5
                )

    asyncio.run(main())


def test_byte_ranges_of_blocks_move_to_their_offsets(peers):
    """A tensor-parallel hand-off READs ranges of heads (`libkv.transfer.sharded`): parts of
    each source block land at their offsets in destination blocks of another size."""
    peer = peers("prefill-0", "inc-a", 16, 4096, seed=3)
    expected = peer.expected()
    decode = Decode(12, 6144, "read", [peer])
    src, dst = [5, 6, 7, 1], [2, 3, 4, 9]  # a run of three, then one
    parts = [(1024, 2048, 1536), (0, 5120, 1024)]  # (source offset, destination offset, bytes)

    async def main() -> None:
        async with decode as transport:
            endpoint = transport.endpoint
            await endpoint.connect(peer.info)
            await endpoint.transfer("READ", peer.info.name, dst, src, b"", 10, parts)

    before = decode.pool.copy()
    asyncio.run(main())
    want = before.copy()
    for s, d in zip(src, dst, strict=True):
        for so, do, n in parts:
            want[d, do : do + n] = expected[s, so : so + n]
    assert decode.pool.tobytes() == want.tobytes()


@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_decode_side_serves_its_held_blocks_to_another(mode):
    """Live KV migration: a draining decode worker's transport serves the blocks it holds for
    a moved request (``serve``) over its own agent, while it still pulls as a decode side; the
    worker taking over READs them (or has them pushed) and they are freed on the notification."""
    from tests.nixl_peer import FakeHolder

    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, (8, 4096), dtype=np.uint8)
    dst = np.zeros((8, 4096), dtype=np.uint8)

    async def main() -> list[str]:
        a_ep = await NixlEndpoint.start(agent_name("decode-0", "inc-a"), region_of(src))
        b_ep = await NixlEndpoint.start(agent_name("decode-1", "inc-b"), region_of(dst))
        assert a_ep.info is not None
        draining = NixlTransport(a_ep, StaticPeers(), "read")
        holder = FakeHolder("inc-a", {"moved": [2, 5, 6]})
        draining.serve(holder, busy=lambda: bool(holder.held))
        taker = NixlTransport(b_ep, StaticPeers({"decode-0": a_ep.info}), mode, probe_interval=0.1)
        try:
            handle = Source("decode-0", "inc-a", (2, 5, 6), 4096)
            path = await taker.fetch("moved", handle, [2, 5, 6], [0, 3, 4], timeout=10)
            assert path == f"nixl-{mode}"
            await taker.release("moved", handle)
            deadline = time.monotonic() + 3
            while "moved" not in holder.released and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return holder.released
        finally:
            await taker.close()
            await draining.close()

    assert "moved" in asyncio.run(main())
    assert np.array_equal(dst[[0, 3, 4]], src[[2, 5, 6]])
