"""The host tier on CUDA: pinned host blocks, page-outs on a side stream, page-ins on the
engine's stream, events guarding blocks a page-out still reads; and the engine's greedy
outputs with the tier equal to those without it (float32), evicted prefixes paged back in and
preempted sequences swapped back in. Runs only where CUDA is present (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.host_store import HostStore  # noqa: E402
from tests.conftest import make_random_model_dir  # noqa: E402


def test_blocks_round_trip_through_pinned_host_memory() -> None:
    device = torch.device("cuda")
    pool = torch.randn(32, 2, 3, 2, 16, 64, device=device, dtype=torch.bfloat16)
    saved = pool.clone()
    store = HostStore(pool, 16)
    assert store.host.is_pinned() and store.stream is not None
    blocks, slots = [3, 4, 5, 9, 20, 21], [0, 1, 2, 7, 8, 15]
    store.copy(blocks, slots, [], [])
    # Blocks 3 and 20 are handed out again and written: the engine's stream waits first.
    store.guard([3, 20])
    pool[[3, 20]] = 0
    store.copy([], [], slots, [10, 11, 12, 13, 14, 15])
    store.synchronize()
    assert torch.equal(pool[10:16], saved[blocks])
    assert store.out_seconds > 0 and store.in_seconds > 0
    store.settle(blocks)  # nothing in flight any more: returns at once


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, together: bool):
    finals = {}
    if together:
        for k, p in enumerate(prompts):
            engine.add_request(f"r{k}", p, params)
    for k, p in enumerate(prompts):
        if not together:
            engine.add_request(f"r{k}", p, params)
        while engine.has_unfinished() and (together or f"r{k}" not in finals):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = (out.token_ids, out.num_cached_tokens)
    engine.check_integrity()
    assert engine.pool.num_used == 0
    return finals


@pytest.mark.parametrize("together", [False, True], ids=["evicted-prefixes", "preemption"])
def test_greedy_outputs_are_the_same_with_the_tier(tmp_path, tokenizer_dir, together) -> None:
    model = make_random_model_dir(tmp_path, tokenizer_dir, "llama")
    prompts = [[(7 * i + 3 * j) % 4000 + 10 for j in range(40 + 5 * i)] for i in range(6)]
    if not together:
        prompts += prompts[:3]  # the first three again, evicted from the 12-block pool
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    out, stats = {}, {}
    for name, gib in (("base", 0.0), ("tier", 0.01)):
        engine = LLMEngine(EngineConfig(
            model_dir=str(model), device="cuda", dtype="float32", num_kv_blocks=16,
            max_num_batched_tokens=128, max_num_seqs=6, kv_host_cache_gib=gib, max_model_len=160,
            kv_swap_min_tokens=16,
        ))  # fmt: skip
        out[name] = run(engine, prompts, params, together)
        stats[name] = engine.stats()
    assert {k: v[0] for k, v in out["tier"].items()} == {k: v[0] for k, v in out["base"].items()}
    tier = stats["tier"].tier
    assert tier is not None and tier.page_in_blocks > 0
    if together:
        assert stats["tier"].num_preemptions > 0 and tier.swaps > 0
    else:
        assert all(out["tier"][f"r{k}"][1] > 0 for k in (6, 7, 8))
