"""The engine on CUDA (Triton kernels, decode CUDA graphs) against the engine on the CPU
(float32, reference kernels) on a SmolLM2-shape model with shared random weights.

On CUDA in float32 the greedy tokens must match the CPU's on most prompts. In bf16 (the CUDA
default) rounding alone flips some greedy choices of a random model, so the bf16 match rate is
reported next to the CPU's own bf16 rate (same model, reference kernels) and must not fall
below the smaller of 80% and that rate less 10 points. Runs only where CUDA is present
(``pytest -m gpu``); set ``TANDEM_GPU_REPORT`` to a file to collect the rates as JSON lines.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts  # noqa: E402

NUM_PROMPTS = 20
MAX_TOKENS = 16
MIN_MATCH_RATE = 0.8
Outputs = list[list[int]]


@pytest.fixture(scope="module")
def smol_shape_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("smol_shape") / "model", seed=0)


@pytest.fixture(scope="module")
def prompts() -> Outputs:
    return random_prompts(NUM_PROMPTS, SMOL_CONFIG["vocab_size"], seed=1, hi=200)


@pytest.fixture(scope="module")
def cpu_fp32(smol_shape_dir, prompts) -> Outputs:
    return _greedy(smol_shape_dir, prompts, device="cpu", dtype="float32")


def _greedy(model_dir: Path, prompts: Outputs, **options) -> Outputs:
    # A 256-token budget splits the longer prompts into chunks: prefill over a cached prefix.
    llm = LLM(model_dir, max_num_batched_tokens=256, max_num_seqs=32, num_kv_blocks=2048, **options)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return outs


def _match_rate(name: str, a: Outputs, b: Outputs) -> float:
    rate = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    first = [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p))
        for p, q in zip(a, b, strict=True)
    ]
    line = json.dumps({"check": name, "match_rate": rate, "first_divergence": first})
    print(line)
    path = os.environ.get("TANDEM_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
    return rate


def test_cuda_fp32_greedy_matches_cpu_fp32(smol_shape_dir, prompts, cpu_fp32):
    gpu = _greedy(smol_shape_dir, prompts, device="cuda", dtype="float32")
    assert _match_rate("cuda_fp32_vs_cpu_fp32", gpu, cpu_fp32) >= MIN_MATCH_RATE


def test_cuda_bf16_greedy_vs_cpu_fp32(smol_shape_dir, prompts, cpu_fp32):
    gpu = _greedy(smol_shape_dir, prompts, device="cuda")
    assert all(len(t) == MAX_TOKENS for t in gpu)
    rate = _match_rate("cuda_bf16_vs_cpu_fp32", gpu, cpu_fp32)
    cpu_bf16 = _greedy(smol_shape_dir, prompts, device="cpu", dtype="bfloat16")
    baseline = _match_rate("cpu_bf16_vs_cpu_fp32", cpu_bf16, cpu_fp32)
    assert rate >= min(MIN_MATCH_RATE, baseline - 0.1)


def test_cuda_graphs_match_eager(smol_shape_dir, prompts):
    graphs = _greedy(smol_shape_dir, prompts, device="cuda", dtype="float32")
    eager = _greedy(smol_shape_dir, prompts, device="cuda", dtype="float32", enforce_eager=True)
    assert _match_rate("cuda_graphs_vs_eager_fp32", graphs, eager) >= MIN_MATCH_RATE


def test_kv_pool_sized_from_the_memory_share(smol_shape_dir):
    llm = LLM(smol_shape_dir, gpu_memory_utilization=0.05, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.dtype == torch.bfloat16
    _free, total = torch.cuda.mem_get_info()
    plan = runner.kv_plan
    assert plan.memory is not None and plan.budget == int(0.05 * total)
    pool = runner.num_blocks * runner.block_bytes
    assert 0 < pool <= plan.budget - plan.memory.weights - plan.memory.activation_peak
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4]
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_released_decode_graphs_are_gone_and_steps_run_eagerly(smol_shape_dir):
    """`ModelRunner.release_graphs` (a closing engine, before a tensor-parallel rank leaves its
    NCCL group, which waits for every graph holding one of its collectives) resets every
    captured graph; the engine still decodes, eagerly, to the same tokens."""
    llm = LLM(smol_shape_dir, gpu_memory_utilization=0.05, max_num_seqs=4, dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.captured
    before = llm.generate([[5, 6, 7], [9, 10]], params)
    runs = graphs.runs
    assert runs > 0
    runner.release_graphs()
    assert runner.graphs is None and not graphs._graphs and not graphs._logits
    after = llm.generate([[5, 6, 7], [9, 10]], params)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert graphs.runs == runs  # nothing replayed


def test_transformers_bf16_on_cuda_matches_at_the_same_rate(smol_shape_dir, prompts, cpu_fp32):
    """``transformers`` on the same GPU in bf16, greedy: its agreement with the CPU fp32 engine
    sets the bar for ours (bf16 rounding flips the same kind of near-ties in both)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_shape_dir, dtype=torch.bfloat16)
    model = model.cuda().eval()
    hf: Outputs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            hf.append(out[0, len(p) :].tolist())
    del model
    torch.cuda.empty_cache()
    ours = _greedy(smol_shape_dir, prompts, device="cuda")
    hf_rate = _match_rate("transformers_cuda_bf16_vs_cpu_fp32", hf, cpu_fp32)
    our_rate = _match_rate("cuda_bf16_vs_cpu_fp32_again", ours, cpu_fp32)
    _match_rate("cuda_bf16_vs_transformers_cuda_bf16", ours, hf)
    assert our_rate >= hf_rate - 0.15


