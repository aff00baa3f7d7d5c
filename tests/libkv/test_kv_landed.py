"""Every CPU transport's fetch lands the sender's blocks in a real decode pool byte for byte
(`tests.landed_cases`): the pool of an `LLMEngine` of the bundled model, as a decode worker's
transports see it (`services.worker.runtime.engine_pool`), for one long run, two and four runs,
five runs, scattered blocks and blocks in no run on either side.

- the gRPC block stream from a `BlockStreamServicer` served here;
- NIXL READ and WRITE with a sender in its own process (`tests.nixl_peer`), over UCX;
- the CUDA IPC transport's copy paths on CPU tensors (CUDA's stream and event stubbed: its
  per-run copies, its block-copy kernel's reference and the fused copy-and-sum with and without
  the sender's sums); between two processes on a GPU: ``tests/gpu/test_kv_landed_gpu.py``.

The same check in the real stack's processes: ``test_the_stacks_decode_pool_holds_...``
below."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
import pytest
import torch
from tandem.v1 import worker_pb2_grpc

from engine import EngineConfig, LLMEngine
from engine.core.client import EngineClient
from libkv.transfer import StaticPeers
from libkv.transfer.grpc_stream import BlockStreamServicer, GrpcStreamTransport
from libkv.transfer.nixl_agent import nixl_available
from libkv.transfer.pool import PoolStore
from services.worker.runtime import engine_pool
from tests.landed_cases import (
    PATTERNS,
    RECEIVER_BLOCKS,
    SENDER_BLOCKS,
    SENTINEL,
    check_landed,
    member_extras,
    process_blocks,
)
from tests.nixl_peer import Source, pool_bytes

SEED = 11
Fetch = Callable[[str, list[int], list[int]], Awaitable[object]]


@pytest.fixture(scope="module")
def receiver(smol_dir) -> LLMEngine:
    """A decode engine whose pool the fetches land in (its own, as the worker registers it)."""
    engine = LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=48 * 1024**2))
    assert engine.runner.kv_pool.shape[0] >= RECEIVER_BLOCKS
    return engine


def pool_bytes_of(engine: LLMEngine) -> np.ndarray:
    pool = engine.runner.kv_pool
    return pool.view(torch.uint8).view(pool.shape[0], -1).numpy()


async def each_pattern(engine: LLMEngine, sender: np.ndarray, fetch: Fetch) -> None:
    """Every pattern into a pool of sentinels, checked byte for byte after its fetch."""
    for name, (src, dst) in PATTERNS.items():
        engine.runner.kv_pool.view(torch.uint8).fill_(SENTINEL)
        await fetch(name, src, dst)
        try:
            check_landed(pool_bytes_of(engine), sender, src, dst)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


class ArrayReader:
    """The serving side of the block stream over an array of blocks."""

    def __init__(self, pool: np.ndarray) -> None:
        self.pool = pool

    async def read_blocks(self, request_id: str, incarnation: str, ids: list[int]) -> list[bytes]:
        return [self.pool[i].tobytes() for i in ids]


def test_the_grpc_stream_lands_every_pattern_byte_for_byte(receiver) -> None:
    bb = receiver.runner.block_bytes
    sender = pool_bytes(SEED, SENDER_BLOCKS, bb)

    async def main() -> int:
        server = grpc.aio.server()
        worker_pb2_grpc.add_KVTransportServicer_to_server(
            BlockStreamServicer(ArrayReader(sender)), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = await EngineClient.local(receiver)
        transport = GrpcStreamTransport(engine_pool(client))
        address = f"127.0.0.1:{port}"

        async def fetch(rid: str, src: list[int], dst: list[int]) -> object:
            source = Source("prefill-0", "inc-a", tuple(src), bb, address)
            return await transport.fetch(rid, source, src, dst, timeout=30)

        try:
            await each_pattern(receiver, sender, fetch)
            return transport.stats.blocks
        finally:
            await transport.close()
            await server.stop(None)
            client.channel.close()  # stops the loop; the engine stays for the next test

    assert asyncio.run(main()) == sum(len(s) for s, _ in PATTERNS.values())


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
@pytest.mark.parametrize("mode", ["read", "write"])
def test_nixl_lands_every_pattern_byte_for_byte(receiver, mode) -> None:
    from libkv.transfer.nixl import NixlTransport
    from libkv.transfer.nixl_agent import NixlEndpoint
    from tests.nixl_peer import Peer

    bb = receiver.runner.block_bytes
    peer = Peer("prefill-0", "inc-a", SENDER_BLOCKS, bb, seed=SEED)
    try:
        sender = peer.expected()

        async def main() -> int:
            region = PoolStore(receiver.runner.kv_pool, bb, None).region  # type: ignore[arg-type]
            endpoint = await NixlEndpoint.start(f"decode@landed-{mode}", region)
            peers = StaticPeers({peer.worker_id: peer.info})
            transport = NixlTransport(endpoint, peers, mode, probe_interval=0.1)

            async def fetch(rid: str, src: list[int], dst: list[int]) -> object:
                peer.call("hold", rid, src)
                source = Source("prefill-0", "inc-a", tuple(src), bb)
                path = await transport.fetch(rid, source, src, dst, timeout=30)
                await transport.release(rid, source)
                return path

            try:
                await each_pattern(receiver, sender, fetch)
                return transport.stats.blocks
            finally:
                await transport.close()

        assert asyncio.run(main()) == sum(len(s) for s, _ in PATTERNS.values())
    finally:
        peer.stop()


@pytest.mark.parametrize("sums", ["off", "copy", "sender"])
def test_the_cuda_ipc_copy_paths_land_every_pattern_byte_for_byte_on_cpu(
    receiver, monkeypatch, sums
) -> None:
    """`CudaIpcTransport.fetch` into the engine's pool on CPU tensors, the peer's pool standing
    for its mapping: the plain copy (``off``: up to four runs one copy each, more through the
    block-copy kernel's reference), the fused copy-and-sum (``copy``) and the fused check with
    the sender's sums on the handle (``sender``, whose verify must count 0)."""
    from kernels import reference
    from libkv.transfer import CUDA_IPC_KEY
    from libkv.transfer.cuda_ipc import CudaIpcTransport
    from libkv.transfer.fetch_checks import MASK
    from services.common.codec import KVHandle

    class Done:
        def query(self) -> bool:
            return True

        def record(self, stream: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda d: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Done)
    bb = receiver.runner.block_bytes
    sender = pool_bytes(SEED, SENDER_BLOCKS, bb)
    peer = torch.from_numpy(sender.copy())
    record = json.dumps({
        "device_uuid": "", "handle": "", "size": peer.numel(), "offset": 0,
        "ref_counter_handle": "", "ref_counter_offset": 0, "event_handle": "",
        "event_sync_required": False, "num_blocks": SENDER_BLOCKS, "block_bytes": bb,
    })  # fmt: skip

    class Records:
        async def extra(self, worker_id: str, incarnation: str, timeout: float) -> dict:
            return {CUDA_IPC_KEY: record}

    t = CudaIpcTransport(receiver.runner.kv_pool, bb, Records(), sums=sums != "off")
    t._mapped = lambda name, info: peer  # type: ignore[method-assign]
    t.can_reach = lambda extra: True  # type: ignore[method-assign]
    words = peer.view(torch.int64).view(SENDER_BLOCKS, -1)
    verified: list[int | None] = []

    async def fetch(rid: str, src: list[int], dst: list[int]) -> object:
        wsum = reference.block_wsum64(words, torch.tensor(src)).tolist()
        checksums = tuple(s & MASK for s in wsum) if sums == "sender" else ()
        handle = KVHandle(
            worker_id="p0", incarnation="i1", address="", block_ids=tuple(src),
            num_tokens=16 * len(src), block_size=16, block_bytes=bb, dtype="float32",
            lease_expires_unix_ms=0, block_checksums=checksums, checksum_algorithm="wsum64",
        )  # fmt: skip
        path = await t.fetch(rid, handle, src, dst, 30.0)
        verified.append(await t.verify(rid, checksums))  # "copy": nothing to compare here
        return path

    asyncio.run(each_pattern(receiver, sender, fetch))
    assert verified == [0 if sums == "sender" else None] * len(PATTERNS)
    assert t.fused_fetches == (0 if sums == "off" else len(PATTERNS))
    assert t.compared_fetches == (len(PATTERNS) if sums == "sender" else 0)


# --- The real stack -------------------------------------------------------------------------
def prompt_rows(block: np.ndarray, shape: tuple[int, ...], rows: int) -> np.ndarray:
    """The first ``rows`` token rows of a float32 block ``[heads, layers, 2, block_size, dim]``."""
    return block.view(np.float32).reshape(shape)[:, :, :, :rows]


def changed(before: np.ndarray, after: np.ndarray) -> list[int]:
    return np.flatnonzero((before != after).any(axis=1)).tolist()


@pytest.fixture(scope="module")
def nixl_stack(smol_dir, tmp_path_factory):
    from services.launcher.etcd import free_port
    from services.launcher.stack import Stack, StackConfig

    config = StackConfig(
        model_dir=str(smol_dir), run_dir=str(tmp_path_factory.mktemp("landed")),
        port=free_port(), kv_transport="nixl", kv_cache_bytes=48 * 1024**2, start_timeout=300.0,
        disagg_mode="length",  # both prompts are prefilled remotely, whatever the machine's load
    )  # fmt: skip
    with Stack(config) as stack:
        yield stack


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
@pytest.mark.timeout(300)
def test_the_stacks_decode_pool_holds_the_prefill_workers_blocks_byte_for_byte(
    nixl_stack, receiver
) -> None:
    """The real processes (gateway, router, a prefill and a decode worker over NIXL): after a
    hand-off every block the prefill worker filled for the prompt is in the decode worker's
    pool byte for byte (both pools read out of the processes' memory), the last, partial one
    in its prompt rows (the decode worker writes the rows after them). A first prompt moves
    all its blocks; a second that extends it moves only what the decode worker does not
    cache (its blocks for the shared part are not written again)."""
    import openai

    from tests.stack_probe import metrics_of

    stack = nixl_stack
    block_size = receiver.config.block_size
    shape = tuple(receiver.runner.kv_pool.shape[1:])  # [heads, layers, 2, block_size, dim]
    pids = {name: stack.children[name].proc.pid for name in ("prefill-0", "decode-0")}
    extras = member_extras(stack.etcd.endpoint)
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=120)
    decode_metrics = stack.scrape_targets()["decode-0"]
    lines = [f"Line {i}: the warehouse shipped {i * 7} crates to dock {i % 5}." for i in range(40)]
    for prompt in (" ".join(lines[:16]), " ".join(lines)):  # ~300, then ~720 tokens
        before = {w: process_blocks(pid, extras[w]) for w, pid in pids.items()}
        counts = metrics_of(decode_metrics)
        out = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                        max_tokens=4, temperature=0)  # fmt: skip
        assert out.usage is not None
        after = {w: process_blocks(pid, extras[w]) for w, pid in pids.items()}
        now = metrics_of(decode_metrics)
        assert now["tandem_kv_transfers_total"] == counts.get("tandem_kv_transfers_total", 0) + 1
        for name in (
            "tandem_kv_handoff_recomputed_total",
            "tandem_kv_transfer_corrupt_blocks_total",
        ):
            assert now.get(name, 0) == counts.get(name, 0), name  # what it decodes is what came
        full, rows = divmod(out.usage.prompt_tokens, block_size)
        assert rows, "the prompt should end in a partial block"
        filled = changed(before["prefill-0"], after["prefill-0"])
        landed = changed(before["decode-0"], after["decode-0"])
        decode = {after["decode-0"][d].tobytes(): d for d in landed}
        found = [p for p in filled if after["prefill-0"][p].tobytes() in decode]
        partial = [p for p in filled if p not in found]
        assert len(partial) == 1, (len(filled), len(found), full)
        # Every full block the prefill worker computed (all of them the first time, those past
        # what the decode worker caches the second) arrived whole.
        assert len(found) == len(filled) - 1 and found, (len(filled), len(found))
        want = prompt_rows(after["prefill-0"][partial[0]], shape, rows)
        assert any(
            np.array_equal(prompt_rows(after["decode-0"][d], shape, rows), want) for d in landed
        ), "the partial block's prompt rows did not arrive"
