"""Routing logic (no grpc): choose workers, book decode capacity, run prefill then decode (or
decode only), retry once on another worker when one fails before the first token, migrate a
stream whose decode worker fails after it (or hands it over while draining), propagate
cancellation. The types it works with are in ``calls``; its calls that route no request (prompt
work, adapters) in ``fleet``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from libkv.cluster.adapters import AdapterRecords
from libkv.cluster.registry import Member, MemberDirectory
from services.common.codec import Event, Moved
from services.common.errors import KVTransferFailed, ResourceExhausted, Unavailable
from services.router.admission import DecodeAdmission, SloGate
from services.router.calls import (
    RESERVATION_LEASE_S,
    RETRYABLE,
    BookingFailed,
    DecodeCall,
    HandedOver,
    NoWorker,
    PrefillReply,
    RouteJob,
    RouterStats,
    WorkerClients,
    soonest,
)
from services.router.fleet import FleetCalls
from services.router.planner import Planner
from services.router.policy import Chooser, LocationLookup, Plan, PolicyConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Route:
    """One request's route so far: the workers that failed it (not picked again), whether a
    token reached the caller (a later failure migrates the stream instead of retrying it),
    choice 0's tokens sent, the migrations made and the KV a draining worker handed over."""

    failed: set[str] = field(default_factory=set)
    started: bool = False
    streamed: list[int] = field(default_factory=list)
    migrations: int = 0
    moved: Moved | None = None


