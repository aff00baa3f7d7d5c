"""Speculative decoding through the engine on CPU: greedy output token-exact against the same
engine without it (bundled SmolLM2 and random Llama/Qwen2 folders), with chunked prefill,
arrivals mid-run, preemption, a warm prefix cache and a prefill -> decode hand-off; limits,
stops and logprobs unchanged; sampling keeps its distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.test_engine_correctness import PLAIN, QUESTIONS, chat, run_with_arrivals

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}
GREEDY = SamplingParams(max_tokens=24, temperature=0)
CODE = """def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
"""
REPETITIVE = [
    "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue,",
    CODE + "\n# The same three functions again:\n",
    "Quote: 'the cat sat on the mat'. Repeat the quote three times: 'the cat sat on the mat'. ",
]


def make_engine(model_dir, spec: dict | None, **kw) -> LLMEngine:
    opts = dict(max_num_batched_tokens=64, max_num_seqs=16, kv_cache_bytes=128 * 1024**2)
    opts.update(kw)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), speculative_config=spec, **opts))


def prompts_for(engine: LLMEngine, full: bool = False) -> list[list[int]]:
    tok = engine.tokenizer
    out = [tok.encode(p) for p in REPETITIVE] + [tok.encode(PLAIN[1])]
    out += [chat(tok, "Rewrite with `a` renamed to `x`:\n" + CODE)]
    if full:
        out += [tok.encode(p) for p in PLAIN[2:8]] + [chat(tok, q) for q in QUESTIONS[:3]]
    return out


def outputs(engine: LLMEngine, prompts, params=GREEDY, waves=(3, 3, 3)) -> list[list[int]]:
    finals = run_with_arrivals(engine, prompts, params, waves=list(waves))
    engine.check_integrity()
    assert engine.pool.num_used == 0
    return [finals[f"r{i}"].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def smol_pair(smol_dir):
    return make_engine(smol_dir, None), make_engine(smol_dir, SPEC)


def test_smol_greedy_is_token_exact_and_drafts_are_kept(smol_pair):
    base, spec = smol_pair
    prompts = prompts_for(base)
    ref = outputs(base, prompts)
    assert outputs(spec, prompts) == ref
    s = spec.stats().spec
    assert s.drafts > 0 and s.accepted_tokens > 0.3 * s.draft_tokens
    assert s.accepted_per_pos[0] >= s.accepted_per_pos[-1]
    assert sum(s.accepted_per_pos) == s.accepted_tokens
    # Second round on the warm prefix cache (full and partial hits): still exact.
    hits = spec.stats().prefix_hit_tokens
    assert outputs(spec, prompts, waves=(12,)) == ref
    assert spec.stats().prefix_hit_tokens > hits


@pytest.mark.slow
def test_smol_greedy_is_token_exact_on_more_prompts_and_under_preemption(smol_dir, smol_pair):
    base, spec = smol_pair
    prompts = prompts_for(base, full=True)
    ref = outputs(base, prompts, waves=(6, 4, 4))
    assert outputs(spec, prompts, waves=(6, 4, 4)) == ref
    tiny = make_engine(smol_dir, SPEC, num_kv_blocks=14, max_num_batched_tokens=96, max_num_seqs=6)
    picked = [i for i, p in enumerate(prompts) if len(p) <= 64]
    assert outputs(tiny, [prompts[i] for i in picked], waves=(len(picked),)) == [
        ref[i] for i in picked
    ]
    assert tiny.scheduler.num_preemptions > 0 and tiny.stats().spec.accepted_tokens > 0


class PerSequence:
    """The engine's proposer interface over a per-sequence ``propose`` (test proposers)."""

    def propose_all(self, seqs, limits) -> list[list[int]]:
        return [self.propose(s, n) for s, n in zip(seqs, limits, strict=True)]  # type: ignore[attr-defined]

    def retain(self, running) -> None:
        pass


