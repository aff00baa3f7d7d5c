"""This router's view of its decode workers' admission (no grpc): what lets it refuse a request
that cannot fit on a worker at once, with no call to the worker.

A decode worker is the one that admits (`services.common.admission.TokenLedger`); the router
only refuses early what the worker would refuse too, from two things it knows:

- **its own bookings.** A worker publishes its bound in its member record
  (``BOUND_KEY``); the router keeps a ledger of that bound per worker incarnation and books
  there every request it sends to the worker (a Reserve, a decode-only or a forced Generate)
  until the worker refuses it (cancelled) or the request ends there (released). Those tokens
  are in the worker's own ledger too, once the calls reach it, so a request that does not fit
  beside them alone does not fit on the worker either. The one way this refuses a request the
  worker would have taken: a call still on its way that the worker will refuse (booked by
  another caller meanwhile) is counted until its refusal comes back, one round trip.
- **the worker's last refusal** (`RefusalMemory`): the room it said it had, plus what this
  router's requests gave back since, for at most ``refusal_memory`` seconds (and at most the
  refusal's Retry-After): that covers what other routers booked there.

Either refusal carries a Retry-After (from the rate this router's requests on the worker
ended, or what is left of the worker's own estimate) and the room, as the worker's does.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from libkv.cluster.registry import Member
from services.common.admission import BOUND_KEY, RefusalMemory, TokenLedger, ledger_like
from services.common.errors import ResourceExhausted
from services.router.calls import RouteJob
from services.router.disagg import Decision, Slo


class DecodeAdmission:
    """Books this router's requests on its decode workers and refuses locally what cannot fit
    (see the module docstring). Used from one event loop."""

    def __init__(self, refusal_memory: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.memory = RefusalMemory(refusal_memory, clock)
        self.clock = clock
        self._ledgers: dict[tuple[str, str], TokenLedger | None] = {}
        self.local_refusals = 0  # requests refused here, with no call

    def book(
        self, worker: Member, job: RouteJob, force: bool = False, cost: int | None = None
    ) -> None:
        """Count ``job`` on ``worker`` from now until `refused`, `failed` or `released` (once:
        booking it again, as a reserved request's Generate does, changes nothing). Raises
        ResourceExhausted instead when it cannot fit there; ``force``: a request admitted for
        its whole life already (it streamed tokens), counted and never refused. ``cost``: what
        the worker books for the call (`DecodeCall.cost`; ``job.cost`` when not given)."""
        cost = job.cost if cost is None else cost
        ledger = self._ledger(worker)
        if ledger is not None and job.request_id in ledger.inflight:
            return
        try:
            if not force:
                self.memory.check(
                    _scope(worker), job.priority, cost, f"decode worker {worker.worker_id}"
                )
            if ledger is not None:
                ledger.admit(job.request_id, cost, job.priority, force)
        except ResourceExhausted:
            self.local_refusals += 1
            raise

    def refused(self, worker: Member, job: RouteJob, e: ResourceExhausted) -> None:
        """The worker refused ``job`` for capacity: it holds nothing of it; remember the room."""
        self.failed(worker, job)
        self.memory.refused(_scope(worker), job.priority, e.room_tokens, e.retry_after_ms)

    def failed(self, worker: Member, job: RouteJob) -> None:
        """The call never reached the worker's admission (or was refused): uncount it."""
        ledger = self._ledgers.get(_scope(worker))
        if ledger is not None:
            ledger.cancel(job.request_id)

    def released(self, worker: Member, job: RouteJob, cost: int | None = None) -> None:
        """``job`` ended on ``worker`` (or its booking was dropped): its tokens (``cost``, as
        booked) are free."""
        ledger = self._ledgers.get(_scope(worker))
        if ledger is not None:
            ledger.release(job.request_id)
        self.memory.released(_scope(worker), job.cost if cost is None else cost)

    def _ledger(self, worker: Member) -> TokenLedger | None:
        scope = _scope(worker)
        if scope not in self._ledgers:
            # A new incarnation: forget those of workers this router has nothing on any more.
            for old in [k for k, v in self._ledgers.items() if v is None or not v.inflight]:
                if old[0] == worker.worker_id:
                    del self._ledgers[old]
                    self.memory.forget(old)
            name = f"decode worker {worker.worker_id} (as this router booked it)"
            self._ledgers[scope] = ledger_like(worker.extra.get(BOUND_KEY), name, self.clock)
        return self._ledgers[scope]


def _scope(worker: Member) -> tuple[str, str]:
    """Where a worker's admission books tokens: this incarnation of it."""
    return worker.worker_id, worker.incarnation


class SloGate:
    """Sheds, with a fast 429, a request that would miss its TTFT objective by far wherever it
    ran: the chosen option's predicted TTFT (`services.router.disagg`) past ``factor`` times
    its objective. Serving it would spend prefill time on a request that no longer counts,
    and delay those behind it that still could (the goodput argument). ``factor`` 0: off.
    The Retry-After is the time the queue needs to come back within the objective. Batch
    requests are not shed here (they have no latency objective to miss)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.shed = 0  # requests refused here

    def check(self, job: RouteJob, decision: Decision, slo: Slo) -> None:
        """Raise ResourceExhausted when ``job`` is to be shed under its objectives ``slo``."""
        predicted = decision.predicted
        if self.factor <= 0 or predicted is None or job.priority == "batch":
            return
        objective = slo.ttft_s
        if predicted.ttft_s <= self.factor * objective:
            return
        self.shed += 1
        wait_ms = max(int(1000 * (predicted.ttft_s - objective)), 1)
        raise ResourceExhausted(
            f"request {job.request_id}: predicted TTFT {predicted.ttft_s:.2f} s is past "
            f"{self.factor:g}x its objective of {objective:.2f} s",
            retry_after_ms=wait_ms,
        )
