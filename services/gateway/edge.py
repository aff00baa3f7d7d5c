"""The outermost layer of every HTTP request: request ids, API-key auth, the body size limit,
and the OpenAI error JSON shape (including for pydantic validation errors)."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.config import GatewayConfig
from services.gateway.core import APIError, internal_error
from services.gateway.keys import KeyRing

log = logging.getLogger(__name__)

_CLIENT_ID_RE = re.compile(r"^[\x21-\x7e]{1,256}$")
_PREFIXES = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl"}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 APIError for pydantic/FastAPI errors: ``param`` names the first bad field in
    OpenAI's style (``messages.[0].content``); union member tags are left out of it."""
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {first['msg']}")
    param, _ = _param_of(first.get("loc", ()))
    if not param:
        return APIError(400, f"The request body is invalid: {first['msg']}")
    if first.get("type") == "missing":
        return APIError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    tags = [t for e in errors for p, t in [_param_of(e.get("loc", ()))] if p == param and t]
    expected = f" (expected one of: {', '.join(dict.fromkeys(tags))})" if len(tags) > 1 else ""
    return APIError(
        400,
        f"Invalid value for '{param}': {first['msg']}{expected}.",
        param=param,
        code="invalid_type" if first.get("type", "").endswith("_type") else None,
    )


def _param_of(loc: Any) -> tuple[str, str | None]:
    parts: list[str] = []
    tag = None
    for i, item in enumerate(loc):
        if i == 0 and item == "body":
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item.lower() in _TYPE_TAGS or not item.isidentifier() or item[0].isupper():
            tag = tag or item  # a union member's tag, e.g. "list[str]" or "TextPart"
        else:
            parts.append(item)
    return ".".join(parts), tag


# --- Middleware ---------------------------------------------------------------------------------


class EdgeMiddleware:
    """Pure ASGI middleware: request ids (``X-Request-Id`` on every response), API-key auth for
    ``/v1/``, the body size limit (413), and a last-resort 500 without a stack trace."""

    def __init__(self, app: ASGIApp, config: GatewayConfig) -> None:
        self.app = app
        self.max_body = config.max_body_bytes
        self.keys = KeyRing(config.api_keys)  # hashes only; compared in constant time

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client_id = headers.get("x-request-id")
        rid = f"{_PREFIXES.get(scope['path'], 'req')}-{uuid.uuid4().hex}"
        echo = client_id if client_id and _CLIENT_ID_RE.match(client_id) else rid
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["x-request-id"] = echo
            await send(message)

        try:
            state["tenant"] = self._tenant(scope["path"], headers)
            self._check_length(headers)
            await self.app(scope, self._limited(receive), send_with_id)
        except APIError as e:
            if not started:
                await error_response(e)(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in request %s", rid)
            if not started:
                await error_response(internal_error())(scope, receive, send_with_id)

    def _tenant(self, path: str, headers: Headers) -> str:
        """The caller's tenant; raises 401 when keys are configured and none matches."""
        if not self.keys or not path.startswith("/v1/"):
            return ""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else ""
        found = self.keys.find(given) if given else None
        if found is None:
            raise APIError(
                401,
                "Incorrect API key provided."
                if given
                else "Missing API key: send 'Authorization: Bearer <key>'.",
                "authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found.tenant

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"Request body exceeds the limit of {self.max_body} bytes.",
            code="request_too_large",
        )

    def _check_length(self, headers: Headers) -> None:
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise self._too_large()

    def _limited(self, receive: Receive) -> Receive:
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise self._too_large()
            return message

        return limited
