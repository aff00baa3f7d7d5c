"""The scheduler with draft tokens, driven without a model: drafts take only what a step has
left, never preempt, free the rejected tokens' blocks, and never let a wrong token into the
prefix cache (checked by ``FakeKV``, which records what each slot was computed from)."""

from __future__ import annotations

import random

import pytest

from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import FinishReason, Sequence
from tests.engine.test_scheduler import FakeKV, assert_done, fake_token, make_scheduler, make_seq


def truth(seq: Sequence, i: int) -> int:
    """The ``i``-th token after the newest one, as the fake model would produce it."""
    return 900_000 + len(seq.output_token_ids) + i


def spec_step(sched: Scheduler, device: FakeKV | None = None) -> SchedulerOutput:
    """One iteration: the model keeps the drafted tokens that match the truth, then emits the
    true next token; sequences finish at ``max_tokens``."""
    out = sched.schedule()
    assert out.num_tokens <= sched.token_budget
    if device is not None:
        device.run(out)
    due = [s for s in out.scheduled if s.samples]
    for s in due:
        n = 0
        while n < len(s.draft) and s.draft[n] == truth(s.seq, n):
            n += 1
        s.num_accepted = n
    sched.advance(out.scheduled)
    for s in due:
        seq = s.seq
        for _ in range(s.num_accepted + 1):
            seq.output_token_ids.append(fake_token(seq))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
                break
    sched.kv.check_integrity()
    return out


def decoding(sched: Scheduler, seq: Sequence, max_steps: int = 20) -> None:
    """Step until ``seq`` has its first output (it is decoding from then on)."""
    for _ in range(max_steps):
        if seq.output_token_ids:
            return
        spec_step(sched)
    raise AssertionError("no first token")


def test_drafts_use_what_the_step_leaves_and_go_before_new_prefills() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, budget=6)
    a = make_seq("a", 3, max_tokens=50)
    sched.add(a)
    decoding(sched, a)
    a.draft_token_ids = [truth(a, i) for i in range(8)]
    b = make_seq("b", 10, max_tokens=5)
    sched.add(b)
    out = spec_step(sched)
    # a: 1 + 5 drafts fill the budget of 6; b waits.
    assert [(s.seq.request_id, s.num_new, len(s.draft)) for s in out.scheduled] == [("a", 6, 5)]
    assert out.scheduled[0].num_accepted == 5
    assert len(a.output_token_ids) == 1 + 6
    a.draft_token_ids = [truth(a, 0)]
    out = spec_step(sched)
    assert [(s.seq.request_id, s.num_new) for s in out.scheduled] == [("a", 2), ("b", 4)]


def test_a_draft_that_does_not_fit_is_dropped_not_preempting() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, b = make_seq("a", 7, max_tokens=30), make_seq("b", 3, max_tokens=2)
    sched.add(a)
    sched.add(b)
    decoding(sched, a)  # a: 8 tokens in 2 blocks, next write at 7; b: 1 block
    assert sched.kv.pool.num_free == 1
    # 6 drafted tokens need positions 8..13: two more blocks, only one is free.
    a.draft_token_ids = [truth(a, i) for i in range(6)]
    out = spec_step(sched)
    assert not out.preempted and [len(s.draft) for s in out.scheduled] == [0, 0]
    assert b.finished and not sched.waiting


def test_rejected_draft_slots_are_freed_and_confirmed_blocks_cached() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    a = make_seq("a", 7, max_tokens=30)
    sched.add(a)
    decoding(sched, a)
    spec_step(sched)  # 9 tokens, 8 computed: blocks 0-1 full, next write at 8 (block 2)
    assert len(sched.kv.block_ids("a")) == 2
    # Draft 5 tokens (positions 9..13: blocks 2-3), the first two right.
    a.draft_token_ids = [truth(a, 0), truth(a, 1), 1, 2, 3]
    out = spec_step(sched)
    assert out.scheduled[0].num_new == 6 and out.scheduled[0].num_accepted == 2
    # 8 + 1 + 2 = 11 computed, 12 tokens: block 3 held only rejected slots and is free again.
    assert a.num_computed == 11 and a.num_tokens == 12
    assert len(sched.kv.block_ids("a")) == 3 and sched.kv.pool.num_used == 3
    # Blocks 0-1 are cached, block 2 (positions 8-11, slot 11 has no KV yet) is not.
    assert len(sched.kv.table("a").hashes) == 2


@pytest.mark.parametrize("seed", range(6))
def test_random_drafts_with_preemption_and_prefix_hits_read_only_valid_kv(seed: int) -> None:
    """Random prompts sharing prefixes, random drafts (some right, some wrong) in a pool small
    enough to preempt: every read slot holds exactly its own prefix, outputs stay the truth,
    and no block leaks."""
    rng = random.Random(seed)
    bs = 4
    sched = make_scheduler(num_blocks=12, block_size=bs, max_num_seqs=4, budget=16)
    device = FakeKV(12, bs)
    shared = list(range(7_000, 7_000 + 12))
    seqs = []
    for i in range(10):
        n = rng.randint(2, 20)
        prompt = (shared[: rng.randint(0, 12)] + list(range(i * 1000, i * 1000 + n)))[:20]
        seqs.append(make_seq(f"s{i}", len(prompt), rng.randint(1, 14), prompt))
    pending = list(seqs)
    steps = 0
    while pending or sched.has_work():
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        for seq in sched.running:
            if seq.output_token_ids and seq.num_uncomputed == 1:
                k = rng.randint(0, 5)
                right = rng.randint(0, k)
                seq.draft_token_ids = [truth(seq, i) for i in range(right)]
                seq.draft_token_ids += [5 + i for i in range(k - right)]
        spec_step(sched, device)
        steps += 1
        assert steps < 2000
    assert_done(sched, *seqs)
