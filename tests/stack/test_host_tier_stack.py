"""The host KV tier through real processes: etcd, a router, a prefill worker with a small GPU
pool and ``--kv-host-cache-gib``, a decode worker. A prompt the prefill worker's GPU pool has
evicted stays published under its host tier's pseudo-incarnation, a prompt sent again is
paged back in (its prompt tokens hit), and the worker's metrics show both tiers."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from tandem.v1 import common_pb2, worker_pb2_grpc

from libkv.cluster.summary_index import LocationIndex
from libkv.cluster.tiers import HOST, TIER_SEPARATOR
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from tests.stack.test_kv_routing import chain, prompt, warm

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory) -> Iterator[Stack]:
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path_factory.mktemp("hosttier")),
        port=free_port(),
        num_prefill=1,
        num_decode=1,
        kv_cache_bytes=24 * 1024**2,  # 34 blocks of SmolLM2 in float32: two prompts of 19
        worker_args=("--kv-host-cache-gib", "0.05", "--kv-swap-min-tokens", "16"),
    )
    with Stack(config) as s:
        yield s


@pytest.fixture
async def index(stack) -> Iterator[LocationIndex]:
    idx = await LocationIndex.start(stack.etcd.endpoint)
    yield idx
    await idx.stop()


def depths(index: LocationIndex, tokens: list[int]) -> dict[str, int]:
    """tier -> depth of prefill-0's deepest published prefix of ``tokens``."""
    out = {}
    for (wid, inc), depth in index.match(chain(tokens)).items():
        if wid == "prefill-0":
            out[HOST if inc.endswith(TIER_SEPARATOR + HOST) else "gpu"] = depth
    return out


async def prefill_stats(stack: Stack) -> common_pb2.WorkerStats:
    async with grpc.aio.insecure_channel(stack.children["prefill-0"].address) as ch:
        stub = worker_pb2_grpc.PrefillStub(ch)
        return await stub.Stats(common_pb2.StatsRequest(), timeout=10)


def metric(stack: Stack, worker: str, name: str, **labels: str) -> float:
    target = stack.scrape_targets()[worker]
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name) and want in line:
            return float(line.split()[-1])
    raise AssertionError(f"no {name} {labels}")


async def test_an_evicted_prompt_stays_published_and_pages_back_in(stack, index) -> None:
    first, others = prompt(11, 300), [prompt(12, 300), prompt(13, 300)]
    await warm(stack, "prefill-0", first)
    assert await index.wait_for(lambda i: depths(i, first).get(HOST) == 16, timeout=10.0)
    for tokens in others:  # the GPU pool holds two prompts at most
        await warm(stack, "prefill-0", tokens)
    assert await index.wait_for(lambda i: "gpu" not in depths(i, first), timeout=10.0)
    assert depths(index, first)[HOST] == 16  # the host tier still holds it
    before = await prefill_stats(stack)
    await warm(stack, "prefill-0", first)
    after = await prefill_stats(stack)
    assert after.prefix_hit_tokens - before.prefix_hit_tokens >= 17 * 16  # paged back in
    assert metric(stack, "prefill-0", "tandem_engine_kv_tier_hit_tokens_total", tier="host") > 0
    assert metric(stack, "prefill-0", "tandem_engine_kv_tier_capacity_blocks", tier="host") > 0
    assert metric(stack, "decode-0", "tandem_engine_kv_tier_used_blocks", tier="gpu") >= 0
