"""bench.engine_steps: the step histograms a worker exports (``StepMetrics``, the real
observer on a real registry), read before and after a run, give per phase the steps, their mean
wall time and batch, and the share of time in steps that computed prompt tokens."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bench.engine_steps import parse_metrics, render, report, serving_compiles
from engine.step_stats import StepStats
from services.observability.engine import StepMetrics


def worker_text(steps: list[StepStats]) -> tuple[str, str]:
    """A worker's /metrics before and after ``steps``."""
    registry = CollectorRegistry()
    observe = StepMetrics(registry)
    before = generate_latest(registry).decode()
    for s in steps:
        observe(s)
    return before, generate_latest(registry).decode()


def test_steps_by_phase_between_two_scrapes():
    decode = [StepStats(seconds=0.006, decode_seqs=64) for _ in range(30)]
    mixed = [StepStats(seconds=0.040, prefill_seqs=1, prefill_tokens=2000, decode_seqs=31)] * 5
    before, after = worker_text(decode + mixed)
    phases = report(parse_metrics(before), parse_metrics(after))
    assert set(phases) == {"decode", "prefill"}
    d, p = phases["decode"], phases["prefill"]
    assert d.steps == 30 and d.mean_ms == pytest.approx(6.0) and d.mean_batch == pytest.approx(64)
    assert p.steps == 5 and p.mean_ms == pytest.approx(40.0) and p.mean_batch == pytest.approx(32)
    assert p.time_share == pytest.approx(0.2 / (0.2 + 0.18))
    table = render([("colocated:1", "decode-heavy", "inf", phases, 0)])
    row = "| colocated:1 | decode-heavy | inf | 30 | 6.00 | 64.0 | 5 | 40.00 | 32.0 | 53% | 0 |"
    assert row in table


def test_a_run_without_steps_reports_none_and_two_workers_add_up():
    idle_before, idle_after = worker_text([])
    assert report(parse_metrics(idle_before), parse_metrics(idle_after)) == {}
    _, a = worker_text([StepStats(seconds=0.01, decode_seqs=2)])
    _, b = worker_text([StepStats(seconds=0.03, decode_seqs=6)])
    summed = {k: parse_metrics(a).get(k, 0) + parse_metrics(b).get(k, 0)
              for k in parse_metrics(a).keys() | parse_metrics(b).keys()}  # fmt: skip
    phases = report({}, summed)
    assert phases["decode"].steps == 2 and phases["decode"].mean_ms == pytest.approx(20.0)
    assert phases["decode"].mean_batch == pytest.approx(4.0)
    assert math.isclose(phases["decode"].time_share, 1.0)
    assert "| 0 | - | - | - | - |" in render([("s", "w", "4", phases, None)])


def test_kernels_compiled_while_serving_between_two_scrapes():
    """The worker's compile counter (its real family) read twice: only serving compiles count."""
    from kernels.compile_counter import CompileCounts
    from services.observability.engine import _compiles

    def text(warmup: int, serving: int) -> str:
        registry = CollectorRegistry()

        class Counts:
            def collect(self):
                yield _compiles(CompileCounts(warmup=warmup, serving=serving))

        registry.register(Counts())
        return generate_latest(registry).decode()

    before, after = parse_metrics(text(40, 1)), parse_metrics(text(40, 4))
    assert serving_compiles(before, after) == 3
    assert serving_compiles(after, after) == 0
    assert serving_compiles({}, parse_metrics(text(40, 0))) == 0


def test_ttft_splits_into_the_engines_part_and_the_services():
    """The gateway's TTFT histogram and the engine's (queue, prompt steps, first token), each
    from its own process's text, give per-run means; the services' part is their difference."""
    from prometheus_client import Histogram

    from bench.engine_steps import render_ttft, snapshot, ttft_split

    def process(name: str, values: list[float]) -> tuple[str, str]:
        registry = CollectorRegistry()
        h = Histogram(name, "a latency", registry=registry)
        before = generate_latest(registry).decode()
        for v in values:
            h.observe(v)
        return before, generate_latest(registry).decode()

    gw = process("tandem_gateway_time_to_first_token_seconds", [0.100, 0.120])
    engine = process("tandem_engine_time_to_first_token_seconds", [0.070, 0.090])
    queue = process("tandem_engine_queue_time_seconds", [0.001, 0.003])
    was = snapshot({"gateway": gw[0], "decode-0": engine[0], "decode-0/q": queue[0]})
    now = snapshot({"gateway": gw[1], "decode-0": engine[1], "decode-0/q": queue[1]})
    split = ttft_split(was, now)
    assert split["gateway"] == pytest.approx(110.0) and split["engine"] == pytest.approx(80.0)
    assert split["queue"] == pytest.approx(2.0) and split["services"] == pytest.approx(30.0)
    assert "prompt steps" not in split  # no sample: left out
    assert ttft_split(now, now) == {}
    row = "| colocated:1 | prefill-heavy | 4 | 110.0 | 80.0 | 2.0 | - | 30.0 |"
    assert row in render_ttft([("colocated:1", "prefill-heavy", "4", split)])
