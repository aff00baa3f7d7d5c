"""The pool planner (`services.router.planner`): demand over its window, the measured prefill rate,
the decode throughput at the TPOT objective from a fit of the decode workers' reports, and the
worker counts and ratio it recommends, as the traffic changes from decode-heavy to
prefill-heavy."""

from __future__ import annotations

import math

import pytest

from libkv.cluster.registry import Member, MemberChange, MemberLoad
from services.router.planner import Planner


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def worker(wid: str, role: str, rate: float = 0.0, running: int = 0, step_ms: float = 0.0,
           model: str = "m") -> Member:  # fmt: skip
    load = MemberLoad(running=running, prefill_tokens_per_s=rate, decode_step_ms=step_ms)
    return Member(wid, role, model, f"{wid}:1", load=load)


def report(planner: Planner, m: Member) -> None:
    planner.observe(MemberChange("put", m.worker_id, m))


def test_nothing_known_yet() -> None:
    plan = Planner().plan([], 0.05)
    assert plan.prompt_tokens_per_s == 0 and math.isnan(plan.prefill_workers)
    assert math.isnan(plan.decode_rate) and math.isnan(plan.prefill_fraction)


def test_decode_rate_from_a_fit_of_step_time_against_batch() -> None:
    planner = Planner()
    # step = 10 ms + 0.5 ms per stream: at a 30 ms objective a worker runs 40 streams.
    for b in (4, 8, 16, 24, 32):
        report(planner, worker("d0", "decode", running=b, step_ms=10 + 0.5 * b))
    assert planner.plan([], 0.030).decode_rate == pytest.approx(40 / 0.030)
    # An objective even one stream misses: one stream at a time.
    assert planner.plan([], 0.005).decode_rate == pytest.approx(1 / 0.0105)


def test_without_a_fit_the_best_throughput_seen() -> None:
    planner = Planner()
    for _ in range(6):  # one batch size only: no slope to fit
        report(planner, worker("d0", "decode", running=8, step_ms=20))
    report(planner, worker("p0", "prefill", running=8, step_ms=1))  # not a decode worker
    report(planner, worker("d9", "decode", running=8, step_ms=1, model="other"))
    planner.model = "m"
    report(planner, worker("d8", "decode", running=8, step_ms=2, model="other"))
    assert planner.plan([], 0.05).decode_rate == pytest.approx(8 / 0.001)  # "" saw every model
    only_m = Planner(model="m")
    report(only_m, worker("d9", "decode", running=8, step_ms=1, model="other"))
    report(only_m, worker("d0", "decode", running=8, step_ms=20))
    assert only_m.plan([], 0.05).decode_rate == pytest.approx(8 / 0.020)


def test_the_ratio_follows_the_traffic() -> None:
    """Decode-heavy traffic needs few prefill workers; the same rate of prefill-heavy requests
    needs more of them, and once the old traffic leaves the window the plan shows only the new."""
    clock = Clock()
    planner = Planner(window=60, utilization=0.5, clock=clock)
    members = [worker("p0", "prefill", rate=10_000), worker("p1", "prefill", rate=6_000)]
    for b in (4, 8, 16, 24, 32):  # 40 streams at a 25 ms step: 1,600 tokens/s
        report(planner, worker("d0", "decode", running=b, step_ms=5 + 0.5 * b))
    for _ in range(120):  # decode-heavy: 2 requests/s of 100 prompt and 1,000 output tokens
        planner.routed(100)
        planner.finished(1000)
    plan = planner.plan(members, 0.025)
    assert plan.prompt_tokens_per_s == 200 and plan.output_tokens_per_s == 2000
    assert plan.prefill_rate == 8000 and plan.decode_rate == pytest.approx(1600)
    assert plan.prefill_workers == pytest.approx(200 / (8000 * 0.5))
    assert plan.decode_workers == pytest.approx(2000 / (1600 * 0.5))
    assert plan.prefill_fraction == pytest.approx(0.05 / 2.55)
    clock.t += 61  # the window moves past it; prefill-heavy: 2 requests/s of 8,000 and 50
    for b in (4, 8, 16, 24, 32):
        report(planner, worker("d0", "decode", running=b, step_ms=5 + 0.5 * b))
    for _ in range(120):
        planner.routed(8000)
        planner.finished(50)
    plan = planner.plan(members, 0.025)
    assert plan.prompt_tokens_per_s == 16_000 and plan.output_tokens_per_s == 100
    assert plan.prefill_workers == pytest.approx(16_000 / (8000 * 0.5))
    assert plan.decode_workers == pytest.approx(100 / (1600 * 0.5))
    assert plan.prefill_fraction == pytest.approx(4 / (4 + 0.125))


def test_a_decode_worker_stands_in_for_the_prefill_rate() -> None:
    plan = Planner().plan([worker("d0", "decode", rate=3000)], 0.05)
    assert plan.prefill_rate == 3000


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        Planner(window=0)
    with pytest.raises(ValueError):
        Planner(utilization=1.5)


def test_an_idle_window_keeps_the_last_decode_rate() -> None:
    clock = Clock()
    planner = Planner(window=60.0, clock=clock)
    for _ in range(3):
        report(planner, worker("d0", "decode", running=8, step_ms=20))
    planner.finished(100)
    assert planner.plan([], 0.05).decode_rate == pytest.approx(8 / 0.020)
    clock.t += 120  # no stream decoded for two windows: no reports, no output
    plan = planner.plan([], 0.05)
    assert plan.decode_rate == pytest.approx(8 / 0.020)  # the workers' speed, still known
    assert plan.output_tokens_per_s == 0 and plan.decode_workers == 0  # nothing to serve
