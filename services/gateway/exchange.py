"""One request's generation at the gateway, from admission to settlement.

``server`` drives a request top to bottom: parse the body, prepare it (template, tokens,
limits; ``prepare``), `Exchange.open` it (the tenant's rate limits and the gateway's admission,
429 otherwise), answer from `Exchange.events` (a JSON body once every event is in, or SSE chunks
as they come; ``responses``), and `Exchange.close` it. Closing is the one place that settles:
it ends the backend's stream (aborting the generation if it had not finished; ``core``) and
charges the tenant for what was generated, releasing the admission, exactly once, however the
request ended (done, failed, client gone).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing

import anyio

from services.gateway.core import Backend, BackendEvent, BackendRequest, run_generation
from services.gateway.limits import Limits, Overloaded, Ticket
from services.gateway.observe import GatewayMetrics, observe_generation


class Exchange:
    """A generation admitted at the gateway: its events (timed into ``metrics``) and its
    accounting. With ``limits``, the routers' refusals for capacity of base model ``model`` are
    remembered there, and the end of a request a worker took frees its room again
    (`Limits.refused`, `Limits.released`)."""

    def __init__(
        self,
        backend: Backend,
        req: BackendRequest,
        ticket: Ticket,
        metrics: GatewayMetrics | None,
        limits: Limits | None = None,
        model: str = "",
    ) -> None:
        self.request = req
        self.ticket = ticket
        self.limits, self.model = limits, model
        self.generated = 0  # tokens that reached the client's side of the gateway
        self.taken = False  # a worker took the request (an event came back)
        self.events: AsyncGenerator[BackendEvent, None] = observe_generation(
            self._counted(run_generation(backend, req)), req, metrics
        )
        self._closed = False

    @classmethod
    def open(
        cls,
        limits: Limits,
        backend: Backend,
        req: BackendRequest,
        metrics: GatewayMetrics | None,
        model: str = "",
    ) -> Exchange:
        """Admit ``req`` on base model ``model`` (APIError 429 when a limit says no) and start
        nothing yet: the backend is called on the first event asked for."""
        return cls(backend, req, limits.admit(req, model), metrics, limits, model)

    @property
    def headers(self) -> dict[str, str]:
        """The rate-limit headers of the answer."""
        return self.ticket.headers

    async def _counted(
        self, events: AsyncGenerator[BackendEvent, None]
    ) -> AsyncGenerator[BackendEvent, None]:
        async with aclosing(events):  # closing this closes the backend's stream too
            try:
                async for event in events:
                    self.taken = True
                    self.generated += len(event.token_ids)
                    yield event
            except Overloaded as e:
                if self.limits is not None:
                    self.limits.refused(self.model, self.request, e)
                raise

    async def close(self) -> None:
        """End the generation (aborted on the backend unless it finished) and settle: charge
        the prompt and the generated tokens (nothing when none was generated) and release the
        admission. Idempotent; shielded, so a cancelled request still settles."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            try:
                await self.events.aclose()
            finally:
                self.ticket.settle(self.generated)
                if self.taken and self.limits is not None:
                    self.limits.released(self.model, self.request)