class RouterCore(FleetCalls):
    def __init__(
        self,
        directory: MemberDirectory,
        clients: WorkerClients,
        decode_only_threshold: int = 256,
        policy: PolicyConfig | None = None,
        index: LocationLookup | None = None,
        max_migrations: int = 2,
        records: AdapterRecords | None = None,
        model: str = "",
        refusal_memory: float = 0.0,
        slo_shed_factor: float = 0.0,
        planner: Planner | None = None,
    ) -> None:
        """``policy`` (default: least-loaded with ``decode_only_threshold``) picks workers;
        ``index``, the block-location index, feeds the "kv" policy; a stream moves to another
        decode worker at most ``max_migrations`` times. ``records`` (with the base ``model``):
        where run-time adapter loads are kept for workers that start later
        (``libkv.cluster.adapters``). Requests that cannot fit on a decode worker are refused
        here, with no call (`DecodeAdmission`: this router's bookings there, and the worker's
        last refusal for capacity, remembered at most ``refusal_memory`` seconds), and those
        whose predicted TTFT is past ``slo_shed_factor`` times their SLO (`SloGate`; 0: off).
        ``planner`` sizes the pools from the traffic routed here (`services.router.planner`)."""
        self.directory = directory
        self.clients = clients
        self.policy = policy or PolicyConfig("least-loaded", decode_only_threshold)
        self.inflight: Counter[str] = Counter()
        self.chooser = Chooser(directory, self.policy, index, self.inflight)
        self.stats = RouterStats()
        self.max_migrations = max_migrations
        self._tasks: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()
        self._sending: set[str] = set()  # requests whose handler is in gRPC's send
        self.records, self.model = records, model
        self.admission = DecodeAdmission(refusal_memory)
        self.slo_gate = SloGate(slo_shed_factor)
        self.planner = planner or Planner()

    def new_request_id(self) -> str:
        return f"req-{uuid.uuid4().hex}"

    # -- one request -------------------------------------------------------------------------
    async def generate(self, job: RouteJob) -> AsyncIterator[Event]:
        """Stream the request's events; retries once if a worker fails before the first token,
        and on every other worker while workers refuse it for capacity (ResourceExhausted, a
        fast refusal); when all refused, raises the refusal that frees up soonest. A stream
        whose decode worker fails after tokens were sent migrates (see `_migrate`)."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks[job.request_id] = task
        route = Route()
        refusals: list[ResourceExhausted] = []
        failures = 0
        try:
            while True:
                try:
                    resume = route.migrations > 0
                    events = self._resume(job, route) if resume else self._attempt(job, route)
                    async for ev in events:
                        if job.request_id in self._aborted:
                            # An abort whose cancel came due with no wait inside `events`:
                            # take it here, before the gRPC send (see `abort`).
                            await asyncio.sleep(0)
                        if ev.index == 0:
                            route.streamed.extend(ev.token_ids)
                        self._sending.add(job.request_id)
                        try:
                            yield ev
                        finally:
                            self._sending.discard(job.request_id)
                        if job.request_id in self._aborted and task is not None:
                            task.cancel()  # abort() came while gRPC sent `ev`
                    self.chooser.disagg.finished(len(route.streamed))
                    self.planner.finished(len(route.streamed))
                    return
                except HandedOver as h:
                    self._migrate(job, Unavailable(str(h)), route)
                    self.stats.live_moves += 1
                    route.moved = h.moved
                except RETRYABLE as e:
                    if route.started:
                        self._migrate(job, e, route)
                        route.moved = None
                        continue
                    if isinstance(e, NoWorker) and refusals:
                        raise soonest(refusals) from e
                    if isinstance(e, ResourceExhausted):
                        refusals.append(e)
                    elif not isinstance(e, BookingFailed):
                        failures += 1
                    if failures > 1 or isinstance(e, NoWorker):
                        raise
                    self.stats.retries += 1
                    # A refusal for capacity is an answer (fast, expected under load).
                    full = isinstance(e, ResourceExhausted)
                    level = logging.DEBUG if full else logging.WARNING
                    log.log(level, "request %s: %s; retrying on another worker", job.request_id, e)
        except asyncio.CancelledError:
            # Our own Abort cancelled this task: the downstream calls are cancelled by now
            # (their workers free the blocks); end the stream cleanly for the caller, who would
            # otherwise never get a status for a handler that was cancelled under it.
            if task is None or job.request_id not in self._aborted:
                raise
            task.uncancel()
            self._tasks.pop(job.request_id, None)  # a second abort finds nothing to cancel
            yield Event(job.request_id, finish_reason="abort")
        finally:
            self._tasks.pop(job.request_id, None)
            self._aborted.discard(job.request_id)
            self._sending.discard(job.request_id)

    def _migrate(self, job: RouteJob, e: Exception, route: Route) -> None:
        """Decide on a stream whose worker failed after its first token (killed, or drained
        past its timeout): it goes on elsewhere from the prompt plus the tokens already sent,
        as Dynamo's migration does (re-prefill on the new decode worker, from its prefix cache
        where it has them), at most ``max_migrations`` times; else re-raise ``e`` as the
        stream's end. Only single-choice requests migrate."""
        why = ""
        streamed, done = route.streamed, route.migrations
        if isinstance(e, NoWorker):
            why = "no decode worker left"
        elif job.params.n != 1:
            why = "n > 1 is not migrated"
        elif done >= self.max_migrations:
            why = f"it already migrated {done} times (--max-migrations {self.max_migrations})"
        elif not streamed or len(streamed) >= job.params.max_tokens:
            why = "nothing to continue from"
        if why:
            raise Unavailable(f"request {job.request_id} lost its worker ({e}); {why}") from e
        self.stats.migrations += 1
        route.migrations += 1
        log.warning("request %s: %s after %d tokens; migrating (%d of at most %d)",
                    job.request_id, e, len(streamed), done + 1, self.max_migrations)  # fmt: skip

    async def _resume(self, job: RouteJob, route: Route):
        """Continue a migrated request on another decode worker: admitted already (it takes it
        past its bound), resumed from the tokens streamed; the deadline still applies. With a
        live move (``route.moved``) the new worker pulls the KV of the prompt and every
        streamed token but the last instead of computing it."""
        streamed, moved = route.streamed, route.moved
        plan = self.chooser.plan(job.route, route.failed)
        if plan is None:
            raise NoWorker("no live decode worker to continue on")
        live = moved is not None and moved.kv.num_tokens == len(job.prompt) + len(streamed) - 1
        log.info("request %s resumes on %s after %d tokens (%s)", job.request_id,
                 plan.decode.worker_id, len(streamed),
                 "its KV moves" if live else "recomputed")  # fmt: skip
        call = DecodeCall(job, admitted=True, resumed=list(streamed))
        if live and moved is not None:
            call.handle, call.generator_state = moved.kv, moved.generator_state
            call.first = Event(job.request_id, [streamed[-1]])
        async for ev in self._decode(plan.decode, call, route):
            yield ev

    async def _attempt(self, job: RouteJob, route: Route):
        plan = self.chooser.plan(job.route, route.failed)
        if plan is None:
            raise NoWorker("no live decode workers")
        self.stats.decisions[(self.policy.name, plan.reason)] += 1
        decision = plan.decision
        self._count(job, plan, route)
        log.info(
            "request %s (%d tokens): %s -> prefill %s, decode %s (%d blocks cached; %s)",
            job.request_id, len(job.prompt), plan.reason,
            plan.prefill.worker_id if plan.prefill else "-", plan.decode.worker_id,
            plan.cached_blocks, decision,
        )  # fmt: skip
        decode, prefill = plan.decode, plan.prefill
        backlogs = self.chooser.disagg.backlogs
        if prefill is None:
            async for ev in self._decode_only(decode, job, plan.uncached, route):
                yield ev
            return
        # Two-phase admission: book the decode side before the prefill, so a request whose
        # first token reaches the client is admitted for its whole life (a full decode pool
        # refuses it here, fast, while the client can still get a 429).
        await self._reserve(decode, job, route.failed)
        try:
            backlogs.add(prefill.worker_id, plan.uncached)
            try:
                reply = await self._prefill(prefill, job, route.failed)
            finally:
                backlogs.done(prefill.worker_id, plan.uncached)
        except asyncio.CancelledError:
            asyncio.ensure_future(self._unreserve(decode, job))
            raise
        except BaseException:
            await self._unreserve(decode, job)  # before a retry books again
            raise
        if reply.handle is None:  # every choice finished at its first token
            asyncio.ensure_future(self._unreserve(decode, job))
        route.started = True
        for first in reply.firsts:  # one per choice
            yield first
        if reply.handle is None:
            return
        call = DecodeCall(
            job, reply.handle, reply.first, reply.generator_state, reply.cached_tokens,
            reply.others, admitted=True,
        )  # fmt: skip
        handed = time.monotonic()  # the hand-off lasts until the decode worker's first event
        async for ev in self._decode_prefilled(decode, prefill, call, route):
            if handed:
                step = decode.load.decode_step_ms / 1000
                self.chooser.disagg.handed_off(plan.uncached, time.monotonic() - handed, step)
                handed = 0.0
            yield ev

    def _count(self, job: RouteJob, plan: Plan, route: Route) -> None:
        """Count ``plan``'s disagg decision and its prompt work (the planner's demand), and shed
        the request when its SLO gate says so (ResourceExhausted: a retry tries the other
        workers, if any)."""
        self.planner.routed(plan.uncached)
        decision = plan.decision
        if decision is None:
            return
        self.stats.disagg[(decision.choice, decision.reason)] += 1
        try:
            slo = self.chooser.disagg.slo(job.slo_ttft_ms, job.slo_tpot_ms)
            self.slo_gate.check(job, decision, slo)
        except ResourceExhausted:
            route.failed.update(m.worker_id for m in (plan.decode, plan.prefill) if m)
            raise

    async def _decode_only(self, decode: Member, job: RouteJob, uncached: int, route: Route):
        """Decode ``job`` on ``decode``, which computes its ``uncached`` prompt tokens itself:
        counted as queued there (`services.router.disagg.Backlogs`) until its first event."""
        backlogs = self.chooser.disagg.backlogs
        backlogs.add(decode.worker_id, uncached)
        pending = True
        try:
            async for ev in self._decode(decode, DecodeCall(job), route):
                if pending:
                    backlogs.done(decode.worker_id, uncached)
                    pending = False
                yield ev
        finally:
            if pending:
                backlogs.done(decode.worker_id, uncached)

    async def _decode_prefilled(self, decode, prefill, call: DecodeCall, route: Route):
        """Decode from prefilled KV. When the decode worker could not obtain the KV and fails
        with KVTransferFailed (its policy "retry"), prefill again on another prefill worker and
        decode from that KV; the first token, already streamed, and its generator state stay."""
        job, failed = call.job, route.failed
        moved = False  # already moved to another decode worker once
        while True:
            handle = call.handle
            assert handle is not None
            keep = False  # the next attempt decodes from this same KV
            sent = 0
            try:
                async for ev in self._decode(decode, call, route):
                    sent += 1
                    yield ev
                return
            except RETRYABLE as e:
                # The decode worker failed (dead, not yet out of the member view, or full)
                # before sending a token: the client has only the first token, so another
                # decode worker continues from the same KV, which prefill still holds.
                plan = None if sent or moved else self.chooser.plan(job.route, failed)
                if plan is None:
                    raise
                decode, moved, keep = plan.decode, True, True
                self.stats.retries += 1
                log.warning("request %s: %s; decoding on %s instead", job.request_id, e,
                            decode.worker_id)  # fmt: skip
            except KVTransferFailed as e:
                sent = -1  # the decode worker took the handle (and released the blocks)
                failed.add(prefill.worker_id)
                prefill = self.chooser.pick_prefill(job.route, failed, decode)
                if prefill is None:
                    raise Unavailable(f"{e}; no other prefill worker to retry on") from e
                self.stats.retries += 1
                log.warning("request %s: %s; prefilling again on %s", job.request_id, e,
                            prefill.worker_id)  # fmt: skip
                reply = await self._prefill(prefill, job, failed)
                if reply.handle is None:
                    raise Unavailable(f"{e}; the retried prefill kept no KV") from e
                call = DecodeCall(
                    job,
                    reply.handle,
                    call.first,
                    call.generator_state,
                    call.cached_tokens,
                    call.others,
                    admitted=True,
                )
            finally:
                # The decode worker releases KV it took (its first event comes after it has the
                # blocks or gave up on them; KVTransferFailed says it gave up); free them here
                # only when no decode worker took them (cancelled, or failed before it got the
                # call), unless another decode worker is about to take the same KV.
                if not keep and not sent:
                    asyncio.ensure_future(self.clients.release(handle, job.request_id))

    def _book(
        self, worker: Member, job: RouteJob, failed: set[str], force: bool, cost: int | None = None
    ) -> None:
        """Count ``job`` (at ``cost``, `DecodeAdmission.book`) on ``worker``, or refuse it here,
        with no call, when it cannot fit there; the worker decides for what may fit."""
        try:
            self.admission.book(worker, job, force, cost)
        except ResourceExhausted:
            failed.add(worker.worker_id)
            raise

    async def _reserve(self, worker: Member, job: RouteJob, failed: set[str]) -> None:
        self._book(worker, job, failed, force=False)
        try:
            await self.clients.reserve(worker, job, job.time_left(RESERVATION_LEASE_S) or 0.0)
        except ResourceExhausted as e:
            self.admission.refused(worker, job, e)
            failed.add(worker.worker_id)
            raise
        except BaseException as e:
            self.admission.failed(worker, job)
            if not isinstance(e, Unavailable):
                raise
            failed.add(worker.worker_id)
            raise BookingFailed(str(e)) from e

    async def _unreserve(self, worker: Member, job: RouteJob) -> None:
        self.admission.released(worker, job)
        await self.clients.unreserve(worker, job.request_id)

    async def _prefill(self, worker: Member, job: RouteJob, failed: set[str]) -> PrefillReply:
        with self.chooser.working(worker, job.cost):
            try:
                return await self.clients.prefill(worker, job)
            except ResourceExhausted as e:
                failed.add(worker.worker_id)
                # Its room counts prompt tokens: not the room a caller's request needs.
                raise ResourceExhausted(str(e), e.retry_after_ms) from e
            except RETRYABLE:
                failed.add(worker.worker_id)
                raise

    async def _decode(self, worker: Member, call: DecodeCall, route: Route):
        """Decode ``call`` on ``worker``: booked there (`_book`; a reserved one already is; one
        not admitted yet, decode-only, may be refused here), and given back when the call ends,
        however it ends, unless the worker refused it."""
        job, cost = call.job, call.cost  # a migrated call books what it brings
        failed = route.failed
        self._book(worker, job, failed, force=call.admitted, cost=cost)
        self.stats.legs["gateway" if job.legs else "router"] += 1
        took = True
        with self.chooser.working(worker, cost):
            try:
                async for ev in (job.legs or self.clients).decode(worker, call):
                    if ev.moved is not None:  # draining: not to be picked again for this one
                        failed.add(worker.worker_id)
                        raise HandedOver(ev.moved)
                    route.started = True
                    yield ev
            except ResourceExhausted as e:
                took = False
                self.admission.refused(worker, job, e)
                failed.add(worker.worker_id)
                raise
            except RETRYABLE:
                failed.add(worker.worker_id)
                raise
            finally:
                if took:
                    self.admission.released(worker, job, cost)

    def abort(self, request_id: str) -> bool:
        """Cancel a running request; the cancellation reaches every worker it touched, and
        the stream ends with an abort event. While the handler is in gRPC's send of an event
        (between two of `generate`'s yields), the cancel waits until `generate` resumes: a
        cancel landing in gRPC's own code ends the RPC with no status at all, and the client
        would wait for its deadline."""
        task = self._tasks.get(request_id)
        if task is None:
            return False
        self._aborted.add(request_id)
        if request_id not in self._sending:
            task.cancel()
        return True

    async def close(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
