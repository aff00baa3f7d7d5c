"""Run the gateway: ``python -m services.gateway --model-dir DIR --router HOST:PORT``.

Every flag ``--some-flag`` falls back to ``TANDEM_SOME_FLAG`` (``--help`` lists them;
`services.gateway.config`); repeatable ones (``--router``, ``--api-key``) take comma-separated
values there. With no API keys, authentication is off. Keys are kept only as SHA-256 hashes;
``--api-keys-file`` holds hashes with tenants and rate limits (``services.gateway.keys``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import uvicorn

from engine.gil import quick_handoffs
from engine.tokenizer import Tokenizer
from services.common.process import setup_logging
from services.gateway.config import GatewayConfig, model_configs, parse_config
from services.gateway.grpc_backend import GrpcBackend
from services.gateway.observe import GatewayMetrics
from services.gateway.server import create_app
from services.observability.metrics import AdmissionCollector
from services.observability.process import Observability

__all__ = ["main", "parse_config", "serve"]
log = logging.getLogger("services.gateway")


async def serve(config: GatewayConfig) -> None:
    """Wire tokenizer, gRPC backend and app, then serve until SIGINT/SIGTERM (uvicorn drains
    open requests for up to 30 s, closes the router channels, then re-raises the signal)."""
    gateway_id = f"gateway-{socket.gethostname()}-{config.port}"
    obs = Observability.start(
        config.observability, "gateway", config.served_model_name, gateway_id, etcd=False
    )  # before the router channels exist: they pick up the tracing interceptor
    tokenizer = Tokenizer(config.model_dir)
    # Inside the loop: grpc.aio channels bind to it.
    backend = GrpcBackend(
        config.routers, config.tls, config.router_api_key, config.served_model_name,
        direct=config.token_path == "direct",
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        yield
        await backend.close()

    metrics = GatewayMetrics(
        obs.metrics.registry, config.slo_ttft_ms / 1000, config.slo_tpot_ms / 1000
    )
    extra = [(c, Tokenizer(c.model_dir)) for c in model_configs(config)[1:]]
    app = create_app(
        config, backend, tokenizer, lifespan=lifespan, metrics=metrics, extra_models=extra
    )
    obs.metrics.register(AdmissionCollector(*app.state.limits.ledgers.values()))
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=30,
            ssl_certfile=config.ssl_certfile or None,  # HTTPS when given
            ssl_keyfile=config.ssl_keyfile or None,
        )
    )
    log.info(
        "serving %s on %s:%d via routers %s",
        config.served_model_name,
        config.host,
        config.port,
        ",".join(config.routers),
    )
    try:
        await server.serve()
    finally:
        obs.stop()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    quick_handoffs()
    setup_logging("gateway", config.log_level)
    # uvloop (libuv) carries the HTTP side's many short connections at about half asyncio's
    # cost per request (bench/results/overload_cpu.md); uvicorn picks httptools by itself.
    run = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        run = uvloop.run
    run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
