"""KV-aware routing end to end: real etcd, two router replicas, two prefill workers and a decode
worker as processes. Workers publish their cached prefixes; the routers (and this test) follow
them in etcd alone."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from tandem.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from libkv.cluster.summary_index import LocationIndex
from libkv.hashing import encode_extra_keys, hash_prefix_blocks
from services.client import TandemClient
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig

pytestmark = pytest.mark.timeout(300)

TTL = 3
BS = 16
PREFILLS = ("prefill-0", "prefill-1")


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory) -> Iterator[Stack]:
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path_factory.mktemp("kvroute")),
        port=free_port(),
        num_prefill=2,
        num_decode=1,
        num_routers=2,
        router_policy="kv",
        decode_only_threshold=1,  # every uncached tail is prefilled: the prefill choice shows
        disagg_mode="length",  # placement by length alone, whatever the load
        kv_cache_bytes=48 * 1024**2,
        member_ttl=TTL,
        member_refresh=1.0,
    )
    with Stack(config) as s:
        yield s


@pytest.fixture
async def index(stack) -> Iterator[LocationIndex]:
    idx = await LocationIndex.start(stack.etcd.endpoint)
    yield idx
    await idx.stop()


def prompt(seed: int, n: int = 400) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


def chain(tokens: list[int], tenant: str = "") -> list[bytes]:
    return hash_prefix_blocks(tokens, BS, encode_extra_keys(tenant or None))


async def stats(stack: Stack) -> dict[str, common_pb2.WorkerStats]:
    out = {}
    for name in (*PREFILLS, "decode-0"):
        async with grpc.aio.insecure_channel(stack.children[name].address) as ch:
            kind = worker_pb2_grpc.PrefillStub if name in PREFILLS else worker_pb2_grpc.DecodeStub
            stub = kind(ch)
            out[name] = await stub.Stats(common_pb2.StatsRequest(), timeout=10)
    return out


async def warm(stack: Stack, worker: str, tokens: list[int], tenant: str = "") -> None:
    """Prefill ``tokens`` on one worker directly (bypassing the routers), then release: the
    blocks stay in its prefix cache and get published."""
    async with grpc.aio.insecure_channel(stack.children[worker].address) as ch:
        stub = worker_pb2_grpc.PrefillStub(ch)
        rid = f"warm-{time.monotonic_ns()}"
        sampling = common_pb2.SamplingOptions(max_tokens=2, temperature=0.0)
        await stub.Prefill(
            worker_pb2.PrefillRequest(
                request_id=rid, token_ids=tokens, sampling=sampling, tenant=tenant
            ),
            timeout=60,
        )
        await stub.Release(worker_pb2.ReleaseRequest(request_id=rid), timeout=10)


async def route(stack: Stack, router: str, tokens: list[int], tenant: str = "") -> None:
    async with TandemClient(stack.children[router].address) as client:
        done = await client.complete(tokens, max_tokens=2, temperature=0.0, tenant=tenant)
    assert done.finish_reason == "length"


def served_by(before, after) -> dict[str, tuple[int, int]]:
    """worker -> (prompt tokens, prefix-hit tokens) it computed between two stats snapshots."""
    return {
        n: (after[n].prompt_tokens - before[n].prompt_tokens,
            after[n].prefix_hit_tokens - before[n].prefix_hit_tokens)
        for n in PREFILLS
    }  # fmt: skip


def holder(index: LocationIndex, tokens: list[int], tenant: str = "") -> dict[str, int]:
    return {wid: depth for (wid, _inc), depth in index.match(chain(tokens, tenant)).items()}


async def test_published_prefix_routes_both_replicas_and_a_restarted_router(stack, index):
    tokens = prompt(1)
    t0 = time.monotonic()
    await warm(stack, "prefill-1", tokens)  # the cold tie-break would pick prefill-0
    # Chunked prefill commits (and publishes) the prompt's blocks chunk by chunk: wait for all
    # (down to the last 4th block: the prompt's leaf).
    full = 400 // BS // 4 * 4
    assert await index.wait_for(lambda i: holder(i, tokens).get("prefill-1") == full, timeout=1.0)
    assert time.monotonic() - t0 < 5.0

    # Both replicas, with the same etcd view, send the same request to the holder.
    for i, router in enumerate(("router", "router-1", "router")):
        before = await stats(stack)
        await route(stack, router, tokens[:390] + [7, 8, 9, i])
        got = served_by(before, await stats(stack))
        assert got["prefill-0"] == (0, 0), (router, got)
        assert got["prefill-1"][1] >= 24 * BS, (router, got)

    # A router restarted (kill -9) routes by cache from its first request.
    stack.kill("router", signal.SIGKILL)
    stack.restart("router")
    before = await stats(stack)
    await route(stack, "router", tokens[:380] + [5, 5, 5])
    got = served_by(before, await stats(stack))
    assert got["prefill-0"] == (0, 0) and got["prefill-1"][1] >= 23 * BS, got


async def test_tenants_never_hit_each_others_prefixes(stack, index):
    tokens = prompt(2)
    await warm(stack, "prefill-1", tokens, tenant="acme")
    assert await index.wait_for(lambda i: "prefill-1" in holder(i, tokens, "acme"), timeout=1.0)
    assert holder(index, tokens) == {} and holder(index, tokens, "other") == {}
    before = await stats(stack)
    await route(stack, "router-1", tokens[:395] + [1], tenant="other")
    got = served_by(before, await stats(stack))
    assert sum(hit for _, hit in got.values()) == 0, got  # no hit anywhere for "other"
    assert got["prefill-0"][0] == 396  # cold: the tie-break, not acme's cache
    before = await stats(stack)
    await route(stack, "router-1", tokens[:395] + [2], tenant="acme")
    got = served_by(before, await stats(stack))
    assert got["prefill-1"][1] >= 24 * BS and got["prefill-0"] == (0, 0), got


async def test_entries_vanish_within_the_lease_ttl_after_kill_9(stack, index):
    tokens = prompt(3)
    await warm(stack, "prefill-0", tokens)
    assert await index.wait_for(lambda i: i.entries("prefill-0") > 0, timeout=1.0)
    stack.kill("prefill-0", signal.SIGKILL)
    t0 = time.monotonic()
    # etcd expires a lease TTL after its last refresh and checks leases every 0.5 s.
    assert await index.wait_for(lambda i: i.entries("prefill-0") == 0, timeout=TTL + 1.5)
    assert time.monotonic() - t0 <= TTL + 1.5
    stack.restart("prefill-0")  # a new incarnation starts with an empty cache
    assert await index.wait_for(lambda i: i.entries("prefill-0") == 0, timeout=0.1)
