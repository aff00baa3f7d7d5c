"""Tandem's engine: Llama/Qwen2 models on a paged KV cache with continuous batching.

from engine import LLM, SamplingParams
outs = LLM(model_dir).generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))

The package's face is cheap: what the front services need (``engine.tokenizer``,
``engine.config``, ``engine.sampling_params``, ``engine.grammar``, ``engine.errors``) imports
no torch, and the names below load their modules (and torch) only when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.errors import (
        InvalidRequestError,
        InvalidSamplingParamsError,
        PromptTooLongError,
        RequestNotFoundError,
        TandemError,
        UnsupportedModelError,
    )
    from engine.grammar import GrammarSpec
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine, RequestOutput
    from engine.sampling_params import SamplingParams

_WHERE = {
    "GrammarSpec": "engine.grammar",
    "LLM": "engine.llm",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "InvalidRequestError": "engine.errors",
    "InvalidSamplingParamsError": "engine.errors",
    "PromptTooLongError": "engine.errors",
    "RequestNotFoundError": "engine.errors",
    "TandemError": "engine.errors",
    "UnsupportedModelError": "engine.errors",
    "LLMEngine": "engine.llm_engine",
    "RequestOutput": "engine.llm_engine",
    "SamplingParams": "engine.sampling_params",
}
__all__ = [
    "EngineConfig",
    "GrammarSpec",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "LLM",
    "LLMEngine",
    "ModelConfig",
    "PromptTooLongError",
    "RequestNotFoundError",
    "RequestOutput",
    "SamplingParams",
    "TandemError",
    "UnsupportedModelError",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
