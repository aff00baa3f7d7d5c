"""Prefill hand-off and decode take-over between two engines in one process: the KV bytes of
the held blocks are copied across, and the decode engine continues token-identically."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import RequestNotFoundError


@pytest.fixture(scope="module")
def pair(smol_dir):
    def make() -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2, max_num_batched_tokens=64
            )
        )

    return make(), make()


def run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


def handoff(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt, params) -> list[int]:
    prefill.add_request(rid, prompt, params, hold_kv=True)
    (first,) = [o for o in run(prefill) if o.request_id == rid]
    assert first.kv_held and first.finish_reason is None
    blocks = prefill.handoff.held_block_ids(rid)
    reserved, cached = decode.handoff.reserve(rid, prompt)
    skip = cached // decode.config.block_size
    decode.handoff.write_blocks(reserved[skip:], prefill.handoff.read_blocks(blocks[skip:]))
    assert prefill.handoff.release(rid)
    decode.handoff.add_prefilled(rid, prompt, first.token_ids[0], params, num_cached_tokens=cached)
    final = [o for o in run(decode) if o.request_id == rid][-1]
    assert final.finished
    return final.token_ids


def test_handoff_is_token_identical(pair, smol_dir):
    prefill, decode = pair
    tok = decode.tokenizer
    params = SamplingParams(max_tokens=20, temperature=0)
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode_chat([{"role": "user", "content": "Name three rivers in Europe."}]),
        tok.encode(" ".join(f"item {i}," for i in range(60))),
    ]
    offline = LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2))
    for i, p in enumerate(prompts):
        offline.add_request(f"o{i}", p, params)
    ref = {o.request_id: o.token_ids for o in run(offline) if o.finished}
    for i, p in enumerate(prompts):
        assert handoff(prefill, decode, f"h{i}", p, params) == ref[f"o{i}"]
    # Second time the decode engine already caches the prompts' full blocks.
    assert handoff(prefill, decode, "again", prompts[2], params) == ref["o2"]
    for e in (prefill, decode):
        e.check_integrity()
        assert e.pool.num_used == 0 and e.handoff.num_held == 0


def test_seeded_handoff_matches_offline(pair, smol_dir):
    prefill, decode = pair
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=3)
    prompt = decode.tokenizer.encode("Write a sentence about cats:")
    offline = LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2))
    offline.add_request("o", prompt, params)
    ref = [o for o in run(offline) if o.finished][0].token_ids

    prefill.add_request("s", prompt, params, hold_kv=True)
    (first,) = run(prefill)
    state = prefill.handoff.generator_state("s")
    blocks = prefill.handoff.held_block_ids("s")
    reserved, _ = decode.handoff.reserve("s", prompt)
    decode.handoff.write_blocks(reserved, prefill.handoff.read_blocks(blocks))
    prefill.handoff.release("s")
    decode.handoff.add_prefilled("s", prompt, first.token_ids[0], params, generator_state=state)
    assert [o for o in run(decode) if o.finished][0].token_ids == ref


def test_abort_and_release_free_everything(pair):
    prefill, decode = pair
    prompt = list(range(100, 150))
    prefill.add_request("x", prompt, SamplingParams(max_tokens=5), hold_kv=True)
    run(prefill)
    assert prefill.pool.num_used > 0 and prefill.handoff.num_held == 1
    assert prefill.abort("x") is None  # held blocks are dropped by abort too
    assert prefill.pool.num_used == 0 and prefill.handoff.num_held == 0
    decode.handoff.reserve("y", prompt)
    assert decode.pool.num_used > 0
    decode.abort("y")
    assert decode.pool.num_used == 0
    with pytest.raises(RequestNotFoundError):
        decode.handoff.add_prefilled("y", prompt, 5, SamplingParams())
    prefill.check_integrity()
    decode.check_integrity()


def test_a_migrated_request_resumes_token_identically(pair) -> None:
    """A request that streamed k tokens elsewhere, resumed here from prompt + those tokens
    (recomputed), continues as an uninterrupted run would: greedy, seeded sampling (its
    generator advanced past the k draws), and a stop string held back across the cut."""
    from engine.handoff import FirstToken

    whole, resumed = pair
    tok = whole.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Write a short poem about rivers."}])
    cases = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=1234, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, stop=["\n\n"]),
    ]
    for i, params in enumerate(cases):
        whole.add_request(f"w{i}", prompt, params)
        outs = [o for o in run(whole) if o.request_id == f"w{i}"]
        ref = outs[-1]
        for k in (1, len(ref.token_ids) // 2):
            done = ref.token_ids[:k]
            streamed_text = "".join(o.new_text for o in outs[:k])
            first = FirstToken(0, done[-1], earlier=tuple(done[:-1]))
            resumed.handoff.add_prefilled(
                f"m{i}-{k}", prompt, None, params, recompute=True, firsts=[first]
            )
            rest = [o for o in run(resumed) if o.request_id == f"m{i}-{k}"]
            assert rest[-1].token_ids == ref.token_ids, (i, k)
            assert streamed_text + "".join(o.new_text for o in rest) == ref.text, (i, k)
            assert rest[-1].finish_reason == ref.finish_reason
            assert sum(len(o.new_token_ids) for o in rest) == len(ref.token_ids) - k
    resumed.check_integrity()


def test_a_running_request_moves_with_its_kv_and_continues_token_identically(pair) -> None:
    """Live KV migration between two engines: after k decode steps the request leaves the first
    engine's batch with its KV held (prompt + every output token but the last), its blocks are
    copied to the second engine, which continues without recomputing and matches an
    uninterrupted run (greedy and seeded)."""
    from engine.handoff import FirstToken

    a, b = pair
    prompt = a.tokenizer.encode("The three most useful kitchen tools are")
    for i, params in enumerate([
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True),
    ]):  # fmt: skip
        a.add_request(f"ref{i}", prompt, params)
        ref = [o for o in run(a) if o.request_id == f"ref{i}"][-1]
        rid = f"mv{i}"
        a.add_request(rid, prompt, params)
        outs = []
        while len(outs) < 5:
            outs += [o for o in a.step() if o.request_id == rid]
        held = a.handoff.hold_for_move(rid)
        assert held is not None and held.output_token_ids == tuple(outs[-1].token_ids)
        assert held.num_tokens == len(prompt) + len(held.output_token_ids) - 1
        done = list(held.output_token_ids)
        kv_tokens = prompt + done[:-1]
        dst, cached = b.handoff.reserve(rid, kv_tokens)
        skip = cached // b.config.block_size
        b.handoff.write_blocks(dst[skip:], a.handoff.read_blocks(list(held.block_ids)[skip:]))
        assert a.handoff.release(rid) and not a.has_unfinished()
        first = FirstToken(0, done[-1], None, held.generator_state, tuple(done[:-1]))
        b.handoff.add_prefilled(rid, prompt, None, params, firsts=[first])
        seq = b.tables.requests[rid].parent
        assert seq.num_computed == held.num_tokens  # nothing is computed again
        rest = [o for o in run(b) if o.request_id == rid]
        assert rest[-1].token_ids == ref.token_ids, i
        assert "".join(o.new_text for o in outs + rest) == ref.text
    a.check_integrity()
    b.check_integrity()
