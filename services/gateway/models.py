"""What ``model`` may name at this gateway: the served base model and its LoRA adapters.

The adapters are those live workers hold, as a router reports them (``Backend.adapters``),
cached for ``ttl`` seconds; a name not in the cache refreshes it at once (at most every
``MISS_REFRESH_S``), so an adapter loaded through another gateway replica is found.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.tokenizer import Tokenizer
from services.gateway.config import GatewayConfig
from services.gateway.core import APIError, Backend
from services.gateway.responses import TokenText
from services.gateway.tools import ToolSupport, tool_support

log = logging.getLogger(__name__)
MISS_REFRESH_S = 0.25


class ModelCatalog:
    def __init__(self, base: str, backend: Backend, ttl: float = 2.0) -> None:
        self.base = base
        self.backend = backend
        self.ttl = ttl
        self._adapters: list[str] = []  # this base model's
        self._at = float("-inf")  # time.monotonic() of the last refresh

    async def adapters(self, refresh: bool = False) -> list[str]:
        """The adapters, from the cache unless it is stale or ``refresh``."""
        now = time.monotonic()
        if refresh or now - self._at > self.ttl:
            try:
                found = await self.backend.adapters()
                self._adapters = sorted(n for n, base in found.items() if base == self.base)
                self._at = now
            except APIError as e:  # no router answered: keep the last list
                log.warning("listing adapters failed: %s", e.message)
        return self._adapters

    async def is_adapter(self, model: str) -> bool:
        """Whether ``model`` names a loaded adapter (refreshing the cache on a miss)."""
        if model == self.base:
            return False
        if model in await self.adapters():
            return True
        if time.monotonic() - self._at < MISS_REFRESH_S:
            return False
        return model in await self.adapters(refresh=True)

    def forget(self) -> None:
        """Drop the cache (after a load or unload through this gateway)."""
        self._at = float("-inf")


@dataclass(slots=True)
class Served:
    """One base model of the gateway: its config (name, folder, context), tokenizer, tool
    format, detokenizer and adapters."""

    config: GatewayConfig
    tokenizer: Tokenizer
    tools: ToolSupport
    text_of: TokenText
    catalog: ModelCatalog

    @property
    def name(self) -> str:
        return self.config.served_model_name

    @classmethod
    def of(cls, config: GatewayConfig, tokenizer: Tokenizer, backend: Backend) -> Served:
        tools = tool_support(tokenizer, config.tool_call_parser, config.tool_chat_template)
        catalog = ModelCatalog(config.served_model_name, backend)
        return cls(config, tokenizer, tools, TokenText(tokenizer), catalog)
