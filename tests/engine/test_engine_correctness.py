"""Greedy output is token-identical to transformers (fp32 CPU) while requests share a
continuous batch, arrive mid-run, prefill in several chunks and hit the prefix cache.

Logit tolerance: the engine and transformers run the same fp32 math in a different order
(paged gather + SDPA with an explicit mask vs. a dense cache), so logits agree to
``LOGIT_ATOL`` = 2e-3 absolute (observed max ~1e-4 on SmolLM2), not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import hf_greedy, load_hf

LOGIT_ATOL = 2e-3
MAX_NEW = 24
SYSTEM = (
    "You are a meticulous assistant for a logistics company. You answer questions about "
    "shipping routes, warehouse capacity, customs paperwork and delivery windows. Always "
    "state assumptions, keep answers short, and never invent tracking numbers."
)
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "The three primary colors are",
    "import numpy as np\n\nx = np.arange(10)\n",
    "Water boils at",
    "A haiku about autumn:\n",
    "The quick brown fox",
    "SELECT name, email FROM users WHERE",
    "Photosynthesis is the process by which",
    "In 1969, the first humans",
]
QUESTIONS = [
    "What is 2+2?",
    "Name a fruit that is yellow.",
    "Write one sentence about the moon.",
    "How many days are in a week?",
    "Translate 'hello' into French.",
    "What colour is the sky on a clear day?",
]
LONG = (
    "Summarise the following report in one sentence.\n\n"
    + " ".join(
        f"Section {i}: shipment volumes rose by {i * 3} percent while delays fell by {i} hours."
        for i in range(1, 15)
    )
    + "\n\nSummary:"
)


def chat(tok, question: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    return tok.encode_chat([*messages, {"role": "user", "content": question}])


def run_with_arrivals(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, waves: list[int]
) -> dict[str, object]:
    """Add ``waves[k]`` prompts every 3 steps until all are in; run to completion."""
    pending = list(enumerate(prompts))
    finals: dict[str, object] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            take = waves[min(step // 3, len(waves) - 1)]
            for i, p in pending[:take]:
                engine.add_request(f"r{i}", p, params)
            pending = pending[take:]
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
        assert step < 5000, "engine did not finish"
    return finals


@pytest.fixture(scope="module")
def smol_prompts(smol_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    prompts = [tok.encode(p) for p in PLAIN]
    prompts += [chat(tok, q) for q in QUESTIONS[:4]]
    prompts += [chat(tok, q, SYSTEM) for q in QUESTIONS[4:]]
    prompts += [tok.encode(LONG), chat(tok, LONG)]
    assert len(prompts) >= 20 and max(len(p) for p in prompts) > 4 * 64
    return prompts


@pytest.fixture(scope="module")
def smol_hf(smol_dir):
    return load_hf(smol_dir)


@pytest.fixture(scope="module")
def smol_reference(smol_hf, smol_prompts):
    return [hf_greedy(smol_hf, p, MAX_NEW) for p in smol_prompts]


def make_engine(model_dir, **kw) -> LLMEngine:
    opts = dict(max_num_batched_tokens=64, max_num_seqs=16, kv_cache_bytes=256 * 1024**2)
    opts.update(kw)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **opts))


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


def test_smol_continuous_batch_matches_transformers(smol_dir, smol_prompts, smol_reference):
    engine = make_engine(smol_dir)
    finals = run_with_arrivals(engine, smol_prompts, GREEDY, waves=[6, 4, 4, 3])
    mismatches = [i for i, ref in enumerate(smol_reference) if finals[f"r{i}"].token_ids != ref]
    assert mismatches == []
    engine.check_integrity()
    assert engine.pool.num_used == 0

    # Second round on the warm cache: repeats hit in full (copy-on-write of the last block),
    # shared system prompts hit partially. Still token-identical.
    hits_before = engine.stats().prefix_hit_tokens
    again = run_with_arrivals(engine, smol_prompts, GREEDY, waves=[10, 10, 10])
    assert [again[f"r{i}"].token_ids for i in range(len(smol_prompts))] == smol_reference
    cached = [again[f"r{i}"].num_cached_tokens for i in range(len(smol_prompts))]
    assert all(c >= (len(p) - 1) // 16 * 16 - 16 for c, p in zip(cached, smol_prompts, strict=True))
    assert sum(cached) > 0.8 * sum(len(p) for p in smol_prompts)
    assert engine.stats().prefix_hit_tokens - hits_before == sum(cached)
    engine.check_integrity()
    assert engine.pool.num_used == 0


def test_shared_system_prompt_hits_and_matches(smol_dir, smol_hf):
    engine = make_engine(smol_dir)
    tok = engine.tokenizer
    first = chat(tok, QUESTIONS[0], SYSTEM)
    engine.add_request("warm", first, GREEDY)
    while engine.has_unfinished():
        engine.step()
    others = [chat(tok, q, SYSTEM) for q in QUESTIONS[1:4]]
    finals = run_with_arrivals(engine, others, GREEDY, waves=[3])
    shared = len(tok.encode_chat([{"role": "system", "content": SYSTEM}])) // 16 * 16
    for i, p in enumerate(others):
        out = finals[f"r{i}"]
        assert out.num_cached_tokens >= shared
        assert out.token_ids == hf_greedy(smol_hf, p, MAX_NEW)


def test_preemption_under_a_tiny_pool_keeps_outputs(smol_dir, smol_prompts, smol_reference):
    # 16 blocks of 16 tokens: far less than the batch needs, so sequences get preempted and
    # recomputed; outputs must not change.
    engine = make_engine(smol_dir, num_kv_blocks=16, max_num_batched_tokens=128, max_num_seqs=8)
    picked = list(range(18))  # everything but the two long prompts
    finals = run_with_arrivals(engine, [smol_prompts[i] for i in picked], GREEDY, waves=[18])
    assert engine.scheduler.num_preemptions > 0
    for k, i in enumerate(picked):
        assert finals[f"r{k}"].token_ids == smol_reference[i]
    engine.check_integrity()
    assert engine.pool.num_used == 0


def test_smol_logits_match_transformers(smol_dir, smol_hf, smol_prompts):
    engine = make_engine(smol_dir)
    for p in smol_prompts[:3] + smol_prompts[-1:]:
        ours = engine.score(p)
        with torch.no_grad():
            ref = smol_hf(torch.tensor([p])).logits[0].float()
        assert (ours - ref).abs().max().item() < LOGIT_ATOL
    assert engine.pool.num_used == 0


def test_prompt_logprobs_match_transformers(smol_dir, smol_hf, smol_prompts, monkeypatch):
    """Each prompt token's logprob, rank and top 3 (vLLM's prompt_logprobs, what echo with
    logprobs answers) against transformers' log-softmax, with the LM head taken 5 rows at a
    time so that the pass's chunks join up; nothing is left in the pool."""
    from engine import model_runner

    engine = make_engine(smol_dir)
    monkeypatch.setattr(model_runner, "SCORE_ELEMENTS", 5 * engine.runner.sampler_width)
    # The prefix cache is not read: a prompt that was just prefilled is scored in full again.
    run_with_arrivals(engine, [smol_prompts[-1]], SamplingParams(max_tokens=1), waves=[1])
    for p in [smol_prompts[0], smol_prompts[-1], smol_prompts[1][:1]]:
        ours = engine.prompt_logprobs(p, 3)
        assert [e.token_id for e in ours] == p[1:]
        with torch.no_grad():
            ref = torch.log_softmax(smol_hf(torch.tensor([p])).logits[0].float(), dim=-1)
        for i, e in enumerate(ours):
            row, want = ref[i], ref[i, p[i + 1]].item()
            assert abs(e.logprob - want) < LOGIT_ATOL
            # The rank, allowing for ties within the tolerance.
            lo, hi = ((row > want + d).sum().item() + 1 for d in (LOGIT_ATOL, -LOGIT_ATOL))
            assert lo <= e.rank <= hi
            top_lp, top_ids = row.topk(3)
            assert len(e.top) == 3
            for (t, lp), rt, rlp in zip(e.top, top_ids.tolist(), top_lp.tolist(), strict=True):
                assert abs(lp - rlp) < LOGIT_ATOL
                assert t == rt or abs(row[t].item() - rlp) < LOGIT_ATOL
    assert engine.prompt_logprobs(smol_prompts[0], 0)[0].top == ()
    with pytest.raises(ValueError, match="top_logprobs"):
        engine.prompt_logprobs(smol_prompts[0], 21)
    assert engine.pool.num_used == 0


