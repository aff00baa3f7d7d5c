"""The gateway's OpenAPI document: FastAPI's own, plus what it cannot see by itself.

The completion routes parse their bodies themselves (any Content-Type, strict pydantic models),
so FastAPI knows neither the request bodies nor the OpenAI error responses; both are added here
from the same models the routes validate with. Clients can generate code from
``/openapi.json``, and the tests fuzz the gateway against it with schemathesis.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from services.gateway.schemas import ChatCompletionRequest, CompletionRequest

BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
_REF = "#/components/schemas/{model}"

ERROR_SCHEMA: dict[str, Any] = {
    "title": "Error",
    "description": "OpenAI error JSON: every 4xx and 5xx answer of the gateway has this shape.",
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# What each status means on the completion routes (README "Operating" has the details).
ERROR_STATUSES = {
    "400": "Malformed or out-of-range input; `param` names the field.",
    "401": "Missing or wrong API key.",
    "404": "Unknown model.",
    "413": "Request body over the size limit.",
    "429": "Overloaded or over the tenant's rate limit; see `Retry-After`.",
    "502": "The backend ended the stream before the request finished.",
    "503": "No live workers, or the request was aborted by the server; retry.",
    "504": "The request's deadline passed.",
}


def _error_responses() -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}
    return {code: {"description": why, "content": content} for code, why in ERROR_STATUSES.items()}


def build_openapi(app: FastAPI, model: str) -> dict[str, Any]:
    """FastAPI's document for ``app`` with the request bodies and error responses added;
    ``model`` is the one model id the gateway serves."""
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Error"] = ERROR_SCHEMA
    for path, body_model in BODIES.items():
        body = body_model.model_json_schema(ref_template=_REF)
        components.update(body.pop("$defs", {}))
        body["properties"]["model"]["enum"] = [model]
        components[body_model.__name__] = body
        ref = {"$ref": _REF.format(model=body_model.__name__)}
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
        op["responses"].update(_error_responses())
    return schema


def install_openapi(app: FastAPI, model: str) -> None:
    """Serve ``build_openapi(app, model)`` at the app's ``openapi_url`` (built on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, model)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
