"""The gateway's flags for protection: API keys (hashed), admission, deadlines and TLS. Parsed by
``__main__`` into the frozen ``GatewayConfig`` like every other flag."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from services.common.tls import add_tls_flags, tls_from_args
from services.gateway.keys import load_keys_file, plain_keys

DEFAULT_MAX_INFLIGHT_TOKENS = 1_000_000


def add_protection_flags(p: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Flags with ``TANDEM_*`` fallbacks from ``env``."""
    e = env.get
    p.add_argument(
        "--api-keys-file",
        default=e("TANDEM_API_KEYS_FILE", ""),
        help="JSON file of SHA-256 hashed API keys with tenants and rate limits "
        "(python -m services.gateway.keys KEY prints an entry)",
    )
    p.add_argument(
        "--max-inflight-tokens",
        type=int,
        default=int(e("TANDEM_MAX_INFLIGHT_TOKENS", str(DEFAULT_MAX_INFLIGHT_TOKENS))),
        help="answer 429 once the requests in flight hold this many tokens "
        "(prompt + max_tokens); 0 = no bound",
    )
    p.add_argument(
        "--batch-admission-fraction",
        type=float,
        default=float(e("TANDEM_BATCH_ADMISSION_FRACTION", "0.5")),
        help="batch-priority requests are admitted only up to this fraction of the bound",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=float(e("TANDEM_REQUEST_TIMEOUT", "600")),
        help="deadline in seconds of a request that gives no 'timeout' field",
    )
    p.add_argument(
        "--max-request-timeout",
        type=float,
        default=float(e("TANDEM_MAX_REQUEST_TIMEOUT", "3600")),
        help="the largest 'timeout' a client may ask for (larger ones are cut to it)",
    )
    p.add_argument(
        "--router-api-key",
        default=e("TANDEM_ROUTER_API_KEY", ""),
        help="key the gateway presents to routers started with --api-key",
    )
    p.add_argument("--ssl-certfile", default=e("TANDEM_SSL_CERTFILE", ""), help="serve HTTPS")
    p.add_argument("--ssl-keyfile", default=e("TANDEM_SSL_KEYFILE", ""))
    add_tls_flags(p, env)


def protection_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser, env: Mapping[str, str]
) -> dict[str, Any]:
    """GatewayConfig fields from the parsed flags; exits through ``parser.error`` when bad."""
    items = args.api_key or [v.strip() for v in env.get("TANDEM_API_KEYS", "").split(",")]
    try:
        keys = plain_keys(i for i in items if i)
        if args.api_keys_file:
            keys += load_keys_file(args.api_keys_file)
        tls = tls_from_args(args)
    except (OSError, ValueError) as err:
        parser.error(str(err))
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("HTTPS needs both --ssl-certfile and --ssl-keyfile")
    if args.max_inflight_tokens < 0 or not 0 < args.batch_admission_fraction <= 1:
        parser.error("--max-inflight-tokens >= 0 and 0 < --batch-admission-fraction <= 1")
    if not (args.request_timeout > 0 and args.max_request_timeout > 0):
        parser.error("--request-timeout and --max-request-timeout must be > 0")
    return {
        "api_keys": keys,
        "max_inflight_tokens": args.max_inflight_tokens,
        "batch_admission_fraction": args.batch_admission_fraction,
        "request_timeout": args.request_timeout,
        "max_request_timeout": args.max_request_timeout,
        "tls": tls,
        "ssl_certfile": args.ssl_certfile,
        "ssl_keyfile": args.ssl_keyfile,
        "router_api_key": args.router_api_key,
    }
