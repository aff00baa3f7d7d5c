"""Small random PEFT LoRA adapters for SmolLM2, made by peft itself (tests of multi-LoRA)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine import LLMEngine

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: Path,
    out: Path,
    *,
    r: int,
    alpha: float,
    targets: list[str] | str,
    seed: int,
    rslora: bool = False,
    std: float = 0.05,
    **extra,
) -> Path:
    """Save a LoRA adapter of ``base_dir`` with random A and B (std ``std``) to ``out``.

    PEFT initialises B to zero (a no-op adapter), so both matrices are drawn here; the
    scaling is PEFT's own (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0,
        **extra,
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    peft_model.save_pretrained(out)
    return out


def write_adapter(
    out: Path, engine: LLMEngine, rank: int, targets: list[str], seed: int, std: float = 0.01
) -> Path:
    """A random PEFT LoRA folder for the engine's model (A, B ~ N(0, std)), stored bf16, made
    without peft (any shape ``engine.shapes`` makes; ``lab.lora`` times them too)."""
    from safetensors.torch import save_file

    from engine.lora_config import module_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(engine.model_config.num_layers):
        for m in targets:
            fan_in, fan_out = module_shape(engine.model_config, m)
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, out / "adapter_model.safetensors"
    )
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
