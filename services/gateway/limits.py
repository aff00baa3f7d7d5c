"""The gateway's limits (no HTTP): admission of tokens in flight, and per-tenant rate limits
metered in tokens (input + output) and requests.

Each tenant with limits has two token buckets: ``tokens_per_window`` and
``requests_per_window``, each refilled evenly over ``window_seconds``. Before a request runs it
reserves its estimate (what admission books: prompt + max_tokens, or the booked completion
tokens of a request that left max_tokens out; at most the bucket's size); when it ends, what it
really used (prompt + the tokens it streamed, 0 if nothing was generated) is settled and the rest
refunded, so the budget matches what clients got. Each answer carries the OpenAI rate-limit
headers; a refusal is a 429 with ``Retry-After`` (seconds) and ``retry-after-ms``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.common.admission import RefusalMemory, TokenLedger, request_cost
from services.common.errors import ResourceExhausted
from services.gateway.config import GatewayConfig
from services.gateway.core import APIError, BackendRequest
from services.gateway.keys import TenantLimits


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    """``Retry-After`` in whole seconds (HTTP) and ``retry-after-ms`` (OpenAI clients)."""
    ms = max(int(retry_after_ms), 1)
    return {"Retry-After": str(math.ceil(ms / 1000)), "retry-after-ms": str(ms)}


class Overloaded(APIError):
    """The 429 of a service at capacity (gateway or every worker), as opposed to a tenant's
    rate limit (code ``rate_limit_exceeded``); ``room_tokens``: the largest request the workers
    could still have taken, when the router said."""

    def __init__(
        self, message: str, retry_after_ms: int | None, room_tokens: int | None = None
    ) -> None:
        super().__init__(429, message, "rate_limit_error", code="server_overloaded",
                         headers=retry_headers(retry_after_ms or 1000))  # fmt: skip
        self.retry_after_ms = retry_after_ms
        self.room_tokens = room_tokens


def _duration(seconds: float) -> str:
    """OpenAI's reset format: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