def test_a_prefill_on_cuda_hands_off_the_sums_taken_at_sealing(smol_shape_dir):
    """Checked KV on a GPU pool: blocks are summed (Triton ``wsum64``) when sealed during the
    chunked prefill, kept on the device, and the hand-off's sums equal a fresh checksum of the
    blocks; a partial last block is summed at hand-off."""
    from engine import EngineConfig, LLMEngine

    eng = LLMEngine(
        EngineConfig(
            model_dir=str(smol_shape_dir), max_num_batched_tokens=64, num_kv_blocks=64,
            max_model_len=512, seal_checksums=True, enforce_eager=True,
        )
    )  # fmt: skip
    assert eng.runner.checksum_algorithm == "wsum64"
    # 150 tokens: nine full blocks of 16 and a partial one
    (prompt,) = random_prompts(1, SMOL_CONFIG["vocab_size"], seed=5, lo=150, hi=150)
    eng.add_request("g", prompt, SamplingParams(max_tokens=4), hold_kv=True)
    while eng.has_unfinished():
        eng.step()
    ids = eng.handoff.held_block_ids("g")
    assert [eng.pool.blocks[i].sealed for i in ids] == [True] * 9 + [False]
    assert eng.handoff.handoff_checksums(ids) == eng.handoff.block_checksums(ids)
    assert eng.handoff.release("g")


def test_prompt_logprobs_on_cuda_match_the_cpu(smol_shape_dir, prompts, monkeypatch):
    """The prompt-logprobs pass (echo with logprobs, vLLM's prompt_logprobs) on CUDA in
    float32 against the CPU's, with the LM head taken 7 rows at a time on both, and the prompt
    in chunks of 64 tokens on CUDA (one pass on the CPU)."""
    from engine import model_runner

    def scores(**options):
        llm = LLM(smol_shape_dir, num_kv_blocks=2048, **{"max_num_batched_tokens": 512, **options})
        monkeypatch.setattr(model_runner, "SCORE_ELEMENTS", 7 * llm.engine.runner.sampler_width)
        out = [llm.engine.prompt_logprobs(p, 2) for p in prompts[:4]]
        del llm
        return out

    cpu = scores(device="cpu", dtype="float32")
    gpu = scores(device="cuda", dtype="float32", max_num_batched_tokens=64)
    assert max(len(p) for p in prompts[:4]) > 64
    diffs = []
    for c, g, p in zip(cpu, gpu, prompts, strict=False):
        assert [e.token_id for e in g] == p[1:] == [e.token_id for e in c]
        diffs += [abs(a.logprob - b.logprob) for a, b in zip(c, g, strict=True)]
        assert all(len(e.top) == 2 and e.rank >= 1 for e in g)
    print(json.dumps({"check": "prompt_logprobs_cuda_fp32_vs_cpu", "max_abs": max(diffs)}))
    assert max(diffs) < 2e-2 and sum(diffs) / len(diffs) < 2e-3


