"""A request's state as the scheduler sees it (no torch)."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller


@dataclass(eq=False)
class Sequence:
    """One choice of a request: its tokens, how many have KV computed, and why it finished.

    ``num_computed`` counts tokens (prompt, then outputs) whose K/V sit in the cache. The
    newest output token never has KV yet: it is the input of the next decode step.

    A request with ``n`` choices has ``n`` sequences sharing its ``request_id``, told apart by
    ``index``; ``key`` names the block table of each (the request id itself for choice 0).

    ``draft_token_ids`` are speculative guesses of the tokens after the newest one, set by the
    engine before a step; the step computes them with it and keeps those the model confirms.

    With async scheduling a step is launched before the previous one's sampled tokens reach the
    host: ``num_inflight`` counts this sequence's tokens that were sampled on the device but not
    read back yet (at most one between two engine steps). They count in ``num_tokens`` (their
    positions exist; the scheduler plans around them) but are not in ``output_token_ids`` until
    they arrive; ``num_known`` is what the host holds.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    cache_salt: bytes = b""
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    num_cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    generator: Any = None  # torch.Generator for seeded sampling (owned by the engine)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # monotonic time of its first step (queue time)
    priority: int = 0  # lower is scheduled first: 0 interactive, 1 batch
    index: int = 0  # which choice of its request (0 <= index < params.n)
    matcher: Any = None  # llguidance matcher of a grammar-constrained sequence (engine-owned)
    lora: str = ""  # the LoRA adapter it runs with ("" = the base model)
    # Token ids that would end it (EOS, stop_token_ids), masked until params.min_tokens outputs.
    stop_ids: tuple[int, ...] = ()
    num_inflight: int = 0  # sampled on the device, not yet read back (async scheduling)

    @property
    def key(self) -> Hashable:
        """The block-table key: ``request_id`` for choice 0, ``(request_id, index)`` otherwise."""
        return self.request_id if self.index == 0 else (self.request_id, self.index)

    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output tokens on the host (not those in flight)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those still in flight included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_known(self) -> int:
        """Tokens the host holds: ``all_token_ids`` (``num_tokens`` less those in flight)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_outputs(self) -> int:
        """Output tokens sampled so far, those still in flight included."""
        return len(self.output_token_ids) + self.num_inflight

    def out_of_room(self, max_len: int) -> bool:
        """Whether its newest token (read back or in flight) is its last by length: its
        ``max_tokens``, or ``max_len`` tokens in all (the context limit)."""
        return self.num_outputs >= self.params.max_tokens or self.num_tokens >= max_len

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_prefilling(self) -> bool:
        """True until every known token (prompt, or prompt + outputs after a preemption) has KV."""
        return self.num_computed < self.num_tokens - 1 or not self.num_outputs

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
