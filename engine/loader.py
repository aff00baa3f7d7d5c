"""Load weights from a Hugging Face safetensors folder, or make random ones of the same shapes.

Fuses q/k/v (and their Qwen2 biases) and gate/up into single matrices as it loads. The
"dummy" mode builds weights from config.json alone, for benchmarks of real shapes on GPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import UnsupportedModelError
from engine.model import LayerWeights, ModelWeights


class _Tensors:
    """Name -> tensor over every *.safetensors file of a folder (index file or not)."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise UnsupportedModelError(f"no *.safetensors files in {model_dir}")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self._where[name] = f
        self._handles: dict[Path, object] = {}
        self.device, self.dtype = device, dtype

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UnsupportedModelError(f"weight {name!r} missing from the checkpoint")
        f = self._where[name]
        if f not in self._handles:
            self._handles[f] = safe_open(str(f), framework="pt")
        t = self._handles[f].get_tensor(name)  # type: ignore[attr-defined]
        return t.to(device=self.device, dtype=self.dtype)


def load_weights(
    model_dir: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> ModelWeights:
    """Read and fuse the checkpoint's weights."""
    src = _Tensors(Path(model_dir), device, dtype)
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        bias = None
        if config.qkv_bias:
            bias = torch.cat([src.get(a + f"{x}_proj.bias") for x in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=src.get(p + "input_layernorm.weight"),
                qkv=torch.cat([src.get(a + f"{x}_proj.weight") for x in "qkv"]),
                qkv_bias=bias,
                o_proj=src.get(a + "o_proj.weight"),
                post_norm=src.get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([src.get(m + "gate_proj.weight"), src.get(m + "up_proj.weight")]),
                down=src.get(m + "down_proj.weight"),
            )
        )
    embed = src.get("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in src:
        lm_head = embed
    else:
        lm_head = src.get("lm_head.weight")
    return ModelWeights(embed, layers, src.get("model.norm.weight"), lm_head)


def dummy_weights(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> ModelWeights:
    """Random weights of the config's shapes (std 0.02; norms 1): for speed, not for text.

    Drawn on ``device`` from a generator seeded with ``seed``, so every engine of one device
    type gets the same weights (an 8B model is drawn in seconds on a GPU, minutes on a CPU);
    the values differ between device types."""
    g = torch.Generator(device=device).manual_seed(seed)
    c = config

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(dtype=dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    qkv_rows = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    layers = [
        LayerWeights(
            input_norm=ones(c.hidden_size),
            qkv=rand(qkv_rows, c.hidden_size),
            qkv_bias=rand(qkv_rows) if c.qkv_bias else None,
            o_proj=rand(c.hidden_size, c.num_heads * c.head_dim),
            post_norm=ones(c.hidden_size),
            gate_up=rand(2 * c.intermediate_size, c.hidden_size),
            down=rand(c.hidden_size, c.intermediate_size),
        )
        for _ in range(c.num_layers)
    ]
    embed = rand(c.vocab_size, c.hidden_size)
    lm_head = embed if c.tie_word_embeddings else rand(c.vocab_size, c.hidden_size)
    return ModelWeights(embed, layers, ones(c.hidden_size), lm_head)
