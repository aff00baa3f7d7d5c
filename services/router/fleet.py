"""The router's calls that are not one request's route (no grpc): prompt-only work (embeddings,
prompt logprobs) on one worker, retried once on another, and LoRA adapters loaded on or
unloaded from every live worker. `services.router.core.RouterCore` has them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from engine.errors import AdapterNotFoundError, InvalidRequestError
from engine.sampling_params import TokenLogprob
from libkv.cluster.adapters import AdapterRecords
from libkv.cluster.registry import Member, MemberDirectory
from services.router.calls import RETRYABLE, NoWorker, WorkerClients
from services.router.policy import Chooser

T = TypeVar("T")


class FleetCalls:
    """Prompt-only work and adapter loads, over the state `RouterCore` sets up."""

    directory: MemberDirectory
    clients: WorkerClients
    chooser: Chooser
    records: AdapterRecords | None
    model: str

    async def embed(
        self, request_id: str, inputs: list[list[int]], lora: str = ""
    ) -> tuple[list[list[float]], int]:
        """(one vector per input, prompt tokens), from a prefill worker (retried once on
        another worker when one is unavailable or full)."""

        def call(worker: Member) -> Awaitable[tuple[list[list[float]], int]]:
            return self.clients.embed(worker, request_id, inputs, lora)

        return await self._prompt_work("embed", inputs, lora, call)

    async def prompt_logprobs(
        self, request_id: str, inputs: list[list[int]], k: int, lora: str = ""
    ) -> tuple[list[list[TokenLogprob]], int]:
        """(the logprobs of each input's tokens after its first, with the ``k`` most likely
        tokens at each place; prompt tokens), from a worker chosen and retried as for
        ``embed``."""

        def call(worker: Member) -> Awaitable[tuple[list[list[TokenLogprob]], int]]:
            return self.clients.prompt_logprobs(worker, request_id, inputs, k, lora)

        return await self._prompt_work("score", inputs, lora, call)

    async def _prompt_work(
        self,
        what: str,
        inputs: list[list[int]],
        lora: str,
        call: Callable[[Member], Awaitable[T]],
    ) -> T:
        """``call(worker)`` on the least loaded prefill worker holding ``lora`` (a decode
        worker when none is live), retried once on another when one is unavailable or full."""
        failed: set[str] = set()
        while True:
            worker = self.chooser.pick_embedder(lora, failed)
            if worker is None:
                raise NoWorker(f"no live worker to {what} on")
            with self.chooser.working(worker, sum(map(len, inputs))):
                try:
                    return await call(worker)
                except RETRYABLE:
                    failed.add(worker.worker_id)
                    if len(failed) > 1:
                        raise

    # -- LoRA adapters ---------------------------------------------------------------------------
    def workers(self) -> list[Member]:
        return [m for role in ("prefill", "decode") for m in self.directory.members_by_role(role)]

    def adapters(self) -> list[str]:
        """Adapters some live decode worker holds (so requests for them can be served)."""
        return sorted(set().union(*(m.loras for m in self.directory.members_by_role("decode"))))

    async def load_lora(self, name: str, path: str) -> list[str]:
        """Load an adapter on every live worker that lacks it; all or none: when one worker
        refuses it (bad folder), the others unload it again and the refusal is raised.
        Returns the workers that loaded it, once the member view lists it on them."""
        workers = self.workers()
        if not workers:
            raise NoWorker("no live workers to load the adapter on")
        targets = [m for m in workers if name not in m.loras]
        if not targets:
            raise InvalidRequestError(f"the adapter `{name}` is already loaded")
        if self.records is not None:  # before the workers: one starting now finds it
            await self.records.put(self.model, name, path)
        results = await asyncio.gather(
            *(self.clients.load_lora(m, name, path) for m in targets), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        done = [
            m for m, r in zip(targets, results, strict=True) if not isinstance(r, BaseException)
        ]
        if errors:
            if self.records is not None:
                await self.records.delete(self.model, name)
            await asyncio.gather(
                *(self.clients.unload_lora(m, name) for m in done), return_exceptions=True
            )
            raise errors[0]
        ids = {m.worker_id for m in done}
        await self._until(lambda: ids <= {m.worker_id for m in self.workers() if name in m.loras})
        return sorted(ids)

    async def unload_lora(self, name: str) -> list[str]:
        """Unload an adapter from every live worker holding it (their requests using it
        finish first) and forget its record; AdapterNotFoundError when neither exists."""
        holders = [m for m in self.workers() if name in m.loras]
        recorded = self.records is not None and name in await self.records.list(self.model)
        if not holders and not recorded:
            raise AdapterNotFoundError(f"the adapter `{name}` is not loaded")
        if self.records is not None and recorded:  # before the workers: none loads it again
            await self.records.delete(self.model, name)
        if not holders:
            return []
        results = await asyncio.gather(
            *(self.clients.unload_lora(m, name) for m in holders), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(holders):
            raise errors[0]
        await self._until(lambda: not any(name in m.loras for m in self.workers()))
        return sorted(m.worker_id for m in holders)

    async def _until(self, done, timeout: float = 5.0) -> None:
        """Wait until ``done()`` holds in the member view (the workers publish at once)."""
        deadline = time.monotonic() + timeout
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
