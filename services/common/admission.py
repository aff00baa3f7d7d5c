"""Admission control measured in tokens (no grpc, no HTTP): a bounded ledger of the work a
process has accepted, shared by the gateway and the prefill and decode workers.

A request costs its prompt plus the completion tokens it books (`request_cost`: its
``max_tokens``, or less where the gateway booked less for a request that left ``max_tokens``
out), not 1: ten requests of 4k tokens load a worker more than a hundred of 20. The ledger
admits a request while the tokens in flight stay within ``max_tokens``; batch requests only
while they stay within ``batch_fraction`` of it, so under load batch work is refused first and
interactive work keeps the rest. An empty ledger admits anything (one request never waits for
itself). A refusal is immediate, with an estimate of when capacity frees up, computed from the
rate at which recently finished requests returned tokens to the ledger, and with the room left
(``room_tokens``), which a caller's `RefusalMemory` uses to refuse what cannot fit without asking
again for a short while.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.common.errors import ResourceExhausted, Unavailable
from services.common.options import option

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

PRIORITIES = ("interactive", "batch")
# The engine's priority number of each class (lower is scheduled first).
ENGINE_PRIORITY = {"interactive": 0, "batch": 1}
DEFAULT_RETRY_AFTER_MS = 1000
MIN_RETRY_AFTER_MS = 100
MAX_RETRY_AFTER_MS = 30_000
RATE_WINDOW_S = 10.0


def booked_per_choice(params: SamplingParams) -> int:
    """The completion tokens admission books for one choice: its ``booked_tokens``, or its
    ``max_tokens`` where it books none (0)."""
    return params.booked_tokens or params.max_tokens


def booked_completion(params: SamplingParams) -> int:
    """The completion tokens admission books for a request: `booked_per_choice` for each of
    its ``n`` choices."""
    return params.n * booked_per_choice(params)


def request_cost(prompt_tokens: int, params: SamplingParams) -> int:
    """What every admission ledger (gateway, router, decode worker) books for a request: its
    prompt plus `booked_completion`. A booking is made once, when the request is admitted; one
    that outgrows it (``booked_tokens < max_tokens``) runs on to ``max_tokens`` and is never
    checked against a bound again, refused or cut for it (under KV pressure the engine preempts
    and recomputes instead), and its release returns what was booked."""
    return prompt_tokens + booked_completion(params)


def resumed_cost(prompt_tokens: int, done: int, params: SamplingParams) -> int:
    """What a decode worker books for a request migrated to it after it produced ``done``
    tokens (one choice): `request_cost`, but never less than its prompt, those tokens (their KV
    is held here from the start) and the rest booked as a new request's completion would be
    (its ``booked_tokens`` or ``max_tokens``, at most what ``max_tokens`` leaves). A request
    that outgrew its booking is then not under-counted on every worker it moves to; one that
    books its whole ``max_tokens`` books the same as before."""
    rest = min(booked_per_choice(params), max(params.max_tokens - done, 0))
    return max(request_cost(prompt_tokens, params), prompt_tokens + done + rest)


def batch_fraction_option() -> Any:
    """The ``--batch-admission-fraction`` field of a config (gateway and workers alike)."""
    return option(0.5, "batch-priority requests are admitted only up to this fraction of the bound")


# Key of a worker's member record (``Member.extra``) that states its admission bound.
BOUND_KEY = "admission"


def bound_record(ledger: TokenLedger) -> str:
    """What a worker publishes under BOUND_KEY: its ledger's bound and batch fraction."""
    return json.dumps({"max_tokens": ledger.max_tokens, "batch_fraction": ledger.batch_fraction})


def ledger_like(
    record: str | None, name: str, clock: Callable[[], float] = time.monotonic
) -> TokenLedger | None:
    """An empty ledger with the bound of a `bound_record` (None when absent, unbounded or not
    one): a caller's own copy, to book what it sends there (``services.router.admission``)."""
    try:
        bound = json.loads(record) if record else None
        ledger = TokenLedger(int(bound["max_tokens"]), float(bound["batch_fraction"]), name, clock)
    except (ValueError, TypeError, KeyError):
        return None
    return ledger if ledger.max_tokens else None


