"""CUDA only (``pytest -m gpu``): the FP8 kernels against their references, and the engine on
CUDA with an FP8 KV cache, FP8 weights and n-gram speculative decoding, on the SmolLM2 shape
with shared random weights (``tests/smol_shape.py``).

Set ``TANDEM_GPU_REPORT`` to a file to collect the agreement figures as JSON lines.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.gpu_report import agreement, fp8_capable, generate, report, require_cuda_triton

pytestmark = pytest.mark.gpu
require_cuda_triton()

import kernels  # noqa: E402
from engine import LLM, EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from kernels import reference  # noqa: E402
from kernels.fp8_gemm import scaled_mm_linear  # noqa: E402
from kernels.reference import FP8, quantize_fp8_rows, to_fp8  # noqa: E402
from kernels.triton_cache import write_kv  # noqa: E402
from kernels.triton_decode import decode_attention  # noqa: E402
from kernels.triton_prefill import prefill_attention  # noqa: E402
from kernels.triton_rope import rotary_embedding  # noqa: E402
from tests.handoff_cases import check_handoff_matches_colocated  # noqa: E402
from tests.kernel_cases import make_paged_batch, reference_attention, rel_err  # noqa: E402
from tests.smol_shape import SMOL_CONFIG, make_smol_shape_dir, random_prompts  # noqa: E402

FP8_OK = fp8_capable()
needs_fp8 = pytest.mark.skipif(not FP8_OK, reason="FP8 needs compute capability 8.9+")
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


# -- kernels -----------------------------------------------------------------------------------


@needs_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [9, 64, 300])
def test_fp8_scaled_mm_matches_reference(rows, dtype):
    """On the FP8 tensor cores for bf16 and fp16 models alike (fp16 went through the
    dequantizing reference before: the whole weight each call)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=g).to(dtype)
    w = quantize_fp8_rows(torch.randn(1024, 2048, device="cuda", generator=g) * 0.02)
    out = scaled_mm_linear(x, w)
    assert out.dtype == dtype
    # The activations are quantized too (e4m3 per row): a few percent, not bf16's 1e-3.
    assert rel_err(out, reference.linear(x.float(), w)) < 4e-2
    assert rel_err(kernels.linear(x, w), reference.linear(x.float(), w)) < 4e-2


