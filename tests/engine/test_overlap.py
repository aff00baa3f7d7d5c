"""Async scheduling (``engine.step_loop``): a step is launched before the previous one is read
back, and the outputs are those of the synchronous engine, one call later.

Each scenario runs the real SmolLM2 twice, overlapped and synchronous, and compares tokens,
text and finish reasons; it checks the overlapped path was taken (``overlapped_steps``), that
each request's outputs arrive in order and stop at its end, and the KV pool's integrity after
every step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.step_stats import StepStats
from engine.tokenizer import Tokenizer

Arrival = tuple[str, list[int], SamplingParams]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def make_engine(smol_dir, overlap: bool, **kw) -> LLMEngine:
    opts = dict(kv_cache_bytes=32 * 1024**2, max_num_batched_tokens=32, max_num_seqs=8)
    opts.update(kw)
    return LLMEngine(EngineConfig(model_dir=str(smol_dir), async_scheduling=overlap, **opts))


@pytest.fixture(scope="module")
def engines(smol_dir) -> dict[bool, LLMEngine]:
    """An overlapped and a synchronous engine, shared by the scenarios (each ends empty)."""
    return {True: make_engine(smol_dir, True), False: make_engine(smol_dir, False)}


def drive(engine: LLMEngine, arrivals: dict[int, Iterable[Arrival]]) -> dict[str, list]:
    """Add ``arrivals[k]`` before step call k, step until nothing is left; every request's
    outputs in order. Checks the pool after every call and that nothing follows a final output."""
    outs: dict[str, list] = {}
    call = 0
    while call <= max(arrivals, default=0) or engine.has_unfinished():
        for rid, prompt, params in arrivals.get(call, ()):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            seen = outs.setdefault(out.request_id, [])
            assert not (seen and seen[-1].finished), f"{out.request_id}: output after its end"
            seen.append(out)
        engine.check_integrity()
        call += 1
        assert call < 2000, "the engine did not finish"
    assert engine.pool.num_used == 0
    return outs


def check_order(outs: list) -> None:
    """Deltas add up to the cumulative fields, one after the other, and only the last is final."""
    tokens: list[int] = []
    text = ""
    for out in outs:
        tokens += out.new_token_ids
        text += out.new_text
        assert out.token_ids == tokens and out.text == text
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def finals(outs: dict[str, list]) -> dict[str, tuple]:
    return {
        rid: (o[-1].token_ids, o[-1].text, o[-1].finish_reason, o[-1].stop_reason)
        for rid, o in outs.items()
    }


def test_a_mixed_batch_matches_the_synchronous_engine(engines, smol_dir) -> None:
    """Greedy and seeded sampled requests of several lengths, one prefilled in chunks, joining
    mid-run, ending by max_tokens, a stop string, a stop token and EOS: the same tokens as the
    synchronous engine, in order; the rows of requests that ended while a step was in flight
    are dropped, and the step stats add up to at most the wall time."""
    tok = engines[True].tokenizer
    long_prompt = tok.encode(" ".join(f"item {i}," for i in range(30)))  # chunked: > 32 tokens
    assert len(long_prompt) > 64
    question = "What is 2+2? Answer with a number only."  # ends by EOS after 8 tokens
    chat = tok.encode_chat([{"role": "user", "content": question}])
    six = tok.encode("1, 2, 3, 4, 5, 6")[-1]
    first: list[Arrival] = [
        ("greedy", tok.encode("The capital of France is"), greedy(max_tokens=9)),
        ("chunked", long_prompt, greedy(max_tokens=6)),
        ("eos", chat, greedy(max_tokens=24)),
        ("stop", tok.encode("1, 2, 3, 4,"), greedy(max_tokens=30, stop=[" 8"])),
    ]
    later: list[Arrival] = [
        ("top_p", tok.encode("My favourite animal is"),
         SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3)),
        ("top_k", tok.encode("Once upon a time"),
         SamplingParams(max_tokens=7, temperature=1.0, top_k=20, min_p=0.05, seed=11,
                        logprobs=2)),
        ("stop_id", tok.encode("1, 2, 3,"), greedy(max_tokens=20, stop_token_ids=[six])),
    ]  # fmt: skip
    results = {}
    for overlap, engine in engines.items():
        before, dropped = engine.stepper.overlapped_steps, engine.stepper.dropped_tokens
        stats: list[StepStats] = []
        engine.on_step = stats.append
        t0 = time.perf_counter()
        outs = drive(engine, {0: first, 2: later})
        wall = time.perf_counter() - t0
        engine.on_step = None
        for o in outs.values():
            check_order(o)
        results[overlap] = outs
        assert sum(s.seconds for s in stats) <= wall
        assert any(s.phase == "prefill" for s in stats) and any(s.phase == "decode" for s in stats)
        if overlap:
            assert engine.stepper.overlapped_steps - before >= 10
            # a request ended by EOS or a stop was planned into the step after its last
            assert engine.stepper.dropped_tokens - dropped >= 1
        else:
            assert (
                engine.stepper.overlapped_steps == before == 0
                and engine.stepper.dropped_tokens == 0
            )
    on, off = finals(results[True]), finals(results[False])
    assert on == off
    reasons = {rid: (f[2], f[3]) for rid, f in on.items() if rid not in ("top_p", "top_k")}
    assert reasons == {
        "greedy": ("length", None), "chunked": ("length", None), "eos": ("stop", None),
        "stop": ("stop", " 8"), "stop_id": ("stop", six),
    }  # fmt: skip
    lp_on, lp_off = (results[x]["top_k"][-1].logprobs for x in (True, False))
    assert [lp.token_id for lp in lp_on] == [lp.token_id for lp in lp_off]
    for a, b in zip(lp_on, lp_off, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_an_abort_with_a_step_in_flight_drops_its_tokens(engines) -> None:
    """Aborting a request whose token is in flight frees its blocks at once; nothing of it is
    emitted after, even when a new request takes its id before the step is read."""
    engine = engines[True]
    tok = engine.tokenizer
    story = greedy(max_tokens=60, ignore_eos=True)
    engine.add_request("a", tok.encode("Tell me a story about a dragon."), story)
    engine.add_request("b", tok.encode("The three primary colors are"), greedy(max_tokens=8))
    got: list = []
    for _ in range(4):
        got += engine.step()
    (seq,) = [s for s in engine.scheduler.running if s.request_id == "a"]
    assert seq.num_inflight == 1 and engine.has_unfinished()
    dropped = engine.stepper.dropped_tokens
    out = engine.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert seq.key not in engine.kv
    engine.check_integrity()
    engine.add_request("a", tok.encode("Water boils at"), greedy(max_tokens=4))
    after = drive(engine, {})
    assert engine.stepper.dropped_tokens == dropped + 1
    assert [len(o.token_ids) for o in after["a"]] == [1, 2, 3, 4]  # the new "a" only
    check_order(after["a"])
    check_order([o for o in got if o.request_id == "b"] + after["b"])
    reference = drive(engines[False], {0: [("a", tok.encode("Water boils at"),
                                             greedy(max_tokens=4))]})  # fmt: skip
    assert after["a"][-1].token_ids == reference["a"][-1].token_ids


def test_a_stopped_sequences_extra_step_is_dropped(engines) -> None:
    """A sequence ended by a stop string was planned into the next step; that step's token is
    dropped, it emits nothing more and holds no block. One ended by max_tokens is not planned
    again at all."""
    engine = engines[True]
    tok = engine.tokenizer
    dropped = engine.stepper.dropped_tokens
    engine.add_request("s", tok.encode("1, 2, 3, 4,"), greedy(max_tokens=30, stop=[" 6"]))
    outs = []
    while not (outs and outs[-1].finished):
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and outs[-1].text == " 5,"
    assert engine.pool.num_used == 0 and not engine.has_unfinished()
    assert engine.step() == [] and engine.stepper.dropped_tokens == dropped + 1
    engine.add_request("m", tok.encode("1, 2, 3, 4,"), greedy(max_tokens=3))
    outs = drive(engine, {})
    assert outs["m"][-1].finish_reason == "length" and engine.stepper.dropped_tokens == dropped + 1
    engine.check_integrity()


def test_rows_that_need_their_history_fall_back_to_synchronous_steps(engines) -> None:
    """A penalised request reads its outputs when it samples: its steps are read back at once
    (none stays in flight), with the synchronous engine's tokens."""
    tok = engines[True].tokenizer
    params = greedy(max_tokens=8, repetition_penalty=1.3, presence_penalty=0.5)
    arrivals = {0: [("pen", tok.encode("one one one one"), params)]}
    before = engines[True].stepper.overlapped_steps
    on, off = (drive(engines[x], arrivals) for x in (True, False))
    assert engines[True].stepper.overlapped_steps == before
    assert finals(on) == finals(off)


