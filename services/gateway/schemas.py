"""OpenAI request bodies of the gateway, as strict pydantic models.

Strict means JSON types must match (``"5"`` is not an integer, ``1`` is not a boolean); a
JSON integer is still accepted where a number is expected. Fields OpenAI clients send that
Tandem does not use (``tools``, ``response_format``, ``logit_bias``, ...) are ignored, as the
OpenAI API ignores fields it does not know. Semantic checks (ranges, limits, the model name)
happen in ``core``, where the tokenizer and the config are at hand.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Body):
    """One part of a message's content; only ``type == "text"`` is supported."""

    type: str
    text: str | None = None


class ChatMessage(_Body):
    """A chat message. ``content`` is a string, a list of text parts, or null (assistant)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with usage and no choices."""

    include_usage: bool = False


class _Sampling(_Body):
    """Fields shared by chat and text completions (OpenAI names, plus vLLM's extensions)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Extensions (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    # Tandem extensions: scheduling class (batch is shed first under load) and a deadline in
    # seconds for the whole request (capped by the server's --max-request-timeout).
    priority: Literal["interactive", "batch"] | None = None
    timeout: float | None = None


class ChatCompletionRequest(_Sampling):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None


class CompletionRequest(_Sampling):
    """Body of ``POST /v1/completions``. ``prompt``: a string, a list holding exactly one
    string, or a list of token ids."""

    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