class Oracle(PerSequence):
    """Drafts each sequence's reference continuation, with a wrong last token every other
    time: long drafts kept in full, and rejections at every position."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], k: int) -> None:
        self.refs, self.k, self.calls = refs, k, 0

    def propose(self, seq, limit: int) -> list[int]:
        ref = self.refs[tuple(seq.prompt_token_ids)]
        n = len(seq.output_token_ids)
        draft = ref[n : n + min(self.k, limit)]
        self.calls += 1
        if draft and self.calls % 2:
            draft[-1] = (draft[-1] + 1) % 1000
        return draft


@pytest.mark.parametrize("fixture", ["qwen2_dir", "llama3_rope_dir"])
def test_random_models_greedy_is_token_exact(fixture, request):
    """Random-weight Llama/Qwen2 folders with drafts from the reference output (random text
    rarely repeats itself, so n-gram drafts would seldom be tested there)."""
    model_dir = request.getfixturevalue(fixture)
    base = make_engine(model_dir, None, max_num_batched_tokens=48)
    spec = make_engine(model_dir, SPEC, max_num_batched_tokens=48)
    prompts = prompts_for(base)
    params = SamplingParams(max_tokens=40, temperature=0)
    ref = outputs(base, prompts, params)
    spec.proposer = Oracle({tuple(p): r for p, r in zip(prompts, ref, strict=True)}, 4)  # type: ignore[assignment]
    assert outputs(spec, prompts, params) == ref
    s = spec.stats().spec
    assert s.accepted_tokens > 0.5 * s.draft_tokens and s.accepted_per_pos[3] > 0


def test_preemption_and_prefix_cache_with_drafts_keep_outputs(qwen2_dir):
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0)
    base = make_engine(qwen2_dir, None)
    ref = outputs(base, prompts, params, waves=(6,))
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, ref, strict=True)}, 4)
    tiny = make_engine(qwen2_dir, SPEC, num_kv_blocks=12, max_num_batched_tokens=64)
    tiny.proposer = oracle  # type: ignore[assignment]
    assert outputs(tiny, prompts, params, waves=(6,)) == ref
    assert tiny.scheduler.num_preemptions > 0 and tiny.stats().spec.accepted_tokens > 0
    # Again on the warm cache (the prompts' full blocks are cached, drafted ones never were).
    assert outputs(tiny, prompts[-2:], params, waves=(1,)) == ref[-2:]
    assert tiny.stats().prefix_hit_tokens > 0


def test_limits_stops_and_logprobs_match(smol_pair):
    base, spec = smol_pair
    prompt = base.tokenizer.encode(REPETITIVE[0])
    for params in (
        SamplingParams(max_tokens=7, temperature=0),
        SamplingParams(max_tokens=40, temperature=0, stop=["blue, red"]),
        SamplingParams(max_tokens=20, temperature=0, logprobs=2),
    ):
        a, b = (run_one(e, prompt, params) for e in (base, spec))
        assert b.token_ids == a.token_ids
        assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason)
        if params.logprobs:
            assert len(b.logprobs) == len(b.token_ids)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-3)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    # A context limit: the drafts never run past it.
    short = make_engine(base.config.model_dir, SPEC, max_model_len=len(prompt) + 9)
    out = run_one(short, prompt, SamplingParams(max_tokens=9, temperature=0))
    assert len(out.token_ids) == 9 and out.finish_reason == "length"


def run_one(engine: LLMEngine, prompt, params):
    engine.add_request("one", prompt, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out
    return final


def test_streamed_deltas_carry_several_tokens(smol_pair):
    _, spec = smol_pair
    prompt = spec.tokenizer.encode(REPETITIVE[0])
    spec.add_request("st", prompt, SamplingParams(max_tokens=30, temperature=0))
    deltas = []
    while spec.has_unfinished():
        deltas += [o for o in spec.step() if o.request_id == "st"]
    assert max(len(d.new_token_ids) for d in deltas) > 1
    assert sum((d.new_token_ids for d in deltas), []) == deltas[-1].token_ids
    assert "".join(d.new_text for d in deltas) == deltas[-1].text


def handoff(prefill, decode, prompt: list[int], params: SamplingParams):
    """Prefill ``prompt`` on ``prefill`` holding its KV, move the blocks into ``decode`` (a
    disaggregated hand-off without the network) and decode there; the final output."""
    prefill.add_request("h", prompt, params, hold_kv=True)
    (first,) = [o for o in drain(prefill) if o.request_id == "h"]
    reserved, _ = decode.handoff.reserve("h", prompt)
    decode.handoff.write_blocks(
        reserved, prefill.handoff.read_blocks(prefill.handoff.held_block_ids("h"))
    )
    prefill.handoff.release("h")
    decode.handoff.add_prefilled("h", prompt, first.token_ids[0], params)
    return [o for o in drain(decode) if o.finished][-1]


def test_handoff_decode_worker_drafts_from_the_whole_history(smol_dir, smol_pair):
    """The decode engine (speculating) continues a request prefilled elsewhere; its drafts come
    from prompt + first token, and the output equals the offline non-speculative one."""
    base, _ = smol_pair
    prefill = make_engine(smol_dir, None)
    decode = make_engine(smol_dir, SPEC)
    prompt = base.tokenizer.encode(REPETITIVE[1])
    params = SamplingParams(max_tokens=32, temperature=0)
    (ref,) = outputs(base, [prompt], params, waves=(1,))
    final = handoff(prefill, decode, prompt, params)
    assert final.token_ids == ref
    assert decode.stats().spec.accepted_tokens > 0
    for e in (prefill, decode):
        e.check_integrity()
        assert e.pool.num_used == 0


def drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


class FixedDraft(PerSequence):
    """A proposer that always drafts the same tokens (to test verification on its own)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, seq, limit: int) -> list[int]:
        return self.tokens[: max(limit, 0)]


