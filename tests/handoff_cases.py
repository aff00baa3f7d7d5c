"""A prefill → decode hand-off through the engines' block I/O (what the transports move), for
tests on the CPU and on CUDA: the decode engine must continue exactly like one engine doing
both."""

from __future__ import annotations

from collections.abc import Callable

from engine import LLMEngine, SamplingParams


def greedy_alone(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy request with nothing else in the batch (results depend on the batch)."""
    engine.add_request("alone", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    assert final is not None and final.finished
    return final.token_ids


def handed_off(
    prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], max_tokens: int
) -> tuple[list[int], int]:
    """Prefill ``prompt`` on ``prefill`` (blocks held), move the blocks as raw bytes into blocks
    ``decode`` reserved, decode there; returns the tokens and the bytes moved."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    prefill.add_request(rid, prompt, params, hold_kv=True)
    first = None
    while prefill.has_unfinished():
        for out in prefill.step():
            first = out
    assert first is not None and first.kv_held
    data = prefill.handoff.read_blocks(prefill.handoff.held_block_ids(rid))
    assert {len(b) for b in data} == {prefill.runner.block_bytes}
    reserved, cached = decode.handoff.reserve(rid, prompt)
    skip = cached // decode.config.block_size
    decode.handoff.write_blocks(reserved[skip:], data[skip:])
    prefill.handoff.release(rid)
    decode.handoff.add_prefilled(rid, prompt, first.token_ids[0], params, num_cached_tokens=cached)
    final = None
    while decode.has_unfinished():
        for out in decode.step():
            final = out
    assert final is not None
    return final.token_ids, sum(len(b) for b in data[skip:])


def check_handoff_matches_colocated(
    make: Callable[[], LLMEngine], prompts: list[list[int]], max_tokens: int = 12
) -> list[int]:
    """Three engines from ``make``: one colocated, a prefill and a decode one. Asserts every
    prompt's handed-off tokens equal the colocated engine's and that both sides end with
    nothing held; returns the bytes moved per prompt."""
    colocated, prefill, decode = make(), make(), make()
    moved = []
    for i, prompt in enumerate(prompts):
        ref = greedy_alone(colocated, prompt, max_tokens)
        got, nbytes = handed_off(prefill, decode, f"h{i}", prompt, max_tokens)
        assert got == ref, (i, got, ref)
        moved.append(nbytes)
    for e in (colocated, prefill, decode):
        e.check_integrity()
        assert e.pool.num_used == 0
    return moved
