"""Tests of engine.scheduler driven without a model: chunked prefill, prefix hits, preemption.

``step`` plays the engine: it schedules, notes which sequences sample *before* advancing (the
chunk's ``samples`` flag reads ``num_computed``), advances, appends a fake token to each due
sequence and finishes those that reached ``max_tokens``.
"""

from __future__ import annotations

import itertools
import random
import zlib
from typing import NamedTuple

import pytest

from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import FinishReason, SeqStatus, Sequence
from libkv.block_pool import BlockPool
from libkv.kv_manager import CopyOp, KVCacheManager

Trace = list[tuple[str, int]]
_arrivals = itertools.count()


def make_scheduler(
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 64,
    prefix_caching: bool = True,
) -> Scheduler:
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(KVCacheManager(pool, prefix_caching), max_num_seqs, budget)


def make_seq(
    request_id: str, n_prompt: int, max_tokens: int, prompt: list[int] | None = None
) -> Sequence:
    """A sequence whose default prompt is distinct per request id (no accidental prefix hits)."""
    if prompt is None:
        base = (zlib.crc32(request_id.encode()) % 100_000) * 1_000
        prompt = list(range(base, base + n_prompt))
    assert len(prompt) == n_prompt
    return Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), next(_arrivals))


def fake_token(seq: Sequence) -> int:
    """A deterministic output token: outputs are known in advance, so we can check they are kept."""
    return 900_000 + len(seq.output_token_ids)