@needs_fp8
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.05, 3.0)])
def test_fp8_write_kv_matches_reference(scales):
    q, kv, meta = make_paged_batch(
        [40, 300], [40, 300], block_size=16, num_heads=8, num_kv_heads=2, head_dim=128
    )
    t = meta.slot_blocks.shape[0]
    k = torch.randn(t, 2, 128, device="cuda").bfloat16() * 4
    v = torch.randn(t, 2, 128, device="cuda").bfloat16() * 4
    ours = torch.zeros(kv.shape, dtype=torch.uint8, device="cuda").view(FP8)
    write_kv(ours, 1, k, v, meta.slot_blocks, meta.slot_offsets, *scales)
    ref = torch.zeros(kv.shape, dtype=torch.uint8).view(FP8)  # the reference on the CPU
    cpu = dataclasses.replace(meta, slot_blocks=meta.slot_blocks.cpu(),
                              slot_offsets=meta.slot_offsets.cpu())  # fmt: skip
    reference.write_kv(ref, 1, k.cpu(), v.cpu(), cpu, *scales)
    ours = ours.cpu()
    same = (ours.view(torch.uint8) == ref.view(torch.uint8)).float().mean().item()
    assert same > 0.999  # both round to nearest; any tie broken otherwise is one e4m3 step
    assert rel_err(ours.float(), ref.float()) < 1e-2


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=needs_fp8)])
def test_rope_write_kv_is_the_unfused_pair_bit_for_bit(fp8):
    """The fused kernel against the Triton RoPE then the Triton KV write (same rounding, so
    exact), with a padding row; the unfused pair is checked against the references elsewhere."""
    q, kv, meta = make_paged_batch(
        [300, 5], [300, 5], block_size=16, num_heads=32, num_kv_heads=8, head_dim=128
    )
    t = q.shape[0]
    qkv = torch.randn(t, 48 * 128, device="cuda").bfloat16()
    qq, k, v = (x.view(t, -1, 128) for x in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    ang = torch.rand(t, 64, device="cuda") * 1000
    cos, sin = (torch.cat([f(ang), f(ang)], -1).bfloat16() for f in (torch.cos, torch.sin))
    meta.slot_blocks[7] = -1  # a padding row of a graph: rotated, but writes nothing
    cache = torch.zeros(kv.shape, dtype=torch.uint8, device="cuda").view(FP8) if fp8 else kv
    fused, unfused = cache.clone(), cache.clone()
    got = kernels.rope_write_kv(qq, k, v, cos, sin, fused, 1, meta, 0.5, 2.0)
    rq, rk = rotary_embedding(qq, k, cos, sin)
    write_kv(unfused, 1, rk, v, meta.slot_blocks, meta.slot_offsets, 0.5, 2.0)
    assert torch.equal(got, rq)
    assert torch.equal(fused.view(torch.uint8), unfused.view(torch.uint8))


def fp8_cache(kv: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """The pool in FP8 (made on the CPU, whose FP8 support the reference uses anyway)."""
    kv = kv.float().cpu()
    parts = [to_fp8(kv[:, :, :1], k_scale), to_fp8(kv[:, :, 1:], v_scale)]
    return torch.cat([p.view(torch.uint8) for p in parts], dim=2).cuda().view(FP8)


@needs_fp8
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.25, 2.0)])
def test_fp8_decode_and_prefill_attention_match_reference(scales):
    ks, vs = scales
    q, kv, meta = make_paged_batch(
        [1, 17, 1000, 4097], [1] * 4, block_size=16, num_heads=32, num_kv_heads=8, head_dim=128
    )
    cache = fp8_cache(kv.float(), ks, vs)
    ref = reference_attention(q, cache, 1, meta, 0.088, ks, vs)
    out = decode_attention(q, cache, 1, meta.block_tables, meta.seq_lens, 0.088, k_scale=ks,
                           v_scale=vs)  # fmt: skip
    assert rel_err(out, ref) < 1e-2
    q, kv, meta = make_paged_batch(
        [1500, 37], [700, 5], block_size=16, num_heads=32, num_kv_heads=8, head_dim=128
    )
    cache = fp8_cache(kv.float(), ks, vs)
    out = prefill_attention(
        q, cache, 0, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
        0.088, k_scale=ks, v_scale=vs,
    )  # fmt: skip
    assert rel_err(out, reference_attention(q, cache, 0, meta, 0.088, ks, vs)) < 1e-2


