"""Verify steps as decode rows (``engine.cuda_graphs``) on CPU: the runner's graph path, run
eagerly on the same inputs, verifies every sequence's newest token and draft as rows of one
decode batch; greedy output stays token-exact against the same engine without speculation,
with waves of arrivals (mixed steps take the eager path), an FP8 KV cache, preemption and a
warm prefix cache. On CUDA the same batches replay captured graphs
(``tests/gpu/test_fp8_spec_gpu.py``)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, memory
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeBatch, DecodeGraphs, graph_batch_sizes
from engine.draft_model import DraftProposer
from tests.engine.test_spec_engine import SPEC, Oracle, make_engine, outputs, prompts_for


def with_decode_rows(engine: LLMEngine, draft: bool = False) -> DecodeGraphs:
    """Give a CPU engine's runner (or its draft model's) the decode-step runner a CUDA engine
    captures, of the same sizes (run eagerly here)."""
    config = engine.config
    r, rows = engine.runner, config.max_decode_rows
    if draft:
        assert isinstance(engine.proposer, DraftProposer)
        r, rows = engine.proposer.runner, config.max_draft_rows
    bs = config.block_size
    sizes = graph_batch_sizes(config.cuda_graph_batch_sizes, rows)
    r.graphs = DecodeGraphs(r.model, r.kv_cache, sizes, -(-engine.max_model_len // bs), bs)
    return r.graphs


def test_batch_rows_share_the_table_and_see_each_other_causally():
    b = DecodeBatch()
    b.add([7, 8, 9], 31, [4, 5, 6], 16)
    b.add([3], 2, [1], 16)
    assert b.token_ids == [7, 8, 9, 3] and b.positions == [31, 32, 33, 2]
    assert b.slot_blocks == [5, 6, 6, 1] and b.slot_offsets == [15, 0, 1, 2]
    assert b.seq_lens == [32, 33, 34, 3] and b.num_seqs == 2
    assert b.block_tables == [[4, 5, 6]] * 3 + [[1]]


def test_graphs_are_captured_for_every_row_of_a_verify_step(smol_dir):
    config = EngineConfig(model_dir=str(smol_dir), speculative_config=SPEC, max_num_seqs=16)
    assert config.max_decode_rows == 16 * 5 and config.max_draft_rows == 32
    assert graph_batch_sizes(config.cuda_graph_batch_sizes, 80)[-1] == 128
    assert EngineConfig(model_dir=str(smol_dir), max_num_seqs=16).max_decode_rows == 16


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_verify_rows_are_token_exact_against_plain_decode(smol_dir, kv_cache_dtype):
    base = make_engine(smol_dir, None, kv_cache_dtype=kv_cache_dtype)
    spec = make_engine(smol_dir, SPEC, kv_cache_dtype=kv_cache_dtype)
    graphs = with_decode_rows(spec)
    prompts = prompts_for(base)
    got, ref = outputs(spec, prompts), outputs(base, prompts)
    if kv_cache_dtype == "auto":
        assert got == ref
    else:
        # e4m3 keeps 3 mantissa bits: a last-bit difference of a K/V element before it is
        # stored (row counts change the CPU's matrix-product blocking) can move it a whole
        # e4m3 step, so late tokens of a close call may differ; most of the output must not.
        same = sum(_common_prefix(a, b) for a, b in zip(got, ref, strict=True))
        assert same >= 0.9 * sum(len(r) for r in ref)
    s = spec.stats().spec
    assert s.accepted_tokens > 0.3 * s.draft_tokens > 0
    assert graphs.rows > graphs.runs > 0  # some runs verified drafts


def test_at_batch_one_every_verify_step_goes_through_the_rows(smol_dir):
    base = make_engine(smol_dir, None)
    spec = make_engine(smol_dir, SPEC)
    graphs = with_decode_rows(spec)
    prompts = prompts_for(base)[:3]
    for p in prompts:  # one at a time: every step after the prefill is a pure decode step
        assert outputs(spec, [p], waves=(1,)) == outputs(base, [p], waves=(1,))
    # One sequence per run: its extra rows are its draft tokens, all of them verified here.
    assert graphs.rows - graphs.runs == spec.stats().spec.draft_tokens > 0


def test_preemption_and_prefix_cache_with_verify_rows(qwen2_dir):
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0)
    ref = outputs(make_engine(qwen2_dir, None), prompts, params, waves=(6,))
    tiny = make_engine(qwen2_dir, SPEC, num_kv_blocks=12, max_num_batched_tokens=64)
    tiny.proposer = Oracle({tuple(p): r for p, r in zip(prompts, ref, strict=True)}, 4)  # type: ignore[assignment]
    graphs = with_decode_rows(tiny)
    assert outputs(tiny, prompts, params, waves=(6,)) == ref
    assert tiny.scheduler.num_preemptions > 0 and tiny.stats().spec.accepted_tokens > 0
    assert outputs(tiny, prompts[-2:], params, waves=(1,)) == ref[-2:]
    assert tiny.stats().prefix_hit_tokens > 0
    assert graphs.rows > graphs.runs > 0


def draft_spec(model_dir, k: int) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def test_self_draft_through_rows_is_accepted_in_full(qwen2_dir):
    """The target as its own draft, both models' single-token steps and the draft's short
    first passes as decode rows: any slip in the rows' positions or slots shows as a
    rejected draft token."""
    base = make_engine(qwen2_dir, None, max_num_batched_tokens=48)
    spec = make_engine(qwen2_dir, draft_spec(qwen2_dir, 3), max_num_batched_tokens=48)
    target, draft = with_decode_rows(spec), with_decode_rows(spec, draft=True)
    prompts = prompts_for(base)
    params = SamplingParams(max_tokens=40, temperature=0)
    assert outputs(spec, prompts, params) == outputs(base, prompts, params)
    s = spec.stats().spec
    assert s.draft_tokens > 100 and s.accepted_tokens >= 0.97 * s.draft_tokens
    assert target.rows > target.runs > 0
    assert draft.runs >= 2 * target.runs  # k = 3 passes per verify step, most through rows
    spec.check_integrity()
    assert spec.pool.num_used == 0 and spec.proposer.pool.num_used == 0  # type: ignore[union-attr]


def test_preemption_with_a_draft_through_rows_keeps_outputs(qwen2_dir):
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0)
    ref = outputs(make_engine(qwen2_dir, None), prompts, params, waves=(6,))
    tiny = make_engine(qwen2_dir, draft_spec(qwen2_dir, 4), num_kv_blocks=12)
    draft = with_decode_rows(tiny, draft=True)
    with_decode_rows(tiny)
    assert outputs(tiny, prompts, params, waves=(6,)) == ref
    assert tiny.scheduler.num_preemptions > 0 and draft.rows > draft.runs > 0
    s = tiny.stats().spec
    assert s.accepted_tokens >= 0.9 * s.draft_tokens > 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def test_the_target_sets_room_aside_for_the_draft_graphs(smol_dir):
    draft = ModelConfig.from_dir(smol_dir)
    eager = memory.Reserve.of(draft, torch.bfloat16, torch.bfloat16, 16, False)
    graphed = memory.Reserve.of(draft, torch.bfloat16, torch.bfloat16, 16, False, [1, 2, 4])
    assert eager.graph_bytes == 0 and eager.weight_bytes == graphed.weight_bytes
    # Each size keeps its float32 logits: 7 rows of the vocabulary at least.
    assert graphed.graph_bytes > 7 * draft.vocab_size * 4
