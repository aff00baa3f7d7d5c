"""Speculative decoding in the workers: the ``--speculative-config`` flag and its variable, the
engine's counters as Prometheus metrics, and (slow) a disaggregated request through the real
stack whose decode worker drafts from prompt and output, token-exact against the offline
engine without speculation."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import SpeculativeConfig
from engine.core.messages import Snapshot
from engine.llm_engine import EngineStats
from engine.step_stats import SpecStats
from services.launcher.etcd import free_port
from services.launcher.stack import Stack, StackConfig
from services.observability.engine import EngineCollector
from services.worker.config import parse_config
from tests.stack_probe import metrics_of

SPEC_JSON = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
)


def parse(argv: list[str], env: dict[str, str] | None = None):
    return parse_config("decode", ["--model-dir", "/m", *argv], env or {})


def test_speculative_config_flag_and_variable(capsys):
    assert parse([]).engine_config().speculative_config is None
    spec = parse(["--speculative-config", SPEC_JSON]).engine_config().speculative_config
    assert spec == SpeculativeConfig("ngram", 4, 3, 1)
    env = {"TANDEM_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 2}'}
    spec = parse([], env).engine_config().speculative_config
    assert spec is not None and spec.num_speculative_tokens == 2 and spec.prompt_lookup_max == 5
    with pytest.raises(SystemExit):
        parse(["--speculative-config", '{"num_speculative_tokens": 2, "speculative_model": "m"}'])
    assert "--speculative-config: unknown speculative config keys" in capsys.readouterr().err


def test_a_prefill_worker_loads_no_speculation(smol_dir):
    """Drafts run where tokens are decoded: a prefill worker's engine gets no speculative
    config (no draft model loaded, no room set aside for one), though the flag is checked."""
    draft = json.dumps({"method": "draft_model", "model": str(smol_dir),
                        "num_speculative_tokens": 3})  # fmt: skip
    for spec in (SPEC_JSON, draft):
        argv = ["--model-dir", "/m", "--speculative-config", spec]
        assert parse_config("prefill", argv, {}).engine_config().speculative_config is None
        assert parse_config("decode", argv, {}).engine_config().speculative_config is not None
    with pytest.raises(SystemExit):  # still refused when wrong
        parse_config("prefill", ["--model-dir", "/m", "--speculative-config", "{"], {})


class _Engine:
    """The slice of EngineClient the collector reads: its latest snapshot."""

    def __init__(self, stats: EngineStats) -> None:
        self.snapshot = Snapshot(stats, num_held=0)


def test_spec_counters_are_exported():
    spec = SpecStats(drafts=10, draft_tokens=37, accepted_tokens=21, accepted_per_pos=[9, 7, 5, 0])
    reg = CollectorRegistry()
    reg.register(EngineCollector(_Engine(EngineStats(0, 0, 10, 0, 0, 0, 0, 0, spec))))  # type: ignore[arg-type]
    assert reg.get_sample_value("tandem_engine_spec_decode_drafts_total") == 10
    assert reg.get_sample_value("tandem_engine_spec_decode_draft_tokens_total") == 37
    assert reg.get_sample_value("tandem_engine_spec_decode_accepted_tokens_total") == 21
    per_pos = [
        reg.get_sample_value(
            "tandem_engine_spec_decode_accepted_tokens_per_pos_total", {"position": str(j)}
        )
        for j in range(4)
    ]
    assert per_pos == [9, 7, 5, 0]


def test_engine_reports_every_draft_position_from_the_start(smol_dir):
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(smol_dir), kv_cache_bytes=16 * 1024**2, speculative_config=SPEC_JSON
        )
    )
    assert engine.stats().spec.accepted_per_pos == [0, 0, 0, 0]


@pytest.mark.slow
def test_disaggregated_request_speculates_on_the_decode_worker(smol_dir, tmp_path):
    prompt_text = "Repeat the list twice. " + ", ".join(f"item {i} of {i * 3}" for i in range(40))
    prompt, decode, prefill = _through_stack(smol_dir, tmp_path, SPEC_JSON, prompt_text, 48)
    assert prefill["tandem_engine_prompt_tokens_total"] >= len(prompt)  # prefilled there
    assert decode["tandem_engine_spec_decode_accepted_tokens_total"] > 0
    assert (
        decode["tandem_engine_spec_decode_draft_tokens_total"]
        >= (decode["tandem_engine_spec_decode_accepted_tokens_total"])
    )
    assert prefill["tandem_engine_spec_decode_drafts_total"] == 0  # it only prefills


def _through_stack(
    smol_dir, tmp_path, spec_json: str, prompt_text: str, max_tokens: int
) -> tuple[list[int], dict, dict]:
    """``prompt_text`` greedily through a 1p1d stack whose workers take ``spec_json``, its
    answer asserted equal to the offline engine's (no speculation); the prompt's tokens and
    the decode and prefill workers' metrics."""
    config = StackConfig(
        model_dir=str(smol_dir),
        run_dir=str(tmp_path),
        port=free_port(),
        num_prefill=1,
        num_decode=1,
        worker_args=("--speculative-config", spec_json),
        disagg_mode="length",  # placement by length alone, whatever the load
    )
    offline = LLMEngine(EngineConfig(model_dir=str(smol_dir), kv_cache_bytes=64 * 1024**2))
    prompt = offline.tokenizer.encode(prompt_text)
    assert len(prompt) > 256  # long enough for the router to prefill it on the prefill worker
    offline.add_request("ref", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    ref = [o for o in _drain(offline) if o.finished][0].text
    with Stack(config) as stack:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt_text,
                "max_tokens": max_tokens, "temperature": 0}  # fmt: skip
        r = httpx.post(stack.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == ref
        decode = metrics_of(stack.scrape_targets()["decode-0"])
        prefill = metrics_of(stack.scrape_targets()["prefill-0"])
    return prompt, decode, prefill


def _drain(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    return outs


@pytest.mark.slow
def test_disaggregated_request_drafts_with_a_draft_model_on_the_decode_worker(smol_dir, tmp_path):
    """The decode worker runs a draft model (here the target's own folder, so drafts are kept
    and every step speculates): it builds the draft's KV from prompt + first token after the
    hand-off (only the target's KV moved), and the output equals the offline engine's."""
    draft = {"method": "draft_model", "model": str(smol_dir), "num_speculative_tokens": 3}
    prompt_text = "Count on: " + ", ".join(f"{i} and {i + 1}" for i in range(60))
    prompt, decode, prefill = _through_stack(smol_dir, tmp_path, json.dumps(draft), prompt_text, 40)
    assert prefill["tandem_engine_prompt_tokens_total"] >= len(prompt)  # prefilled there
    drafted = decode["tandem_engine_spec_decode_draft_tokens_total"]
    assert decode["tandem_engine_spec_decode_accepted_tokens_total"] >= 0.9 * drafted > 0
    assert prefill["tandem_engine_spec_decode_drafts_total"] == 0
