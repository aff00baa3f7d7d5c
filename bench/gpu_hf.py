"""``transformers`` generate on the same shape: the reference point for decode steps."""

from __future__ import annotations

import statistics
import time

import torch

from bench.gpu_common import LLAMA_31_8B


class _StepClock:
    """A stopping criterion that never stops and stamps the time of every generated token."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def build_model():
    import transformers

    cfg = transformers.LlamaConfig(
        **{k: v for k, v in LLAMA_31_8B.items() if k not in ("architectures", "model_type")}
    )
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def hf_decode_step_ms(model, b: int, ctx: int, steps: int = 16) -> float:
    """Median time between consecutive tokens of ``generate`` (greedy, dynamic cache)."""
    from transformers import StoppingCriteriaList

    ids = torch.randint(0, LLAMA_31_8B["vocab_size"], (b, ctx), device="cuda")
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    gaps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]
    return statistics.median(gaps) * 1e3
