"""The router refusing locally, with no call, what cannot fit on a decode worker (issue 18's
fast 429s): its own bookings against the bound a worker publishes, and the worker's last
refusal (`services.router.admission`), with fake workers whose admission is a real ledger."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine.sampling_params import SamplingParams
from libkv.cluster.registry import Member
from services.common.admission import (
    BOUND_KEY,
    DEFAULT_RETRY_AFTER_MS,
    MIN_RETRY_AFTER_MS,
    TokenLedger,
    bound_record,
)
from services.common.codec import Event
from services.common.errors import ResourceExhausted
from services.router.admission import DecodeAdmission
from services.router.calls import PrefillReply, RouteJob
from services.router.core import RouterCore
from tests.services.test_admission import Clock
from tests.services.test_router_core import HANDLE, Directory, member

LIMIT = 100  # each fake decode worker's admission bound, in tokens


def bounded(worker_id: str, limit: int | None = LIMIT, **kw) -> Member:
    """A decode worker as etcd lists it, with its admission bound when ``limit`` is given."""
    m = member(worker_id, "decode", **kw)
    extra = {BOUND_KEY: bound_record(TokenLedger(limit))} if limit is not None else {}
    return dataclasses.replace(m, extra=extra)


def job(rid: str, prompt: int = 10, max_tokens: int = 20, priority: str = "interactive"):
    return RouteJob(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens),
                    priority=priority)  # fmt: skip


class Workers:
    """Decode workers with real ledgers of ``LIMIT`` tokens (``others``: tokens that callers
    other than this router hold there); a request holds its tokens until `finish` ends it."""

    def __init__(self, others: dict[str, int] | None = None) -> None:
        self.ledgers: dict[str, TokenLedger] = {}
        self.others = others or {}
        self.calls: list[tuple[str, str, str]] = []  # (kind, worker, request)
        self.done: dict[str, asyncio.Event] = {}

    def ledger(self, worker: Member) -> TokenLedger:
        if worker.worker_id not in self.ledgers:
            ledger = TokenLedger(LIMIT, name=f"decode worker {worker.worker_id}")
            if self.others.get(worker.worker_id):
                ledger.admit("someone-else", self.others[worker.worker_id])
            self.ledgers[worker.worker_id] = ledger
        return self.ledgers[worker.worker_id]

    def finish(self, rid: str) -> None:
        self.done.setdefault(rid, asyncio.Event()).set()

    async def decode(self, worker, call):
        rid = call.job.request_id
        self.calls.append(("decode", worker.worker_id, rid))
        ledger = self.ledger(worker)
        if rid not in ledger.inflight:  # else it took its reservation
            ledger.admit(rid, call.job.cost, call.job.priority, force=call.admitted)
        try:
            yield Event(rid, [1], "a")
            await self.done.setdefault(rid, asyncio.Event()).wait()
            yield Event(rid, [2], "b", finish_reason="length")
        finally:
            ledger.release(rid)

    async def reserve(self, worker, job, lease):
        self.calls.append(("reserve", worker.worker_id, job.request_id))
        self.ledger(worker).admit(job.request_id, job.cost, job.priority)

    async def unreserve(self, worker, request_id):
        self.calls.append(("unreserve", worker.worker_id, request_id))
        self.ledger(worker).release(request_id)

    async def prefill(self, worker, job):
        self.calls.append(("prefill", worker.worker_id, job.request_id))
        return PrefillReply(Event(job.request_id, [7], "x"), HANDLE)

    async def release(self, handle, request_id):
        pass


async def start(core: RouterCore, j: RouteJob) -> tuple[asyncio.Task, asyncio.Queue]:
    """Run ``j`` until its first event; the task finishes the stream once the worker ends it."""
    first: asyncio.Queue = asyncio.Queue()

    async def run():
        out = []
        async for ev in core.generate(j):
            out.append(ev)
            if len(out) == 1:
                first.put_nowait(ev)
        return out

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.get(), 5)
    return task, first


async def refused(core: RouterCore, j: RouteJob) -> ResourceExhausted:
    with pytest.raises(ResourceExhausted) as e:
        _ = [ev async for ev in core.generate(j)]
    return e.value


# -- DecodeAdmission on its own --------------------------------------------------------------


def test_own_bookings_refuse_what_cannot_fit_beside_them() -> None:
    clock = Clock()
    adm = DecodeAdmission(refusal_memory=0.0, clock=clock)
    d0 = bounded("d0")
    adm.book(d0, job("a", 30, 30))  # 60
    adm.book(d0, job("a", 30, 30))  # booking it again (its Generate after a Reserve): no change
    adm.book(d0, job("b", 10, 30))  # 100: exactly the bound
    with pytest.raises(ResourceExhausted, match="100 tokens in flight \\+ 2 requested") as e:
        adm.book(d0, job("c", 1, 1))
    assert e.value.room_tokens == 0 and e.value.retry_after_ms == DEFAULT_RETRY_AFTER_MS
    adm.book(d0, job("migrated", 40, 40), force=True)  # streamed tokens elsewhere: never refused
    adm.released(d0, job("migrated", 40, 40))
    adm.released(d0, job("a", 30, 30))  # 140 tokens back at t=100
    clock.now += 2.0
    adm.book(d0, job("c", 30, 30))  # fits again
    with pytest.raises(ResourceExhausted) as e:
        adm.book(d0, job("d", 40, 40))  # 100 + 80 > 100: 80 excess at 70 tokens/s
    assert e.value.retry_after_ms == 1143
    assert adm.local_refusals == 2


def test_a_call_the_worker_refused_or_never_got_frees_nothing_there() -> None:
    adm = DecodeAdmission(refusal_memory=0.0)
    d0 = bounded("d0")
    adm.book(d0, job("a", 50, 50))
    adm.failed(d0, job("a", 50, 50))  # unreachable: uncounted
    adm.book(d0, job("b", 50, 50))
    adm.refused(d0, job("b", 50, 50), ResourceExhausted("full", 500, room_tokens=0))
    adm.book(d0, job("c", 50, 50))  # nothing of ours is there: fits by our count...
    ledger = adm._ledgers[("d0", d0.incarnation)]
    assert ledger is not None and ledger.pending_tokens == 100
    assert not ledger._returned  # ...and neither counted as tokens given back


def test_a_refusal_is_remembered_for_its_retry_after_at_most_and_releases_make_room() -> None:
    clock = Clock()
    adm = DecodeAdmission(refusal_memory=1.0, clock=clock)
    d0 = bounded("d0", limit=None)  # no published bound: only what the worker said counts
    adm.book(d0, job("a", 20, 20))
    adm.refused(d0, job("a", 20, 20), ResourceExhausted("full", 400, room_tokens=30))
    with pytest.raises(ResourceExhausted, match="40 tokens requested > 30 free") as e:
        adm.book(d0, job("b", 20, 20))
    assert e.value.room_tokens == 30 and e.value.retry_after_ms == 400
    adm.book(d0, job("small", 10, 20))  # fits in the room it said: the worker decides
    clock.now += 0.3
    with pytest.raises(ResourceExhausted) as e:
        adm.book(d0, job("b", 20, 20))
    assert e.value.retry_after_ms == 100  # what is left of the worker's estimate
    adm.book(d0, job("batch", 20, 20, "batch"))  # another priority: nothing known about it
    adm.released(d0, job("old", 5, 5))  # one of ours ended there: 10 more room
    adm.book(d0, job("b", 20, 20))
    adm.refused(d0, job("c", 30, 30), ResourceExhausted("full", 5000, room_tokens=0))
    clock.now += 0.999
    with pytest.raises(ResourceExhausted) as e:
        adm.book(d0, job("d", 1, 1))
    assert e.value.retry_after_ms == 4001
    clock.now += 0.002  # past refusal_memory: the worker is asked again
    adm.book(d0, job("d", 1, 1))


def test_a_restarted_worker_starts_with_a_clean_view() -> None:
    adm = DecodeAdmission(refusal_memory=5.0)
    d0 = bounded("d0")
    adm.book(d0, job("a", 50, 50))
    adm.refused(d0, job("b", 50, 50), ResourceExhausted("full", 5000, room_tokens=0))
    with pytest.raises(ResourceExhausted):
        adm.book(d0, job("c", 1, 1))
    restarted = dataclasses.replace(d0, incarnation="new")
    adm.book(restarted, job("c", 25, 25))  # neither the old bookings nor the refusal count
    adm.book(restarted, job("d", 25, 25))
    assert list(adm._ledgers) == [("d0", d0.incarnation), ("d0", "new")]  # a still runs there


# -- the router core: refused with no call ---------------------------------------------------


async def test_decode_only_requests_are_refused_without_a_call_once_its_bookings_fill() -> None:
    workers = Workers()
    core = RouterCore(Directory([bounded("d0")]), workers, refusal_memory=1.0)
    running = [await start(core, job(f"r{i}", 10, 20)) for i in range(3)]  # 90 of 100 tokens
    calls = len(workers.calls)
    e = await refused(core, job("x", 10, 20))
    assert len(workers.calls) == calls  # no call reached the worker
    assert e.room_tokens == 10 and e.retry_after_ms == DEFAULT_RETRY_AFTER_MS
    assert core.admission.local_refusals == 1
    small = await start(core, job("small", 5, 5))  # fits in the room left: the worker takes it
    workers.finish("r0")
    await asyncio.wait_for(running[0][0], 5)
    more = await start(core, job("x", 10, 20))  # r0's tokens are back
    assert workers.ledgers["d0"].pending_tokens == 100
    for rid in ("r1", "r2", "small", "x"):
        workers.finish(rid)
    for task, _ in [*running[1:], small, more]:
        await asyncio.wait_for(task, 5)
    assert workers.ledgers["d0"].pending_tokens == 0
    ours = core.admission._ledgers[("d0", core.directory.members[0].incarnation)]
    assert ours is not None and ours.pending_tokens == 0  # its view ends where the worker's does


async def test_a_worker_full_of_other_routers_requests_is_asked_once_then_remembered() -> None:
    workers = Workers(others={"d0": 90})
    core = RouterCore(Directory([bounded("d0")]), workers, refusal_memory=1.0)
    e = await refused(core, job("a", 10, 20))
    assert e.room_tokens == 10 and workers.calls == [("decode", "d0", "a")]
    for i in range(5):
        await refused(core, job(f"b{i}", 10, 20))
    assert workers.calls == [("decode", "d0", "a")]  # the rest were refused here
    await asyncio.wait_for(start(core, job("small", 2, 8)), 5)  # fits the room: asked, taken
    assert workers.calls[-1] == ("decode", "d0", "small")
    workers.finish("small")


async def test_with_refusal_memory_off_every_request_still_asks_the_worker() -> None:
    workers = Workers(others={"d0": 90})
    core = RouterCore(Directory([bounded("d0", limit=None)]), workers, refusal_memory=0.0)
    for i in range(3):
        await refused(core, job(f"a{i}", 10, 20))
    assert [c[2] for c in workers.calls] == ["a0", "a1", "a2"]


async def test_a_full_worker_is_skipped_without_a_call_for_one_with_room() -> None:
    workers = Workers(others={"d1": 0})
    decoders = [bounded("d0"), bounded("d1", queue=5)]  # d0 is preferred while it has room
    core = RouterCore(Directory(decoders), workers, refusal_memory=1.0)
    first = [await start(core, job(f"r{i}", 30, 20)) for i in range(2)]  # 100 on d0
    task, _ = await start(core, job("next", 30, 20))
    assert workers.calls[-1] == ("decode", "d1", "next")
    assert ("decode", "d0", "next") not in workers.calls  # d0 was never asked
    for rid in ("r0", "r1", "next"):
        workers.finish(rid)
    for t in [task, *(t for t, _ in first)]:
        await asyncio.wait_for(t, 5)


async def test_the_decode_booking_before_a_prefill_is_refused_locally_too() -> None:
    workers = Workers()
    decoders = [bounded("d0"), member("p0", "prefill")]
    core = RouterCore(Directory(decoders), workers, refusal_memory=1.0)
    long = [await start(core, job(f"r{i}", 300, 20)) for i in range(1)]  # one of 320 tokens
    assert workers.calls[:2] == [("reserve", "d0", "r0"), ("prefill", "p0", "r0")]
    calls = len(workers.calls)
    e = await refused(core, job("x", 300, 20))
    assert len(workers.calls) == calls and e.room_tokens == 0  # no Reserve, no prefill
    workers.finish("r0")
    await asyncio.wait_for(long[0][0], 5)
    await asyncio.wait_for(start(core, job("y", 300, 20)), 5)
    assert workers.calls[-3:-1] == [("reserve", "d0", "y"), ("prefill", "p0", "y")]
    workers.finish("y")


async def test_the_callers_refusal_carries_the_largest_room_of_all_workers() -> None:
    workers = Workers(others={"d0": 90, "d1": 70})
    core = RouterCore(Directory([bounded("d0"), bounded("d1")]), workers, refusal_memory=1.0)
    e = await refused(core, job("a", 20, 20))
    assert e.room_tokens == 30 and "all 2 workers" in str(e)
    assert e.retry_after_ms is not None and e.retry_after_ms >= MIN_RETRY_AFTER_MS
