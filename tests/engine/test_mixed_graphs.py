"""Piecewise graphs for mixed steps (``engine.mixed_graphs``) on the CPU: nothing is captured
here, so ``MixedGraphs.run`` runs the same padded piece loop eagerly on its static buffers. Its
hidden states and logits must be the plain forward's on mixed batches (decode rows, prompt
chunks, chunks over a cached prefix, ids in flight), whatever earlier steps left in the padded
rows, folded or not; and an engine with it must give the plain engine's and transformers' greedy
tokens. On CUDA the same steps replay captured pieces (``tests/gpu/test_mixed_graphs_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.mixed_graphs import MixedGraphs, mixed_graph_sizes
from engine.model_runner import ModelRunner, StepPlan
from tests.conftest import hf_greedy, load_hf
from tests.engine.test_fold import greedy

BS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Water boils at"]


def make_engine(model_dir, **kw) -> LLMEngine:
    opts = dict(max_num_batched_tokens=64, max_num_seqs=8, kv_cache_bytes=64 * 1024**2)
    return LLMEngine(EngineConfig(model_dir=str(model_dir), **{**opts, **kw}))


def with_mixed_graphs(engine: LLMEngine) -> MixedGraphs:
    """Give a CPU engine's runner the mixed steps' graphs a CUDA engine captures (eager here)."""
    c, r = engine.config, engine.runner
    sizes = mixed_graph_sizes(c.mixed_graph_sizes, c.mixed_graph_max_tokens,
                              c.max_num_batched_tokens)  # fmt: skip
    r.mixed = MixedGraphs(r.model, r.kv_cache, sizes)
    return r.mixed


def plan_of(seqs: list[tuple[list[int], int, int, int, bool]]) -> StepPlan:
    """A step of sequences ``(tokens, first block, start, new, samples)``: the tokens at
    positions ``start .. start + new`` of each, its table the blocks from ``first block`` on."""
    plan = StepPlan([], [], [], [0], [], [], max(s[3] for s in seqs), [])
    for tokens, first, lo, n, samples in seqs:
        hi = lo + n
        table = list(range(first, first + -(-hi // BS)))
        plan.token_ids += tokens[lo:hi]
        plan.positions += range(lo, hi)
        plan.slots += [table[p // BS] * BS + p % BS for p in range(lo, hi)]
        plan.query_start.append(plan.query_start[-1] + n)
        plan.seq_lens.append(hi)
        plan.block_tables.append(table)
        if samples:
            plan.sample_rows.append(plan.query_start[-1] - 1)
    return plan


def both(runner: ModelRunner, mixed: MixedGraphs, plan: StepPlan, fed=None):
    """The plan's sampled logits and the pool after it, plain and through ``mixed``, each from
    the same pool."""
    start = runner.kv_pool.clone()
    runner.mixed = None
    want = runner._forward(plan, fed)
    want_kv = runner.kv_pool.clone()
    runner.kv_pool.copy_(start)
    runner.mixed = mixed
    got = runner._forward(plan, fed)
    runner.mixed = None
    return got, want, runner.kv_pool, want_kv


@pytest.fixture(scope="module")
def engine(smol_dir) -> LLMEngine:
    return make_engine(smol_dir)


@pytest.mark.parametrize("fold", [False, True])
def test_piecewise_steps_match_the_plain_forward(engine, fold):
    runner = engine.runner
    if fold:
        runner.model.fold()
    mixed = with_mixed_graphs(engine)
    assert mixed.sizes == [16, 32, 48, 64]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 40000, (90,), generator=g).tolist() for _ in range(5)]
    # Prefixes in the cache first: a, b and d up to 40, 25 and 17 tokens.
    runner._forward(plan_of([(seqs[0], 0, 0, 40, False), (seqs[1], 8, 0, 25, False),
                             (seqs[3], 24, 0, 17, True)]))  # fmt: skip
    steps = [
        # a chunk over a's cached prefix, b and d decoding, a new prompt c: 45 rows in 48
        [(seqs[0], 0, 40, 30, True), (seqs[1], 8, 25, 1, True), (seqs[2], 16, 0, 13, True),
         (seqs[3], 24, 17, 1, True)],
        # fewer rows in the same bucket: rows 4..47 keep the step before's values
        [(seqs[1], 8, 26, 1, True), (seqs[3], 24, 18, 1, True), (seqs[4], 32, 0, 2, False)],
        # exactly a bucket (no padding), the last chunk of a prompt
        [(seqs[2], 16, 13, 31, True), (seqs[4], 32, 2, 1, False)],
    ]  # fmt: skip
    for seqs_of_step in steps:
        plan = plan_of(seqs_of_step)
        got, want, kv, want_kv = both(runner, mixed, plan)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(kv, want_kv, atol=1e-5, rtol=1e-5)
        runner._forward(plan)  # the step, for the next one's prefixes
    assert mixed.runs == 3 and mixed.tokens == 45 + 4 + 32 and mixed.padded == 3 + 12 + 0


def test_ids_in_flight_are_gathered_before_the_pieces(engine):
    """Decode rows whose token the step before sampled take it from the device ids (``fed``),
    beside a prompt chunk."""
    runner = engine.runner
    mixed = with_mixed_graphs(engine)
    prompt = list(range(100, 140))
    runner._forward(plan_of([(prompt, 40, 0, 20, False), (prompt, 44, 0, 20, False)]))
    fed = torch.tensor([11, 4242, 977])
    plan = plan_of([(prompt, 40, 20, 1, True), (prompt, 48, 0, 9, True), (prompt, 44, 20, 1, True)])
    plan.feed_src = [2] + [-1] * 9 + [1]  # 977 and 4242 in place of the ids on the host
    got, want, kv, want_kv = both(runner, mixed, plan, fed)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(kv, want_kv, atol=1e-5, rtol=1e-5)
    plan.feed_src = []
    plan.token_ids[0], plan.token_ids[-1] = 977, 4242
    torch.testing.assert_close(runner._forward(plan), want, atol=2e-4, rtol=1e-4)
    assert mixed.runs == 2 and mixed.padded == (48 - 40) + (16 - 11)  # the prefixes' step too


def test_buckets_follow_the_knob_and_the_step_budget():
    sizes = EngineConfig(model_dir="x").mixed_graph_sizes
    assert mixed_graph_sizes(sizes, 512, 512)[-1] == 512
    assert mixed_graph_sizes(sizes, 512, 200) == [16, 32, 48, 64, 96, 128, 160, 192, 224]
    assert mixed_graph_sizes(sizes, 100, 8192) == [16, 32, 48, 64, 96]
    assert mixed_graph_sizes(sizes, 0, 512) == []
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        EngineConfig(model_dir="x", mixed_graph_max_tokens=-1)


def test_an_engine_with_mixed_graphs_gives_the_same_greedy_tokens(smol_dir):
    """Prompts of several lengths, chunked (a 64-token budget) and prefilled beside decodes:
    the plain engine's tokens, which are transformers'."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts.append(tok.encode(" ".join(PROMPTS * 6))[:150])
    plain, graphed = make_engine(smol_dir), make_engine(smol_dir)
    mixed = with_mixed_graphs(graphed)
    got = greedy(graphed, prompts)
    assert mixed.runs > 2 and mixed.padded > 0
    assert got == greedy(plain, prompts)
    hf = load_hf(smol_dir)
    assert got[:4] == [hf_greedy(hf, p, 16) for p in prompts[:4]]
