"""Late planning (``engine.late_planning``): the clock's prediction and wait, the engine's hold
before a plan (with the step in flight's CUDA event stood in for by one that never fires, so
the wait runs on the CPU: off CUDA the engine never waits), and the flag from the worker to
the engine. The GPU test is
``tests/gpu/test_engine_gpu.py::test_late_planning_holds_and_keeps_the_tokens``."""

from __future__ import annotations

import threading
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine import late_planning as lp
from engine.scheduler import ScheduledSeq, SchedulerOutput


class NeverDone:
    """A CUDA event's stand-in whose work never ends (``hold`` waits on the clock alone)."""

    def query(self) -> bool:
        return False


class Done:
    def query(self) -> bool:
        return True


def test_a_steps_kind_is_its_rows_and_prompt_tokens_in_powers_of_two():
    def sched(*chunks: int) -> SchedulerOutput:
        return SchedulerOutput([ScheduledSeq(None, n, []) for n in chunks])  # type: ignore[arg-type]

    assert lp.kind(sched(1, 1, 1)) == (4, 0)  # decodes alone
    assert lp.kind(sched(*[1] * 33)) == (64, 0)
    assert lp.kind(sched(1, 1, 700)) == (4, 1024)  # a prompt chunk beside two decodes
    assert lp.kind(sched(1)) == (1, 0)


def test_the_clock_waits_until_the_predicted_end_less_the_launch():
    clock = lp.PlanClock()
    assert clock.slack((8, 0), began=10.0, now=10.0) == 0.0  # nothing seen yet
    clock.ran((8, 0), 0.020)
    assert clock.slack((8, 0), began=10.0, now=10.0) == 0.0  # no launch time yet
    clock.launched(0.002)
    # 0.9 x 20 ms from the start, less the 2 ms launch and the guard
    assert clock.slack((8, 0), 10.0, 10.0) == pytest.approx(0.018 - 0.002 - lp.GUARD_S)
    assert clock.slack((8, 0), 10.0, 10.010) == pytest.approx(0.008 - 0.002 - lp.GUARD_S)
    assert clock.slack((8, 0), 10.0, 10.017) == 0.0  # too late to wait
    assert clock.slack((16, 0), 10.0, 10.0) == 0.0  # another kind: no estimate
    clock.ran((8, 0), 0.010)  # the average moves toward the newest time
    assert clock.slack((8, 0), 10.0, 10.0) == pytest.approx(
        lp.SAFETY * (0.020 + lp.ALPHA * (0.010 - 0.020)) - 0.002 - lp.GUARD_S
    )
    clock.ran((64, 1024), 1.0)
    assert clock.slack((64, 1024), 10.0, 10.0) == lp.MAX_HOLD_S  # never longer


def test_the_wait_ends_on_a_command_on_the_steps_end_or_on_time():
    clock, wake = lp.PlanClock(), threading.Event()
    t0 = time.perf_counter()
    assert clock.hold(0.03, NeverDone(), wake) >= 0.03  # on time
    assert time.perf_counter() - t0 < 1.0
    assert clock.hold(0.03, Done(), wake) < 0.01  # the step in flight is done: plan now
    threading.Timer(0.01, wake.set).start()
    waited = clock.hold(0.5, NeverDone(), wake)  # a command: plan now
    assert 0.005 < waited < 0.3
    assert clock.hold(0.0, NeverDone(), threading.Event()) == 0.0
    assert clock.holds == 3 and clock.held_s >= 0.03 + 0.005


def make_engine(smol_dir, late: bool) -> LLMEngine:
    config = EngineConfig(
        model_dir=str(smol_dir), async_scheduling=True, late_planning=late,
        kv_cache_bytes=32 * 1024**2, max_num_batched_tokens=64, max_num_seqs=8,
    )  # fmt: skip
    return LLMEngine(config)


def run(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_the_engine_holds_only_with_a_step_in_flight_on_a_device(smol_dir, monkeypatch):
    """Off CUDA the step in flight has no event: no wait, and the same tokens. With an event
    that has not fired, the engine waits before the next plan, and a command ends the wait."""
    prompts = [[5, 6, 7] * n for n in (2, 9)]
    plain = make_engine(smol_dir, late=False)
    late = make_engine(smol_dir, late=True)
    assert plain.stepper.clock is None and late.stepper.clock is not None
    assert run(late, prompts, 6) == run(plain, prompts, 6)
    wake = threading.Event()
    late.add_request("x", [5, 6, 7] * 4, SamplingParams(temperature=0, max_tokens=30))
    late.step()
    late.step()
    assert late.stepper.inflight is not None and late.hold_planning(wake) == 0.0  # CPU: none

    monkeypatch.setattr("engine.step_loop.mark", lambda device: NeverDone())
    late.step()
    clock, step = late.stepper.clock, late.stepper.inflight
    assert clock is not None and clock.launch_s is not None and step is not None
    # On the CPU the host is the bottleneck (a launch computes the step): no time to wait.
    assert late.hold_planning(wake) == 0.0 and clock.holds == 0
    for _ in range(30):  # as on a GPU: steps of this kind take far longer than a launch
        clock.ran(step.kind, 1.0)
    threading.Timer(0.005, wake.set).start()
    t0 = time.perf_counter()
    late.hold_planning(wake)
    assert time.perf_counter() - t0 < lp.MAX_HOLD_S  # the command ended it
    assert clock.holds >= 1
    wake.clear()
    late.add_request("y", [8, 9], SamplingParams(temperature=0, max_tokens=4))
    assert late.hold_planning(wake) == 0.0  # a prompt waits already: plan now
    late.abort("x")
    late.abort("y")
    plain.close()
    late.close()


@pytest.mark.parametrize("value", ["--late-planning", "--no-late-planning"])
def test_the_worker_flag_reaches_the_engine(value):
    from services.worker.config import parse_config

    assert EngineConfig(model_dir="/m").late_planning is False
    cfg = parse_config("decode", ["--model-dir", "/m", value], env={})
    assert cfg.engine_config().late_planning is (value == "--late-planning")


def test_the_bench_stack_option_passes_the_flag():
    from bench.stacks import parse_stack, stack_config

    def args(spec: str) -> tuple[str, ...]:
        return stack_config(parse_stack(spec), "/m", "/r").worker_args

    assert "--late-planning" in args("colocated:1:late=1")
    assert "--late-planning" not in args("disagg:1p1d")
