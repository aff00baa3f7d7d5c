"""Decode logic (no grpc): obtain the prompt's KV (or prefill it locally), join the running
batch, stream outputs."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from engine.core.client import EngineClient
from engine.core.client import Moved as MovedOut
from engine.errors import KVCapacityError
from engine.handoff import FirstToken
from engine.kv_checksum import WSUM64, legacy_algorithm
from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams, TokenLogprob
from libkv.transfer import CopySums, KVTransferError, KVTransport
from services.common.admission import ENGINE_PRIORITY, TokenLedger, request_cost, resumed_cost
from services.common.codec import KVHandle, Moved
from services.common.errors import FailedPrecondition, KVTransferFailed
from services.decode.handover import Handover
from services.decode.interval import every
from services.worker.slo_gate import SloGate
from services.worker.stats import WorkerStats, collect

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=64)
def _warn_once(message: str) -> None:
    log.warning("%s", message)


@dataclass(slots=True)
class DecodeJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tenant: str = ""
    kv: KVHandle | None = None
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    generator_state: bytes = b""
    cached_tokens: int = 0
    priority: str = "interactive"
    lora: str = ""  # LoRA adapter ("" = the base model)
    admitted: bool = False  # admitted before its first token reached the client (see generate)
    resumed: list[int] = field(default_factory=list)  # a migrated request's streamed tokens
    # With kv: the choices that go on here, each from its first token (empty: choice 0 from
    # first_token, first_logprob and generator_state).
    starts: list[FirstToken] = field(default_factory=list)
    slo_ttft_ms: float = 0.0  # the request's objectives (0: none given; `SloGate`)
    slo_tpot_ms: float = 0.0

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens whose KV ``kv`` holds: the prompt, and for a request moved here from a
        draining decode worker every output token but the last."""
        return self.prompt + self.resumed[:-1]

    @property
    def firsts(self) -> list[FirstToken]:
        """The choices that go on here, each from its first token(s)."""
        if self.starts:
            return list(self.starts)
        assert self.first_token is not None
        return [FirstToken(0, self.first_token, self.first_logprob, self.generator_state)]

    @property
    def cost(self) -> int:
        """What admission books for it (`request_cost`): prompt plus its choices' booked
        completion tokens. Booked once; the request may generate past it (to max_tokens). A
        migrated request (`resumed_cost`) also books the tokens it already produced."""
        if self.resumed:
            return resumed_cost(len(self.prompt), len(self.resumed), self.params)
        return request_cost(len(self.prompt), self.params)


