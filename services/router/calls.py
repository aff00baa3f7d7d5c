"""What the router core works with (no grpc): the routing job, the workers' replies and calls,
the client Protocol the core talks to workers through, the errors that steer its retries and
migrations, and its counters."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.sampling_params import SamplingParams, TokenLogprob
from libkv.cluster.registry import Member
from services.common.admission import booked_completion, request_cost, resumed_cost
from services.common.codec import ChoiceStart, Event, KVHandle, Moved
from services.common.errors import DeadlineExceeded, ResourceExhausted, Unavailable
from services.router.policy import RouteRequest

RETRYABLE = (Unavailable, ResourceExhausted)
RESERVATION_LEASE_S = 60.0  # a decode booking no Generate took lapses after this


class HandedOver(Exception):
    """A draining decode worker handed the request over with its KV (live KV migration)."""

    def __init__(self, moved: Moved) -> None:
        super().__init__("handed over by a draining decode worker")
        self.moved = moved


class BookingFailed(Unavailable):
    """A decode worker could not be reached to book capacity (dead, not yet out of the member
    view): nothing ran anywhere, so trying the next one does not use up the one retry."""


class NoWorker(Unavailable):
    """No live worker is left to try (none registered, or all failed or refused)."""


def soonest(refusals: list[ResourceExhausted]) -> ResourceExhausted:
    """One refusal for the caller: every worker is full; retry when the first frees up."""
    waits = [r.retry_after_ms for r in refusals if r.retry_after_ms is not None]
    rooms = [r.room_tokens for r in refusals if r.room_tokens is not None]
    return ResourceExhausted(
        f"all {len(refusals)} workers tried are at capacity; last: {refusals[-1]}",
        retry_after_ms=min(waits) if waits else None,
        # The largest request one of them could take: known when each said its room.
        room_tokens=max(rooms) if len(rooms) == len(refusals) else None,
    )


@dataclass(slots=True)
class RouteJob:
    """One request as the router routes it (from ``tandem.v1.GenerateRequest``)."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    tenant: str = ""
    priority: str = "interactive"
    deadline: float | None = None  # time.monotonic() after which the caller gave up
    session: str = ""  # sticky-routing key (OpenAI ``user``) for the "session" policy
    lora: str = ""  # LoRA adapter ("" = the base model)
    slo_ttft_ms: float = 0.0  # the request's objectives (0: the router's defaults)
    slo_tpot_ms: float = 0.0
    # The caller's own decode calls (`services.router.legs`, the Route RPC); None: the router
    # makes them and relays their events.
    legs: DecodeCalls | None = None

    @property
    def cost(self) -> int:
        """What decode admission books for it (`request_cost`): prompt plus its choices' booked
        completion tokens."""
        return request_cost(len(self.prompt), self.params)

    @property
    def route(self) -> RouteRequest:
        """What the routing policy looks at (the completion as booked, as admission sees it)."""
        return RouteRequest(
            self.prompt, self.tenant, self.session, booked_completion(self.params), self.lora,
            self.slo_ttft_ms, self.slo_tpot_ms,
        )  # fmt: skip

    def time_left(self, cap: float | None = None) -> float | None:
        """Seconds until the deadline (at most ``cap``); DeadlineExceeded once it passed."""
        if self.deadline is None:
            return cap
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"request {self.request_id} passed its deadline")
        return left if cap is None else min(left, cap)


@dataclass(slots=True)
class PrefillReply:
    """Choice 0's first event and generator state; ``others``: those of choices 1..n-1."""

    first: Event
    handle: KVHandle | None
    generator_state: bytes = b""
    cached_tokens: int = 0
    others: list[ChoiceStart] = field(default_factory=list)

    @property
    def firsts(self) -> list[Event]:
        return [self.first, *(c.first for c in self.others)]


@dataclass(slots=True)
class DecodeCall:
    job: RouteJob
    handle: KVHandle | None = None
    first: Event | None = None
    generator_state: bytes = b""
    cached_tokens: int = 0
    others: list[ChoiceStart] = field(default_factory=list)
    admitted: bool = False  # booked before its first token: the decode worker must take it
    resumed: list[int] = field(default_factory=list)  # migrated: choice 0's streamed tokens

    @property
    def cost(self) -> int:
        """What the decode worker books for this call: ``job.cost``, or for a migrated one
        (`resumed_cost`) also the tokens it already produced, as the worker's ledger does."""
        if self.resumed:
            return resumed_cost(len(self.job.prompt), len(self.resumed), self.job.params)
        return self.job.cost


class DecodeCalls(Protocol):
    """Who makes a request's decode calls: the router (`WorkerClients`) or its caller."""

    def decode(self, worker: Member, call: DecodeCall) -> AsyncIterator[Event]: ...


class WorkerClients(Protocol):
    """How the router talks to workers; raises Unavailable/ResourceExhausted when a worker
    cannot serve (retryable) and engine errors (InvalidRequestError, ...) otherwise."""

    async def prefill(self, worker: Member, job: RouteJob) -> PrefillReply: ...

    def decode(self, worker: Member, call: DecodeCall) -> AsyncIterator[Event]: ...

    async def release(self, handle: KVHandle, request_id: str) -> None:
        """Free a prefill's held blocks: only for KV no decode worker took (the decode worker
        that takes it releases it itself, `services.decode.core`)."""
        ...

    async def load_lora(self, worker: Member, name: str, path: str) -> None: ...

    async def unload_lora(self, worker: Member, name: str) -> None: ...

    async def embed(
        self, worker: Member, request_id: str, inputs: list[list[int]], lora: str
    ) -> tuple[list[list[float]], int]: ...

    async def prompt_logprobs(
        self, worker: Member, request_id: str, inputs: list[list[int]], k: int, lora: str
    ) -> tuple[list[list[TokenLogprob]], int]: ...

    async def reserve(self, worker: Member, job: RouteJob, lease: float) -> None:
        """Book ``job.cost`` on a decode worker (ResourceExhausted at once when it is full)."""
        ...

    async def unreserve(self, worker: Member, request_id: str) -> None:
        """Drop a decode booking no Generate took (the prefill failed, the client left)."""
        ...


@dataclass(slots=True)
class RouterStats:
    decisions: Counter = field(default_factory=Counter)  # (policy, reason) -> plans made
    disagg: Counter = field(default_factory=Counter)  # (choice, reason) -> disagg decisions
    retries: int = 0
    migrations: int = 0  # streams moved to another decode worker after tokens were sent
    live_moves: int = 0  # of those, moved with their KV off a draining worker
    legs: Counter = field(default_factory=Counter)  # who streamed a decode call -> calls
