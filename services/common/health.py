"""Live and ready, told apart the same way by every gRPC service (router, prefill, decode).

- **live**: the process works and should not be restarted. grpc.health.v1 service
  ``"liveness"`` (`LIVENESS_SERVICE`); NOT_SERVING only when a vital part died (a worker's
  engine step thread), and at stop.
- **ready**: the process should get new work. grpc.health.v1 ``""`` and each service name;
  NOT_SERVING until the service can serve (a worker: registered in etcd; a router: its member
  view loaded), while draining, and whenever ``ready()`` gives a reason.

`Health` polls the service's two checks and publishes changes; the first poll happens at
`start`, so a server starts NOT_SERVING and turns ready on the first good check. Other
names (a router's ``model:NAME``, see `model_service`) may be published alongside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from services.common.grpc_server import LIVENESS_SERVICE, GrpcServerHandle

log = logging.getLogger(__name__)
POLL_S = 0.5


def model_service(model: str) -> str:
    """The health service name of "this router can route to a live decode worker of
    ``model``" (what the gateway's /health asks)."""
    return f"model:{model}"


class Health:
    """Publishes a server's liveness and readiness from ``live()`` (a bool) and ``ready()``
    (None when ready, else the reason), plus ``extra()`` (name -> serving) each poll."""

    def __init__(
        self,
        server: GrpcServerHandle,
        live: Callable[[], bool] = lambda: True,
        ready: Callable[[], str | None] = lambda: None,
        extra: Callable[[], dict[str, bool]] = dict,
        poll: float = POLL_S,
    ) -> None:
        self.server, self.live, self.ready, self.extra = server, live, ready, extra
        self.poll = poll
        self.draining = False
        self.reason: str | None = "starting"
        self._shown: dict[str, bool] = {}
        self._task: asyncio.Task | None = None

    async def start(self) -> Health:
        await self.update()
        self._task = asyncio.create_task(self._run(), name="health")
        return self

    async def update(self) -> None:
        """Evaluate the checks now and publish what changed."""
        live = self.live()
        reason = "draining" if self.draining else None
        reason = reason or ("not live" if not live else self.ready())
        if reason != self.reason:
            if reason is None:
                log.info("ready")
            else:
                log.info("not ready: %s", reason)
            self.reason = reason
        states = {LIVENESS_SERVICE: live, "": reason is None}
        states.update({name: reason is None and ok for name, ok in self.extra().items()})
        for name, serving in states.items():
            if self._shown.get(name) != serving:
                self._shown[name] = serving
                if name == "":
                    await self.server.set_serving(serving)
                else:
                    await self.server.set_status(name, serving)

    async def drain(self) -> None:
        """Not ready from now on (the process finishes its work; it stays live)."""
        self.draining = True
        await self.update()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll)
            try:
                await self.update()
            except Exception:  # a failing check must not end the health loop
                log.exception("health check failed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
