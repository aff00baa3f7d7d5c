"""CUDA only (``pytest -m gpu``): mixed steps replaying piecewise CUDA graphs
(``engine.mixed_graphs``) on SmolLM2's shape with seeded random weights (``tests/smol_shape.py``).

The captured pieces give the eager forward's logits and KV within bf16 rounding on mixed steps
(decode rows, prompt chunks, a chunk over a cached prefix, a smaller step after a larger one in
the same bucket, ids in flight); in float32 an engine with them gives the eager engine's
greedy tokens (all but a near-tie); their pool stays small (a few segments, not a layer's
activations per bucket); and no kernel compiles after ready while mixed steps replay them.

    pytest -m gpu -q tests/gpu/test_mixed_graphs_gpu.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu_report import report, require_cuda_triton

require_cuda_triton()

from engine import EngineConfig, LLMEngine  # noqa: E402
from engine.mixed_graphs import MixedGraphs  # noqa: E402
from tests.engine.test_mixed_graphs import both, plan_of  # noqa: E402
from tests.gpu_report import agreement, generate  # noqa: E402
from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts  # noqa: E402
from tests.warmup_cases import serve_mixed  # noqa: E402

pytestmark = pytest.mark.gpu
SHAPE = dict(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=256, num_kv_blocks=2048)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("smol_shape") / "model", seed=0)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12))


def steps() -> list[list[tuple]]:
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 40000, (400,), generator=g).tolist() for _ in range(5)]
    return [
        [(seqs[0], 0, 0, 40, False), (seqs[1], 30, 0, 25, False), (seqs[3], 90, 0, 17, True)],
        [(seqs[0], 0, 40, 150, True), (seqs[1], 30, 25, 1, True), (seqs[2], 60, 0, 13, True),
         (seqs[3], 90, 17, 1, True)],  # 165 rows in 192: a chunk over a cached prefix
        [(seqs[1], 30, 26, 1, True), (seqs[3], 90, 18, 1, True), (seqs[4], 120, 0, 162, True)],
        [(seqs[2], 60, 13, 31, True), (seqs[4], 120, 162, 1, False)],  # 32 rows: no padding
    ]  # fmt: skip


def test_captured_pieces_match_eager(model_dir):
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), **SHAPE))
    runner = engine.runner
    mixed = runner.mixed
    assert isinstance(mixed, MixedGraphs) and mixed.captured and mixed.sizes[-1] == 256
    runs = mixed.runs  # the warm-up's steps ran through it too
    errs, exact, agree = [], [], []
    for step in steps():
        plan = plan_of(step)
        got, want, kv, want_kv = both(runner, mixed, plan)
        if plan.sample_rows:
            errs.append(rel(got, want))
            assert errs[-1] < 5e-2, errs
            agree += (got.argmax(-1) == want.argmax(-1)).tolist()
        assert rel(kv, want_kv) < 5e-2
        if plan.sample_rows:  # the same pieces on the same padded rows, eagerly: the graphs'
            runner.mixed, mixed.captured = mixed, False  # own error, about none
            pieces = runner._forward(plan)
            runner.mixed, mixed.captured = None, True
            exact.append(torch.equal(got, pieces))
            assert rel(got, pieces) < 1e-3
        runner._forward(plan)  # the eager step (``both`` leaves no graphs), for the next prefixes
    fed = torch.tensor([11, 4242], device=runner.device)
    plan = plan_of(steps()[3])
    plan.feed_src = [1] + [-1] * 31
    got, want, _, _ = both(runner, mixed, plan, fed)
    assert rel(got, want) < 5e-2
    report("mixed_graphs_logits", rel_errs=[round(e, 5) for e in errs], exact=exact,
           argmax_agree=sum(agree) / len(agree))  # fmt: skip
    assert sum(agree) >= 0.75 * len(agree)
    assert mixed.runs - runs == len(steps()) + 1 + len(exact)


def test_float32_greedy_tokens_match_eager(model_dir):
    prompts = random_prompts(24, SMOL_CONFIG["vocab_size"], seed=1, hi=300)
    on = generate(model_dir, prompts, dtype="float32")
    off = generate(model_dir, prompts, dtype="float32", mixed_graph_max_tokens=0)
    report("mixed_graphs_fp32", agreement=agreement(on, off))
    # Identical but for a near-tie: cuBLAS may sum a padded bucket's rows in another order.
    assert agreement(on, off) >= 0.95
    bf16_on = generate(model_dir, prompts)
    bf16_eager = generate(model_dir, prompts, enforce_eager=True)
    report("mixed_graphs_bf16", agreement=agreement(bf16_on, bf16_eager))
    assert agreement(bf16_on, bf16_eager) >= 0.75


def test_pool_is_bounded_and_nothing_compiles_after_ready(model_dir):
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), **SHAPE))
    mixed, plan = engine.runner.mixed, engine.runner.kv_plan
    assert mixed is not None and plan.memory is not None
    report("mixed_graphs_pool", pool_mib=mixed.pool_bytes / 2**20, buckets=mixed.sizes,
           graphs_set_aside_mib=plan.memory.graphs / 2**20)  # fmt: skip
    assert 0 < mixed.pool_bytes <= 256 * 2**20
    before = engine.stats().kernel_compiles
    runs = mixed.runs
    steps_run = serve_mixed(engine, seed=3, requests=60, max_tokens=24)
    after = engine.stats().kernel_compiles
    report("mixed_graphs_serving", steps=steps_run, mixed_runs=mixed.runs - runs,
           serving_compiles=after.serving - before.serving)  # fmt: skip
    assert mixed.runs - runs > 10
    assert after.serving == before.serving
