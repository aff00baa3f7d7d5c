"""A worker's LoRA adapters: loaded at start (``--lora-modules NAME=PATH``, then those loaded
at run time before this worker started, as etcd records them: ``libkv.cluster.adapters``) and at
run time (the ``tandem.v1.Adapters`` service the router fans out to), listed in the member
record (``Member.loras``) so routers send an adapter's requests only to workers that hold it."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from tandem.v1 import common_pb2, worker_pb2_grpc

from engine.errors import InvalidAdapterError
from libkv.cluster.adapters import AdapterRecords
from libkv.cluster.registry import LORAS

if TYPE_CHECKING:
    from engine.core.client import EngineClient

log = logging.getLogger(__name__)
SERVICE_NAME = "tandem.v1.Adapters"
add_to_server = worker_pb2_grpc.add_AdaptersServicer_to_server


class Adapters:
    """Loads and unloads adapters in the engine and keeps the member record's list current."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.set_extra: Callable[[str, str], None] | None = None  # set once registered
        self.publish: Callable[[], Awaitable[None]] | None = None
        self.recorded: set[str] = set()  # loaded from the cluster's records (load_recorded)

    async def load_recorded(self, records: AdapterRecords, model: str) -> None:
        """Match the run-time adapters the cluster records for ``model``
        (``libkv.cluster.adapters``): load each one not loaded (before registering, and once
        more right after), unload those loaded from a record that is gone. A record whose
        folder no longer serves is skipped with a warning, not fatal."""
        try:
            wanted = await records.list(model)
        except Exception as e:  # etcd unreachable: serve what the flags load
            log.warning("reading the recorded LoRA adapters failed: %r", e)
            return
        loaded = set(await self.engine.list_loras())
        changed = False
        for name, path in wanted.items():
            if name in loaded:
                continue
            try:
                await self.engine.add_lora(name, path)
            except InvalidAdapterError as e:
                log.warning("recorded LoRA adapter %s (%s) not loaded: %s", name, path, e)
                continue
            log.info("loaded recorded LoRA adapter %s from %s", name, path)
            self.recorded.add(name)
            changed = True
        for name in sorted(self.recorded - set(wanted)):
            self.recorded.discard(name)
            if name in loaded:
                await self.engine.remove_lora(name)
                log.info("unloading LoRA adapter %s (its record is gone)", name)
                changed = True
        if changed:
            await self._announce()

    async def load_at_start(self, modules: Sequence[tuple[str, str]]) -> None:
        """``--lora-modules``: a bad adapter stops the worker with the reason."""
        for name, path in modules:
            try:
                await self.engine.add_lora(name, path)
            except InvalidAdapterError as e:
                raise SystemExit(f"error: --lora-modules {name}={path}: {e}") from e
            log.info("loaded LoRA adapter %s from %s", name, path)

    async def record(self) -> str:
        """The member record's ``loras`` field."""
        return ",".join(await self.engine.list_loras())

    async def _announce(self) -> None:
        if self.set_extra is not None:
            self.set_extra(LORAS, await self.record())
        if self.publish is not None:
            await self.publish()

    async def load(self, name: str, path: str) -> None:
        await self.engine.add_lora(name, path)
        log.info("loaded LoRA adapter %s from %s", name, path)
        await self._announce()

    async def unload(self, name: str) -> None:
        await self.engine.remove_lora(name)
        log.info("unloading LoRA adapter %s (once its requests finish)", name)
        await self._announce()


class AdaptersServicer(worker_pb2_grpc.AdaptersServicer):
    def __init__(self, adapters: Adapters, worker_id: str) -> None:
        self.adapters = adapters
        self.worker_id = worker_id

    async def LoadLoraAdapter(self, request, context):  # noqa: N802 - generated name
        await self.adapters.load(request.lora_name, request.lora_path)
        return common_pb2.LoraAdapterResponse(worker_ids=[self.worker_id])

    async def UnloadLoraAdapter(self, request, context):  # noqa: N802
        await self.adapters.unload(request.lora_name)
        return common_pb2.LoraAdapterResponse(worker_ids=[self.worker_id])