def refusal_memory_option(refuser: str) -> Any:
    """The ``--refusal-memory`` field of a config (router and gateway): see `RefusalMemory`."""
    return option(
        1.0,
        f"seconds a refusal for capacity by a {refuser} is remembered (at most its Retry-After), "
        "to answer 429 at once, with no call, to requests larger than the room it had; 0: off",
    )


def check_priority(priority: str) -> str:
    """``priority`` if it is one of PRIORITIES, else ValueError."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {PRIORITIES}, got {priority!r}")
    return priority


class TokenLedger:
    """Tokens in flight per request id, bounded by ``max_tokens`` (0: no bound).

    Not thread-safe: used from one event loop.
    """

    def __init__(
        self,
        max_tokens: int,
        batch_fraction: float = 0.5,
        name: str = "worker",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_tokens < 0 or not 0.0 < batch_fraction <= 1.0:
            raise ValueError("max_tokens >= 0 and 0 < batch_fraction <= 1")
        self.max_tokens = max_tokens
        self.batch_fraction = batch_fraction
        self.name = name
        self.clock = clock
        self.inflight: dict[str, int] = {}
        self.pending_tokens = 0
        self.refused = {p: 0 for p in PRIORITIES}
        self.closed = False  # draining: admit nothing more (see close)
        self._returned: deque[tuple[float, int]] = deque()  # (time, tokens) of releases

    def limit_for(self, priority: str) -> int:
        """The ledger level up to which a request of ``priority`` is admitted."""
        if priority == "batch":
            return max(1, int(self.max_tokens * self.batch_fraction))
        return self.max_tokens

    def admit(
        self, request_id: str, tokens: int, priority: str = "interactive", force: bool = False
    ) -> None:
        """Book ``tokens`` for ``request_id`` or raise ResourceExhausted (with
        ``retry_after_ms``) when that would take the ledger past the priority's limit.
        ``force``: a request admitted for its whole life elsewhere (it has streamed tokens):
        booked even past the limit, never refused for capacity."""
        check_priority(priority)
        if self.closed:
            raise Unavailable(f"{self.name} is draining; it takes no new requests")
        if request_id in self.inflight:
            raise ValueError(f"request {request_id!r} is already admitted")
        limit = self.limit_for(priority)
        after = self.pending_tokens + tokens
        if self.max_tokens and self.inflight and after > limit and not force:
            self.refused[priority] += 1
            raise ResourceExhausted(
                f"{self.name} is at its admission limit for {priority} requests: "
                f"{self.pending_tokens} tokens in flight + {tokens} requested > {limit}",
                retry_after_ms=self.retry_after_ms(after - limit),
                room_tokens=max(limit - self.pending_tokens, 0),
            )
        self.inflight[request_id] = tokens
        self.pending_tokens = after

    def close(self) -> None:
        """Refuse every later request with Unavailable (the router retries it on another
        worker); those in flight run to the end. Graceful termination calls this first."""
        self.closed = True

    def release(self, request_id: str) -> None:
        """Return a request's tokens (idempotent)."""
        tokens = self.inflight.pop(request_id, None)
        if tokens is None:
            return
        self.pending_tokens -= tokens
        now = self.clock()
        self._returned.append((now, tokens))
        self._trim(now)

    def cancel(self, request_id: str) -> None:
        """Drop a booking that never took effect (idempotent): unlike `release`, its tokens do
        not count as returned in the rate that `retry_after_ms` estimates from."""
        tokens = self.inflight.pop(request_id, None)
        if tokens is not None:
            self.pending_tokens -= tokens

    @contextmanager
    def hold(
        self, request_id: str, tokens: int, priority: str = "interactive", force: bool = False
    ) -> Iterator[None]:
        """``admit`` now, ``release`` when the block exits however it exits."""
        self.admit(request_id, tokens, priority, force)
        try:
            yield
        finally:
            self.release(request_id)

    def retry_after_ms(self, excess: int) -> int:
        """How long until ``excess`` tokens are likely returned, from the recent return rate."""
        now = self.clock()
        self._trim(now)
        if not self._returned:
            return DEFAULT_RETRY_AFTER_MS
        span = max(now - self._returned[0][0], 1.0)
        rate = sum(t for _, t in self._returned) / span  # tokens per second
        ms = math.ceil(1000 * excess / max(rate, 1e-9))
        return min(max(ms, MIN_RETRY_AFTER_MS), MAX_RETRY_AFTER_MS)

    def _trim(self, now: float) -> None:
        while self._returned and self._returned[0][0] < now - RATE_WINDOW_S:
            self._returned.popleft()


