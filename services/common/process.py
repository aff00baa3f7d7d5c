"""What every service process does around its work: logging set up once, and running until
SIGINT/SIGTERM, then cleaning up."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from services.observability.tracing import install_log_context

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


def setup_logging(name: str, level: str = "info") -> None:
    """Log lines ``time NAME LEVEL logger: message [rid=... trace=...]`` at ``level``."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    install_log_context(name)  # lines carry the request id and trace id
