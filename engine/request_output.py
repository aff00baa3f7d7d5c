"""What the engine returns for each choice of a request after a step (``LLMEngine.step``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling_params import TokenLogprob


@dataclass(slots=True)
class RequestOutput:
    """What one choice of a request has produced: cumulative fields plus the delta of the latest
    step. ``index`` is the choice (``0 <= index < params.n``); ``others_pending`` says that other
    choices of the request still run here, so the request is not over although this one is."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    num_cached_tokens: int
    stop_reason: str | int | None = None
    kv_held: bool = False  # prefill hand-off: blocks kept for a decode worker (see release)
    index: int = 0
    others_pending: bool = False
    # A prefill's held KV (``engine.core.messages.Handoff``), on the request's last output
    # through an engine client; None elsewhere.
    handoff: Any = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
