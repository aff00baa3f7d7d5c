"""The disk tier on CUDA: demotions written by a thread after the side stream's page-outs,
host slots reused at once in the same batch, loads through pinned staging memory on the
engine's stream; and the engine's greedy outputs with host + disk tiers equal to those without
any tier (float32), prefixes read back from disk and preempted sequences resumed. Runs only
where CUDA is present (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.disk_store import DiskStore  # noqa: E402
from engine.host_store import HostStore  # noqa: E402
from tests.conftest import make_random_model_dir  # noqa: E402
from tests.gpu.test_host_tier_gpu import run  # noqa: E402


def test_blocks_round_trip_through_disk_with_slots_reused_at_once(tmp_path) -> None:
    device = torch.device("cuda")
    pool = torch.randn(64, 2, 3, 2, 16, 64, device=device, dtype=torch.bfloat16)
    saved = pool.clone()
    store = HostStore(pool, 8)
    store.disk = DiskStore(str(tmp_path), 0, 40, store.host, pool)
    store.copy(list(range(8)), list(range(8)), [], [])  # page-outs in flight on the side stream
    # demote all eight (the writer waits for those page-outs) and reuse the slots at once
    store.copy(list(range(8, 16)), list(range(8)), [], [], (), list(range(8)), list(range(8)))
    store.copy([], [], [], [], (), (), (), list(range(7, -1, -1)), list(range(40, 48)))
    store.synchronize()
    assert torch.equal(pool[40:48], saved[:8].flip(0))
    assert torch.equal(store.host.to(device), saved[8:16])
    # longer than the staging buffer: both halves reused
    store.copy([], [], [], [], (), list(range(8)), list(range(8, 16)))
    store.copy([], [], [], [], (), (), (), list(range(40)), list(range(20, 60)))
    store.synchronize()
    assert torch.equal(pool[28:36], saved[8:16])
    store.disk.close()


@pytest.mark.parametrize("together", [False, True], ids=["evicted-prefixes", "preemption"])
def test_greedy_outputs_are_the_same_with_host_and_disk_tiers(tmp_path, tokenizer_dir, together):
    model = make_random_model_dir(tmp_path, tokenizer_dir, "llama")
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(40 + 5 * i)] for i in range(6)]
    if not together:
        prompts += prompts[:3]  # the first three again: out of the pool and the host tier
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    opts = dict(model_dir=str(model), device="cuda", dtype="float32", num_kv_blocks=16,
                max_num_batched_tokens=128, max_num_seqs=6, kv_swap_min_tokens=16,
                max_model_len=160)  # fmt: skip
    base = LLMEngine(EngineConfig(**opts, kv_host_cache_gib=0.0))
    want = run(base, prompts, params, together)
    block = base.runner.layout.block_bytes
    del base
    engine = LLMEngine(EngineConfig(
        **opts, kv_host_cache_gib=4 * block / 1024**3, kv_disk_cache_dir=str(tmp_path / "kv"),
        kv_disk_cache_gib=64 * block / 1024**3,
    ))  # fmt: skip
    got = run(engine, prompts, params, together)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    stats = engine.stats()
    assert stats.disk_tier is not None and stats.disk_tier.page_out_blocks > 0
    if together:
        assert stats.num_preemptions > 0
    else:
        assert stats.disk_tier.hit_blocks > 0
        assert all(got[f"r{k}"][1] > 0 for k in (6, 7, 8))
    engine.close()