class FakeKV:
    """The device KV cache as content: a slot holds the token ids its K/V were computed from.

    K/V at position ``p`` depend on tokens ``0..p``, so the slot stores that whole prefix. A
    chunk may only read slots holding exactly its own prefix: a stale hit, a block evicted
    while in use or a copy-on-write gone wrong shows up as a mismatch.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[tuple[int, ...] | None]] = [
            [None] * block_size for _ in range(num_blocks)
        ]

    def run(self, out: SchedulerOutput) -> None:
        # Copies first, all read before any is written (as ``kv_cache[dst] = kv_cache[src]``).
        copied = [list(self.slots[c.src]) for c in out.copies]
        for c, content in zip(out.copies, copied, strict=True):
            self.slots[c.dst] = content
        bs = self.block_size
        for (
            s
        ) in out.scheduled:  # a draft's slots hold the draft (tests/engine/test_spec_scheduler.py)
            tokens, start = s.seq.all_token_ids + s.draft, s.seq.num_computed
            for p in range(start, start + s.num_new):
                self.slots[s.block_ids[p // bs]][p % bs] = tuple(tokens[: p + 1])
        for s in out.scheduled:  # attention reads the whole context of every new token
            tokens = s.seq.all_token_ids + s.draft
            for p in range(s.seq.num_computed + s.num_new):
                got = self.slots[s.block_ids[p // bs]][p % bs]
                assert got == tuple(tokens[: p + 1]), f"{s.seq.request_id} reads bad KV at {p}"


class Step(NamedTuple):
    """What one step scheduled, as seen *before* ``advance`` (``starts``: ``num_computed``)."""

    out: SchedulerOutput
    trace: Trace
    sampled: list[str]
    starts: dict[str, int]


def step(sched: Scheduler, device: FakeKV | None = None) -> Step:
    """One engine iteration without a model, checking the step's invariants on the way."""
    out = sched.schedule()
    kv = sched.kv
    assert out.num_tokens <= sched.token_budget
    assert len(sched.running) <= sched.max_num_seqs
    assert len({id(s.seq) for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        assert s.num_new > 0 and s.seq.status is SeqStatus.RUNNING
        assert s.block_ids == kv.block_ids(s.seq.request_id)
        assert len(s.block_ids) >= kv.blocks_for(s.seq.num_computed + s.num_new)
    if device is not None:
        device.run(out)
    result = Step(
        out,
        [(s.seq.request_id, s.num_new) for s in out.scheduled],
        [s.seq.request_id for s in out.scheduled if s.samples],
        {s.seq.request_id: s.seq.num_computed for s in out.scheduled},
    )
    due = [s.seq for s in out.scheduled if s.samples]
    sched.advance(out.scheduled)
    for seq in due:
        seq.output_token_ids.append(fake_token(seq))
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    kv.check_integrity()
    return result


def run_to_end(sched: Scheduler, max_steps: int, device: FakeKV | None = None) -> list[Trace]:
    """Step until no work is left; fails if that takes more than ``max_steps`` steps."""
    traces: list[Trace] = []
    while sched.has_work():
        assert len(traces) < max_steps, "the scheduler stopped making progress"
        result = step(sched, device)
        assert result.trace, "an idle step while work is pending"
        traces.append(result.trace)
    return traces


def assert_done(sched: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        assert seq.finished and seq.finish_reason is FinishReason.LENGTH
        assert seq.output_token_ids == [900_000 + i for i in range(seq.params.max_tokens)]
        assert seq.request_id not in sched.kv
    assert not sched.has_work()
    sched.kv.check_integrity()
    assert sched.kv.pool.num_used == 0


def test_chunked_prefill_splits_a_long_prompt_by_the_budget() -> None:
    sched = make_scheduler(16, budget=4)
    a = make_seq("a", 10, 3)
    sched.add(a)
    first = step(sched)
    assert first.trace == [("a", 4)] and first.sampled == [] and first.starts == {"a": 0}
    assert a.num_computed == 4 and a.output_token_ids == []
    assert sched.kv.block_ids("a") == [0]
    second = step(sched)
    assert second.trace == [("a", 4)] and second.sampled == [] and a.num_computed == 8
    third = step(sched)
    assert third.trace == [("a", 2)] and third.sampled == ["a"] and third.starts == {"a": 8}
    assert len(a.output_token_ids) == 1 and sched.kv.block_ids("a") == [0, 1, 2]
    assert run_to_end(sched, 10) == [[("a", 1)], [("a", 1)]]
    assert_done(sched, a)


def test_chunked_prefill_shares_the_budget_in_arrival_order() -> None:
    sched = make_scheduler(16, budget=8)
    device = FakeKV(16, 4)
    a, b, c = make_seq("a", 10, 2), make_seq("b", 9, 2), make_seq("c", 3, 1)
    for seq in (a, b, c):
        sched.add(seq)
    assert run_to_end(sched, 20, device) == [
        [("a", 8)],
        [("a", 2), ("b", 6)],  # a finishes its prompt; b starts in the leftover budget
        [("a", 1), ("b", 3), ("c", 3)],  # a decodes, b finishes its prompt, c fits whole
        [("b", 1)],
    ]
    assert_done(sched, a, b, c)


def test_decodes_are_scheduled_before_new_prefills() -> None:
    sched = make_scheduler(16, budget=4)
    seqs = [make_seq(r, 1, 4) for r in "abc"]
    for seq in seqs:
        sched.add(seq)
    assert step(sched).trace == [("a", 1), ("b", 1), ("c", 1)]
    d = make_seq("d", 8, 1)
    sched.add(d)
    # Three decodes take three tokens of the budget; the new prompt gets what is left.
    for _ in range(3):
        result = step(sched)
        assert result.trace == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
        assert result.sampled == ["a", "b", "c"]
    assert all(seq.finished for seq in seqs) and d.num_computed == 3
    assert run_to_end(sched, 5) == [[("d", 4)], [("d", 1)]]
    assert_done(sched, *seqs, d)


def test_a_decode_is_never_starved_by_a_long_waiting_prompt() -> None:
    sched = make_scheduler(16, budget=4)
    a = make_seq("a", 2, 3)
    sched.add(a)
    step(sched)
    b = make_seq("b", 12, 1)
    sched.add(b)
    assert step(sched).trace == [("a", 1), ("b", 3)]
    assert step(sched).trace == [("a", 1), ("b", 3)]
    assert a.finished
    run_to_end(sched, 5)
    assert_done(sched, a, b)


def test_mixed_batch_of_decodes_and_prefill_chunks() -> None:
    sched = make_scheduler(32, budget=6)
    device = FakeKV(32, 4)
    a = make_seq("a", 5, 3)
    sched.add(a)
    assert step(sched, device).trace == [("a", 5)]
    b, c = make_seq("b", 7, 2), make_seq("c", 4, 2)
    sched.add(b)
    sched.add(c)
    mixed = step(sched, device)
    assert mixed.trace == [("a", 1), ("b", 5)] and mixed.sampled == ["a"]
    mixed = step(sched, device)
    assert mixed.trace == [("a", 1), ("b", 2), ("c", 3)] and mixed.sampled == ["a", "b"]
    assert mixed.starts == {"a": 6, "b": 5, "c": 0}
    assert a.finished
    assert run_to_end(sched, 10, device) == [[("b", 1), ("c", 1)], [("c", 1)]]
    assert_done(sched, a, b, c)


def test_prefix_hit_skips_the_cached_prompt_blocks() -> None:
    sched = make_scheduler(16)
    device = FakeKV(16, 4)
    prompt = list(range(100, 110))
    a = make_seq("a", 10, 2, prompt)
    sched.add(a)
    assert step(sched, device).trace == [("a", 10)]
    a_blocks = sched.kv.block_ids("a")
    assert a_blocks == [0, 1, 2] and a.num_cached_prompt_tokens == 0
    run_to_end(sched, 5, device)
    assert_done(sched, a)

    b = make_seq("b", 10, 2, list(prompt))
    sched.add(b)
    hit = step(sched, device)
    assert hit.trace == [("b", 2)] and hit.sampled == ["b"]  # 8 of 10 tokens are cached
    assert hit.starts == {"b": 8} and b.num_cached_prompt_tokens == 8
    assert hit.out.copies == []
    assert hit.out.scheduled[0].block_ids[:2] == a_blocks[:2]
    run_to_end(sched, 5, device)
    assert_done(sched, b)


def test_a_running_sequence_shares_its_prefix_with_a_new_one() -> None:
    sched = make_scheduler(16)
    device = FakeKV(16, 4)
    prompt = list(range(100, 109))
    a, b = make_seq("a", 9, 3, prompt), make_seq("b", 9, 3, list(prompt))
    sched.add(a)
    step(sched, device)
    sched.add(b)
    shared = step(sched, device)
    assert shared.trace == [("a", 1), ("b", 1)] and shared.starts == {"a": 9, "b": 8}
    assert b.num_cached_prompt_tokens == 8
    assert sched.kv.block_ids("a") == [0, 1, 2] and sched.kv.block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in sched.kv.pool.blocks[:4]] == [2, 2, 1, 1]
    run_to_end(sched, 10, device)
    assert_done(sched, a, b)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    sched = make_scheduler(8)
    device = FakeKV(8, 4)
    prompt = list(range(100, 108))
    a = make_seq("a", 8, 1, prompt)
    sched.add(a)
    assert step(sched, device).trace == [("a", 8)]
    assert_done(sched, a)

    b = make_seq("b", 8, 2, list(prompt))
    sched.add(b)
    last = step(sched, device)
    assert last.trace == [("b", 1)] and last.sampled == ["b"] and last.starts == {"b": 7}
    assert b.num_cached_prompt_tokens == 7
    # Token 7 is written into a private copy of cached block 1, never into block 1 itself.
    assert last.out.copies == [CopyOp(src=1, dst=2)]
    assert last.out.scheduled[0].block_ids == [0, 2]
    assert run_to_end(sched, 5, device) == [[("b", 1)]]
    assert_done(sched, b)


def test_prefix_caching_disabled_computes_every_token() -> None:
    sched = make_scheduler(16, prefix_caching=False)
    prompt = list(range(100, 108))
    a = make_seq("a", 8, 1, prompt)
    sched.add(a)
    step(sched)
    b = make_seq("b", 8, 1, list(prompt))
    sched.add(b)
    assert step(sched).trace == [("b", 8)]
    assert b.num_cached_prompt_tokens == 0
    assert_done(sched, a, b)


def test_the_newest_running_sequence_is_preempted() -> None:
    # 6 blocks of 4 tokens. a, b and c take two blocks each for their prompts (5 tokens); the
    # decode of token 8 needs a third block, so the newest (c) makes room for a and b.
    sched = make_scheduler(6)
    device = FakeKV(6, 4)
    a, b, c, d = (make_seq(r, n, 5) for r, n in [("a", 5), ("b", 5), ("c", 5), ("d", 3)])
    for seq in (a, b, c, d):
        sched.add(seq)
    assert step(sched, device).trace == [("a", 5), ("b", 5), ("c", 5)]  # d does not fit
    assert sched.kv.pool.num_free == 0 and list(sched.waiting) == [d]
    for _ in range(3):
        assert step(sched, device).trace == [("a", 1), ("b", 1), ("c", 1)]
    assert sched.kv.block_ids("c") == [4, 5]

    preempting = step(sched, device)
    assert preempting.out.preempted == [c]
    assert preempting.trace == [("a", 1), ("b", 1)]  # and no admission in this step
    # c's blocks went to a and b, its leaf first.
    assert [s.block_ids for s in preempting.out.scheduled] == [[0, 1, 5], [2, 3, 4]]
    assert c.status is SeqStatus.WAITING and c.num_computed == 0 and "c" not in sched.kv
    assert c.num_preemptions == 1 and sched.num_preemptions == 1
    assert c.output_token_ids == [900_000 + i for i in range(4)]  # its outputs are kept
    assert list(sched.waiting) == [c, d]  # at the front of the queue
    assert a.finished and b.finished

    # c recomputes prompt and outputs in one chunk (its cached blocks were evicted) and
    # samples its fifth token; d is admitted behind it.
    resumed = step(sched, device)
    assert resumed.trace == [("c", 9), ("d", 3)] and resumed.sampled == ["c", "d"]
    assert c.num_cached_prompt_tokens == 0
    assert run_to_end(sched, 10, device) == [[("d", 1)]] * 4
    assert_done(sched, a, b, c, d)


def test_a_preempted_sequence_resumes_from_its_cached_prefix() -> None:
    sched = make_scheduler(4)
    device = FakeKV(4, 4)
    a, b = make_seq("a", 4, 6), make_seq("b", 4, 6)
    sched.add(a)
    sched.add(b)
    assert step(sched, device).trace == [("a", 4), ("b", 4)]
    for _ in range(4):
        assert step(sched, device).trace == [("a", 1), ("b", 1)]
    assert sched.kv.block_ids("a") == [0, 2] and sched.kv.block_ids("b") == [1, 3]

    preempting = step(sched, device)  # token 8 of a needs a third block: b goes
    assert preempting.trace == [("a", 1)] and preempting.out.preempted == [b]
    # a took b's leaf block; b's first (prompt) block stays cached.
    assert preempting.out.scheduled[0].block_ids == [0, 2, 3]
    assert a.finished and b.output_token_ids == [900_000 + i for i in range(5)]

    # b's prompt block is still cached: it resumes at token 4 and recomputes 5 tokens.
    resumed = step(sched, device)
    assert resumed.trace == [("b", 5)] and resumed.starts == {"b": 4}
    assert resumed.sampled == ["b"] and resumed.out.scheduled[0].block_ids == [1, 2, 3]  # one run
    assert b.num_cached_prompt_tokens == 0  # set at first admission only
    assert b.num_preemptions == 1
    assert_done(sched, a, b)


def test_preemption_of_a_chunked_prefill() -> None:
    sched = make_scheduler(4, budget=4)
    device = FakeKV(4, 4)
    a, b = make_seq("a", 4, 5), make_seq("b", 12, 1)
    sched.add(a)
    sched.add(b)
    assert step(sched, device).trace == [("a", 4)]
    assert step(sched, device).trace == [("a", 1), ("b", 3)]
    assert step(sched, device).trace == [("a", 1), ("b", 3)]
    assert sched.kv.block_ids("a") == [0, 1] and sched.kv.block_ids("b") == [2, 3]
    # b's next chunk needs a third block and none is free: b, the newest, preempts itself.
    preempting = step(sched, device)
    assert preempting.trace == [("a", 1)] and preempting.out.preempted == [b]
    assert b.num_computed == 0 and b.output_token_ids == [] and list(sched.waiting) == [b]
    # It comes back as soon as there is room, skipping its computed (cached) first block.
    resumed = step(sched, device)
    assert resumed.trace == [("a", 1), ("b", 3)] and resumed.starts == {"a": 7, "b": 4}
    assert resumed.out.scheduled[1].block_ids == [2, 3]
    assert b.num_cached_prompt_tokens == 4  # no output yet: this is still its first prefill
    assert run_to_end(sched, 10, device) == [[("b", 4)], [("b", 1)]]
    assert b.num_preemptions == 1
    assert_done(sched, a, b)


@pytest.mark.parametrize("seed", range(20))
def test_no_deadlock_with_a_tiny_pool_and_many_sequences(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks, bs = 6, 4
    sched = make_scheduler(num_blocks, bs, max_num_seqs=rng.choice([2, 4, 16]), budget=8)
    shared = list(range(500, 508))
    seqs = []
    for i in range(12):
        n_prompt = rng.randint(1, 14)
        # What the engine admits: prompt + max_tokens fits in the pool alone.
        max_tokens = rng.randint(1, num_blocks * bs - n_prompt)
        prompt = None
        if n_prompt >= 8 and rng.random() < 0.5:  # some prompts share a prefix (hits, copies)
            prompt = shared + list(range(7000 + 100 * i, 7000 + 100 * i + n_prompt - 8))
        seqs.append(make_seq(f"s{i}", n_prompt, max_tokens, prompt))
    for seq in seqs:
        sched.add(seq)
    # The oldest running sequence gains a token every step, so this bound is never reached.
    bound = sum(s.num_tokens + s.params.max_tokens for s in seqs) + len(seqs)
    run_to_end(sched, bound, FakeKV(num_blocks, bs))
    assert_done(sched, *seqs)


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_reads_only_valid_kv(seed: int) -> None:
    """Arrivals, aborts, shared prefixes and preemption: every chunk reads exactly its own KV."""
    rng = random.Random(1000 + seed)
    bs = rng.choice([1, 2, 4])
    num_blocks = rng.randint(4, 10)
    capacity = num_blocks * bs
    sched = make_scheduler(
        num_blocks, bs, max_num_seqs=rng.randint(1, 6), budget=rng.randint(1, 3 * bs + 2)
    )
    device = FakeKV(num_blocks, bs)
    prefixes = [[rng.randint(0, 3) for _ in range(rng.randint(0, capacity // 2))] for _ in "ab"]
    live: list[Sequence] = []
    finished: list[Sequence] = []
    for i in range(150):
        if rng.random() < 0.3:
            head = rng.choice(prefixes)[: capacity - 1]
            prompt = head + [rng.randint(0, 3) for _ in range(rng.randint(0, 3))]
            prompt = (prompt or [0])[: capacity - 1]
            seq = make_seq(f"r{i}", len(prompt), rng.randint(1, capacity - len(prompt)), prompt)
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            victim = live.pop(rng.randrange(len(live)))
            used = sched.kv.pool.num_used
            rid = victim.request_id
            table = sched.kv.table(rid).blocks if rid in sched.kv else []
            sole = sum(1 for b in table if b.ref_cnt == 1)  # blocks no other sequence holds
            sched.abort(victim)
            assert victim.finish_reason is FinishReason.ABORT
            assert sched.kv.pool.num_used == used - sole and rid not in sched.kv
            sched.kv.check_integrity()
        if sched.has_work():
            assert step(sched, device).trace, "an idle step while work is pending"
        done = [s for s in live if s.finished]
        finished.extend(done)
        live = [s for s in live if not s.finished]
    run_to_end(sched, 2000, device)
    finished.extend(live)
    for seq in finished:
        assert seq.finished and len(seq.output_token_ids) == seq.params.max_tokens
    assert sched.kv.pool.num_used == 0
    sched.kv.check_integrity()


def test_abort_frees_blocks_at_once() -> None:
    sched = make_scheduler(16, budget=6)
    a, b, c = make_seq("a", 10, 4), make_seq("b", 3, 4), make_seq("c", 3, 4)
    for seq in (a, b, c):
        sched.add(seq)
    assert step(sched).trace == [("a", 6)]
    assert step(sched).trace == [("a", 4), ("b", 2)]
    assert sched.kv.block_ids("a") == [0, 1, 2] and sched.kv.block_ids("b") == [3]
    # A running sequence in the middle of its prefill: its block is freed now.
    sched.abort(b)
    assert b.finished and b.finish_reason is FinishReason.ABORT and "b" not in sched.kv
    assert sched.kv.pool.num_used == 3 and b not in sched.running
    sched.kv.check_integrity()
    # A waiting sequence just leaves the queue.
    sched.abort(c)
    assert c.finished and c.finish_reason is FinishReason.ABORT and not sched.waiting
    sched.kv.check_integrity()
    # A decoding sequence: its computed full blocks stay cached for later hits.
    sched.abort(a)
    assert a.finish_reason is FinishReason.ABORT and not sched.has_work()
    assert sched.kv.pool.num_used == 0 and sched.kv.pool.num_cached == 2
    sched.kv.check_integrity()
    assert sched.schedule().scheduled == []


def test_abort_of_a_finished_sequence_keeps_its_reason() -> None:
    sched = make_scheduler(8)
    a = make_seq("a", 3, 1)
    sched.add(a)
    step(sched)
    sched.abort(a)
    assert a.finish_reason is FinishReason.LENGTH
    assert_done(sched, a)


def test_max_num_seqs_is_respected() -> None:
    sched = make_scheduler(32, max_num_seqs=2)
    seqs = [make_seq(r, 3, 2) for r in "abcd"]
    for seq in seqs:
        sched.add(seq)
    assert run_to_end(sched, 10) == [
        [("a", 3), ("b", 3)],  # c and d wait for a slot, not for blocks or budget
        [("a", 1), ("b", 1)],
        [("c", 3), ("d", 3)],
        [("c", 1), ("d", 1)],
    ]
    assert_done(sched, *seqs)


@pytest.mark.parametrize("max_num_seqs", [1, 3])
def test_running_set_never_exceeds_max_num_seqs(max_num_seqs: int) -> None:
    sched = make_scheduler(64, max_num_seqs=max_num_seqs, budget=16)
    seqs = [make_seq(f"r{i}", 2 + i, 3) for i in range(6)]
    for seq in seqs:
        sched.add(seq)
    for t in run_to_end(sched, 60):
        assert len(t) <= max_num_seqs
    assert_done(sched, *seqs)
