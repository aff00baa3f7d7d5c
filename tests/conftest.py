"""Shared fixtures: the bundled model folder, small random-weight model folders, references."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from engine.bundled import DEFAULT_DIR, convert

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# NIXL/UCX in tests (this process and every worker it spawns) talk over loopback only.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (`make install` creates it; cached)."""
    return convert(DEFAULT_DIR)


BOS_ID = 1  # <|im_start|>, SmolLM2's bos_token


def make_bos_model_dir(base: Path, smol: Path) -> Path:
    """SmolLM2's folder (files linked) with a tokenizer whose post-processor puts a BOS before
    every sequence, as a Llama tokenizer's does (SmolLM2's adds nothing)."""
    import json

    base.mkdir(parents=True, exist_ok=True)
    for f in smol.iterdir():
        if f.name != "tokenizer.json":
            (base / f.name).symlink_to(f.resolve())
    spec = json.loads((smol / "tokenizer.json").read_text())
    bos = "<|im_start|>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
    }
    (base / "tokenizer.json").write_text(json.dumps(spec))
    return base


def make_random_model_dir(base: Path, smol: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """A small random-weight Llama or Qwen2 folder that reuses SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=49152,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # Larger than the default 0.02 so random logits are peaked and greedy ties are rare.
        initializer_range=0.25,
        eos_token_id=2,
        bos_token_id=1,
    )
    common.update(overrides)
    if arch == "qwen2":
        cfg, cls = Qwen2Config(tie_word_embeddings=False, **common), Qwen2ForCausalLM
    else:
        cfg, cls = LlamaConfig(**common), LlamaForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    if arch == "qwen2":  # make the QKV biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    out = base / arch
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(smol / name, out / name)
    return out


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory, smol_dir) -> Path:
    return make_random_model_dir(tmp_path_factory.mktemp("models"), smol_dir, "qwen2")


@pytest.fixture(scope="session")
def llama3_rope_dir(tmp_path_factory, smol_dir) -> Path:
    return make_random_model_dir(
        tmp_path_factory.mktemp("models"),
        smol_dir,
        "llama",
        seed=1,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers greedy continuation of one unpadded prompt (fp32 CPU)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
