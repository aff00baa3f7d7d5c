"""Tensor parallelism on CUDA (NCCL, 2 ranks on 2 GPUs; skipped with fewer): decode steps run
from CUDA graphs that hold the all-reduce and the logits all-gather, and greedy output in
float32 matches TP=1 on the same GPU type (all-reduce rounding aside, the random model's peaked
logits keep greedy choices equal), with graphs on and off.

``pytest -m gpu tests/test_tensor_parallel_gpu.py`` on a host with two GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA devices", allow_module_level=True)
pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts  # noqa: E402

PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("tp_gpu") / "model", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(12, SMOL_CONFIG["vocab_size"], seed=1, hi=200)


def greedy(model_dir: Path, prompts, tp: int, eager: bool) -> tuple[list[list[int]], bool]:
    with LLM(
        model_dir,
        tensor_parallel_size=tp,
        dtype="float32",
        enforce_eager=eager,
        num_kv_blocks=512,
        max_num_seqs=16,
    ) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        graphs = llm.engine.runner.graphs is not None
    torch.cuda.empty_cache()
    return outs, graphs


def test_tp2_with_graphs_matches_tp1(model_dir, prompts):
    ref, _ = greedy(model_dir, prompts, 1, eager=True)
    two, graphs = greedy(model_dir, prompts, 2, eager=False)
    assert graphs  # decode steps ran from captured graphs (with the collectives inside)
    assert two == ref
    eager, graphs = greedy(model_dir, prompts, 2, eager=True)
    assert not graphs and eager == ref
