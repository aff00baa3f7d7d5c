"""Admission control in isolation: the token ledger (workers and gateway), priority order in the
engine's scheduler, and the router trying every worker when they refuse for capacity."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from libkv.block_pool import BlockPool
from libkv.kv_manager import KVCacheManager
from services.common.admission import (
    DEFAULT_RETRY_AFTER_MS,
    MAX_RETRY_AFTER_MS,
    MIN_RETRY_AFTER_MS,
    RefusalMemory,
    TokenLedger,
    bound_record,
    ledger_like,
)
from services.common.codec import Event
from services.common.errors import ResourceExhausted, Unavailable
from services.router.calls import PrefillReply, RouteJob
from services.router.core import RouterCore
from tests.services.test_router_core import HANDLE, Directory, member


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_ledger_counts_tokens_not_requests() -> None:
    ledger = TokenLedger(1000, batch_fraction=0.5)
    ledger.admit("a", 600)
    ledger.admit("b", 400)  # exactly at the bound
    assert ledger.pending_tokens == 1000
    with pytest.raises(ResourceExhausted, match="1000 tokens in flight \\+ 1 requested"):
        ledger.admit("c", 1)
    ledger.release("a")
    ledger.release("a")  # idempotent
    assert ledger.pending_tokens == 400
    for i in range(60):  # many small requests fit where one large one did not
        ledger.admit(f"s{i}", 10)
    assert ledger.pending_tokens == 1000 and len(ledger.inflight) == 61


def test_batch_is_refused_first_and_interactive_keeps_the_rest() -> None:
    ledger = TokenLedger(1000, batch_fraction=0.5)
    ledger.admit("i1", 400)
    ledger.admit("b1", 100, "batch")  # 500 <= 500
    with pytest.raises(ResourceExhausted, match="batch"):
        ledger.admit("b2", 1, "batch")
    ledger.admit("i2", 500)  # interactive still fits up to 1000
    assert ledger.refused == {"interactive": 0, "batch": 1}
    with pytest.raises(ValueError):
        ledger.admit("x", 1, "urgent")


def test_an_empty_ledger_admits_anything_and_zero_means_unbounded() -> None:
    ledger = TokenLedger(100)
    ledger.admit("huge", 10_000, "batch")  # alone it never waits for itself
    with pytest.raises(ResourceExhausted):
        ledger.admit("next", 1)
    unbounded = TokenLedger(0)
    for i in range(10):
        unbounded.admit(str(i), 10**9)


def test_retry_after_follows_the_rate_tokens_come_back() -> None:
    clock = Clock()
    ledger = TokenLedger(1000, clock=clock)
    ledger.admit("a", 1000)
    with pytest.raises(ResourceExhausted) as e:
        ledger.admit("b", 500)
    assert e.value.retry_after_ms == DEFAULT_RETRY_AFTER_MS  # nothing returned yet
    ledger.release("a")  # 1000 tokens back at t=100
    ledger.admit("c", 1000)
    clock.now += 2.0  # 1000 tokens over 2 s: 500 tokens/s
    with pytest.raises(ResourceExhausted) as e:
        ledger.admit("d", 250)  # 250 over the bound: half a second
    assert e.value.retry_after_ms == 500
    assert ledger.retry_after_ms(1) == MIN_RETRY_AFTER_MS
    assert ledger.retry_after_ms(10**9) == MAX_RETRY_AFTER_MS
    clock.now += 60  # the rate window forgets old returns
    assert ledger.retry_after_ms(250) == DEFAULT_RETRY_AFTER_MS


def test_hold_releases_on_error() -> None:
    ledger = TokenLedger(100)
    with pytest.raises(RuntimeError), ledger.hold("a", 50):
        assert ledger.pending_tokens == 50
        raise RuntimeError("engine failed")
    assert ledger.pending_tokens == 0 and not ledger.inflight


# --- priority in the engine's scheduler ---------------------------------------------------------


def _seq(rid: str, priority: int, n: int = 4) -> Sequence:
    base = 1000 * (ord(rid[0]) + len(rid))
    seq = Sequence(rid, list(range(base, base + n)), SamplingParams(max_tokens=8), 0)
    seq.priority = priority
    return seq


def test_interactive_is_queued_ahead_of_batch_in_arrival_order() -> None:
    sched = Scheduler(KVCacheManager(BlockPool(64, 4)), max_num_seqs=8, max_num_batched_tokens=64)
    for rid, prio in [("b1", 1), ("i1", 0), ("b2", 1), ("i2", 0)]:
        sched.add(_seq(rid, prio))
    assert [s.request_id for s in sched.waiting] == ["i1", "i2", "b1", "b2"]


def test_a_batch_sequence_is_preempted_before_a_newer_interactive_one() -> None:
    # 4 blocks of 4 tokens: two prompts of 7 tokens fill the pool; the next decode of the older
    # one needs a third block, so one is preempted: the batch one, although it is the older.
    sched = Scheduler(KVCacheManager(BlockPool(4, 4)), max_num_seqs=8, max_num_batched_tokens=64)
    batch, inter = _seq("batch", 1, n=7), _seq("inter", 0, n=7)
    sched.add(batch)
    for seq in (batch, inter):
        out = sched.schedule()
        sched.advance(out.scheduled)
        for s in out.scheduled:
            s.seq.output_token_ids.append(1)
        if seq is batch:
            sched.add(inter)
    assert [s.request_id for s in sched.running] == ["batch", "inter"]
    assert sched.kv.pool.num_free == 0
    out = sched.schedule()
    assert out.preempted == [batch] and list(sched.waiting) == [batch]
    out = sched.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["inter"]


# --- the router tries every worker while they refuse for capacity -------------------------------


class Refusing:
    """Decode workers in ``full`` refuse with ResourceExhausted (retry-after per worker)."""

    def __init__(self, full: dict[str, int], down: set[str] = frozenset()) -> None:
        self.full, self.down = full, set(down)
        self.calls: list[str] = []

    async def prefill(self, worker, job):
        raise AssertionError("short prompts go decode-only")

    async def decode(self, worker, call):
        self.calls.append(worker.worker_id)
        if worker.worker_id in self.full:
            raise ResourceExhausted("full", retry_after_ms=self.full[worker.worker_id])
        if worker.worker_id in self.down:
            raise Unavailable("down")
        yield Event(call.job.request_id, [9], "z", finish_reason="length")

    async def release(self, handle, request_id):
        pass


def _job() -> RouteJob:
    return RouteJob("r1", [1, 2, 3], SamplingParams(max_tokens=3))


async def test_router_tries_every_worker_that_refuses_for_capacity() -> None:
    decoders = [member(f"d{i}", "decode", queue=i) for i in range(4)]
    clients = Refusing({"d0": 900, "d1": 300, "d2": 700})
    core = RouterCore(Directory(decoders), clients)
    events = [ev async for ev in core.generate(_job())]
    assert clients.calls == ["d0", "d1", "d2", "d3"]  # refusals do not use up the one retry
    assert events[-1].finish_reason == "length"


async def test_router_raises_the_soonest_refusal_when_all_are_full() -> None:
    decoders = [member(f"d{i}", "decode", queue=i) for i in range(3)]
    clients = Refusing({"d0": 900, "d1": 300, "d2": 700})
    core = RouterCore(Directory(decoders), clients)
    with pytest.raises(ResourceExhausted, match="all 3 workers") as e:
        _ = [ev async for ev in core.generate(_job())]
    assert e.value.retry_after_ms == 300
    assert clients.calls == ["d0", "d1", "d2"]


async def test_router_still_retries_a_dead_worker_only_once() -> None:
    decoders = [member(f"d{i}", "decode", queue=i) for i in range(3)]
    clients = Refusing({}, down={"d0", "d1"})
    core = RouterCore(Directory(decoders), clients)
    with pytest.raises(Unavailable):
        _ = [ev async for ev in core.generate(_job())]
    assert clients.calls == ["d0", "d1"]


# --- a worker core refuses before touching its engine -------------------------------------------


class _Engine:
    """The slice of EngineClient a PrefillCore uses; records what reached it."""

    def __init__(self) -> None:
        self.engine = self
        self.added: list[tuple[str, int]] = []

    async def generate(self, request_id, prompt, params, **kw):
        self.added.append((request_id, kw["priority"]))
        yield type("Out", (), {"kv_held": False, "index": 0, "handoff": None})()


async def test_prefill_core_admits_in_prompt_tokens_and_passes_priority() -> None:
    from services.prefill.core import PrefillCore

    engine = _Engine()
    core = PrefillCore(engine, "p0", "inc", 30.0, TokenLedger(100, batch_fraction=0.5))
    params = SamplingParams(max_tokens=1000)  # prefill books the prompt only
    core.ledger.admit("other", 60)
    result = await core.prefill("a", list(range(40)), params, "t", "interactive")
    assert result.handle is None and core.ledger.pending_tokens == 60  # released again
    with pytest.raises(ResourceExhausted) as e:
        await core.prefill("b", list(range(41)), params, "t", "interactive")
    assert e.value.retry_after_ms is not None
    with pytest.raises(ResourceExhausted):
        await core.prefill("c", list(range(1)), params, "t", "batch")  # 61 > 50
    assert engine.added == [("a", 0)]  # refused requests never reached the engine
    core.ledger.release("other")
    await core.prefill("d", list(range(10)), params, "t", "batch")
    assert engine.added[-1] == ("d", 1)


# --- two-phase admission: decode capacity is booked before the prefill ----------------------


class Booking(Refusing):
    """Prefill-and-decode routing; decode workers in ``full`` refuse the booking."""

    def __init__(self, full: dict[str, int], prefill_down: bool = False) -> None:
        super().__init__(full)
        self.prefill_down = prefill_down
        self.log: list[tuple[str, str]] = []

    async def reserve(self, worker, job, lease):
        self.log.append(("reserve", worker.worker_id))
        assert lease > 0 and job.cost == len(job.prompt) + job.params.max_tokens
        if worker.worker_id in self.full:
            raise ResourceExhausted("full", retry_after_ms=self.full[worker.worker_id])

    async def unreserve(self, worker, request_id):
        self.log.append(("unreserve", worker.worker_id))

    async def prefill(self, worker, job):
        self.log.append(("prefill", worker.worker_id))
        if self.prefill_down:
            raise Unavailable("prefill down")
        return PrefillReply(Event(job.request_id, [7], "x"), HANDLE)

    async def decode(self, worker, call):
        self.log.append(("decode" if call.admitted else "decode-unbooked", worker.worker_id))
        yield Event(call.job.request_id, [9], "z", finish_reason="length")


def _long_job() -> RouteJob:
    return RouteJob("r1", list(range(300)), SamplingParams(max_tokens=3))


async def test_decode_is_booked_before_the_prefill_and_a_full_pool_is_refused_first() -> None:
    workers = [member("p0", "prefill"), member("d0", "decode"), member("d1", "decode", queue=1)]
    clients = Booking({"d0": 500})
    events = [ev async for ev in RouterCore(Directory(workers), clients).generate(_long_job())]
    assert [e.token_ids for e in events] == [[7], [9]]
    assert clients.log == [("reserve", "d0"), ("reserve", "d1"), ("prefill", "p0"),
                           ("decode", "d1")]  # fmt: skip
    # Every decode worker full: refused before any prefill work, with the soonest retry.
    clients = Booking({"d0": 500, "d1": 200})
    with pytest.raises(ResourceExhausted) as e:
        _ = [ev async for ev in RouterCore(Directory(workers), clients).generate(_long_job())]
    assert e.value.retry_after_ms == 200
    assert clients.log == [("reserve", "d0"), ("reserve", "d1")]


async def test_a_failed_prefill_drops_its_booking() -> None:
    workers = [member("p0", "prefill"), member("d0", "decode")]
    clients = Booking({}, prefill_down=True)
    events = [ev async for ev in RouterCore(Directory(workers), clients).generate(_long_job())]
    assert events[-1].finish_reason == "length"
    # Dropped before the retry, which goes decode-only (no prefill worker left) and books at
    # the decode worker's own admission.
    assert clients.log == [("reserve", "d0"), ("prefill", "p0"), ("unreserve", "d0"),
                           ("decode-unbooked", "d0")]  # fmt: skip


class _DecodeEngine:
    """The slice of EngineClient a decode-only DecodeCore uses."""

    async def generate(self, request_id, prompt, params, **kw):
        yield f"out-{request_id}"


async def test_decode_core_takes_its_booking_and_a_started_stream_past_the_bound() -> None:
    from services.decode.core import DecodeCore, DecodeJob

    core = DecodeCore(_DecodeEngine(), None, "d0", "inc", ledger=TokenLedger(100))  # type: ignore[arg-type]
    core.reserve("a", 80, "interactive", lease=30)
    core.reserve("a", 80, "interactive", lease=30)  # a retried call renews, books once
    assert core.ledger.pending_tokens == 80 and core.num_reserved == 1
    with pytest.raises(ResourceExhausted):
        core.reserve("b", 30, "interactive", lease=30)
    job = DecodeJob("a", list(range(70)), SamplingParams(max_tokens=10))
    assert [o async for o in core.generate(job)] == ["out-a"]  # took the booking: no refusal
    assert core.ledger.pending_tokens == 0 and core.num_reserved == 0
    core.reserve("c", 90, "interactive", lease=30)
    # A request that streamed tokens elsewhere (migrated, or its booking lapsed) is never
    # refused for capacity; an unbooked new one is.
    started = DecodeJob("s", list(range(40)), SamplingParams(max_tokens=10), admitted=True)
    assert [o async for o in core.generate(started)] == ["out-s"]
    with pytest.raises(ResourceExhausted):
        _ = [o async for o in core.generate(DecodeJob("n", [1], SamplingParams(max_tokens=20)))]
    assert core.unreserve("c") and core.ledger.pending_tokens == 0


def test_an_unused_booking_lapses() -> None:
    from services.decode.core import DecodeCore

    core = DecodeCore(None, None, "d0", "inc", ledger=TokenLedger(100))  # type: ignore[arg-type]
    core.reserve("a", 90, "interactive", lease=0.0)
    core.reserve("b", 90, "interactive", lease=30)  # a's lease is over: it was released
    assert list(core.ledger.inflight) == ["b"]


async def test_an_unreachable_decode_worker_fails_its_booking_without_using_the_retry() -> None:
    """A dead decode worker still in the member view fails the booking, before any prefill:
    the next decode worker is booked, and a prefill failure after that still gets its retry."""

    class DeadD0(Booking):
        async def reserve(self, worker, job, lease):
            self.log.append(("reserve", worker.worker_id))
            if worker.worker_id == "d0":
                raise Unavailable("d0 unreachable")

        async def prefill(self, worker, job):
            self.log.append(("prefill", worker.worker_id))
            if worker.worker_id == "p0":
                raise Unavailable("p0 down")
            return PrefillReply(Event(job.request_id, [7], "x"), HANDLE)

    workers = [member("p0", "prefill"), member("p1", "prefill", queue=1),
               member("d0", "decode"), member("d1", "decode", queue=1)]  # fmt: skip
    clients = DeadD0({})
    core = RouterCore(Directory(workers), clients)
    events = [ev async for ev in core.generate(_long_job())]
    assert [e.token_ids for e in events] == [[7], [9]]
    assert clients.log == [("reserve", "d0"), ("reserve", "d1"), ("prefill", "p0"),
                           ("unreserve", "d1"), ("reserve", "d1"), ("prefill", "p1"),
                           ("decode", "d1")]  # fmt: skip


# --- what a refusal says about the room left, and who remembers it ------------------------------


def test_a_refusal_says_the_room_left_and_a_cancel_is_not_a_release() -> None:
    clock = Clock()
    ledger = TokenLedger(1000, batch_fraction=0.5, clock=clock)
    ledger.admit("a", 700)
    with pytest.raises(ResourceExhausted) as e:
        ledger.admit("b", 400)
    assert e.value.room_tokens == 300
    with pytest.raises(ResourceExhausted) as e:
        ledger.admit("c", 1, "batch")
    assert e.value.room_tokens == 0  # batch stops at 500
    ledger.cancel("a")
    ledger.cancel("a")  # idempotent
    assert ledger.pending_tokens == 0 and ledger.retry_after_ms(1) == DEFAULT_RETRY_AFTER_MS


def test_a_workers_bound_travels_in_its_member_record() -> None:
    record = bound_record(TokenLedger(5824, batch_fraction=0.25))
    copy = ledger_like(record, "decode worker d0 (as a router booked it)")
    assert copy is not None and (copy.max_tokens, copy.batch_fraction) == (5824, 0.25)
    assert not copy.inflight
    for bad in (None, "", "{", "[]", '{"max_tokens": 10}', bound_record(TokenLedger(0))):
        assert ledger_like(bad, "x") is None  # absent, not one, or unbounded: nothing to book


def test_refusal_memory_remembers_the_room_until_the_wait_or_ttl_and_adds_releases() -> None:
    clock = Clock()
    memory = RefusalMemory(2.0, clock)
    memory.refused("w", "interactive", None, 500)  # no room said: nothing to go by
    memory.check("w", "interactive", 10**9, "w")
    memory.refused("w", "interactive", 100, 5000)
    memory.check("w", "interactive", 100, "w")
    with pytest.raises(ResourceExhausted, match="101 tokens requested > 100 free") as e:
        memory.check("w", "interactive", 101, "worker w")
    assert (e.value.retry_after_ms, e.value.room_tokens) == (5000, 100)
    memory.check("w", "batch", 10**9, "w")  # nothing known for another kind
    memory.check("v", "interactive", 10**9, "w")  # nor for another scope
    memory.released("w", 20)
    memory.check("w", "interactive", 120, "w")
    clock.now += 1.5
    with pytest.raises(ResourceExhausted) as e:
        memory.check("w", "interactive", 121, "w")
    assert e.value.retry_after_ms == 3500
    clock.now += 0.5  # ttl (2 s) comes before the refuser's 5 s
    memory.check("w", "interactive", 10**9, "w")
    memory.refused("w", "interactive", 0, 50)
    clock.now += 0.049
    with pytest.raises(ResourceExhausted) as e:
        memory.check("w", "interactive", 1, "w")
    assert e.value.retry_after_ms == MIN_RETRY_AFTER_MS  # never below the floor
    memory.forget("w")
    memory.check("w", "interactive", 1, "w")
    off = RefusalMemory(0.0, clock)
    off.refused("w", "interactive", 0, 5000)
    off.check("w", "interactive", 10**9, "w")
    with pytest.raises(ValueError):
        RefusalMemory(-1.0)