def test_sampling_distribution_is_kept_through_the_engine(qwen2_dir):
    """Two tokens after the first, sampled 600 times with and without a forced draft: the two
    empirical joint distributions agree (chi-square two-sample test at 0.1%)."""
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s) for s in range(600)]
    prompt = list(range(300, 340))
    base = make_engine(qwen2_dir, None, max_num_seqs=600, max_num_batched_tokens=4096)
    spec = make_engine(qwen2_dir, SPEC, max_num_seqs=600, max_num_batched_tokens=4096)
    probe = run_one(base, prompt, SamplingParams(max_tokens=2, temperature=0))
    spec.proposer = FixedDraft([probe.token_ids[1]])  # type: ignore[assignment]

    a, b = joint_counts(base, prompt, params), joint_counts(spec, prompt, params)
    assert spec.stats().spec.accepted_tokens > 50
    assert_same_distribution(a, b)


def joint_counts(engine: LLMEngine, prompt, params, at=(1, 2)) -> dict[tuple[int, ...], int]:
    """How often each tuple of the output tokens at positions ``at`` came out, one request per
    params."""
    for i, p in enumerate(params):
        engine.add_request(f"d{i}", prompt, p)
    counts: dict[tuple[int, ...], int] = {}
    for out in drain(engine):
        if out.finished:
            key = tuple(out.token_ids[j] for j in at)
            counts[key] = counts.get(key, 0) + 1
    return counts


def assert_same_distribution(a: dict, b: dict) -> None:
    """Chi-square two-sample test at 0.1% on two empirical distributions (counts by outcome),
    over the outcomes with at least 5 expected counts."""
    keys = sorted(set(a) | set(b))
    ca, cb = np.array([a.get(k, 0) for k in keys]), np.array([b.get(k, 0) for k in keys])
    pooled = (ca + cb) / (ca.sum() + cb.sum())
    keep = pooled * min(ca.sum(), cb.sum()) >= 5
    stat = sum(
        (c[keep] - c.sum() * pooled[keep]) ** 2 / (c.sum() * pooled[keep]) for c in (ca, cb)
    ).sum()
    df = int(keep.sum()) - 1
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert stat < crit, (stat, df, a, b)


def test_drafts_share_a_step_with_grammars_forks_and_logit_bias(smol_pair):
    """A step where one sequence verifies a draft while others sample plainly: a JSON-schema
    request (its grammar mask applies to its row only; it never drafts), n = 2 forks of one
    prompt, and a logit-biased request. Every output equals the engine without speculation."""
    from engine.grammar import GrammarSpec

    base, spec = smol_pair
    tok = base.tokenizer
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    ask = tok.encode_chat([{"role": "user", "content": "Give a JSON object with a number n."}])
    greedy = dict(max_tokens=24, temperature=0)
    requests = [
        ("rep", tok.encode(REPETITIVE[0]), SamplingParams(**greedy)),
        ("json", ask, SamplingParams(**greedy, grammar=GrammarSpec.json_schema(schema))),
        ("two", tok.encode(REPETITIVE[2]), SamplingParams(**greedy, n=2)),
        ("bias", tok.encode(REPETITIVE[0]), SamplingParams(**greedy, logit_bias=((11, 5.0),))),
    ]

    def run(engine: LLMEngine) -> dict:
        for rid, prompt, params in requests:
            engine.add_request(rid, prompt, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[(out.request_id, out.index)] = out.token_ids
        engine.check_integrity()
        return done

    drafts = spec.stats().spec.drafts
    assert run(spec) == run(base)
    assert spec.stats().spec.drafts > drafts
