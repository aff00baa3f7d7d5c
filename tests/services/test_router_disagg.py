"""The router's SLO-aware choice between a prefill worker plus a hand-off and prefill on the decode
worker (`services.router.disagg`): the prediction, the choice and its reasons, the queue this
router adds before workers report it, the SLO from the request, the shedding gate, and the
workers' pace meter. Fixed member records stand in for etcd; the router core runs with the
scripted clients of test_router_core."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.step_stats import StepStats, prefill_backlog
from libkv.cluster.registry import Member, MemberChange, MemberLoad
from services.common.errors import ResourceExhausted
from services.router.admission import SloGate
from services.router.calls import RouteJob
from services.router.core import RouterCore
from services.router.disagg import (
    DISAGG,
    LOCAL,
    Decision,
    Pace,
    Prediction,
    Slo,
    choose,
    predict_disagg,
    predict_local,
)
from services.router.policy import Chooser, PolicyConfig, RouteRequest
from services.worker.pace import PaceMeter, chain
from tests.services.test_router_core import Clients

BS = 16
RATE = 10_000.0  # prompt tokens per second, as a worker measured it
SLO = Slo(1.0, 0.05)


class Directory:
    def __init__(self, members: list[Member]) -> None:
        self.members = members

    def members_by_role(self, role: str) -> list[Member]:
        return sorted((m for m in self.members if m.role == role), key=lambda m: m.worker_id)


def worker(
    worker_id: str, role: str, backlog: int = 0, rate: float = RATE, step_ms: float = 20.0,
    running: int = 0,
) -> Member:  # fmt: skip
    load = MemberLoad(
        running=running, kv_blocks_free=900, kv_blocks_used=10, prefill_backlog=backlog,
        prefill_tokens_per_s=rate, decode_step_ms=step_ms, max_batched_tokens=2048,
    )  # fmt: skip
    return Member(worker_id, role, "m", f"{worker_id}:1", 1000, BS, f"inc-{worker_id}", load=load)


def chooser(members: list[Member], policy: str = "kv", **kw) -> Chooser:
    return Chooser(Directory(members), PolicyConfig(policy, **kw))


def req(n: int = 2000, out: int = 128, ttft_ms: float = 0.0, tpot_ms: float = 0.0):
    return RouteRequest(list(range(n)), max_tokens=out, slo_ttft_ms=ttft_ms, slo_tpot_ms=tpot_ms)


def test_prediction_of_both_options() -> None:
    prefill = Pace(queued=8000, rate=RATE, step_s=0.0, batch=0, chunk=2048)
    decode = Pace(queued=0, rate=RATE, step_s=0.02, batch=8, chunk=2048)
    a = predict_disagg(prefill, decode, 2000, 100, handoff_s=0.01)
    assert a == Prediction(DISAGG, pytest.approx(1.0), pytest.approx(0.02 + 0.01 / 100))
    b = predict_local(decode, 3000, 100)
    # Two chunks, each also running the batch's decodes; the streams wait for the whole prompt.
    assert b == Prediction(LOCAL, pytest.approx(0.3 + 2 * 0.02), pytest.approx(0.02 + 0.3 / 100))
    idle = dataclasses.replace(decode, batch=0)
    assert predict_local(idle, 3000, 100) == Prediction(LOCAL, pytest.approx(0.3), 0.02)


def test_choice_and_reasons() -> None:
    fast, slow = Prediction(DISAGG, 0.2, 0.02), Prediction(DISAGG, 2.0, 0.02)
    local = Prediction(LOCAL, 0.5, 0.03)
    assert choose(fast, local, SLO) == Decision(DISAGG, "headroom", fast)
    assert choose(slow, local, SLO) == Decision(LOCAL, "saturated", local)
    late = Prediction(LOCAL, 3.0, 0.03)
    assert choose(slow, late, SLO) == Decision(DISAGG, "both-miss", slow)  # misses by less
    assert choose(local, local, SLO).choice == LOCAL  # a tie stays on the decode worker
    # Both miss a TPOT objective the decode step alone misses (by 14x and 15x): the TTFT that
    # one of them still meets decides, not the smaller TPOT miss.
    idle_prefill = Prediction(DISAGG, 0.5, 0.75)
    queued_decode = Prediction(LOCAL, 9.0, 0.70)
    assert choose(idle_prefill, queued_decode, SLO) == Decision(DISAGG, "both-miss", idle_prefill)


def test_a_long_prefill_queue_sends_the_prompt_decode_side() -> None:
    members = [worker("p0", "prefill", backlog=30_000), worker("d0", "decode", running=4)]
    plan = chooser(members).plan(req(), set())
    assert plan.prefill is None and plan.reason == "decode-only"
    assert plan.decision == Decision(LOCAL, "saturated", plan.decision.predicted)
    assert plan.uncached == 2000


def test_an_idle_prefill_pool_takes_it() -> None:
    members = [worker("p0", "prefill"), worker("p1", "prefill", backlog=5000),
               worker("d0", "decode", running=16)]  # fmt: skip
    plan = chooser(members).plan(req(), set())
    assert plan.prefill is not None and plan.prefill.worker_id == "p0"
    assert plan.decision is not None and plan.decision.choice == DISAGG


def test_the_requests_own_slo_decides() -> None:
    """The same cluster: a loose TPOT objective keeps a prompt decode-side (it meets both with
    more TTFT headroom there), a tight one moves it to the prefill worker, whose queue its TTFT
    objective still allows."""
    members = [worker("p0", "prefill", backlog=4000), worker("d0", "decode", running=8,
                                                             step_ms=10)]  # fmt: skip
    c = chooser(members)
    loose = c.plan(req(1000, out=64, ttft_ms=2000, tpot_ms=200), set())
    tight = c.plan(req(1000, out=64, ttft_ms=2000, tpot_ms=12), set())
    assert loose.decision.choice == LOCAL and tight.decision.choice == DISAGG
    assert c.disagg.slo(0, 12) == Slo(1.0, 0.012)  # unset: the router's default


def test_cold_start_falls_back_to_the_length_rule() -> None:
    members = [worker("p0", "prefill", rate=0), worker("d0", "decode", rate=0)]
    c = chooser(members, decode_only_threshold=256)
    assert c.plan(req(100), set()).decision == Decision(LOCAL, "cold-start")
    assert c.plan(req(300), set()).decision == Decision(DISAGG, "cold-start")
    # A decode worker that never computed a prompt borrows a peer's measured rate.
    members = [worker("p0", "prefill", backlog=50_000), worker("d0", "decode", rate=0)]
    assert chooser(members).plan(req(), set()).decision.reason == "saturated"


def test_length_mode_keeps_the_length_rule_whatever_the_load() -> None:
    """``--disagg-mode length``: a long prefill queue does not move a long prompt decode-side,
    and a short prompt stays there with the prefill pool idle."""
    members = [worker("p0", "prefill", backlog=30_000), worker("d0", "decode", running=4)]
    c = chooser(members, decode_only_threshold=256, disagg_mode="length")
    assert c.plan(req(), set()).decision == Decision(DISAGG, "length")
    assert c.plan(req(100), set()).decision == Decision(LOCAL, "length")
    with pytest.raises(ValueError, match="disagg mode"):
        chooser(members, disagg_mode="always")


def test_no_prefill_worker() -> None:
    plan = chooser([worker("d0", "decode")], policy="round-robin").plan(req(), set())
    assert plan.prefill is None and plan.decision == Decision(LOCAL, "no-prefill")


def test_this_routers_own_prompts_count_until_the_report_shows_them() -> None:
    p0, d0 = worker("p0", "prefill"), worker("d0", "decode", running=4)
    c = chooser([p0, d0])
    assert c.plan(req(), set()).decision.choice == DISAGG
    c.disagg.backlogs.add("p0", 40_000)  # sent, not reported yet: the prefill queue is long
    assert c.plan(req(), set()).decision.choice == LOCAL
    # p0's report arrives while they are still in flight: counted once, not twice.
    reported = dataclasses.replace(p0, load=dataclasses.replace(p0.load, prefill_backlog=40_000))
    c.observe(MemberChange("put", "p0", reported))
    assert c.disagg.backlogs.queued(reported) == 40_000
    c.disagg.backlogs.done("p0", 40_000)
    assert c.disagg.backlogs.queued(reported) == 0


def test_the_gate_sheds_requests_that_would_miss_by_far() -> None:
    gate = SloGate(2.0)
    job = RouteJob("r", [1], SamplingParams(max_tokens=1))
    late = Decision(LOCAL, "both-miss", Prediction(LOCAL, 3.0, 0.01))
    with pytest.raises(ResourceExhausted) as e:
        gate.check(job, late, SLO)
    assert e.value.retry_after_ms == 2000 and gate.shed == 1
    gate.check(job, Decision(LOCAL, "saturated", Prediction(LOCAL, 1.5, 0.01)), SLO)
    gate.check(dataclasses.replace(job, priority="batch"), late, SLO)
    SloGate(0).check(job, late, SLO)
    assert gate.shed == 1


async def test_the_core_counts_decisions_and_gives_back_its_queue() -> None:
    members = [worker("p0", "prefill", backlog=30_000), worker("d0", "decode", running=2)]
    clients = Clients()
    core = RouterCore(Directory(members), clients, policy=PolicyConfig("least-loaded"))
    job = RouteJob("r1", list(range(2000)), SamplingParams(max_tokens=100))
    events = [ev async for ev in core.generate(job)]
    assert clients.calls == [("decode", "d0")] and events[-1].finish_reason == "length"
    members[0] = worker("p0", "prefill")  # the prefill queue drained
    events = [ev async for ev in core.generate(dataclasses.replace(job, request_id="r2"))]
    assert clients.calls[1:] == [("prefill", "p0"), ("decode", "d0")]
    # The first stream ended after 2 tokens: a 2,000-token prompt decode-side would now cost
    # the streams there 0.1 s of TPOT each, past the objective.
    assert core.stats.disagg == {(LOCAL, "saturated"): 1, (DISAGG, "saturated"): 1}
    await asyncio.sleep(0)
    assert not +core.chooser.disagg.backlogs.own  # nothing left queued by this router
    # Completion tokens seen end: 2, then 3 (the prefill worker's first token, then 2).
    assert core.chooser.disagg.output_tokens.value == pytest.approx(2 + 0.2 * (3 - 2))
    assert core.chooser.disagg.handoff_per_token.value is not None


async def test_the_core_sheds_through_the_gate_after_trying_every_worker() -> None:
    members = [worker("p0", "prefill", backlog=90_000), worker("d0", "decode", backlog=90_000)]
    core = RouterCore(Directory(members), Clients(), policy=PolicyConfig("kv"), slo_shed_factor=2)
    job = RouteJob("r1", list(range(2000)), SamplingParams(max_tokens=3), slo_ttft_ms=500)
    with pytest.raises(ResourceExhausted, match="predicted TTFT"):
        [ev async for ev in core.generate(job)]
    assert core.slo_gate.shed == 1


def test_the_pace_meter() -> None:
    meter = PaceMeter(alpha=0.5)
    seen: list[StepStats] = []
    observe = chain(None, seen.append, meter)
    assert meter.report().prefill_tokens_per_s == 0 and meter.report().decode_step_ms == 0
    observe(StepStats(seconds=0.02, decode_seqs=8))
    observe(StepStats(seconds=0.2, prefill_seqs=1, prefill_tokens=2000))
    assert meter.report().prefill_tokens_per_s == pytest.approx(10_000)
    assert meter.report().decode_step_ms == pytest.approx(20)
    # A mixed step: its decodes' share (one decode step) is not prompt time.
    observe(StepStats(seconds=0.12, prefill_seqs=1, prefill_tokens=1000, decode_seqs=8))
    assert meter.report().prefill_tokens_per_s == pytest.approx(1500 / 0.15)
    observe(StepStats(seconds=0.04, decode_seqs=8))
    assert meter.report().decode_step_ms == pytest.approx(30)
    # A short prompt's step (mostly the pass's fixed cost) changes neither figure.
    observe(StepStats(seconds=0.05, prefill_seqs=1, prefill_tokens=20, decode_seqs=8))
    assert meter.report().prefill_tokens_per_s == pytest.approx(1500 / 0.15)
    assert meter.report().decode_step_ms == pytest.approx(30)
    assert len(seen) == 5


def test_the_prefill_backlog_a_worker_reports() -> None:
    """Prompt tokens not computed yet: a waiting prompt's all, a part-computed one's rest, a
    preempted stream's prompt and outputs; none of a decoding stream's."""
    params = SamplingParams(max_tokens=4)
    waiting = Sequence("a", list(range(100)), params, 0)
    chunked = Sequence("b", list(range(300)), params, 1, num_computed=256)
    decoding = Sequence("c", [1, 2], params, 2, output_token_ids=[7], num_computed=2)
    preempted = Sequence("d", [1, 2, 3], params, 3, output_token_ids=[7, 8], num_computed=0)
    assert prefill_backlog([waiting, chunked, decoding, preempted]) == 100 + 44 + 5


def test_a_hand_off_counts_what_it_adds_to_the_second_token() -> None:
    """Measured from the prefill reply to the decode worker's first event, less the decode step
    that token takes anyway."""
    c = chooser([worker("d0", "decode")])
    c.disagg.handed_off(1000, 0.05, step_s=0.02)
    assert c.disagg.handoff_per_token.value == pytest.approx(0.03 / 1000)
    c.disagg.handed_off(1000, 0.01, step_s=0.02)  # a step shorter than usual: adds nothing
    assert c.disagg.handoff_per_token.value == pytest.approx(0.8 * 0.03 / 1000)
