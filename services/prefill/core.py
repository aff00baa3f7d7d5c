"""Prefill logic (no grpc): run the prompt, return the first token and a KV handle, hold the
blocks until the decode worker releases them or their lease runs out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from services.common.admission import ENGINE_PRIORITY, TokenLedger
from services.common.codec import KVHandle
from services.common.errors import FailedPrecondition
from services.worker.stats import WorkerStats, collect

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillResult:
    """The first output of every choice (by index) and where the prompt's KV is held."""

    firsts: list[RequestOutput]
    handle: KVHandle | None  # None when every choice already finished at its first token
    generator_states: list[bytes]  # per choice (b"" when unseeded or finished)

    @property
    def first(self) -> RequestOutput:
        return self.firsts[0]


class PrefillCore:
    """Owns the engine of a prefill worker and the leases of held KV blocks."""

    def __init__(
        self,
        engine: AsyncEngine,
        worker_id: str,
        incarnation: str,
        lease_seconds: float,
        ledger: TokenLedger | None = None,
        checksums: bool = True,
    ) -> None:
        self.engine = engine
        self.checksums = checksums  # sent with each handle, for the decode worker to check
        # Admission in prompt tokens: a prefill's work and what it holds for the decode side.
        self.ledger = ledger or TokenLedger(0, name=f"prefill worker {worker_id}")
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.lease_seconds = lease_seconds
        self.address = ""  # set once the server is bound
        self._leases: dict[str, float] = {}  # request id -> monotonic expiry
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap(), name="kv-lease-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        tenant: str,
        priority: str = "interactive",
        lora: str = "",
    ) -> PrefillResult:
        """Prefill ``prompt``; refused at once (ResourceExhausted) past the admission bound.
        Cancelling the call (client gone, deadline passed) aborts it and frees its blocks."""
        eng = self.engine.engine
        firsts: dict[int, RequestOutput] = {}
        with self.ledger.hold(request_id, len(prompt), priority):
            async for out in self.engine.generate(
                request_id,
                prompt,
                params,
                tenant=tenant or None,
                hold_kv=True,
                priority=ENGINE_PRIORITY[priority],
                lora=lora or None,
            ):
                firsts[out.index] = out
        if len(firsts) < params.n:
            raise FailedPrecondition(f"request {request_id} was aborted during prefill")
        outs = [firsts[i] for i in range(params.n)]
        if not any(o.kv_held for o in outs):
            return PrefillResult(outs, None, [b""] * params.n)
        expires = time.monotonic() + self.lease_seconds
        self._leases[request_id] = expires
        block_ids = eng.held_block_ids(request_id)
        # Each full block's sum was taken when the block was sealed (the engine's
        # ``seal_checksums``); only a last, partial block is summed now. No step writes held
        # blocks.
        sums = await self.engine.run(eng.handoff_checksums, block_ids) if self.checksums else []
        handle = KVHandle(
            worker_id=self.worker_id,
            incarnation=self.incarnation,
            address=self.address,
            block_ids=tuple(block_ids),
            num_tokens=len(prompt),
            block_size=eng.config.block_size,
            block_bytes=eng.runner.layout.block_bytes,  # canonical: every KV head
            dtype=str(eng.runner.dtype).removeprefix("torch."),
            lease_expires_unix_ms=int((time.time() + self.lease_seconds) * 1000),
            block_checksums=tuple(sums),
            checksum_algorithm=eng.runner.checksum_algorithm if sums else "",
        )
        states = [eng.generator_state(request_id, i) for i in range(params.n)]
        return PrefillResult(outs, handle, states)

    def release(self, request_id: str) -> bool:
        """Free the request's held blocks (a decode worker has them, or gave up on them)."""
        self._leases.pop(request_id, None)
        return self.engine.engine.release(request_id)

    def abort(self, request_id: str) -> bool:
        self._leases.pop(request_id, None)
        return self.engine.abort(request_id)

    # The calls of the servicers: off the event loop (they take the engine lock, which a model
    # step holds for its whole length).
    async def release_request(self, request_id: str) -> bool:
        return await self.engine.run(self.release, request_id)

    async def abort_request(self, request_id: str) -> bool:
        return await self.engine.run(self.abort, request_id)

    async def stats(self) -> WorkerStats:
        return await self.engine.run(
            collect, self.engine.engine, self.worker_id, self.incarnation, "prefill"
        )

    async def read_blocks(
        self, request_id: str, incarnation: str, block_ids: list[int]
    ) -> list[bytes]:
        """The gRPC block stream's read (`libkv.transfer.grpc_stream.BlockReader`)."""
        return await self.engine.run(self._read_blocks, request_id, incarnation, block_ids)

    def held_blocks(self, request_id: str, incarnation: str, block_ids: Sequence[int]) -> None:
        """Check that this incarnation holds ``block_ids`` for the request (else
        FailedPrecondition): stale handles and blocks of other requests are never served."""
        if incarnation != self.incarnation:
            raise FailedPrecondition(
                f"KV handle names incarnation {incarnation}, this worker is {self.incarnation}"
            )
        try:
            held = set(self.engine.engine.held_block_ids(request_id))
        except KeyError as e:
            raise FailedPrecondition(f"blocks of {request_id} are no longer held") from e
        if not set(block_ids) <= held:
            raise FailedPrecondition(f"request {request_id} does not hold blocks {block_ids}")

    def _read_blocks(self, request_id: str, incarnation: str, block_ids: list[int]) -> list[bytes]:
        """Bytes of held blocks (the gRPC stream transport); see ``held_blocks``. Refused for a
        pool in GPU memory: GPU memory never moves through the host and TCP."""
        if self.engine.engine.runner.device.type == "cuda":
            raise FailedPrecondition(
                f"the KV of prefill worker {self.worker_id} is in GPU memory: it moves only over "
                "a GPU-direct path (CUDA IPC, NIXL), never the gRPC stream"
            )
        self.held_blocks(request_id, incarnation, block_ids)
        return self.engine.engine.read_blocks(block_ids)

    @property
    def num_held(self) -> int:
        return self.engine.engine.num_held

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.lease_seconds / 4))
            now = time.monotonic()
            for rid, expiry in list(self._leases.items()):
                if expiry <= now:
                    log.warning("KV lease of %s expired; freeing its blocks", rid)
                    self.release(rid)