def test_preemption_with_a_token_in_flight_keeps_it(smol_dir) -> None:
    """A pool far too small for the batch preempts decoding sequences while their newest token
    is in flight: the token is kept when it arrives, the sequence recomputes, and the outputs
    are the synchronous engine's."""
    tok = Tokenizer(smol_dir)
    questions = ["What is 2+2?", "Name a fruit.", "Say hello.", "Count to five.",
                 "Name a colour.", "What is water?", "Name a planet.", "Say goodbye."]  # fmt: skip
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = greedy(max_tokens=16, ignore_eos=True)
    kw = dict(num_kv_blocks=10, max_num_batched_tokens=64)
    sync = make_engine(smol_dir, False, **kw)
    reference = finals(drive(sync, {0: [(f"q{i}", p, params) for i, p in enumerate(prompts)]}))
    assert sync.scheduler.num_preemptions > 0
    engine = make_engine(smol_dir, True, **kw)
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, params)
    outs: dict[str, list] = {}
    in_flight_preempted = 0
    while engine.has_unfinished():
        flying = [(s, s.num_preemptions) for s in engine.scheduler.running if s.num_inflight]
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
        in_flight_preempted += sum(s.num_preemptions > n for s, n in flying)
        engine.check_integrity()
    assert in_flight_preempted > 0 and engine.stepper.overlapped_steps > 0
    for o in outs.values():
        check_order(o)
    assert finals(outs) == reference
    assert engine.pool.num_used == 0


def test_decode_rows_take_the_tokens_in_flight_on_the_device(engines, smol_dir) -> None:
    """The CUDA-graph decode path (run eagerly off CUDA) gathers each row's token in flight
    into its static input buffer: the same tokens as the synchronous engine."""
    from tests.engine.test_spec_decode_rows import with_decode_rows

    engine = make_engine(smol_dir, True)
    graphs = with_decode_rows(engine)
    tok = engine.tokenizer
    arrivals = {
        0: [("d0", tok.encode("The quick brown fox"), greedy(max_tokens=10)),
            ("d1", tok.encode("def fibonacci(n):"), greedy(max_tokens=12)),
            ("d2", tok.encode("Water boils at"),
             SamplingParams(max_tokens=8, temperature=0.7, seed=5, logprobs=1))],
        3: [("d3", tok.encode("In 1969, the first humans"), greedy(max_tokens=6))],
    }  # fmt: skip
    on = drive(engine, arrivals)
    assert graphs.runs >= 10 and engine.stepper.overlapped_steps >= graphs.runs
    assert finals(on) == finals(drive(engines[False], arrivals))
