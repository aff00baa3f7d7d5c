"""Readiness (``/health``) and liveness (``/livez``), different questions: ready means able to
serve, live means the process answers HTTP."""

from __future__ import annotations

import asyncio
import logging

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway.state import gateway

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 2.0
router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once, for every served base model, a router can route to a live decode worker of
    it, else 503 with the reasons (load balancers and Kubernetes send traffic only on 200).
    ``models`` says, per model, ``ready`` or why not."""
    backend = gateway(request).backend

    async def one(model: str) -> str | None:
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            try:
                return await backend.readiness(model)
            except Exception as e:
                log.warning("backend health check of %s failed", model, exc_info=True)
                return f"health check failed: {type(e).__name__}"
        return "no answer from the routers in time"

    names = list(gateway(request).by_name)
    found = dict(zip(names, await asyncio.gather(*map(one, names)), strict=True))
    models = {name: why or "ready" for name, why in found.items()}
    reasons = [why for why in found.values() if why is not None]
    if not reasons:
        return JSONResponse({"status": "ok", "models": models})
    body = {"status": "unavailable", "reason": "; ".join(reasons), "models": models}
    return JSONResponse(body, status_code=503)


@router.get("/livez")
async def livez() -> Response:
    """The process serves HTTP (restart it when this fails)."""
    return JSONResponse({"status": "ok"})
