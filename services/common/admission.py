"""Admission control measured in tokens (no grpc, no HTTP): a bounded ledger of the work a
process has accepted, shared by the gateway and the prefill and decode workers.

A request costs its prompt plus its ``max_tokens`` (what it may still ask of the KV cache and
the batch), not 1: ten requests of 4k tokens load a worker more than a hundred of 20. The ledger
admits a request while the tokens in flight stay within ``max_tokens``; batch requests only
while they stay within ``batch_fraction`` of it, so under load batch work is refused first and
interactive work keeps the rest. An empty ledger admits anything (one request never waits for
itself). A refusal is immediate, with an estimate of when capacity frees up, computed from the
rate at which recently finished requests returned tokens to the ledger.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from services.common.errors import ResourceExhausted, Unavailable
from services.common.options import option

PRIORITIES = ("interactive", "batch")
# The engine's priority number of each class (lower is scheduled first).
ENGINE_PRIORITY = {"interactive": 0, "batch": 1}
DEFAULT_RETRY_AFTER_MS = 1000
MIN_RETRY_AFTER_MS = 100
MAX_RETRY_AFTER_MS = 30_000
RATE_WINDOW_S = 10.0


def batch_fraction_option() -> Any:
    """The ``--batch-admission-fraction`` field of a config (gateway and workers alike)."""
    return option(0.5, "batch-priority requests are admitted only up to this fraction of the bound")


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
