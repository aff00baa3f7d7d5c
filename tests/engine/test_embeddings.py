"""Embeddings against transformers' final hidden states (fp32 CPU): last-token pooling with L2
normalisation (vLLM's default for generative models), a sentence-transformers folder's mean
pooling, and an adapter's embedding against peft's."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.errors import UnsupportedModelError
from engine.pooling import PoolingConfig
from tests.conftest import load_hf

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b", "Hi"]


def hf_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # after the final norm, as the engine's


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert abs(ours.norm().item() - 1.0) < 1e-4
    assert F.cosine_similarity(ours, ref, dim=0).item() >= 0.999


@pytest.fixture(scope="module")
def llm(smol_dir) -> LLM:
    return LLM(smol_dir, num_kv_blocks=128)


def test_last_token_pooling_matches_transformers(llm, smol_dir):
    assert llm.engine.pooling == PoolingConfig("last", True)
    hf = load_hf(smol_dir)
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        ours = llm.engine.embed(ids)
        assert ours.shape == (llm.engine.model_config.hidden_size,)
        assert_close(ours, F.normalize(hf_hidden(hf, ids)[-1], dim=0))
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used == 0  # the borrowed blocks went back


def sentence_transformers_dir(base, smol_dir, pooling: dict) -> str:
    out = base / "st"
    out.mkdir()
    for f in os.listdir(smol_dir):
        os.symlink(smol_dir / f, out / f)
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    return str(out)


def test_sentence_transformers_mean_pooling(smol_dir, tmp_path):
    folder = sentence_transformers_dir(tmp_path, smol_dir, {"pooling_mode_mean_tokens": True})
    llm = LLM(folder, num_kv_blocks=64)
    assert llm.engine.pooling == PoolingConfig("mean", True)
    hf = load_hf(smol_dir)
    ids = llm.tokenizer.encode(TEXTS[0])
    assert_close(llm.engine.embed(ids), F.normalize(hf_hidden(hf, ids).mean(0), dim=0))


def test_unsupported_pooling_is_refused(smol_dir, tmp_path):
    folder = sentence_transformers_dir(tmp_path, smol_dir, {"pooling_mode_max_tokens": True})
    with pytest.raises(UnsupportedModelError, match="pooling_mode_max_tokens"):
        PoolingConfig.from_dir(folder)


def test_adapter_embedding_matches_peft(smol_dir, tmp_path):
    from peft import PeftModel

    from tests.lora_adapters import ALL_TARGETS, make_adapter

    path = make_adapter(smol_dir, tmp_path / "a", r=8, alpha=16, targets=ALL_TARGETS, seed=1)
    llm = LLM(smol_dir, num_kv_blocks=64, enable_lora=True, max_loras=1, max_lora_rank=8)
    llm.engine.add_lora("a", str(path))
    peft_model = PeftModel.from_pretrained(load_hf(smol_dir), str(path)).eval()
    ids = llm.tokenizer.encode(TEXTS[1])
    ours, base = llm.engine.embed(ids, lora="a"), llm.engine.embed(ids)
    ref = F.normalize(hf_hidden(peft_model, ids)[-1], dim=0)
    assert_close(ours, ref)
    assert F.cosine_similarity(base, ref, dim=0).item() < 0.999  # the adapter matters
