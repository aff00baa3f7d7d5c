"""The gateway's logic, free of HTTP and gRPC: errors, the Backend contract, and running a
generation.

``prepare`` turns a request body into a ``BackendRequest``; ``server`` then iterates
``run_generation``, which guarantees ``Backend.abort`` is called whenever a generation stops
before its last event, however the consumer stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import anyio

from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0


class APIError(Exception):
    """An error to send to the client as OpenAI error JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# --- The Backend contract -------------------------------------------------------------------


class TokenLogprob(NamedTuple):
    """A token's logprob and the top alternatives ``((token_id, logprob), ...)``; ``rank``
    (1: the most likely) where the backend computed it (prompt tokens), else 0."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int = 0


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BackendRequest:
    """A tokenized, validated generation request. ``sampling.logprobs`` is the number of top
    alternatives wanted per token (None: no logprobs)."""

    request_id: str
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str = ""
    model: str = ""
    priority: str = "interactive"
    deadline: float | None = None  # time.monotonic() after which the request is given up
    session: str = ""  # sticky-routing key: the OpenAI ``user`` field
    # Latency objectives in ms (`services.gateway.slo`; 0: none given, the router's defaults).
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0

    def time_left(self) -> float | None:
        """Seconds until the deadline (None: no deadline); APIError 504 once it passed."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise deadline_exceeded()
        return left


@dataclass(frozen=True, slots=True)
class BackendEvent:
    """A slice of the output of choice ``index``. The last one of a choice has
    ``finish_reason`` ("stop", "length" or "abort"); the request ends when every choice did."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    index: int = 0


class Backend(Protocol):
    """Where generation happens (the router over gRPC in production).

    ``generate`` raises ``APIError`` for failures (e.g. 503 when no worker is available). Closing
    its iterator before the last event must stop the generation; ``abort`` may be called in
    addition and must be idempotent and quick.
    """

    def generate(self, req: BackendRequest) -> AsyncIterator[BackendEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    async def readiness(self, model: str = "") -> str | None:
        """None when a request for base model ``model`` (default: the first served) could be
        served now, else the reason it could not."""
        ...

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters live workers hold: name -> its base model."""
        ...

    async def load_lora(self, name: str, path: str) -> None:
        """Load an adapter on the workers (APIError 400 with the reason when it cannot); with
        several base models ``name`` is ``BASE/NAME``."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Unload an adapter from the workers (APIError 404 when none has it)."""
        ...

    async def embed(
        self, request_id: str, model: str, inputs: list[list[int]]
    ) -> tuple[list[list[float]], int]:
        """(one embedding per input, prompt tokens) from the workers of ``model``."""
        ...

    async def prompt_logprobs(
        self, request_id: str, model: str, inputs: list[list[int]], k: int
    ) -> tuple[list[list[TokenLogprob]], int]:
        """(for each input, the logprobs of its tokens after the first with the ``k`` most
        likely tokens at each place; prompt tokens) from the workers of ``model``."""
        ...


async def run_generation(
    backend: Backend, req: BackendRequest
) -> AsyncGenerator[BackendEvent, None]:
    """Yield ``backend.generate(req)`` up to its last event (the last choice's finish). If
    iteration stops earlier (client gone, task cancelled, error, ``aclose``), close the backend
    stream and call ``abort``, shielded from the cancellation that got us here so neither is
    skipped. An abort event ends it at once."""
    stream = backend.generate(req)
    finished = False
    pending = set(range(req.sampling.n))
    try:
        async for event in stream:
            if event.finish_reason is not None:
                pending.discard(event.index)
            finished = not pending or event.finish_reason == "abort"
            yield event
            if finished:
                return
    finally:
        with anyio.move_on_after(ABORT_TIMEOUT_S, shield=True):
            try:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()
            except Exception:
                log.exception("closing the backend stream of %s failed", req.request_id)
            if not finished:
                try:
                    await backend.abort(req.request_id)
                except Exception:
                    log.exception("aborting %s failed", req.request_id)


# --- Collecting a whole generation ------------------------------------------------------------


@dataclass(slots=True)
class Generation:
    """Everything a non-streaming response needs, accumulated from the events."""

    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0

    def add(self, event: BackendEvent) -> None:
        check_event(event)
        self.text += event.text
        self.num_tokens += len(event.token_ids)
        self.logprobs.extend(event.logprobs)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        if event.usage is not None:
            self.cached_tokens = event.usage.cached_tokens


def check_event(event: BackendEvent) -> None:
    """Raise for an event that ends the request in failure (aborted by the server side)."""
    if event.finish_reason == "abort":
        raise APIError(
            503, "the request was aborted by the server; retry", "server_error", code="aborted"
        )


def internal_error() -> APIError:
    """The 500 sent for unexpected failures: no details, never a stack trace."""
    return APIError(500, "internal server error", "server_error", code="internal_error")


def deadline_exceeded() -> APIError:
    """The 504 of a request that passed its deadline (``timeout``) before it finished."""
    return APIError(504, "The request did not finish in time.", "server_error", code="timeout")


def unfinished() -> APIError:
    return APIError(
        502,
        "the backend ended the stream before the request finished",
        "server_error",
        code="backend_error",
    )


async def collect(events: AsyncIterator[BackendEvent], n: int = 1) -> list[Generation]:
    """Accumulate the ``n`` choices of a whole generation; raises if it fails or a choice ends
    without a finish reason."""
    gens = [Generation() for _ in range(n)]
    async for event in events:
        if not 0 <= event.index < n:
            raise internal_error()
        gens[event.index].add(event)
    if any(g.finish_reason is None for g in gens):
        raise unfinished()
    return gens
