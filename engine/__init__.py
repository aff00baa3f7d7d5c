"""Tandem's engine: Llama/Qwen2 models on a paged KV cache with continuous batching.

from engine import LLM, SamplingParams
outs = LLM(model_dir).generate(["Hello"], SamplingParams(max_tokens=16, temperature=0))
"""

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

__all__ = [
    "LLM",
    "EngineConfig",
    "GrammarSpec",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "LLMEngine",
    "ModelConfig",
    "PromptTooLongError",
    "RequestNotFoundError",
    "RequestOutput",
    "SamplingParams",
    "TandemError",
    "UnsupportedModelError",
]