@dataclass(slots=True)
class _Refusal:
    room: int  # tokens a request could still book: as the refusal said, plus releases seen since
    at: float  # when the refusal was made
    retry_after_ms: int  # the refuser's estimate then
    expires: float


class RefusalMemory:
    """What capacity refusals said, so that a request that cannot fit is refused at once, with
    no call to the one that refused (a router towards a worker, a gateway towards its routers).

    A refusal (``ResourceExhausted`` with ``room_tokens``) is remembered per ``scope`` (where the
    tokens are booked: a worker incarnation, a base model) and ``kind`` (what the room is for:
    a priority), until the refuser's ``retry_after_ms`` or ``ttl`` seconds, whichever comes
    first. Meanwhile `check` refuses a request costing more than the room, and `released` adds
    the tokens of requests seen ending in that scope back to every room of it. Bookings are not
    subtracted: a room can only be too large, never too small, through what this process sees,
    so a request that fits still goes to the refuser, which decides (and whose next refusal
    replaces the room). What it cannot see (releases by other callers, lapsed bookings, a
    ledger that emptied) can make a room too small for at most ``ttl`` seconds: that bounds how
    long a request that would fit is refused. ``ttl`` 0: remember nothing.

    Not locked: written on one event loop; a `check` from a worker thread reads a consistent
    enough value (a room read while a release adds to it is one of the two values).
    """

    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl < 0:
            raise ValueError("ttl must be >= 0")
        self.ttl = ttl
        self.clock = clock
        self._by_scope: dict[Hashable, dict[Hashable, _Refusal]] = {}

    def refused(
        self, scope: Hashable, kind: Hashable, room_tokens: int | None, retry_after_ms: int | None
    ) -> None:
        """Remember a refusal that left ``room_tokens`` (nothing when unknown or ``ttl`` is 0)
        and said to retry after ``retry_after_ms``."""
        if room_tokens is None or not self.ttl:
            return
        now = self.clock()
        wait = retry_after_ms if retry_after_ms is not None else int(self.ttl * 1000)
        expires = now + min(self.ttl, wait / 1000)
        self._by_scope.setdefault(scope, {})[kind] = _Refusal(room_tokens, now, wait, expires)

    def released(self, scope: Hashable, tokens: int) -> None:
        """Requests of ``tokens`` in all ended in ``scope``: that much more room there."""
        for r in self._by_scope.get(scope, {}).values():
            r.room += tokens

    def forget(self, scope: Hashable) -> None:
        self._by_scope.pop(scope, None)

    def check(self, scope: Hashable, kind: Hashable, cost: int, who: str) -> None:
        """Raise ResourceExhausted (with the time left of the refuser's estimate) when a live
        refusal of ``scope`` for ``kind`` leaves less room than ``cost``; ``who``: the
        refuser, for the message."""
        kinds = self._by_scope.get(scope)
        r = kinds.get(kind) if kinds else None
        if r is None:
            return
        now = self.clock()
        if now >= r.expires:
            kinds.pop(kind, None)  # type: ignore[union-attr]
            return
        if cost <= r.room:
            return
        ago = round((now - r.at) * 1000)
        raise ResourceExhausted(
            f"{who} is at its admission limit: {cost} tokens requested > {r.room} free when it "
            f"last refused ({ago} ms ago)",
            retry_after_ms=max(r.retry_after_ms - ago, MIN_RETRY_AFTER_MS),
            room_tokens=r.room,
        )
