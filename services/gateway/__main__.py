"""Run the gateway: ``python -m services.gateway --model-dir DIR --router HOST:PORT``.

Flags fall back to the environment: ``TANDEM_ROUTERS`` (comma-separated host:port),
``TANDEM_API_KEYS`` (comma-separated ``key`` or ``key:tenant``; a bare key's tenant is a short
hash of the key), and ``TANDEM_<FLAG>`` for the others (``TANDEM_HOST``, ``TANDEM_PORT``,
``TANDEM_MODEL_DIR``, ...). With no API keys, authentication is off. Keys are kept only as
SHA-256 hashes; ``--api-keys-file`` holds hashes with tenants and rate limits
(``services.gateway.keys``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from services.common.metrics import AdmissionCollector
from services.common.obs_config import add_observability_flags, observability_config
from services.common.observability import Observability
from services.common.tracing import install_log_context
from services.gateway.core import GatewayConfig
from services.gateway.grpc_backend import GrpcBackend
from services.gateway.observe import GatewayMetrics
from services.gateway.options import add_protection_flags, protection_config
from services.gateway.server import create_app
from services.gateway.tools import TOOL_CALL_PARSER_CHOICES

log = logging.getLogger("services.gateway")


def _split(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The gateway's flags; most fall back to a ``TANDEM_*`` variable of ``env``."""
    e = (os.environ if env is None else env).get
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    p.add_argument("--host", default=e("TANDEM_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=e("TANDEM_PORT", "8000"))
    p.add_argument(
        "--model-dir",
        default=e("TANDEM_MODEL_DIR"),
        required=not e("TANDEM_MODEL_DIR"),
        help="model folder: tokenizer and config.json",
    )
    p.add_argument(
        "--served-model-name",
        default=e("TANDEM_SERVED_MODEL_NAME") or None,
        help="model id clients send (default: folder name)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=e("TANDEM_MAX_MODEL_LEN") or None,
        help="context length (default: the model's)",
    )
    p.add_argument("--router", action="append", default=[], help="router host:port; repeatable")
    p.add_argument("--api-key", action="append", default=[], help="key or key:tenant; repeatable")
    p.add_argument(
        "--max-body-bytes", type=int, default=e("TANDEM_MAX_BODY_BYTES", str(4 * 1024 * 1024))
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=e("TANDEM_DEFAULT_MAX_TOKENS", "4096"),
        help="cap on max_tokens when a request omits it",
    )
    p.add_argument("--log-level", default=e("TANDEM_LOG_LEVEL", "info").lower())
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=e("TANDEM_SLO_TTFT_MS", "1000"),
        help="goodput counts requests with TTFT and TPOT within both SLOs",
    )
    p.add_argument("--slo-tpot-ms", type=float, default=e("TANDEM_SLO_TPOT_MS", "50"))
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSER_CHOICES,
        default=e("TANDEM_TOOL_CALL_PARSER", "auto"),
        help="format of tool calls in the model's output (auto: chosen by model; none: tools "
        "refused)",
    )
    p.add_argument(
        "--tool-chat-template",
        default=e("TANDEM_TOOL_CHAT_TEMPLATE", ""),
        help="jinja chat template for requests with tools (default: the model's own when it "
        "renders tools, else a built-in Hermes ChatML template for ChatML models)",
    )
    add_observability_flags(p, os.environ if env is None else env)
    add_protection_flags(p, os.environ if env is None else env)
    return p


def parse_config(
    argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> GatewayConfig:
    """The frozen config from flags, falling back to ``env``."""
    env = os.environ if env is None else env
    parser = build_parser(env)
    args = parser.parse_args(argv)
    routers = tuple(args.router or _split(env.get("TANDEM_ROUTERS")))
    if not routers:
        parser.error("no router: pass --router HOST:PORT or set TANDEM_ROUTERS")
    model_dir = Path(args.model_dir).expanduser()
    context = ModelConfig.from_dir(model_dir).max_position_embeddings
    max_model_len = args.max_model_len or context
    if not 1 < max_model_len <= context:
        parser.error(f"--max-model-len must be in [2, {context}] for this model")
    config = GatewayConfig(
        model_dir=str(model_dir),
        served_model_name=args.served_model_name or model_dir.resolve().name,
        max_model_len=max_model_len,
        host=args.host,
        port=args.port,
        routers=routers,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        log_level=args.log_level,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        observability=observability_config(args),
        tool_call_parser=args.tool_call_parser,
        tool_chat_template=args.tool_chat_template,
        **protection_config(args, parser, env),
    )
    return config


async def serve(config: GatewayConfig) -> None:
    """Wire tokenizer, gRPC backend and app, then serve until SIGINT/SIGTERM (uvicorn drains
    open requests for up to 30 s, closes the router channels, then re-raises the signal)."""
    gateway_id = f"gateway-{socket.gethostname()}-{config.port}"
    obs = Observability.start(
        config.observability, "gateway", config.served_model_name, gateway_id, etcd=False
    )  # before the router channels exist: they pick up the tracing interceptor
    tokenizer = Tokenizer(config.model_dir)
    # Inside the loop: grpc.aio channels bind to it.
    backend = GrpcBackend(config.routers, config.tls, config.router_api_key)

    @asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        yield
        await backend.close()

    metrics = GatewayMetrics(
        obs.metrics.registry, config.slo_ttft_ms / 1000, config.slo_tpot_ms / 1000
    )
    app = create_app(config, backend, tokenizer, lifespan=lifespan, metrics=metrics)
    obs.metrics.register(AdmissionCollector(app.state.limits.ledger))
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
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    install_log_context("gateway")  # lines carry the request id and trace id
    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
