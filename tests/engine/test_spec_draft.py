"""Draft-model speculative decoding (``engine.draft_model``) on CPU: greedy output token-exact
against the engine without speculation (a truncated SmolLM2 drafting for SmolLM2; random
folders of two shapes sharing SmolLM2's vocabulary), under chunked prefill, arrivals mid-run,
preemption and a warm prefix cache; after a prefill -> decode hand-off the decode engine builds
the draft's KV from the whole history; sampling keeps its distribution; bad configs are refused
at start."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.draft_model import parse_layers, truncate_model
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.draft_model import DraftProposer
from engine.errors import UnsupportedConfigError
from tests.conftest import make_random_model_dir
from tests.engine.test_spec_engine import (
    assert_same_distribution,
    handoff,
    joint_counts,
    make_engine,
    outputs,
    prompts_for,
    run_one,
)

GREEDY = SamplingParams(max_tokens=24, temperature=0)


def draft_spec(model_dir, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def drafter(engine: LLMEngine) -> DraftProposer:
    assert isinstance(engine.proposer, DraftProposer)
    return engine.proposer


def assert_all_freed(engine: LLMEngine) -> None:
    engine.check_integrity()  # both pools
    assert engine.pool.num_used == 0 and drafter(engine).pool.num_used == 0


@pytest.fixture(scope="module")
def smol_draft_dir(tmp_path_factory, smol_dir):
    """SmolLM2-135M without its layers 4-7 (26 of 30): real weights, a partial acceptance
    (layer subsets much smaller than this keep almost no draft token of this model)."""
    dst = tmp_path_factory.mktemp("draft") / "smol-26l"
    return truncate_model(smol_dir, dst, parse_layers("0-3,8-29"))


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory, smol_dir):
    """A random Llama of a larger shape than ``qwen2_dir`` with the same vocabulary."""
    return make_random_model_dir(
        tmp_path_factory.mktemp("wide"), smol_dir, "llama", seed=3, hidden_size=256,
        intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    )  # fmt: skip


@pytest.fixture(scope="module")
def smol_base(smol_dir):
    return make_engine(smol_dir, None)


@pytest.mark.slow
def test_truncated_smol_draft_is_token_exact_and_partly_accepted(
    smol_dir, smol_draft_dir, smol_base
):
    spec = make_engine(smol_dir, draft_spec(smol_draft_dir))
    prompts = prompts_for(smol_base)
    ref = outputs(smol_base, prompts)
    assert outputs(spec, prompts) == ref
    assert_all_freed(spec)
    s = spec.stats().spec
    assert s.drafts > 0 and 0 < s.accepted_tokens < s.draft_tokens
    assert sum(s.accepted_per_pos) == s.accepted_tokens
    # Second round on warm prefix caches (the draft pool has its own): still exact, and the
    # draft skips the cached prompt blocks.
    fed = drafter(spec).prefill_tokens
    assert outputs(spec, prompts, waves=(len(prompts),)) == ref
    assert_all_freed(spec)
    assert drafter(spec).pool.num_cached > 0
    assert drafter(spec).prefill_tokens - fed < sum(len(p) for p in prompts)


def test_self_draft_is_accepted_in_full(qwen2_dir):
    """The target as its own draft: every greedy draft token is the target's next token, so
    any slip in the draft's KV bookkeeping (positions, truncation after a rejection, catch-up)
    shows as a rejection."""
    base = make_engine(qwen2_dir, None, max_num_batched_tokens=48)
    spec = make_engine(qwen2_dir, draft_spec(qwen2_dir, 3), max_num_batched_tokens=48)
    prompts = prompts_for(base)
    params = SamplingParams(max_tokens=40, temperature=0)
    assert outputs(spec, prompts, params) == outputs(base, prompts, params)
    s = spec.stats().spec
    assert s.draft_tokens > 100 and s.accepted_tokens >= 0.97 * s.draft_tokens
    assert_all_freed(spec)


def test_small_random_draft_for_a_larger_target_is_token_exact(wide_llama_dir, qwen2_dir):
    base = make_engine(wide_llama_dir, None, max_num_batched_tokens=48)
    spec = make_engine(wide_llama_dir, draft_spec(qwen2_dir, 5), max_num_batched_tokens=48)
    prompts = prompts_for(base)[:3]
    params = SamplingParams(max_tokens=24, temperature=0)
    assert outputs(spec, prompts, params, waves=(2, 1)) == outputs(
        base, prompts, params, waves=(2, 1)
    )
    assert spec.stats().spec.draft_tokens > 0
    assert_all_freed(spec)


def test_preemption_with_a_draft_keeps_outputs(qwen2_dir):
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0)
    ref = outputs(make_engine(qwen2_dir, None), prompts, params, waves=(6,))
    tiny = make_engine(qwen2_dir, draft_spec(qwen2_dir), num_kv_blocks=12)
    assert outputs(tiny, prompts, params, waves=(6,)) == ref
    assert tiny.scheduler.num_preemptions > 0
    s = tiny.stats().spec
    assert s.accepted_tokens >= 0.9 * s.draft_tokens > 0
    assert_all_freed(tiny)


def test_handoff_decode_engine_prefills_the_draft_over_the_history(qwen2_dir):
    """A request prefilled by one engine and decoded by another: only the target's KV moves;
    the decode engine runs the draft (the target's own folder: drafts are kept) over prompt +
    first token before its first draft, then drafts every step."""
    base = make_engine(qwen2_dir, None)
    prefill = make_engine(qwen2_dir, None)
    decode = make_engine(qwen2_dir, draft_spec(qwen2_dir))
    prompt = list(range(200, 290))
    params = SamplingParams(max_tokens=32, temperature=0)
    (ref,) = outputs(base, [prompt], params, waves=(1,))
    final = handoff(prefill, decode, prompt, params)
    assert final.token_ids == ref
    assert drafter(decode).prefill_tokens >= len(prompt)  # the history, in the draft
    s = decode.stats().spec
    assert s.accepted_tokens >= 0.9 * s.draft_tokens > 0
    assert_all_freed(decode)


def test_sampling_distribution_is_kept_with_a_draft_model(qwen2_dir):
    """Three tokens after the first, sampled 600 times with and without the draft model (the
    target itself, so that drafts are often kept and often not): the joint distributions
    agree (chi-square two-sample test at 0.1%)."""
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=s) for s in range(600)]
    prompt = list(range(300, 340))
    opts = dict(max_num_seqs=600, max_num_batched_tokens=4096)
    base = make_engine(qwen2_dir, None, **opts)
    spec = make_engine(qwen2_dir, draft_spec(qwen2_dir, 2), **opts)
    a = joint_counts(base, prompt, params, at=(1, 2, 3))
    b = joint_counts(spec, prompt, params, at=(1, 2, 3))
    s = spec.stats().spec
    assert s.accepted_tokens > 200 and s.accepted_per_pos[1] > 50
    assert s.accepted_tokens < 0.9 * s.draft_tokens  # sampled tokens do differ from drafts
    assert_same_distribution(a, b)
    assert_all_freed(spec)


def test_abort_frees_the_draft_blocks(qwen2_dir):
    spec = make_engine(qwen2_dir, draft_spec(qwen2_dir))
    spec.add_request("a", list(range(50, 90)), SamplingParams(max_tokens=30, temperature=0))
    for _ in range(3):
        spec.step()
    assert drafter(spec).pool.num_used > 0
    spec.abort("a")
    assert_all_freed(spec)
    assert run_one(spec, list(range(50, 90)), GREEDY).finished


def test_bad_draft_configs_are_refused(tmp_path, smol_dir, qwen2_dir):
    def refuse(spec, match: str, exc=ValueError, **kw) -> None:
        with pytest.raises(exc, match=match):
            LLMEngine(EngineConfig(model_dir=str(qwen2_dir), speculative_config=spec, **kw))

    refuse({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'")
    refuse({"method": "ngram", "model": str(qwen2_dir), "num_speculative_tokens": 3}, "no 'model'")
    refuse({**draft_spec(qwen2_dir), "prompt_lookup_max": 3}, "belong to method 'ngram'")
    refuse(draft_spec(tmp_path / "nowhere"), "no config.json")
    refuse({**draft_spec(qwen2_dir), "num_speculative_tokens": 0}, "integer >= 1")
    refuse({**draft_spec(qwen2_dir), "draft_model": "x"}, "unknown speculative config keys")
    refuse(draft_spec(qwen2_dir), "tensor_parallel_size > 1", tensor_parallel_size=2)
    # The method is inferred from "model", as in vLLM.
    cfg = EngineConfig(model_dir=str(qwen2_dir), speculative_config=json.dumps(
        {"model": str(qwen2_dir), "num_speculative_tokens": 2}))  # fmt: skip
    assert cfg.speculative_config is not None
    assert cfg.speculative_config.method == "draft_model"
    # Another vocabulary size; the same size but a tokenizer with two ids swapped.
    small_vocab = make_random_model_dir(tmp_path / "v", smol_dir, "llama", vocab_size=1000)
    refuse(draft_spec(small_vocab), "vocab_size 1000, the target 49152", UnsupportedConfigError)
    other = tmp_path / "other-tok"
    shutil.copytree(qwen2_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    refuse(
        draft_spec(other),
        "another tokenizer than the target: 2 tokens differ",
        UnsupportedConfigError,
    )
