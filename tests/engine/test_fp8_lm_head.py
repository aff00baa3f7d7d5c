"""The LM head in FP8 (``quantize_lm_head``, with ``quantization="fp8"``) on CPU: refused without
FP8 weights, an ``Fp8Weight`` of its own beside the embedding (tied models too), per-row scales
that shard with the vocab rows, memory accounting that counts it at one byte a weight, and the
bundled SmolLM2's logits and greedy output against the FP8 engine whose head stays unquantized.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import EngineConfig, LLMEngine
from engine.config import ModelConfig
from engine.fp8 import quantize_head
from engine.loader import dummy_weights
from engine.memory import weight_bytes
from engine.model import ModelWeights
from engine.parallel.shard import ModelShard
from engine.shapes import SHAPES
from kernels import Fp8Weight
from kernels.reference import FP8, quantize_fp8_rows
from services.worker.config import parse_config
from tests.engine import test_fp8
from tests.engine.test_fp8 import greedy, make

smol_prompts = test_fp8.smol_prompts  # the fixture: five short prompts of the bundled model


def nbytes(w: ModelWeights) -> int:
    """Bytes the weights hold (an embedding shared with the head counted once)."""

    def size(t: torch.Tensor | Fp8Weight | None) -> int:
        if t is None:
            return 0
        if isinstance(t, Fp8Weight):
            return size(t.weight) + size(t.scale)
        return t.numel() * t.element_size()

    mats = [getattr(lw, f.name) for lw in w.layers for f in dataclasses.fields(lw)]
    head = 0 if w.lm_head is w.embed else size(w.lm_head)
    return (
        sum(size(t) for t in mats if isinstance(t, torch.Tensor | Fp8Weight))
        + size(w.embed)
        + size(w.norm)
        + head
    )


def test_config_and_worker_flags_refuse_it_without_fp8_weights(smol_dir, capsys):
    for other in (None, "fp8_kv"):
        kw = {"kv_cache_dtype": "fp8"} if other else {}
        with pytest.raises(ValueError, match="quantize_lm_head needs quantization='fp8'"):
            EngineConfig(model_dir=str(smol_dir), quantize_lm_head=True, **kw)
    assert EngineConfig(model_dir=str(smol_dir), quantization="fp8").quantize_lm_head is False
    with pytest.raises(SystemExit):
        parse_config("decode", ["--model-dir", "/m", "--quantize-lm-head"], {})
    assert "--quantize-lm-head needs --quantization fp8" in capsys.readouterr().err
    env = {"TANDEM_QUANTIZATION": "fp8", "TANDEM_QUANTIZE_LM_HEAD": "1"}
    engine = parse_config("decode", ["--model-dir", "/m"], env).engine_config()
    assert engine.quantization == "fp8" and engine.quantize_lm_head is True
    flags = ["--model-dir", "/m", "--quantization", "fp8", "--quantize-lm-head"]
    assert parse_config("prefill", flags, {}).engine_config().quantize_lm_head is True


def test_quantize_head_in_chunks_is_quantize_fp8_rows(monkeypatch):
    from engine import fp8

    monkeypatch.setattr(fp8, "HEAD_CHUNK_ROWS", 7)  # chunks that do not divide the rows
    w = torch.randn(30, 40) * torch.logspace(-2, 1, 30).unsqueeze(1)
    got, want = quantize_head(w), quantize_fp8_rows(w)
    assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("tied", [True, False])
def test_dummy_head_shards_with_its_scales_and_memory_counts_one_byte(tied):
    """Dummy weights of SmolLM2's shape (tied and not): the head is an Fp8Weight apart from the
    float32 embedding; each TP=2 shard holds exactly its rows of the whole quantized head, scales
    included; `weight_bytes` equals the bytes held, whole and per shard."""
    c = dataclasses.replace(ModelConfig.from_dict(SHAPES["smollm2-135m"]), tie_word_embeddings=tied)
    cpu = torch.device("cpu")
    whole = dummy_weights(c, cpu, torch.float32, fp8=True, fp8_head=True)
    head = whole.lm_head
    assert isinstance(head, Fp8Weight) and head.weight.dtype == FP8
    assert whole.embed.dtype == torch.float32 and head.shape == whole.embed.shape
    plain = dummy_weights(c, cpu, torch.float32, fp8=True)
    assert torch.equal(plain.embed, whole.embed)  # the embedding is untouched
    want = quantize_fp8_rows(plain.lm_head)
    assert torch.equal(head.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert nbytes(whole) == weight_bytes(c, 4, None, 1, 1)
    assert nbytes(plain) == weight_bytes(c, 4, None, 1)
    # The quantized head: a 1-byte copy plus scales where the tied model had none.
    extra = c.vocab_size * c.hidden_size * (1 if tied else -3) + 4 * c.vocab_size
    assert weight_bytes(c, 4, None, 1, 1) - weight_bytes(c, 4, None, 1) == extra
    for rank in (0, 1):
        shard = ModelShard.of(c, 2, rank)
        part = dummy_weights(c, cpu, torch.float32, shard=shard, fp8=True, fp8_head=True)
        lo, hi = shard.vocab
        assert isinstance(part.lm_head, Fp8Weight) and part.lm_head.shape[0] == hi - lo
        assert torch.equal(part.lm_head.scale, head.scale[lo:hi])
        assert torch.equal(
            part.lm_head.weight.view(torch.uint8), head.weight[lo:hi].view(torch.uint8)
        )
        assert nbytes(part) == weight_bytes(c, 4, shard, 1, 1)


@pytest.fixture(scope="module")
def engines(smol_dir) -> tuple[LLMEngine, LLMEngine]:
    """FP8 weights on the bundled SmolLM2 (real weights, tied embeddings, float32 on CPU):
    the LM head unquantized (vLLM's semantics) and quantized."""
    return make(smol_dir, quantization="fp8"), make(
        smol_dir, quantization="fp8", quantize_lm_head=True
    )


def test_the_real_checkpoints_head_is_its_embedding_quantized(engines, smol_prompts):
    plain, quant = engines
    w = quant.runner.model.w
    assert plain.runner.model.w.lm_head is plain.runner.model.w.embed  # tied
    assert isinstance(w.lm_head, Fp8Weight) and not isinstance(w.embed, Fp8Weight)
    assert w.embed.dtype == torch.float32 and torch.equal(w.embed, plain.runner.model.w.embed)
    assert quant.runner.sampler_width == w.lm_head.shape[0] == 49152
    # Its logits are the unquantized-head engine's hidden states times exactly that head.
    deq = w.lm_head.weight.float() * w.lm_head.scale[:, None]
    saved = plain.runner.model.w.lm_head
    try:
        plain.runner.model.w.lm_head = deq
        want = plain.score(smol_prompts[0])
    finally:
        plain.runner.model.w.lm_head = saved
    torch.testing.assert_close(quant.score(smol_prompts[0]), want, atol=1e-4, rtol=0)


def test_logits_and_greedy_stay_close_to_the_unquantized_head(engines, smol_prompts):
    """Measured (61 prompt positions, float32): max |logit change| 2.6, mean 0.27 (the logits'
    mean magnitude is 8.1), argmax the same at 90% of positions, mean |logprob change| of the
    chosen token 0.11; greedy 16 tokens: 3 of 5 prompts identical, first divergences at tokens
    10, 16, 0, 16, 16. For scale: the FP8 layers alone against float32 change logits by 0.69 on
    average and keep 84% of the argmaxes."""
    plain, quant = engines
    la = torch.cat([plain.score(p) for p in smol_prompts])
    lb = torch.cat([quant.score(p) for p in smol_prompts])
    diff = (la - lb).abs()
    assert 0.05 < diff.mean() < 0.5 and diff.max() < 5.0  # changed (really quantized), not far
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean() >= 0.75
    chosen = la.argmax(-1, keepdim=True)
    delta = torch.log_softmax(la, -1).gather(1, chosen) - torch.log_softmax(lb, -1).gather(
        1, chosen
    )
    assert delta.abs().mean() < 0.25
    a, b = greedy(plain, smol_prompts), greedy(quant, smol_prompts)
    same = [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=False)) if x != y), len(p))
        for p, q in zip(a, b, strict=True)
    ]
    assert sum(x == y for x, y in zip(a, b, strict=True)) >= 2 and sum(same) >= 0.5 * 16 * len(a)
