"""The gateway's ASGI app: its middlewares (request ids, auth and the body limit in
``edge.EdgeMiddleware``; metrics and the server span in ``observe.ObserveMiddleware``), the
shared state (``state.Gateway``), the error handlers, and the routes, one module per endpoint
family under ``services.gateway.routes``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI

from engine.tokenizer import Tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.core import Backend
from services.gateway.edge import EdgeMiddleware
from services.gateway.http import add_error_handlers
from services.gateway.observe import GatewayMetrics, ObserveMiddleware
from services.gateway.openapi import install_openapi
from services.gateway.routes import adapters, embeddings, generate, health, models, tokens
from services.gateway.state import Gateway

ROUTES = (generate, models, embeddings, tokens, adapters, health)


def create_app(
    config: GatewayConfig,
    backend: Backend,
    tokenizer: Tokenizer,
    lifespan: Any = None,
    metrics: GatewayMetrics | None = None,
    extra_models: Sequence[tuple[GatewayConfig, Tokenizer]] = (),
) -> FastAPI:
    """The gateway's ASGI app: OpenAI routes over ``backend``, tokenizing with ``tokenizer``.
    ``lifespan`` (optional) is FastAPI's: start-up and shutdown work such as closing channels.
    ``metrics`` (optional) records requests, token timings and goodput. ``extra_models``: the
    config and tokenizer of each further base model (``config.model_configs``); a request's
    ``model`` picks one."""
    app = FastAPI(
        title="Tandem gateway",
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        # ObserveMiddleware owns the server span (with the request id) and the request metrics;
        # FastAPI's native OpenTelemetry would add a second, unlinked server span.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.add_middleware(EdgeMiddleware, config=config)
    app.add_middleware(ObserveMiddleware, metrics=metrics)  # outermost: sees every answer
    g = Gateway.of(config, backend, [(config, tokenizer), *extra_models], metrics)
    app.state.gateway = g
    app.state.metrics = metrics
    app.state.limits = g.limits
    add_error_handlers(app)
    install_openapi(app, config.served_model_name)
    for module in ROUTES:
        app.include_router(module.router)
    return app
