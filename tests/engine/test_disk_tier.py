"""The disk tier in a real engine on CPU (a file per engine, the same code as on CUDA): blocks
the host tier evicts are written to disk and read back disk -> host staging -> device pool,
greedy outputs are token-identical with and without the tiers, the size cap holds, tenants
stay apart, and a restarted engine starts with an empty disk tier and a new file."""

from __future__ import annotations

import glob
import os

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import make_random_model_dir
from tests.engine.test_host_tier import prompt, run_one

BLOCK_BYTES = 24576  # one canonical KV block of this model (16 tokens)


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / 1024**3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_dir):
    return make_random_model_dir(tmp_path_factory.mktemp("disk"), smol_dir, "llama")


def make_engine(model_dir, disk=None, host: int = 8, disk_blocks: int = 40, **kw) -> LLMEngine:
    opts = dict(num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=4)
    if host:
        opts.update(kv_host_cache_gib=gib(host), kv_swap_min_tokens=16)
    if disk is not None:
        opts.update(kv_disk_cache_dir=str(disk), kv_disk_cache_gib=gib(disk_blocks))
    opts.update(kw)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **opts))


def files(directory) -> list[str]:
    return glob.glob(os.path.join(str(directory), "tandem-kv-*.bin"))


def test_prefixes_evicted_to_disk_page_back_in_with_identical_outputs(tiny_dir, tmp_path):
    """Six prompts of four full blocks each overflow the 12-block pool and the 8-slot host
    tier: the first ones are on disk only when they come back, and still give the same
    tokens as an engine without any tier."""
    order = [0, 1, 2, 3, 4, 5, 0, 1, 2]
    base = make_engine(tiny_dir, host=0)
    disk = make_engine(tiny_dir, tmp_path)
    assert disk.runner.layout.block_bytes == BLOCK_BYTES
    outs = {}
    for name, engine in (("base", base), ("disk", disk)):
        outs[name] = [run_one(engine, f"r{k}", prompt(i)) for k, i in enumerate(order)]
        engine.check_integrity()
        assert engine.pool.num_used == 0
    assert [o.token_ids for o in outs["disk"]] == [o.token_ids for o in outs["base"]]
    assert [o.num_cached_tokens for o in outs["base"]] == [0] * 9
    assert [o.num_cached_tokens for o in outs["disk"]][6:] == [64, 64, 64]
    stats = disk.stats()
    host, d = stats.tier, stats.disk_tier
    assert host is not None and d is not None and base.stats().disk_tier is None
    assert d.capacity_blocks == 40 and d.block_bytes == BLOCK_BYTES
    assert d.hit_blocks >= 4 and d.page_in_blocks == d.hit_blocks
    assert d.page_out_blocks >= 8 and d.used_blocks == d.page_out_blocks
    assert host.hit_blocks + d.hit_blocks == 12  # three prompts of four blocks came back
    disk.runner.host_store.synchronize()
    assert d.page_out_seconds >= 0 and d.page_in_seconds > 0
    disk.close()
    assert files(tmp_path) == []  # removed on a clean shutdown


def test_preempted_sequences_resume_with_identical_outputs(tiny_dir, tmp_path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [prompt(i, 40 + 5 * i) for i in range(6)]
    outs, stats = {}, {}
    for name, disk in (("base", None), ("disk", tmp_path)):
        sizes = dict(num_kv_blocks=16, max_num_batched_tokens=128, max_num_seqs=6)
        engine = make_engine(tiny_dir, disk, host=4 if disk else 0, disk_blocks=64, **sizes)
        for k, p in enumerate(prompts):
            engine.add_request(f"r{k}", p, params)
        finals = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
        engine.check_integrity()
        outs[name], stats[name] = finals, engine.stats()
        engine.close()
    assert outs["disk"] == outs["base"]
    assert stats["disk"].num_preemptions > 0
    assert stats["disk"].disk_tier.page_out_blocks > 0


def test_the_size_cap_holds_and_outputs_stay_identical(tiny_dir, tmp_path) -> None:
    base, engine = make_engine(tiny_dir, host=0), make_engine(tiny_dir, tmp_path, disk_blocks=6)
    order = [0, 1, 2, 3, 4, 5, 5, 0, 4]
    for k, i in enumerate(order):
        want = run_one(base, f"r{k}", prompt(i)).token_ids
        assert run_one(engine, f"r{k}", prompt(i)).token_ids == want
        d = engine.stats().disk_tier
        assert d is not None and d.used_blocks <= 6
    engine.check_integrity()
    size = os.path.getsize(files(tmp_path)[0])
    assert size == 6 * BLOCK_BYTES  # one preallocated slot per block, no more
    engine.close()


def test_tenants_do_not_read_each_others_blocks_from_disk(tiny_dir, tmp_path) -> None:
    engine = make_engine(tiny_dir, tmp_path)
    run_one(engine, "a0", prompt(0), tenant="acme")
    for k in range(1, 6):  # push it out of the device pool and the host tier
        run_one(engine, f"f{k}", prompt(k))
    assert engine.stats().tier.used_blocks < 8
    other = run_one(engine, "g0", prompt(0), tenant="globex")
    again = run_one(engine, "a1", prompt(0), tenant="acme")
    assert other.num_cached_tokens == 0
    assert again.num_cached_tokens == 64 and engine.stats().disk_tier.hit_blocks == 4
    assert other.token_ids == again.token_ids
    engine.close()


def test_a_restarted_engine_starts_with_an_empty_disk_tier(tiny_dir, tmp_path) -> None:
    stale = tmp_path / "tandem-kv-1-dead-r0.bin"  # a worker that died left its file
    stale.write_bytes(b"\0" * BLOCK_BYTES)
    first = make_engine(tiny_dir, tmp_path)
    assert not stale.exists()
    for k in range(6):
        run_one(first, f"r{k}", prompt(k))
    assert first.stats().disk_tier.used_blocks > 0
    second = make_engine(tiny_dir, tmp_path)  # the first one's file is live: both stay
    assert len(files(tmp_path)) == 2
    assert second.stats().disk_tier.used_blocks == 0
    assert run_one(second, "r0", prompt(0)).num_cached_tokens == 0
    first.close()
    second.close()
    assert files(tmp_path) == []


def test_the_disk_tier_needs_a_host_tier(tiny_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="host KV tier"):
        make_engine(tiny_dir, tmp_path, host=0)
