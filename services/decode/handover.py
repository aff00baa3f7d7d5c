"""Live KV migration off a draining decode worker (no grpc): on a planned drain each running
single-choice request leaves the batch between two steps with its KV held, as a prefill's is;
its stream ends with a `Moved` event naming those blocks, and the router continues it on another
decode worker, which pulls the blocks (prompt and every output token but the last) and decodes
on, without computing anything again. The blocks are READ over NIXL where both workers run an
agent (the taker's READ carries the ``rel`` notification on which they are freed), else served
over the gRPC block stream (``tandem.v1.KVTransport``) and freed once read; in any case freed
when the worker exits."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from engine.core.client import EngineClient
from engine.handoff import HeldKV
from services.common.codec import Moved
from services.common.errors import FailedPrecondition
from services.worker.handles import kv_handle

log = logging.getLogger(__name__)
LEASE_S = 30.0  # what the handle promises; the draining worker exits by its drain timeout


class Handover:
    """The sending side of live KV migration for one decode worker's engine."""

    def __init__(
        self, engine: EngineClient, worker_id: str, incarnation: str, checksums: bool = True
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.checksums = checksums
        self.address = ""  # set once the server is bound
        self.moved_out = 0  # requests handed over with their KV
        self._held: dict[str, tuple[int, ...]] = {}  # request id -> blocks held for a peer

    async def move_out(self, request_ids: Iterable[str]) -> int:
        """Take each request out of the batch with its KV held; those that could not move now
        (several choices, not yet decoding) stay and finish, or are cut at the drain timeout.
        Returns how many moved."""
        moved = 0
        for rid in list(request_ids):
            held = await self.engine.move_out(rid)
            if held is not None:
                self._held[rid] = held.block_ids
                moved += 1
        self.moved_out += moved
        if moved:
            log.info("draining: %d running requests handed over with their KV", moved)
        return moved

    async def moved(self, held: HeldKV) -> Moved:
        """The last event of a request that moved out: where its KV is."""
        info = self.engine.info
        ids = list(held.block_ids)
        sums = await self.engine.handoff_checksums(ids) if self.checksums else []
        handle = kv_handle(
            info, self.worker_id, self.incarnation, self.address, ids, held.num_tokens, LEASE_S,
            sums, info.checksum_algorithm,
        )  # fmt: skip
        return Moved(handle, held.generator_state)

    async def read_blocks(
        self, request_id: str, incarnation: str, block_ids: list[int]
    ) -> list[bytes]:
        """The gRPC block stream's read (`libkv.transfer.grpc_stream.BlockReader`): the bytes
        of blocks held for a move. The handle is good for one read: the blocks are freed after
        it (the taker reads every block it does not cache, in one call)."""
        self.held_blocks(request_id, incarnation, block_ids)
        try:
            return await self.engine.read_blocks(block_ids)
        finally:
            if self._held.pop(request_id, None) is not None:
                await self.engine.release(request_id)

    def held_blocks(self, request_id: str, incarnation: str, block_ids: Sequence[int]) -> None:
        """Raise unless this incarnation holds ``block_ids`` for a moved request (the
        `libkv.transfer.BlockHolder` a NIXL block server asks before a push)."""
        held = self._held.get(request_id)
        if incarnation != self.incarnation or held is None or not set(block_ids) <= set(held):
            raise FailedPrecondition(f"no moved KV of {request_id} with blocks {block_ids}")

    def release(self, request_id: str) -> bool:
        """Free a moved request's blocks (its taker READ them over NIXL, or gave up); the engine
        frees them before its next step."""
        if self._held.pop(request_id, None) is None:
            return False
        self.engine.release_later(request_id)
        return True

    @property
    def num_held(self) -> int:
        """Moved requests whose KV no peer has read yet."""
        return len(self._held)
