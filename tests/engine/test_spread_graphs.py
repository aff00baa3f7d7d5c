"""Decode graphs for batches of spread lengths (``engine.cuda_graphs.SpreadGraphs``): which
steps replay the second capture, and what a CPU engine does with the setting (nothing is
captured; the same tokens). The captures themselves are checked on a GPU
(``tests/gpu/test_engine_gpu.py::test_spread_graphs_replay_for_spread_lengths_and_keep_the_tokens``)."""

from __future__ import annotations

import pytest

import kernels
from engine import LLM, EngineConfig, SamplingParams
from engine.cuda_graphs import SpreadGraphs


def test_only_long_uneven_batches_take_the_spread_capture():
    s = SpreadGraphs()
    assert not s.takes([])
    assert not s.takes([4000] * 32)  # even: the rule's plan
    assert not s.takes([100] * 31 + [900])  # uneven but short
    assert s.takes([200] * 31 + [2000])  # 2,000 against a mean of 256
    assert s.takes(list(range(128, 2561, 76)))  # the mixed workload's spread: 1.9x the mean
    assert not s.takes([1000, 1200, 1400])  # 1.17x the mean
    assert SpreadGraphs(min_context=64, ratio=1.1).takes([50, 70])


def test_the_split_floor_is_a_no_op_without_triton():
    with kernels.decode_split_floor(6):
        pass  # (with Triton the rule's plans change inside: the GPU test)


def test_the_setting_is_on_by_default_and_changes_nothing_on_the_cpu(smol_dir):
    assert EngineConfig(model_dir=str(smol_dir)).decode_spread_graphs is True
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7] * n for n in (2, 30, 90)]
    outs = []
    for spread in (False, True):
        llm = LLM(smol_dir, decode_spread_graphs=spread)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert llm.engine.runner.graphs is None  # no decode graphs off CUDA
        llm.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("value", ["--decode-spread-graphs", "--no-decode-spread-graphs"])
def test_the_worker_flag_reaches_the_engine(value):
    from services.worker.config import parse_config

    cfg = parse_config("decode", ["--model-dir", "/m", value], env={})
    assert cfg.engine_config().decode_spread_graphs is (value == "--decode-spread-graphs")
