"""A model folder of SmolLM2-135M's shape with seeded random weights, made without downloads.

The GPU tests run the engine on it in bf16 on CUDA and in float32 on the CPU. Weights are drawn
on the CPU from a fixed seed and stored in bf16, so both devices start from the very same
values; a word-level tokenizer over the vocabulary stands in for the real one (prompts are
token ids).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.shapes import SHAPES

SMOL_CONFIG = {**SHAPES["smollm2-135m"], "head_dim": 64}


def _weights(cfg: dict, seed: int, std: float, embed_std: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def rand(rows: int, cols: int, s: float = std) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * s).to(torch.bfloat16)

    def norm() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)

    out = {"model.embed_tokens.weight": rand(cfg["vocab_size"], hidden, embed_std)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm()
        out[p + "post_attention_layernorm.weight"] = norm()
        out[p + "self_attn.q_proj.weight"] = rand(q_rows, hidden)
        out[p + "self_attn.k_proj.weight"] = rand(kv_rows, hidden)
        out[p + "self_attn.v_proj.weight"] = rand(kv_rows, hidden)
        out[p + "self_attn.o_proj.weight"] = rand(hidden, q_rows)
        out[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        out[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        out[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    out["model.norm.weight"] = norm()
    return out


def _word_tokenizer(vocab_size: int) -> dict:
    vocab = {f"w{i}": i for i in range(vocab_size)}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"},
    }


def make_smol_shape_dir(
    out: Path, seed: int = 0, std: float = 0.03, embed_std: float = 0.1, **overrides
) -> Path:
    """Write config.json, tokenizer.json and model.safetensors under ``out``; returns it.

    With ``std`` 0.03 the random model is neither degenerate (at 0.02 greedy decoding repeats
    one token) nor so chaotic that bf16 rounding flips most greedy choices (at 0.05 it does,
    even between two CPU runs, float32 against bf16)."""
    cfg = {**SMOL_CONFIG, **overrides}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "tokenizer.json").write_text(json.dumps(_word_tokenizer(cfg["vocab_size"])))
    save_file(_weights(cfg, seed, std, embed_std), str(out / "model.safetensors"))
    return out


def random_prompts(n: int, vocab_size: int, seed: int = 0, lo: int = 4, hi: int = 300):
    """``n`` token-id prompts of random lengths in ``[lo, hi]`` (ids 3.. to skip specials)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (k,), generator=g).tolist() for k in lengths]
