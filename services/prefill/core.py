"""Prefill logic (no grpc): run the prompt, return the first token and a KV handle, hold the
blocks until the decode worker releases them or their lease runs out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine.core.client import EngineClient
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from services.common.admission import ENGINE_PRIORITY, TokenLedger
from services.common.codec import KVHandle
from services.common.errors import FailedPrecondition
from services.worker.handles import kv_handle
from services.worker.slo_gate import SloGate
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
        engine: EngineClient,
        worker_id: str,
        incarnation: str,
        lease_seconds: float,
        ledger: TokenLedger | None = None,
        checksums: bool = True,
        gate: SloGate | None = None,
    ) -> None:
        """``gate``: SLO admission of new prompts (`services.worker.slo_gate`; None: off)."""
        self.engine = engine
        self.gate = gate
        self.checksums = checksums  # sent with each handle, for the decode worker to check
        # Admission in prompt tokens: a prefill's work and what it holds for the decode side.
        self.ledger = ledger or TokenLedger(0, name=f"prefill worker {worker_id}")
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.lease_seconds = lease_seconds
        self.address = ""  # set once the server is bound
        self._leases: dict[str, float] = {}  # request id -> monotonic expiry
        self._held: dict[str, frozenset[int]] = {}  # request id -> blocks held for a peer
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
        ttft_ms: float = 0.0,
    ) -> PrefillResult:
        """Prefill ``prompt``; refused at once (ResourceExhausted) past the admission bound or
        when the queue here already misses its TTFT objective ``ttft_ms`` (``gate``).
        Cancelling the call (client gone, deadline passed) aborts it and frees its blocks."""
        if self.gate is not None:
            self.gate.admit_prefill(ttft_ms)
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
                handoff_sums=self.checksums,
            ):
                firsts[out.index] = out
        if len(firsts) < params.n:
            raise FailedPrecondition(f"request {request_id} was aborted during prefill")
        outs = [firsts[i] for i in range(params.n)]
        held = next((o.handoff for o in outs if o.handoff is not None), None)
        if held is None or not any(o.kv_held for o in outs):
            return PrefillResult(outs, None, [b""] * params.n)
        self._leases[request_id] = time.monotonic() + self.lease_seconds
        self._held[request_id] = frozenset(held.block_ids)
        # Each full block's sum was taken when the block was sealed; only a last, partial
        # block was summed at the hand-off (``Handoff.handoff_checksums``).
        handle = kv_handle(
            self.engine.info, self.worker_id, self.incarnation, self.address, held.block_ids,
            len(prompt), self.lease_seconds, held.checksums, held.checksum_algorithm,
        )  # fmt: skip
        return PrefillResult(outs, handle, list(held.generator_states))

    def release(self, request_id: str) -> bool:
        """Free the request's held blocks (a decode worker has them, or gave up on them); the
        engine frees them before its next step. False when none were held."""
        self._leases.pop(request_id, None)
        if self._held.pop(request_id, None) is None:
            return False
        self.engine.release_later(request_id)
        return True

    async def release_request(self, request_id: str) -> bool:
        """The Release RPC."""
        self._leases.pop(request_id, None)
        self._held.pop(request_id, None)
        return await self.engine.release(request_id)

    async def abort_request(self, request_id: str) -> bool:
        """The Abort RPC: a prefill in flight, or its held blocks."""
        self._leases.pop(request_id, None)
        self._held.pop(request_id, None)
        return await self.engine.abort(request_id)

    async def stats(self) -> WorkerStats:
        locations = getattr(self.engine.listener, "stats", None)  # a SummaryPublisher's
        return await collect(self.engine, self.worker_id, self.incarnation, "prefill", locations)

    async def read_blocks(
        self, request_id: str, incarnation: str, block_ids: list[int]
    ) -> list[bytes]:
        """The gRPC block stream's read (`libkv.transfer.grpc_stream.BlockReader`): bytes of
        held blocks; see ``held_blocks``. Refused for a pool in GPU memory: GPU memory never
        moves through the host and TCP."""
        if self.engine.info.device_type == "cuda":
            raise FailedPrecondition(
                f"the KV of prefill worker {self.worker_id} is in GPU memory: it moves only over "
                "a GPU-direct path (CUDA IPC, NIXL), never the gRPC stream"
            )
        self.held_blocks(request_id, incarnation, block_ids)
        return await self.engine.read_blocks(block_ids)

    def held_blocks(self, request_id: str, incarnation: str, block_ids: Sequence[int]) -> None:
        """Check that this incarnation holds ``block_ids`` for the request (else
        FailedPrecondition): stale handles and blocks of other requests are never served."""
        if incarnation != self.incarnation:
            raise FailedPrecondition(
                f"KV handle names incarnation {incarnation}, this worker is {self.incarnation}"
            )
        held = self._held.get(request_id)
        if held is None:
            raise FailedPrecondition(f"blocks of {request_id} are no longer held")
        if not set(block_ids) <= held:
            raise FailedPrecondition(f"request {request_id} does not hold blocks {block_ids}")

    @property
    def num_held(self) -> int:
        """Requests whose KV is held for a decode worker."""
        return len(self._held)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.lease_seconds / 4))
            now = time.monotonic()
            for rid, expiry in list(self._leases.items()):
                if expiry <= now:
                    log.warning("KV lease of %s expired; freeing its blocks", rid)
                    self.release(rid)
