"""Small random PEFT LoRA adapters for SmolLM2, made by peft itself (tests of multi-LoRA)."""

from __future__ import annotations

from pathlib import Path

import torch

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