# -- engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_shape_dir(tmp_path_factory) -> Path:
    return make_smol_shape_dir(tmp_path_factory.mktemp("smol_shape") / "model", seed=0)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Random prompts made of a repeated random phrase: n-gram drafts find matches."""
    out = []
    for i, p in enumerate(random_prompts(n, SMOL_CONFIG["vocab_size"], seed=seed, hi=40)):
        out.append((p * (1 + 160 // max(len(p), 1)))[: 60 + 5 * i])
    return out


def test_speculative_greedy_is_token_exact_on_cuda_fp32(smol_shape_dir):
    """fp32 on CUDA: verification (decode rows in the CUDA graphs, or the prefill kernel in a
    step that also prefills) and plain decode agree to float32 rounding, so greedy outputs are
    identical."""
    prompts = repetitive_prompts(12, seed=3)
    base = generate(smol_shape_dir, prompts, dtype="float32")
    spec = generate(smol_shape_dir, prompts, dtype="float32", speculative_config=SPEC)
    rate = agreement(base, spec)
    report("spec_vs_plain_cuda_fp32", match_rate=rate)
    assert rate == 1.0


def run_engine(engine: LLMEngine, prompts, one_at_a_time: bool) -> list[list[int]]:
    """Greedy tokens (``ignore_eos``, 24 each) of ``prompts``, all at once or one at a time."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    finals: dict[str, list[int]] = {}
    waves = [[i] for i in range(len(prompts))] if one_at_a_time else [range(len(prompts))]
    for wave in waves:
        for i in wave:
            engine.add_request(f"s{i}", prompts[i], params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
    engine.check_integrity()
    return [finals[f"s{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_verify_steps_replay_the_decode_graphs_on_cuda_fp32(smol_shape_dir, one_at_a_time):
    """A verify step is a decode step of one row per token (the newest and each draft), so it
    replays the captured graphs: at batch 1 every drafted token goes through them, and greedy
    output is the non-speculative output."""
    prompts = repetitive_prompts(8, seed=6)
    base = generate(smol_shape_dir, prompts, dtype="float32")
    engine = LLMEngine(
        EngineConfig(model_dir=str(smol_shape_dir), dtype="float32", num_kv_blocks=2048,
                     max_num_seqs=8, speculative_config=SPEC)
    )  # fmt: skip
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.captured and graphs.sizes[-1] >= 8 * 5
    spec = run_engine(engine, prompts, one_at_a_time)
    s = engine.stats().spec
    report(f"spec_graphs_vs_plain_cuda_fp32_{'b1' if one_at_a_time else 'b8'}",
           match_rate=agreement(base, spec), draft_tokens=s.draft_tokens,
           graph_rows=graphs.rows, graph_runs=graphs.runs)  # fmt: skip
    assert spec == base
    assert s.draft_tokens > 0 and graphs.rows > graphs.runs
    if one_at_a_time:  # one sequence per run: its extra rows are its drafts, all verified there
        assert graphs.rows - graphs.runs == s.draft_tokens
    del engine
    torch.cuda.empty_cache()


def test_draft_model_steps_replay_their_graphs_on_cuda_fp32(smol_shape_dir):
    """The target as its own draft (fp32): the draft's passes replay its own CUDA graphs and
    the target's verify steps its graphs; output is the non-speculative output and the drafts
    (the target's own greedy tokens) are kept."""
    prompts = repetitive_prompts(4, seed=8)
    base = generate(smol_shape_dir, prompts, dtype="float32")
    spec_config = {"method": "draft_model", "model": str(smol_shape_dir),
                   "num_speculative_tokens": 3}  # fmt: skip
    engine = LLMEngine(
        EngineConfig(model_dir=str(smol_shape_dir), dtype="float32", num_kv_blocks=1024,
                     max_num_seqs=4, gpu_memory_utilization=0.5, speculative_config=spec_config)
    )  # fmt: skip
    target, draft = engine.runner.graphs, engine.proposer.runner.graphs  # type: ignore[union-attr]
    assert target is not None and draft is not None and draft.captured
    spec = run_engine(engine, prompts, one_at_a_time=False)
    s = engine.stats().spec
    report("draft_model_graphs_vs_plain_cuda_fp32", match_rate=agreement(base, spec),
           draft_tokens=s.draft_tokens, accepted=s.accepted_tokens, draft_graph_runs=draft.runs,
           target_graph_runs=target.runs)  # fmt: skip
    assert spec == base
    assert s.draft_tokens > 0 and s.accepted_tokens >= 0.9 * s.draft_tokens
    assert target.rows > target.runs > 0 and draft.runs >= target.runs  # k passes a step
    del engine
    torch.cuda.empty_cache()


@needs_fp8
def test_verify_rows_with_an_fp8_kv_cache_on_cuda(smol_shape_dir):
    prompts = repetitive_prompts(8, seed=7)
    base = generate(smol_shape_dir, prompts, kv_cache_dtype="fp8")
    engine = LLMEngine(
        EngineConfig(model_dir=str(smol_shape_dir), num_kv_blocks=2048, kv_cache_dtype="fp8",
                     max_num_seqs=8, speculative_config=SPEC)
    )  # fmt: skip
    graphs = engine.runner.graphs
    assert graphs is not None
    spec = run_engine(engine, prompts, one_at_a_time=False)
    rate = agreement(base, spec)
    report("spec_graphs_vs_plain_cuda_fp8_kv", match_rate=rate, graph_rows=graphs.rows,
           graph_runs=graphs.runs)  # fmt: skip
    assert graphs.rows > graphs.runs and engine.stats().spec.draft_tokens > 0
    assert rate >= 0.75  # bf16 and e4m3 round differently when rows are batched differently
    del engine
    torch.cuda.empty_cache()


def test_speculative_greedy_on_cuda_bf16_and_acceptance(smol_shape_dir):
    prompts = repetitive_prompts(12, seed=4)
    base = generate(smol_shape_dir, prompts)
    engine = LLMEngine(
        EngineConfig(model_dir=str(smol_shape_dir), num_kv_blocks=2048, speculative_config=SPEC)
    )
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", p, params)
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.token_ids
    spec = [finals[f"s{i}"] for i in range(len(prompts))]
    s = engine.stats().spec
    rate = agreement(base, spec)
    report("spec_vs_plain_cuda_bf16", match_rate=rate, drafts=s.drafts,
           draft_tokens=s.draft_tokens, accepted=s.accepted_tokens)  # fmt: skip
    assert s.drafts > 0
    assert rate >= 0.75  # bf16: the verify pass rounds differently from a decode step


@needs_fp8
def test_fp8_kv_engine_on_cuda(smol_shape_dir):
    prompts = random_prompts(12, SMOL_CONFIG["vocab_size"], seed=5, hi=200)
    base = generate(smol_shape_dir, prompts)
    fp8 = generate(smol_shape_dir, prompts, kv_cache_dtype="fp8")
    report("fp8_kv_vs_bf16_cuda", match_rate=agreement(base, fp8))
    first = [first_difference(a, b) for a, b in zip(base, fp8, strict=True)]
    report("fp8_kv_vs_bf16_cuda_first_divergence", positions=first)
    assert sum(first) / len(first) >= 4  # random weights: near-ties flip early, not at once
    eager = generate(smol_shape_dir, prompts, kv_cache_dtype="fp8", enforce_eager=True)
    assert agreement(fp8, eager) >= 0.9  # CUDA graphs read the FP8 cache like eager steps


@needs_fp8
def test_fp8_weights_engine_on_cuda(smol_shape_dir):
    prompts = random_prompts(12, SMOL_CONFIG["vocab_size"], seed=6, hi=200)
    base = generate(smol_shape_dir, prompts)
    w8 = generate(smol_shape_dir, prompts, quantization="fp8")
    report("fp8_weights_vs_bf16_cuda", match_rate=agreement(base, w8))
    assert all(len(o) == 24 for o in w8)
    llm = LLM(
        smol_shape_dir,
        num_kv_blocks=64,
        max_model_len=512,
        quantization="fp8",
        kv_cache_dtype="fp8",
    )
    assert llm.engine.runner.model.w.layers[0].qkv.weight.dtype == FP8
    assert llm.engine.runner.kv_cache.dtype == FP8


@needs_fp8
def test_fp8_kv_handoff_on_cuda_is_token_exact_against_fp8_colocated(smol_shape_dir):
    """The disaggregated path on CUDA with FP8 caches (prefill graph-free, decode with CUDA
    graphs on both sides): the decode engine continues exactly like one FP8 engine, and each
    hand-off moves half the bytes of a bf16 one."""
    prompts = random_prompts(4, SMOL_CONFIG["vocab_size"], seed=7, lo=20, hi=200)

    def make(**kw) -> LLMEngine:
        opts = {"num_kv_blocks": 256, "max_model_len": 256, "max_num_batched_tokens": 256, **kw}
        return LLMEngine(EngineConfig(model_dir=str(smol_shape_dir), **opts))

    moved = check_handoff_matches_colocated(lambda: make(kv_cache_dtype="fp8"), prompts, 16)
    bf16 = make(num_kv_blocks=32)
    blocks = [-(-len(p) // bf16.config.block_size) for p in prompts]
    report(
        "fp8_kv_handoff_cuda", bytes=moved, bf16_bytes=[n * bf16.runner.block_bytes for n in blocks]
    )
    assert moved == [n * bf16.runner.block_bytes // 2 for n in blocks]


# -- the LM head in FP8 (quantize_lm_head) -------------------------------------------------------
@needs_fp8
@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp8_lm_head_of_the_8b_shape_through_linear(rows):
    """The 8B shape's LM head (128256 x 4096) in FP8 through ``kernels.linear``, as the engine
    runs it: the skinny kernel at 1 row (weight-only) and 8 (the H100's measured plan: W8A8),
    ``torch._scaled_mm`` above (a prefill's or a large batch's rows)."""
    from engine.fp8 import quantize_head

    g = torch.Generator(device="cuda").manual_seed(rows)
    head = quantize_head(torch.randn(128256, 4096, device="cuda", generator=g).bfloat16() * 0.02)
    x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
    got = kernels.linear(x, head)
    err = rel_err(got, reference.linear(x.float(), head))
    report("fp8_lm_head_8b_linear", rows=rows, rel_err=err)
    assert got.shape == (rows, 128256) and got.dtype == torch.bfloat16
    assert err < (1e-2 if rows == 1 else 5e-2)  # more rows: x in e4m3 too


@needs_fp8
def test_fp8_lm_head_engine_on_cuda(smol_shape_dir):
    """``quantize_lm_head`` on CUDA: the head is the CPU-quantized one; the prompts' logits (the
    head through ``torch._scaled_mm``) are those of the FP8 engine given that head dequantized
    (to x's e4m3 rounding); greedy decoding (the head in the skinny kernel, CUDA graphs) stays
    near the bf16 head's and equals eager steps'."""
    from engine.config import ModelConfig
    from engine.loader import load_weights

    # Two engines at once, after other tests in this process: a share each that both fit in.
    opts = {"num_kv_blocks": 256, "max_model_len": 512, "max_num_seqs": 8, "quantization": "fp8",
            "gpu_memory_utilization": 0.3}  # fmt: skip
    plain = LLM(smol_shape_dir, **opts)
    quant = LLM(smol_shape_dir, **opts, quantize_lm_head=True)
    w, w_plain = quant.engine.runner.model.w, plain.engine.runner.model.w
    assert isinstance(w.lm_head, kernels.Fp8Weight) and w.embed.dtype == torch.bfloat16
    cpu = load_weights(smol_shape_dir, ModelConfig.from_dir(smol_shape_dir), torch.device("cpu"),
                       torch.bfloat16, fp8_head=True).lm_head  # fmt: skip
    assert isinstance(cpu, kernels.Fp8Weight)
    torch.testing.assert_close(w.lm_head.scale.cpu(), cpu.scale, rtol=1e-6, atol=0)
    # The same scales; the division by them rounds differently on the GPU now and then (0.12%
    # of the bytes on an H100), each such value one e4m3 step from the CPU's at most.
    got_q, want_q = w.lm_head.weight.cpu(), cpu.weight
    differ = got_q.view(torch.uint8) != want_q.view(torch.uint8)
    assert int(differ.sum()) <= cpu.weight.numel() * 5e-3, int(differ.sum())
    a, b = got_q[differ].float(), want_q[differ].float()
    assert bool(((a - b).abs() <= b.abs() / 8 + 2.0**-9).all())  # 3 mantissa bits; subnormals
    prompts = random_prompts(6, SMOL_CONFIG["vocab_size"], seed=8, lo=20, hi=120)
    deq = (w.lm_head.weight.float() * w.lm_head.scale[:, None]).bfloat16()
    saved, w_plain.lm_head = w_plain.lm_head, deq
    try:
        want = [plain.engine.score(p) for p in prompts]
    finally:
        w_plain.lm_head = saved
    got = [quant.engine.score(p) for p in prompts]
    errs = [rel_err(a, b) for a, b in zip(got, want, strict=True)]
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, want, strict=True))
    report("fp8_lm_head_scores_cuda", rel_err=max(errs), argmax_same=same / sum(map(len, prompts)))
    assert max(errs) < 5e-2
    del plain, quant
    torch.cuda.empty_cache()
    prompts = random_prompts(12, SMOL_CONFIG["vocab_size"], seed=9, hi=200)
    w8 = generate(smol_shape_dir, prompts, quantization="fp8")
    head = generate(smol_shape_dir, prompts, quantization="fp8", quantize_lm_head=True)
    first = [first_difference(a, b) for a, b in zip(w8, head, strict=True)]
    report("fp8_lm_head_vs_bf16_head_cuda", match_rate=agreement(w8, head), first=first)
    assert all(len(o) == 24 for o in head) and sum(first) / len(first) >= 2
    eager = generate(smol_shape_dir, prompts, quantization="fp8", quantize_lm_head=True,
                     enforce_eager=True)  # fmt: skip
    assert agreement(head, eager) >= 0.9  # CUDA graphs run the FP8 head like eager steps
