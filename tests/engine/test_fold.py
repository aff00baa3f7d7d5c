"""Folded norms (``engine.model.fold_norms``, issue 19): each RMSNorm's weight multiplied into
the columns of the product after it, the decode step's norms, SiLU-and-multiply and residual
adds made by ``kernels.rms_linear`` / ``kernels.linear_add``.

The engine folds on CUDA only (one rank, no LoRA, bf16/fp16 weights); the fused kernels are
tested on the GPU (``tests/gpu/test_fold_gpu.py``). Here, on the CPU, the folded model (its
reference paths) must give transformers' greedy tokens on the real SmolLM2 weights, the
compositions must hold, and what cannot be folded is refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model import DecoderModel, fold_norms
from engine.parallel.comm import TPComm
from engine.parallel.shard import ModelShard
from kernels import reference
from tests.conftest import hf_greedy, load_hf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", "Water boils at"]
MAX_NEW = 16


def _engine(model_dir, fold: bool) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), max_num_batched_tokens=64,
                                    max_num_seqs=8, kv_cache_bytes=64 * 1024**2))  # fmt: skip
    if fold:
        engine.runner.model.fold()
    return engine


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens (MAX_NEW of them, past EOS), batched in ``engine``."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    for _ in range(2000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if not engine.has_unfinished():
            break
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_folded_engine_matches_transformers(smol_dir):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    engine = _engine(smol_dir, fold=True)
    model = engine.runner.model
    assert model.folded and all(lw.folded for lw in model.w.layers)
    assert all(torch.equal(lw.input_norm, torch.ones_like(lw.input_norm)) for lw in model.w.layers)
    hf = load_hf(smol_dir)
    want = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    assert greedy(engine, prompts) == want


def test_folded_qwen2_with_bias_matches_unfolded(qwen2_dir):
    """Qwen2's QKV bias is added after the folded norm's 1/rms (random weights, float32)."""
    prompts = [[5 + i, 17, 99 + 3 * i, 250, 31, 7 * i + 2] * 3 for i in range(4)]
    plain, folded = _engine(qwen2_dir, fold=False), _engine(qwen2_dir, fold=True)
    assert plain.runner.model.w.layers[0].qkv_bias is not None
    assert greedy(folded, prompts) == greedy(plain, prompts)


def test_compositions_on_the_reference_path():
    g = torch.Generator().manual_seed(0)
    m, k, n, eps = 5, 64, 48, 1e-5
    x = torch.randn(m, k, generator=g)
    norm = 1 + 0.3 * torch.randn(k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    bias = torch.randn(n, generator=g)
    ones = torch.ones(k)
    h, _ = reference.rms_norm(x, norm, eps)
    got = kernels.rms_linear(x, ones, eps, w * norm, bias)
    torch.testing.assert_close(got, reference.linear(h, w, bias), atol=1e-5, rtol=1e-5)
    got = kernels.rms_linear(x, ones, eps, w * norm, silu=True)
    torch.testing.assert_close(got, reference.silu_and_mul(reference.linear(h, w)), atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    add = torch.randn(m, n, generator=g)
    torch.testing.assert_close(kernels.linear_add(x, w, add), x @ w.T + add)
    # No sums of squares off the skinny kernel: the next norm sums its input itself.
    out, sums = kernels.linear_add_sums(x, w, add)
    assert sums is None
    torch.testing.assert_close(out, x @ w.T + add)
    torch.testing.assert_close(kernels.rms_linear(x, ones, eps, w * norm, bias, sums=sums),
                               reference.linear(h, w, bias), atol=1e-5, rtol=1e-5)  # fmt: skip


def test_rope_attention_is_rope_write_then_attention_on_the_reference_path():
    from tests.kernel_cases import make_paged_batch

    q, kv, meta = make_paged_batch([9, 40], [1, 1], block_size=16, num_heads=4, num_kv_heads=2,
                                   head_dim=16, dtype=torch.float32, device="cpu")  # fmt: skip
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 2, 16, generator=g).unbind(0)
    ang = torch.rand(2, 8, generator=g)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    two = kv.clone()
    got = kernels.rope_attention(q, k, v, cos, sin, kv, 1, meta, 0.25)
    qr = reference.rope_write_kv(q, k, v, cos, sin, two, 1, meta)
    assert torch.equal(kv, two)
    torch.testing.assert_close(got, reference.paged_attention(qr, two, 1, meta, 0.25))


def test_what_cannot_be_folded_is_refused(smol_dir):
    engine = _engine(smol_dir, fold=False)
    model = engine.runner.model
    w = model.w
    fp8 = dataclasses.replace(w, layers=[dataclasses.replace(
        w.layers[0], qkv=reference.quantize_fp8_rows(w.layers[0].qkv))])  # fmt: skip
    with pytest.raises(ValueError, match="FP8"):
        fold_norms(fp8)
    two = TPComm(ModelShard.of(model.config, 3, 0))
    with pytest.raises(ValueError, match="one rank"):
        DecoderModel(model.config, w, 64, two).fold()
    model.fold()
    with pytest.raises(ValueError, match="LoRA"):
        model.forward(torch.tensor([1]), torch.tensor([0]), engine.runner.kv_cache, None,
                      lora=object())  # fmt: skip


def test_linear_add_rounds_once_and_leaves_the_stream_alone():
    """Off the skinny kernel the stream is added in the BLAS's epilogue (``addmm``): one
    rounding of ``x @ w.T + add`` in bf16, ``add`` itself unchanged."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(64, 96, generator=g), torch.randn(80, 96, generator=g)
    add = torch.randn(64, 80, generator=g) * 30
    exact = x @ w.T + add
    xb, wb, ab = x.bfloat16(), w.bfloat16(), add.bfloat16()
    kept = ab.clone()
    got = kernels.linear_add(xb, wb, ab)
    assert got.dtype == torch.bfloat16 and torch.equal(ab, kept)
    exact_b = xb.float() @ wb.float().T + ab.float()  # the bf16 inputs, summed in fp32
    torch.testing.assert_close(got.float(), exact_b, atol=0.25, rtol=1e-2)
    assert got.float().sub(exact_b).abs().mean() < 0.05 * exact.abs().mean()
