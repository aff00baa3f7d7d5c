"""Helpers of the GPU tests: what they report beside pass/fail (one JSON line per figure on
stdout, appended to the file ``TANDEM_GPU_REPORT`` names: the device run collects them), the
module guard, and greedy runs of an offline engine compared."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def assert_replays_in_a_cuda_graph(fn, x: torch.Tensor, eager: torch.Tensor) -> None:
    """``fn()`` (a product of ``x``) captured in a CUDA graph: three replays give ``eager``
    bit for bit, and after new values in ``x`` a replay gives what ``fn()`` gives eagerly."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, fn())


def report(check: str, **values) -> None:
    line = json.dumps({"check": check, **values})
    print(line)
    path = os.environ.get("TANDEM_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def fp8_capable() -> bool:
    """Whether this CUDA device has FP8 (compute capability 8.9+: Ada, Hopper)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def require_cuda_triton() -> None:
    """Skip the calling test module (at import) unless CUDA and Triton are both there."""
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA", allow_module_level=True)
    pytest.importorskip("triton")


def generate(model_dir: Path, prompts, max_tokens: int = 24, **options) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (``ignore_eos``) from a fresh offline engine, freed after."""
    from engine import LLM, SamplingParams

    opts = {"max_num_batched_tokens": 256, "max_num_seqs": 32, "num_kv_blocks": 2048, **options}
    llm = LLM(model_dir, **opts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    del llm
    torch.cuda.empty_cache()
    return outs


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of prompts whose tokens are identical."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
