"""Run-time LoRA adapters as the cluster remembers them, so that workers started later load them.

Key: ``/tandem/v1/loras/<base model>/<adapter name>``; value: JSON ``{"name", "path"}``. No
lease: a record outlives every process, as the load it stands for should. The router that loads
an adapter at run time (``POST /v1/load_lora_adapter``) puts the record before it asks the live
workers, and deletes it again when a worker refuses the folder; an unload deletes it before the
workers unload. A worker loads every record of its model before it registers (a restart comes
back with them), then once more right after registering: a load whose router listed the live
workers before this one registered is found there (the record was put before that listing).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from libkv.cluster.etcd_follow import Endpoints, EtcdConnection, read_prefix

log = logging.getLogger(__name__)

ADAPTERS_PREFIX = "/tandem/v1/loras/"
T = TypeVar("T")


def adapters_prefix(model: str) -> bytes:
    if not model or "/" in model:
        raise ValueError(f"a base model name must be non-empty and contain no '/': {model!r}")
    return f"{ADAPTERS_PREFIX}{model}/".encode()


def adapter_key(model: str, name: str) -> bytes:
    """The record of adapter ``name`` (which may be ``BASE/NAME``) of base model ``model``."""
    if not name:
        raise ValueError("an adapter name must be non-empty")
    return adapters_prefix(model) + name.encode()


class AdapterRecords:
    """Put, delete and list the adapter records of base models (one retry on a new connection
    after an etcd error; the caller sees the second error)."""

    def __init__(self, endpoints: Endpoints, timeout: float = 5.0) -> None:
        self._etcd = EtcdConnection(endpoints, timeout, "adapters")

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        try:
            return await fn()
        except Exception:
            await self._etcd.reset()
            return await fn()

    async def put(self, model: str, name: str, path: str) -> None:
        value = json.dumps({"name": name, "path": path}).encode()
        await self._call(lambda: self._etcd.client.put(adapter_key(model, name), value))

    async def delete(self, model: str, name: str) -> None:
        await self._call(lambda: self._etcd.client.delete(adapter_key(model, name)))

    async def list(self, model: str) -> dict[str, str]:
        """Adapter name -> folder of every record of ``model``, by name."""
        items, _ = await self._call(lambda: read_prefix(self._etcd, adapters_prefix(model)))
        out: dict[str, str] = {}
        for key, value in items:
            try:
                record = json.loads(value)
                out[str(record["name"])] = str(record["path"])
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring a malformed adapter record at %r", key)
        return dict(sorted(out.items()))

    async def close(self) -> None:
        await self._etcd.close()