def test_spread_graphs_replay_for_spread_lengths_and_keep_the_tokens(smol_shape_dir):
    """``decode_spread_graphs``: the decode sizes whose attention plan a floor of splits changes
    are captured twice, a batch of spread lengths (prompts of 64 to 1,800 tokens: the longest
    over 1.5x the mean) replays the second capture, and the greedy tokens are those of the
    engine without it (float32)."""
    prompts = random_prompts(24, SMOL_CONFIG["vocab_size"], seed=3, lo=64, hi=1800)
    lens = [len(p) for p in prompts]
    assert max(lens) >= 1024 and max(lens) * len(lens) >= 1.5 * sum(lens)
    # (enough tokens that, once every prompt is in, all 24 decode together: padded to 32)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    outs, runs = {}, {}
    for spread in (False, True):
        llm = LLM(smol_shape_dir, device="cuda", dtype="float32", max_num_batched_tokens=2048,
                  max_num_seqs=32, num_kv_blocks=4096, decode_spread_graphs=spread)  # fmt: skip
        outs[spread] = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.captured
        runs[spread] = (graphs.spread_sizes, graphs.spread_runs, graphs.runs)
        del llm
        torch.cuda.empty_cache()
    assert runs[False][:2] == (set(), 0)
    sizes, spread_runs, total = runs[True]
    assert 32 in sizes and 1 not in sizes  # batch 1: 32 splits already
    assert 0 < spread_runs <= total
    assert _match_rate("spread_graphs_vs_rule_fp32", outs[True], outs[False]) >= 0.9


def test_late_planning_holds_and_keeps_the_tokens(smol_shape_dir):
    """``late_planning``: between steps the engine waits until the step in flight nearly ends
    (``LLMEngine.hold_planning``, as the engine core's loop calls it; no command comes here, so
    each wait runs to its end). The greedy tokens are those of the engine without it, waits
    happened, and the device was never left idle for long: the whole run takes at most 1.15x
    the time of the same run planning at once (float32, decode CUDA graphs)."""
    import threading
    import time

    from engine import EngineConfig, LLMEngine

    prompts = random_prompts(16, SMOL_CONFIG["vocab_size"], seed=4, lo=64, hi=512)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    outs, took, holds = {}, {}, {}
    for late in (False, True, False, True):  # each twice: the second of each is timed
        config = EngineConfig(model_dir=str(smol_shape_dir), device="cuda", dtype="float32",
                              max_num_batched_tokens=2048, max_num_seqs=32, num_kv_blocks=4096,
                              async_scheduling=True, late_planning=late)  # fmt: skip
        engine = LLMEngine(config)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens: dict[str, list[int]] = {}
        wake = threading.Event()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            engine.hold_planning(wake)
        torch.cuda.synchronize()
        took[late] = time.perf_counter() - t0
        outs[late] = [tokens[f"r{i}"] for i in range(len(prompts))]
        clock = engine.stepper.clock
        holds[late] = (clock.holds, clock.held_s) if clock is not None else (0, 0.0)
        engine.close()
        del engine
        torch.cuda.empty_cache()
    print(json.dumps({"check": "late_planning", "seconds": took, "holds": holds}))
    assert holds[False] == (0, 0.0) and holds[True][0] > 0 and holds[True][1] > 0
    assert outs[True] == outs[False]
    assert took[True] <= 1.15 * took[False]