def test_a_prompt_alone_runs_in_chunks_of_the_step_budget(smol_dir, smol_prompts):
    """Embeddings and prompt logprobs run a prompt outside the batch; it goes in chunks of
    max_num_batched_tokens (the activation peak the memory plan measured), each attending to
    the ones before, and gives what one pass gives."""
    small = make_engine(smol_dir, max_num_batched_tokens=16)
    one = make_engine(smol_dir, max_num_batched_tokens=512)
    p = smol_prompts[-1]
    assert len(p) > 4 * 16
    steps = []
    hidden_all = small.runner.hidden_all
    small.runner.hidden_all = lambda sched: steps.append(sched.num_tokens) or hidden_all(sched)
    cos = torch.nn.functional.cosine_similarity(small.embed(p), one.embed(p), dim=0)
    assert steps == [16] * (len(p) // 16) + ([len(p) % 16] if len(p) % 16 else [])
    assert cos.item() > 0.99999
    a, b = small.prompt_logprobs(p, 2), one.prompt_logprobs(p, 2)
    assert [e.token_id for e in a] == [e.token_id for e in b] == p[1:]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b, strict=True)) < 1e-4
    assert small.pool.num_used == 0


@pytest.mark.parametrize("fixture", ["qwen2_dir", "llama3_rope_dir"])
def test_random_models_match_transformers(fixture, request, smol_prompts):
    model_dir = request.getfixturevalue(fixture)
    hf = load_hf(model_dir)
    engine = make_engine(model_dir, max_num_batched_tokens=48)
    prompts = smol_prompts[:8] + smol_prompts[-2:]
    finals = run_with_arrivals(engine, prompts, GREEDY, waves=[4, 3, 3])
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"].token_ids == hf_greedy(hf, p, MAX_NEW), f"prompt {i}"
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        assert (engine.score(p) - ref).abs().max().item() < LOGIT_ATOL
    engine.check_integrity()
