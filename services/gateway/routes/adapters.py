"""vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (on every worker, through
the routers), allowed with ``--allow-runtime-lora-updating``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from services.gateway.core import APIError
from services.gateway.http import parse
from services.gateway.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from services.gateway.state import Gateway, gateway

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    """Load a PEFT adapter folder on every worker; 400 with the reason when it cannot be
    served. With several base models the name is ``BASE/NAME``."""
    g = _allowed(request)
    body = await parse(request, LoadLoraAdapterRequest)
    if body.lora_name in g.by_name:
        raise APIError(400, "the adapter name is a base model's", param="lora_name")
    await g.backend.load_lora(body.lora_name, body.lora_path)
    for m in g.served:
        m.catalog.forget()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    """Unload an adapter everywhere (404 when not loaded); requests already using it finish
    first."""
    g = _allowed(request)
    body = await parse(request, UnloadLoraAdapterRequest)
    await g.backend.unload_lora(body.lora_name)
    for m in g.served:
        m.catalog.forget()
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _allowed(request: Request) -> Gateway:
    g = gateway(request)
    if not g.config.allow_runtime_lora_updating:
        raise APIError(
            403,
            "loading and unloading LoRA adapters at run time is off on this gateway "
            "(--allow-runtime-lora-updating)",
            "permission_error",
        )
    return g
