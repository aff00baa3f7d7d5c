"""The host tier in a real engine on CPU (plain memory copies, the same code as on CUDA):
prefixes evicted from the device pool page back in, preempted sequences swap back in, and
greedy outputs are token-identical with and without the tier."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.client import EngineClient
from libkv.hashing import hash_prefix_blocks
from tests.conftest import make_random_model_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0)
TIER = dict(kv_host_cache_gib=0.002, kv_swap_min_tokens=16)  # 87 host blocks of this model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_dir):
    return make_random_model_dir(tmp_path_factory.mktemp("tier"), smol_dir, "llama")


def make_engine(model_dir, **kw) -> LLMEngine:
    opts = dict(num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=4)
    opts.update(kw)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **opts))


def prompt(i: int, n: int = 70) -> list[int]:
    return [(7 * i + 3 * j) % 4000 + 10 for j in range(n)]


def run_one(engine: LLMEngine, rid: str, ids: list[int], params=GREEDY, **kw):
    engine.add_request(rid, ids, params, **kw)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    assert final is not None
    return final


def test_evicted_prefixes_page_back_in_with_identical_outputs(tiny_dir) -> None:
    base, tiered = make_engine(tiny_dir), make_engine(tiny_dir, **TIER)
    order = [0, 1, 2, 3, 0, 1]  # 0 and 1 are evicted from the 12-block pool by 2 and 3
    outs = {}
    for name, engine in (("base", base), ("tier", tiered)):
        outs[name] = [run_one(engine, f"r{k}", prompt(i)) for k, i in enumerate(order)]
        engine.check_integrity()
        assert engine.pool.num_used == 0
    assert [o.token_ids for o in outs["tier"]] == [o.token_ids for o in outs["base"]]
    assert [o.num_cached_tokens for o in outs["base"]] == [0] * 6
    assert [o.num_cached_tokens for o in outs["tier"]] == [0, 0, 0, 0, 64, 64]
    tier = tiered.stats().tier
    assert tier is not None and base.stats().tier is None
    assert tier.hit_blocks == tier.page_in_blocks == 8
    assert tier.page_out_blocks == 16  # each prompt's four full blocks, once
    assert tier.used_blocks == 16 and tier.capacity_blocks == 87


def test_short_host_hits_are_recomputed(tiny_dir) -> None:
    engine = make_engine(tiny_dir, kv_host_cache_gib=0.002, kv_swap_min_tokens=128)
    outs = [run_one(engine, f"r{k}", prompt(i)) for k, i in enumerate([0, 1, 2, 3, 0])]
    assert outs[-1].num_cached_tokens == 0
    stats = engine.stats().tier
    assert stats is not None and stats.short_hits >= 1 and stats.page_in_blocks == 0


def test_preempted_sequences_swap_back_in_with_identical_outputs(tiny_dir) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [prompt(i, 40 + 5 * i) for i in range(6)]
    outs, stats = {}, {}
    for name, kw in (("base", {}), ("tier", TIER)):
        engine = make_engine(tiny_dir, num_kv_blocks=16, max_num_batched_tokens=128,
                             max_num_seqs=6, **kw)  # fmt: skip
        for k, p in enumerate(prompts):
            engine.add_request(f"r{k}", p, params)
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
        engine.check_integrity()
        assert engine.pool.num_used == 0
        outs[name], stats[name] = finals, engine.stats()
    assert outs["tier"] == outs["base"]
    assert stats["base"].num_preemptions > 0 and stats["tier"].num_preemptions > 0
    tier = stats["tier"].tier
    assert tier is not None and tier.swaps > 0 and tier.page_in_blocks > 0


def test_tenants_do_not_page_in_each_others_blocks(tiny_dir) -> None:
    engine = make_engine(tiny_dir, **TIER)
    run_one(engine, "a0", prompt(0), tenant="acme")
    for k in (1, 2, 3):  # evict it from the device pool
        run_one(engine, f"f{k}", prompt(k))
    other = run_one(engine, "g0", prompt(0), tenant="globex")
    again = run_one(engine, "a1", prompt(0), tenant="acme")
    assert other.num_cached_tokens == 0
    assert again.num_cached_tokens == 64
    assert other.token_ids == again.token_ids


def test_a_restarted_engine_starts_with_an_empty_tier(tiny_dir) -> None:
    first = make_engine(tiny_dir, **TIER)
    for k in (0, 1, 2, 3):
        run_one(first, f"r{k}", prompt(k))
    assert first.stats().tier.used_blocks == 16
    second = make_engine(tiny_dir, **TIER)
    assert second.stats().tier.used_blocks == 0
    assert run_one(second, "r0", prompt(0)).num_cached_tokens == 0


class Events:
    """A cache listener recording the prefix hashes it is told of."""

    def __init__(self) -> None:
        self.added: list[bytes] = []
        self.removed: list[bytes] = []

    def cached(self, index: int, block_hash: bytes, parent: bytes) -> None:
        self.added.append(block_hash)

    def evicted(self, block_hash: bytes) -> None:
        self.removed.append(block_hash)


async def _until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_the_worker_hears_the_host_tier_apart_from_the_gpu_cache(tiny_dir) -> None:
    """Through the engine client (what a worker's host-tier publisher listens to): the host
    tier's entries arrive as their own events, and the client says it has a host tier."""
    client = await EngineClient.local(make_engine(tiny_dir, **TIER))
    gpu, host = Events(), Events()
    try:
        assert client.info.host_blocks == 87
        client.set_host_listener(host)
        client.set_listener(gpu)
        await asyncio.sleep(0.1)  # the engine turns its events on
        for k in range(4):
            outs = [o async for o in client.generate(f"r{k}", prompt(k), GREEDY)]
            assert outs[-1].finished
        chains = [hash_prefix_blocks(prompt(k), 16) for k in range(4)]
        await _until(lambda: len(host.added) == 16)
        assert host.added == [h for chain in chains for h in chain]
        assert host.removed == []
        assert gpu.added[:4] == chains[0] and len(gpu.removed) > 0  # the GPU pool is small
    finally:
        client.stop()


def test_a_decode_worker_takes_a_handoffs_prefix_from_its_host_tier(tiny_dir) -> None:
    """The decode side of a hand-off counts what its host tier holds as cached (paged in at
    once): only the rest of the blocks come from the prefill worker, and the stream goes on
    token-identically."""
    prefill, decode = make_engine(tiny_dir), make_engine(tiny_dir, **TIER)
    ids = prompt(0)
    expected = run_one(make_engine(tiny_dir), "ref", ids).token_ids
    run_one(decode, "warm", ids)  # the decode worker saw this prompt before...
    for k in (1, 2, 3):
        run_one(decode, f"f{k}", prompt(k))  # ...and its GPU pool has evicted it since
    assert len(decode.kv.find_prefix(ids, b"").blocks) == 0
    prefill.add_request("h", ids, GREEDY, hold_kv=True)
    first = None
    while prefill.has_unfinished():
        first = next((o for o in prefill.step() if o.request_id == "h"), first)
    assert first is not None and first.kv_held
    reserved, cached = decode.handoff.reserve("h", ids)
    assert cached == 64  # four blocks from the host tier
    assert decode.stats().tier.page_in_blocks == 4  # (paged in already)
    skip = cached // 16
    held = prefill.handoff.held_block_ids("h")[skip:]
    decode.handoff.write_blocks(reserved[skip:], prefill.handoff.read_blocks(held))
    assert prefill.handoff.release("h")
    decode.handoff.add_prefilled("h", ids, first.token_ids[0], GREEDY, num_cached_tokens=cached)
    final = None
    while decode.has_unfinished():
        final = next((o for o in decode.step() if o.request_id == "h" and o.finished), final)
    assert final is not None and final.token_ids == expected
    decode.check_integrity()
    assert decode.pool.num_used == 0


def test_host_tier_sizing(tmp_path) -> None:
    """Off on CPU hosts by default; a size in GiB is that many canonical blocks; the room a
    container may take is its cgroup's limit less its use, not the host's free memory."""
    import torch

    from engine.host_store import _cgroup_room, host_slots

    cpu = torch.device("cpu")
    assert host_slots(None, 1 << 20, cpu, 1 << 30) == 0
    assert host_slots(0.0, 1 << 20, cpu, 1 << 30) == 0
    assert host_slots(2.0, 1 << 20, cpu, 1 << 30) == 2048
    limit, usage = tmp_path / "max", tmp_path / "current"
    limit.write_text("8589934592\n")
    usage.write_text("1073741824\n")
    assert _cgroup_room(((str(limit), str(usage)),)) == 7 << 30
    limit.write_text("max\n")
    assert _cgroup_room(((str(limit), str(usage)),)) is None
    assert _cgroup_room(((str(tmp_path / "none"), str(usage)),)) is None