@dataclass(slots=True)
class Bucket:
    """A token bucket of ``size`` refilled at ``size / window`` per second; may go negative
    when a request used more than it reserved (the debt is paid back by refill)."""

    size: int
    window: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        rate = self.size / self.window
        self.level = min(self.size, self.level + (now - self.updated) * rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0: now)."""
        return max(0.0, (amount - self.level) * self.window / self.size)

    def reset_in(self) -> float:
        """Seconds until the bucket is full again."""
        return self.wait_for(self.size)


@dataclass(slots=True)
class Ticket:
    """One admitted request: its reservations, to be settled exactly once."""

    request_id: str
    prompt_tokens: int
    reserved: int
    buckets: tuple[Bucket, ...] = ()  # (tokens,) or () when the tenant has no token limit
    headers: dict[str, str] = field(default_factory=dict)
    on_settle: Callable[[], None] | None = None
    settled: bool = False

    def settle(self, completion_tokens: int, prompt_only: bool = False) -> None:
        """Charge what was really used (prompt + generated; 0 when nothing was generated, unless
        ``prompt_only``: an embedding, whose prompt is all it uses) and release the admission;
        only the first call counts (`services.gateway.exchange`)."""
        if self.settled:
            return
        self.settled = True
        done = completion_tokens or prompt_only
        used = self.prompt_tokens + completion_tokens if done else 0
        for bucket in self.buckets:
            bucket.level = min(bucket.size, bucket.level + self.reserved - used)
        if self.on_settle is not None:
            self.on_settle()


class Limits:
    """Admission (tokens in flight at this gateway) and per-tenant rate limits.

    Admission is per base model: each of ``models`` has a ledger of its own bounded by
    ``max_inflight_tokens``, since its requests load only its own workers (one model's overload
    never refuses another's requests). Tenants' budgets span every model. ``memory`` holds the
    routers' recent refusals for capacity per base model (`RefusalMemory`; kind: the model a
    request names and its priority): a request larger than the room they left is refused here,
    before any call, for at most ``refusal_memory`` seconds."""

    def __init__(
        self,
        tenant_limits: dict[str, TenantLimits],
        max_inflight_tokens: int = 0,
        batch_fraction: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        models: Sequence[str] = ("",),
        refusal_memory: float = 0.0,
    ) -> None:
        if not models:
            raise ValueError("at least one model")
        self.tenant_limits = tenant_limits
        one = len(models) == 1
        self.ledgers = {
            m: TokenLedger(
                max_inflight_tokens, batch_fraction,
                name="the gateway" if one else f"the gateway (model {m})",
            )
            for m in models
        }  # fmt: skip
        self.clock = clock
        self._buckets: dict[tuple[str, str], Bucket] = {}
        self.memory = RefusalMemory(refusal_memory, clock)

    @property
    def ledger(self) -> TokenLedger:
        """The first model's admission ledger."""
        return next(iter(self.ledgers.values()))

    @classmethod
    def from_config(cls, config: GatewayConfig, models: Sequence[str] = ("",)) -> Limits:
        """Limits per tenant from the API keys (the first key of a tenant that has any), and
        admission for each of ``models``."""
        per_tenant: dict[str, TenantLimits] = {}
        for key in config.api_keys:
            if key.limits.limited:
                per_tenant.setdefault(key.tenant, key.limits)
        return cls(
            per_tenant, config.max_inflight_tokens, config.batch_admission_fraction,
            models=models, refusal_memory=config.refusal_memory,
        )  # fmt: skip

    def _bucket(self, tenant: str, kind: str, size: int, window: float) -> Bucket:
        b = self._buckets.get((tenant, kind))
        if b is None or b.size != size:
            b = self._buckets[(tenant, kind)] = Bucket(size, window, size, self.clock())
        b.refill(self.clock())
        return b

    def check_room(self, model: str, name: str, priority: str, cost: int) -> None:
        """Raise 429 at once when the routers of base model ``model`` refused a request for
        ``name`` at ``priority`` a moment ago, leaving less room than ``cost`` tokens (a lower
        bound of the request's, before it is tokenized; see `RefusalMemory`)."""
        try:
            self.memory.check(model or self.first_model, (name, priority), cost, "every worker")
        except ResourceExhausted as e:
            raise Overloaded(str(e), e.retry_after_ms, e.room_tokens) from e

    def refused(self, model: str, req: BackendRequest, e: Overloaded) -> None:
        """The routers refused ``req`` for capacity: remember the room they said was left."""
        scope = model or self.first_model
        self.memory.refused(scope, (req.model, req.priority), e.room_tokens, e.retry_after_ms)

    def released(self, model: str, req: BackendRequest) -> None:
        """``req``, which a worker took, ended: its tokens are free on base model ``model``."""
        self.memory.released(model or self.first_model, cost_of(req))

    @property
    def first_model(self) -> str:
        return next(iter(self.ledgers))

    def admit(self, req: BackendRequest, model: str = "") -> Ticket:
        """Reserve for ``req`` on base model ``model`` (default: the first) or raise APIError
        429 (the routers' recent refusal, a rate limit, or the gateway is full for that
        model)."""
        ledger = self.ledgers[model] if model else self.ledger
        estimate = cost_of(req)
        self.check_room(model, req.model, req.priority, estimate)
        lim = self.tenant_limits.get(req.tenant, TenantLimits())
        ticket = Ticket(req.request_id, len(req.token_ids), 0)
        headers: dict[str, str] = {}
        taken: list[tuple[Bucket, float]] = []
        for kind, size, amount in (
            ("requests", lim.requests_per_window, 1),
            ("tokens", lim.tokens_per_window, estimate),
        ):
            if not size:
                continue
            b = self._bucket(req.tenant, kind, size, lim.window_seconds)
            amount = min(amount, size)
            wait = b.wait_for(amount)
            if wait > 0:
                for bucket, n in taken:  # undo the request bucket
                    bucket.level += n
                raise _limited(kind, size, b, amount, wait)
            b.level -= amount
            taken.append((b, amount))
            headers |= _rate_headers(kind, size, b)
            if kind == "tokens":
                ticket.buckets, ticket.reserved = (b,), int(amount)
        try:
            ledger.admit(req.request_id, estimate, req.priority)
        except ResourceExhausted as e:
            for bucket, n in taken:
                bucket.level += n
            raise Overloaded(str(e), e.retry_after_ms) from e
        ticket.headers = headers
        ticket.on_settle = lambda: ledger.release(req.request_id)
        return ticket


def cost_of(req: BackendRequest) -> int:
    """What admission books for ``req`` (`request_cost`): its prompt plus its choices' booked
    completion tokens."""
    return request_cost(len(req.token_ids), req.sampling)


def _rate_headers(kind: str, size: int, b: Bucket) -> dict[str, str]:
    return {
        f"x-ratelimit-limit-{kind}": str(size),
        f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(b.level))),
        f"x-ratelimit-reset-{kind}": _duration(b.reset_in()),
    }


def _limited(kind: str, size: int, b: Bucket, amount: float, wait: float) -> APIError:
    per = f"{b.window:g} s"
    headers = _rate_headers(kind, size, b) | retry_headers(math.ceil(wait * 1000))
    return APIError(
        429,
        f"Rate limit reached for {kind} per {per}: limit {size}, remaining "
        f"{max(0, math.floor(b.level))}, requested {math.ceil(amount)}. Please try again in "
        f"{_duration(wait)}.",
        kind,
        code="rate_limit_exceeded",
        headers=headers,
    )
