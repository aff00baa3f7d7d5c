"""What every route of the gateway shares: the served base models, the backend, the config, and
the worker threads that template and tokenize (``Gateway``, on ``app.state.gateway``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from fastapi import Request

from services.gateway.config import GatewayConfig
from services.gateway.core import APIError, Backend
from services.gateway.keys import tenant_slos
from services.gateway.limits import Limits
from services.gateway.models import Served
from services.gateway.observe import GatewayMetrics
from services.gateway.slo import Slo, SloOverride

T = TypeVar("T")


@dataclass(slots=True)
class Gateway:
    """The app's shared state. ``served[0]`` is the first model (``--model-dir``); a request's
    ``model`` picks one of ``served`` or an adapter of one."""

    config: GatewayConfig
    backend: Backend
    served: list[Served]
    limits: Limits
    metrics: GatewayMetrics | None
    lanes: anyio.CapacityLimiter
    started: int = field(default_factory=lambda: int(time.time()))
    tenant_slos: dict[str, SloOverride] = field(default_factory=dict)

    @property
    def default_slo(self) -> Slo:
        return Slo(self.config.slo_ttft_ms, self.config.slo_tpot_ms)

    @classmethod
    def of(
        cls,
        config: GatewayConfig,
        backend: Backend,
        models: Sequence[tuple[GatewayConfig, Any]],
        metrics: GatewayMetrics | None,
    ) -> Gateway:
        """``models``: (config, tokenizer) of each served base model, the first one's first."""
        served = [Served.of(c, t, backend) for c, t in models]
        limits = Limits.from_config(config, [m.name for m in served])
        lanes = anyio.CapacityLimiter(config.tokenizer_threads)
        slos = tenant_slos(config.api_keys)
        return cls(config, backend, served, limits, metrics, lanes, tenant_slos=slos)

    @property
    def by_name(self) -> dict[str, Served]:
        return {m.name: m for m in self.served}

    async def prepare(self, func: Callable[..., T], *args: Any) -> T:
        """``func(*args)`` (templating, tokenizing: CPU work) in a worker thread, at most
        ``--tokenizer-threads`` at once, first come first served."""
        return await anyio.to_thread.run_sync(functools.partial(func, *args), limiter=self.lanes)

    async def pick(self, model: str) -> tuple[Served, bool]:
        """(the base model ``model`` runs on, whether it names an adapter of it); the first
        model for an unknown name, whose checks answer 404."""
        for m in self.served:
            if m.name == model:
                return m, False
        for m in self.served:
            if await m.catalog.is_adapter(model):
                return m, True
        return self.served[0], False

    async def known(self, model: str) -> Served:
        """The base model of ``model``; 404 when it is neither a base model nor an adapter."""
        m, adapter = await self.pick(model)
        if model != m.name and not adapter:
            raise APIError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return m


def gateway(request: Request) -> Gateway:
    """The shared state of the app serving ``request``."""
    return request.app.state.gateway
