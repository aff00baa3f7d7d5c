"""What every service process does around its work: logging set up once, and running until
SIGINT/SIGTERM, then cleaning up."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from services.common.options import option
from services.observability.tracing import install_log_context

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

log = logging.getLogger(__name__)


async def run_until_signal(cleanup: Callable[[], Awaitable[None]]) -> None:
    """Block until SIGINT/SIGTERM, then run ``cleanup``."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await cleanup()


def log_level(text: str) -> str:
    """A log level name, any case (ValueError for another word)."""
    if text.lower() not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()


def log_level_option() -> Any:
    """The ``--log-level`` field of every service's config."""
    return option("info", f"log level ({', '.join(LOG_LEVELS)})", convert=log_level)


def setup_logging(name: str, level: str = "info") -> None:
    """Log lines ``time NAME LEVEL logger: message [rid=... trace=...]`` at ``level``."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    install_log_context(name)  # lines carry the request id and trace id
