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

    @property
    def closes(self) -> bool:
        """Whether this output ends its choice here: finished, or its KV held or handed off."""
        return self.finished or self.kv_held or self.handoff is not None


def merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``b`` carrying ``a``'s delta too (consecutive outputs of one choice; ``b``'s cumulative
    fields already hold ``a``'s)."""
    b.new_token_ids = a.new_token_ids + b.new_token_ids
    b.new_text = a.new_text + b.new_text
    b.new_logprobs = a.new_logprobs + b.new_logprobs
    return b