class DecodeCore:
    """Owns the engine of a decode worker and its KV transport.

    When obtaining a request's KV fails (prefill worker dead or restarted, transfer stuck past
    ``transfer_timeout``), the reserved blocks are freed at once and ``on_transfer_failure``
    decides: "recompute" prefills the prompt here (the first token, already streamed, is kept),
    "retry" fails the call with KVTransferFailed so the router prefills on another worker.
    """

    def __init__(
        self,
        engine: EngineClient,
        transport: KVTransport,
        worker_id: str,
        incarnation: str,
        transfer_timeout: float = 10.0,
        on_transfer_failure: str = "recompute",
        ledger: TokenLedger | None = None,
        fault: str = "",
        checksums: bool = True,
        gate: SloGate | None = None,
        stream_interval: int = 1,
    ) -> None:
        """``gate``: SLO admission of new requests (`services.worker.slo_gate`; None: off);
        ``stream_interval``: tokens per streamed message (`services.decode.interval`)."""
        if on_transfer_failure not in ("recompute", "retry"):
            raise ValueError(f"unknown on_transfer_failure {on_transfer_failure!r}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, not {stream_interval}")
        self.engine = engine
        self.stream_interval = stream_interval
        self.transport = transport
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.transfer_timeout = transfer_timeout
        self.on_transfer_failure = on_transfer_failure
        self.ledger = ledger or TokenLedger(0, name=f"decode worker {worker_id}")
        self._reservations: dict[str, float] = {}  # request id -> monotonic expiry
        self.blocks_pulled = 0  # blocks that moved (cached prefix blocks never do)
        self.transfer_failures = 0
        self.corrupt_blocks = 0  # arrived blocks whose checksum did not match the sender's
        self.fault = fault  # test only: "corrupt" damages each transfer's first block
        self.fused_checks = 0  # transfers checked by the sums their copy took (CUDA IPC)
        self.handover = Handover(engine, worker_id, incarnation, checksums)
        self.recomputed = 0
        self.resumed = 0  # migrated requests continued here
        self._releasing: set[asyncio.Future] = set()
        self.gate = gate

    def reserve(
        self, request_id: str, tokens: int, priority: str, lease: float, tpot_ms: float = 0.0
    ) -> None:
        """Book ``tokens`` for a request that is being prefilled elsewhere (ResourceExhausted
        at once when full or when its TPOT objective ``tpot_ms`` is already missed here,
        Unavailable while draining); `generate` takes the booking, `unreserve` drops it, and it
        lapses ``lease`` seconds from now."""
        self._expire()
        if request_id not in self._reservations:  # else a retried call: renew the lease
            if self.gate is not None:
                self.gate.admit_decode(tpot_ms)
            self.ledger.admit(request_id, tokens, priority)
        self._reservations[request_id] = time.monotonic() + lease

    def unreserve(self, request_id: str) -> bool:
        """Drop a booking no Generate took (the prefill failed, the client left)."""
        if self._reservations.pop(request_id, None) is None:
            return False
        self.ledger.release(request_id)
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, expiry in list(self._reservations.items()):
            if expiry <= now:
                log.warning("reservation of %s lapsed unused; releasing it", rid)
                self.unreserve(rid)

    @property
    def num_reserved(self) -> int:
        return len(self._reservations)

    async def generate(self, job: DecodeJob) -> AsyncIterator[RequestOutput | Moved]:
        """Stream the job's outputs. A job with a reservation here takes it; one ``admitted``
        elsewhere is booked even past the bound (it has a client waiting on a started stream);
        any other is refused at once (ResourceExhausted) past the admission bound or past its
        TPOT objective (``gate``). Closing the
        stream (client gone, deadline passed) aborts it and frees its blocks."""
        if self._reservations.pop(job.request_id, None) is not None:
            try:
                async for out in every(self._relay(job), self.stream_interval):
                    yield out
            finally:
                self.ledger.release(job.request_id)
            return
        if self.gate is not None and not job.admitted and not job.resumed:
            self.gate.admit_decode(job.slo_tpot_ms)  # a started stream is never refused
        with self.ledger.hold(job.request_id, job.cost, job.priority, force=job.admitted):
            async for out in every(self._relay(job), self.stream_interval):
                yield out

    async def _relay(self, job: DecodeJob) -> AsyncIterator[RequestOutput | Moved]:
        """The engine's outputs; a request handed over on a drain ends with where its KV is."""
        async for out in self._generate(job):
            if isinstance(out, MovedOut):
                yield await self.handover.moved(out.held)
                return
            yield out

    async def move_out(self) -> int:
        """On a planned drain: hand every running request over with its KV (`Handover`)."""
        running = [rid for rid in self.ledger.inflight if rid not in self._reservations]
        return await self.handover.move_out(running)

    async def _generate(self, job: DecodeJob) -> AsyncIterator[RequestOutput]:
        priority = ENGINE_PRIORITY[job.priority]
        if job.resumed and job.kv is None:
            async for out in self._resume(job, priority):
                yield out
            return
        if job.kv is None:
            async for out in self.engine.generate(
                job.request_id, job.prompt, job.params, tenant=job.tenant or None,
                priority=priority, lora=job.lora or None,
            ):  # fmt: skip
                yield out
            return
        recompute = not await self._receive_kv(job)
        async for out in self.engine.follow_prefilled(
            job.request_id, job.prompt, job.params, job.firsts, tenant=job.tenant or None,
            num_cached_tokens=job.cached_tokens, recompute=recompute, priority=priority,
            lora=job.lora or None,
        ):  # fmt: skip
            yield out

    async def _resume(self, job: DecodeJob, priority: int) -> AsyncIterator[RequestOutput]:
        """A request migrated from a decode worker that died: recompute the KV of its prompt
        and of the tokens it streamed (from this worker's prefix cache where it has them), then
        sample on; the text of those tokens is not sent again."""
        done = job.resumed
        first = FirstToken(0, done[-1], earlier=tuple(done[:-1]))
        self.resumed += 1
        async for out in self.engine.follow_prefilled(
            job.request_id, job.prompt, job.params, [first], tenant=job.tenant or None,
            recompute=True, priority=priority, lora=job.lora or None,
        ):  # fmt: skip
            yield out

    async def _receive_kv(self, job: DecodeJob) -> bool:
        """Reserve blocks, fetch the ones not cached here, tell prefill to release. This worker
        owns the release of a handle it was given: it tells the prefill worker once it has the
        blocks, or once it gives up on them (the router releases only KV no decode worker
        took).

        True when the KV is in place; False when it must be recomputed (blocks freed)."""
        assert job.kv is not None and job.first_token is not None
        info = self.engine.info
        if job.kv.block_bytes != info.layout.block_bytes:
            raise FailedPrecondition(
                f"KV layout mismatch: prefill blocks are {job.kv.block_bytes} bytes, "
                f"this worker's are {info.layout.block_bytes}"
            )
        try:
            dst, cached = await self.engine.reserve(
                job.request_id, job.kv_tokens, job.tenant or None, job.lora or None
            )
        except KVCapacityError:
            # Admitted, its first token streamed: never fail it for capacity. It queues like
            # a preempted sequence and is recomputed here once blocks free up.
            log.warning("no free KV blocks for %s now; it queues and is recomputed", job.request_id)
            self._release_source(job)
            self.recomputed += 1
            return False
        skip = cached // info.block_size
        src = job.kv.block_ids[skip:]
        try:
            timeout = self._timeout(job.kv)
            if src:  # nothing to move when this worker already caches the whole prompt
                await self.transport.fetch(job.request_id, job.kv, src, dst[skip:], timeout)
        except KVTransferError as e:
            await self.engine.release(job.request_id)
            self._release_source(job)  # this worker took the handle: it releases, in any case
            self.transfer_failures += 1
            if self.on_transfer_failure == "retry":
                raise KVTransferFailed(f"KV of {job.request_id} did not arrive: {e}") from e
            log.warning("KV of %s did not arrive (%s); recomputing it here", job.request_id, e)
            self.recomputed += 1
            return False
        except BaseException:
            self.engine.release_later(job.request_id)  # maybe cancelled: awaits nothing
            raise
        self.blocks_pulled += len(src)
        await self.transport.release(job.request_id, job.kv)
        bad = await self._check(job, dst[skip:], skip)
        if bad:
            await self.engine.release(job.request_id)
            self.corrupt_blocks += bad
            self.recomputed += 1
            log.warning("KV of %s: %d of %d blocks arrived corrupt; recomputing it here",
                        job.request_id, bad, len(src))  # fmt: skip
            return False
        return True

    def _release_source(self, job: DecodeJob) -> None:
        """Tell the prefill worker to free the request's held blocks without waiting (it may
        be gone: its lease then frees them)."""
        assert job.kv is not None
        task = asyncio.ensure_future(self.transport.release(job.request_id, job.kv))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _check(self, job: DecodeJob, dst: list[int], skip: int) -> int:
        """How many of the blocks that arrived differ from the sender's checksums (0 when the
        handle carries none). Where the transport's copy summed the blocks as it moved them
        (CUDA IPC with ``wsum64``: `CudaIpcTransport.verify`) those sums were compared on the
        device behind the copy, with no second read of the blocks and no wait of their own;
        else the arrived blocks are summed here.
        The test fault hook then damages the first one before the check (on the fused path
        the transport damages it in transit instead)."""
        assert job.kv is not None
        info = self.engine.info
        expected = job.kv.block_checksums[skip:]
        algorithm = job.kv.checksum_algorithm or legacy_algorithm(torch.device(info.device))
        if isinstance(self.transport, CopySums):
            # Always asked (it drops the fetch's sums); used when they are the sender's kind.
            fused = await self.transport.verify(
                job.request_id, expected if algorithm == WSUM64 else ()
            )
            if fused is not None:
                self.fused_checks += 1
                return fused
        if self.fault == "corrupt" and dst:
            damaged = b"\xa5" * info.layout.block_bytes  # a canonical block: every head
            await self.engine.write_blocks(dst[:1], [damaged])
        if not expected or not dst:
            return 0
        try:
            got = await self.engine.block_checksums(dst, algorithm)
        except ValueError as e:  # a function this worker does not compute: unchecked
            _warn_once(f"KV from {job.kv.worker_id} is not checked: {e}")
            return 0
        return sum(a != b for a, b in zip(got, expected, strict=True))

    def _timeout(self, kv: KVHandle) -> float:
        """The transfer timeout, cut short so a transfer never outlives the prefill lease: a
        one-sided READ is not checked by the prefill worker, and once the lease has run out
        its blocks may hold another request's KV."""
        if not kv.lease_expires_unix_ms:
            return self.transfer_timeout
        lease_left = kv.lease_expires_unix_ms / 1000 - time.time() - 1.0
        if lease_left <= 0:
            raise KVTransferError(f"the KV lease on {kv.worker_id} has run out")
        return min(self.transfer_timeout, lease_left)

    async def abort_request(self, request_id: str) -> bool:
        """The Abort RPC; drops a reservation too."""
        dropped = self.unreserve(request_id)
        return await self.engine.abort(request_id) or dropped

    async def stats(self) -> WorkerStats:
        locations = getattr(self.engine.listener, "stats", None)  # a SummaryPublisher's
        return await collect(self.engine, self.worker_id, self.incarnation, "decode", locations)
