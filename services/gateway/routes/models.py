"""``/v1/models``: the served base models and the adapters loaded on them (an adapter's card
names its base model as ``parent``, as vLLM's does)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from services.gateway.models import Served
from services.gateway.state import Gateway, gateway

router = APIRouter()


def model_card(g: Gateway, m: Served, name: str) -> dict[str, Any]:
    """OpenAI's model object of ``name`` (``m`` or an adapter of it)."""
    return {
        "id": name,
        "object": "model",
        "created": g.started,
        "owned_by": "tandem",
        "root": m.name,
        "parent": None if name == m.name else m.name,
        "max_model_len": m.config.max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    g = gateway(request)
    data = []
    for m in g.served:
        names = [m.name, *await m.catalog.adapters(refresh=True)]
        data += [model_card(g, m, n) for n in names]
    return {"object": "list", "data": data}


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> dict[str, Any]:
    g = gateway(request)
    return model_card(g, await g.known(model), model)
