"""Live KV migration off a draining decode worker (no grpc): on a planned drain each running
single-choice request leaves the batch between two steps with its KV held, as a prefill's is;
its stream ends with a `Moved` event naming those blocks, and the router continues it on another
decode worker, which pulls the blocks (prompt and every output token but the last) and decodes
on, without computing anything again. The blocks are READ over NIXL where both workers run an
agent (the taker's READ carries the ``rel`` notification on which they are freed), else served
over the gRPC block stream (``tandem.v1.KVTransport``) and freed once read; in any case freed
when the worker exits."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence

from engine.async_engine import AsyncEngine
from engine.handoff import HeldKV
from services.common.codec import KVHandle, Moved
from services.common.errors import FailedPrecondition

log = logging.getLogger(__name__)
LEASE_S = 30.0  # what the handle promises; the draining worker exits by its drain timeout


class Handover:
    """The sending side of live KV migration for one decode worker's engine."""

    def __init__(
        self, engine: AsyncEngine, worker_id: str, incarnation: str, checksums: bool = True
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.checksums = checksums
        self.address = ""  # set once the server is bound
        self.moved_out = 0  # requests handed over with their KV
        self._held: dict[str, tuple[int, ...]] = {}  # request id -> blocks held for a peer
        self._releasing: set[asyncio.Task] = set()

    async def move_out(self, request_ids: Iterable[str]) -> int:
        """Take each request out of the batch with its KV held; those that could not move now
        (several choices, not yet decoding) stay and finish, or are cut at the drain timeout.
        Returns how many moved."""
        eng = self.engine.engine
        moved = 0
        for rid in list(request_ids):
            held = await self.engine.move_out(rid, eng.hold_for_move)
            if held is not None:
                self._held[rid] = held.block_ids
                moved += 1
        self.moved_out += moved
        if moved:
            log.info("draining: %d running requests handed over with their KV", moved)
        return moved

    async def moved(self, held: HeldKV) -> Moved:
        """The last event of a request that moved out: where its KV is."""
        eng = self.engine.engine
        ids = list(held.block_ids)
        sums = await self.engine.run(eng.handoff_checksums, ids) if self.checksums else []
        handle = KVHandle(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            address=self.address,
            block_ids=held.block_ids,
            num_tokens=held.num_tokens,
            block_size=eng.config.block_size,
            block_bytes=eng.runner.layout.block_bytes,  # canonical: every KV head
            dtype=str(eng.runner.dtype).removeprefix("torch."),
            lease_expires_unix_ms=int((time.time() + LEASE_S) * 1000),
            block_checksums=tuple(sums),
            checksum_algorithm=eng.runner.checksum_algorithm if sums else "",
        )
        return Moved(handle, held.generator_state)

    async def read_blocks(
        self, request_id: str, incarnation: str, block_ids: list[int]
    ) -> list[bytes]:
        """The gRPC block stream's read (`libkv.transfer.grpc_stream.BlockReader`): the bytes
        of blocks held for a move. The handle is good for one read: the blocks are freed after
        it (the taker reads every block it does not cache, in one call)."""
        self.held_blocks(request_id, incarnation, block_ids)
        eng = self.engine.engine
        try:
            return await self.engine.run(eng.read_blocks, block_ids)
        finally:
            if self._held.pop(request_id, None) is not None:
                await self.engine.run(eng.release, request_id)

    def held_blocks(self, request_id: str, incarnation: str, block_ids: Sequence[int]) -> None:
        """Raise unless this incarnation holds ``block_ids`` for a moved request (the
        `libkv.transfer.BlockHolder` a NIXL block server asks before a push)."""
        held = self._held.get(request_id)
        if incarnation != self.incarnation or held is None or not set(block_ids) <= set(held):
            raise FailedPrecondition(f"no moved KV of {request_id} with blocks {block_ids}")

    def release(self, request_id: str) -> bool:
        """Free a moved request's blocks (its taker READ them over NIXL, or gave up); called on
        the event loop, so the engine's release runs in a thread."""
        if self._held.pop(request_id, None) is None:
            return False
        task = asyncio.create_task(self.engine.run(self.engine.engine.release, request_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
        return True

    @property
    def num_held(self) -> int:
        """Moved requests whose KV no peer has read yet."""
        return len(self._held)
