"""Tensor parallelism on CUDA (NCCL, 2 ranks on 2 GPUs; skipped with fewer): decode steps run
from CUDA graphs that hold the all-reduce and the logits all-gather, and greedy output in
float32 matches TP=1 on the same GPU type (all-reduce rounding aside, the random model's peaked
logits keep greedy choices equal), with graphs on and off.

``pytest -m gpu tests/gpu/test_tensor_parallel_gpu.py`` on a host with two GPUs."""

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


def greedy(
    model_dir: Path, prompts, tp: int, eager: bool, **options
) -> tuple[list[list[int]], tuple[int, int] | None]:
    """Greedy tokens, and the graphs' (runs, rows) when decode steps ran from graphs."""
    with LLM(
        model_dir,
        tensor_parallel_size=tp,
        dtype="float32",
        enforce_eager=eager,
        num_kv_blocks=512,
        max_model_len=2048,  # 512 blocks of 16 cannot hold the shape's 8,192 (refused at start)
        max_num_seqs=16,
        **options,
    ) as llm:
        outs = [o.token_ids for o in llm.generate(prompts, PARAMS)]
        graphs = llm.engine.runner.graphs
        counts = None if graphs is None else (graphs.runs, graphs.rows)
    torch.cuda.empty_cache()
    return outs, counts


def test_tp2_with_graphs_matches_tp1(model_dir, prompts):
    ref, _ = greedy(model_dir, prompts, 1, eager=True)
    two, graphs = greedy(model_dir, prompts, 2, eager=False)
    assert graphs  # decode steps ran from captured graphs (with the collectives inside)
    assert two == ref
    eager, graphs = greedy(model_dir, prompts, 2, eager=True)
    assert not graphs and eager == ref


def test_tp2_verify_steps_replay_the_graphs_and_match_tp1(model_dir):
    """n-gram drafts verified as decode rows in the TP graphs (every rank replays the batch)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}  # fmt: skip
    phrases = random_prompts(6, SMOL_CONFIG["vocab_size"], seed=2, hi=30)
    prompts = [(p * (1 + 80 // max(len(p), 1)))[:80] for p in phrases]
    ref, _ = greedy(model_dir, prompts, 1, eager=True)
    two, counts = greedy(model_dir, prompts, 2, eager=False, speculative_config=spec)
    assert counts is not None and counts[1] > counts[0] > 0  # some runs verified drafts
    assert two == ref
