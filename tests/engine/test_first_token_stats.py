"""The engine's part of TTFT (``StepStats.first_token_seconds`` and ``prefill_seconds``, exported
as ``tandem_engine_time_to_first_token_seconds`` and ``tandem_engine_prefill_time_seconds``):
each request's first token is counted once, in the step that read it back, whether its prompt
took one step or several, with the steps overlapped or not, and for n > 1 once per request."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_stats import StepStats
from services.observability.engine import StepMetrics
from tests.conftest import make_random_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_dir):
    return make_random_model_dir(tmp_path_factory.mktemp("ttft"), smol_dir, "qwen2", seed=5)


@pytest.mark.parametrize("overlap", [True, False])
def test_each_request_counts_its_first_token_once(tiny_dir, overlap: bool) -> None:
    engine = LLMEngine(EngineConfig(
        model_dir=str(tiny_dir), device="cpu", max_model_len=128, max_num_seqs=4,
        max_num_batched_tokens=32, num_kv_blocks=64, async_scheduling=overlap,
    ))  # fmt: skip
    seen: list[StepStats] = []
    engine.on_step = seen.append
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = {"short": list(range(5, 13)), "long": list(range(5, 85))}  # 1 and 3 chunks
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, greedy)
    engine.add_request("forked", list(range(7, 19)), SamplingParams(
        max_tokens=3, n=2, temperature=1.0, seed=1, ignore_eos=True))  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    ttft = [t for s in seen for t in s.first_token_seconds]
    prefill = [t for s in seen for t in s.prefill_seconds]
    queue = [t for s in seen for t in s.queue_seconds]
    assert len(ttft) == len(prefill) == 3  # one per request: the fork's second choice is not
    assert all(t >= p >= 0 for t, p in zip(ttft, prefill, strict=True))
    assert len(queue) >= 3
    reg = CollectorRegistry()
    observe = StepMetrics(reg)
    for s in seen:
        observe(s)
    count = reg.get_sample_value("tandem_engine_time_to_first_token_seconds_count")
    assert count == 3
    assert reg.get_sample_value("tandem_engine_prefill_time_seconds_count") == 3
    total = reg.get_sample_value("tandem_engine_time_to_first_token_seconds_sum")
    assert total == pytest.approx(sum(ttft))
