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
    TokenLedger,
)
from services.common.codec import Event
from services.common.errors import ResourceExhausted, Unavailable
from services.router.core import RouteJob, RouterCore
from tests.test_router_core import Directory, member


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
    """The slice of AsyncEngine a PrefillCore uses; records what reached it."""

    def __init__(self) -> None:
        self.engine = self
        self.added: list[tuple[str, int]] = []

    async def generate(self, request_id, prompt, params, **kw):
        self.added.append((request_id, kw["priority"]))
        yield type("Out", (), {"kv_held": False, "index": 0})()


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
