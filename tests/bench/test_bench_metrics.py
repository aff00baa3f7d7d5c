"""bench.metrics on hand-built traces: exact TTFT, ITL, TPOT, E2E, percentiles and goodput."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.metrics import SLO, Dist, meets_slo, percentile, record_from_trace, summarize


def trace(rid: str, sent: float, chunks: list[float], end: float, out: int, **kw):
    return record_from_trace(rid, 0.0, sent, chunks, end, input_tokens=10, output_tokens=out, **kw)


def test_one_trace_exact():
    # Dyadic times, so every difference is exact in binary floating point.
    r = record_from_trace(
        "a", t0=100.0, sent=100.5, chunk_times=[100.75, 100.8125, 100.875, 101.0], end=101.0,
        input_tokens=12, output_tokens=4,
    )  # fmt: skip
    assert r.ok and r.error is None
    assert r.start == 0.5
    assert r.ttft == 0.25
    assert r.itl == (0.0625, 0.0625, 0.125)
    assert r.e2e == 0.5
    assert r.tpot == 0.25 / 3  # (e2e - ttft) / (output_tokens - 1)
    assert (r.input_tokens, r.output_tokens) == (12, 4)


def test_coalesced_chunks_tpot_counts_tokens_not_chunks():
    # 5 tokens in 3 text chunks: ITL has 2 gaps, TPOT divides by 4 token gaps.
    r = trace("b", 0.0, [0.5, 1.0, 1.5], end=1.5, out=5)
    assert r.itl == (0.5, 0.5)
    assert r.tpot == 1.0 / 4


def test_one_token_and_failures():
    one = trace("c", 0.0, [0.25], end=0.25, out=1)
    assert one.ok and one.tpot is None and one.itl == ()
    silent = trace("d", 0.0, [], end=0.5, out=0)
    assert not silent.ok and silent.error == "no output text" and silent.ttft is None
    failed = trace("e", 0.0, [0.1], end=0.2, out=1, error="APIStatusError: 500")
    assert not failed.ok and failed.e2e is None and failed.tpot is None


def test_percentile_matches_numpy_linear():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7, abs=1e-12)
    assert percentile(xs, 99) == pytest.approx(3.97, abs=1e-12)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    rng = np.random.default_rng(0)
    vals = rng.exponential(size=101).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(vals, q) == pytest.approx(np.percentile(vals, q), rel=1e-12)
    d = Dist.of([1.0, 2.0, 3.0, 4.0])
    assert (d.n, d.mean, d.p50, d.max) == (4, 2.5, 2.5, 4.0)
    assert math.isnan(Dist.of([]).p99)


def test_goodput_and_attainment():
    slo = SLO(ttft=1.0, tpot=0.05)
    records = [
        trace("meets", 0.0, [0.5, 0.53125, 0.5625], end=0.5625, out=3),  # ttft .5, tpot 1/32
        trace("slow-first", 0.0, [1.5, 1.51, 1.52], end=1.52, out=3),  # ttft 1.5 > 1
        trace("slow-decode", 0.0, [0.25, 0.375, 0.5], end=0.5, out=3),  # tpot .125 > .05
        trace("edge", 0.0, [1.0], end=1.0, out=1),  # ttft == SLO, one token: meets
        trace("failed", 0.0, [], end=0.1, out=0, error="boom"),
    ]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, True, False]
    s = summarize(records, duration=2.0, slo=slo)
    assert (s.sent, s.completed, s.failed) == (5, 4, 1)
    assert s.goodput == 1.0  # 2 requests met both SLOs in 2 s
    assert s.slo_attainment == 0.4  # 2 of 5 sent (failures count as misses)
    assert s.request_throughput == 2.0  # 4 completed in 2 s
    assert s.output_tokens == 10 and s.output_token_throughput == 5.0
    assert s.input_tokens == 40 and s.input_token_throughput == 20.0
    assert s.ttft.n == 4 and s.ttft.p50 == pytest.approx((0.5 + 1.0) / 2)
    assert s.tpot.n == 3  # the one-token answer has no TPOT
    assert s.tpot.max == 0.125
    assert s.itl.n == 6
    assert s.e2e.max == 1.52


def test_summarize_nothing():
    s = summarize([], duration=0.0, slo=SLO())
    assert s.sent == 0 and math.isnan(s.goodput) and math.isnan(s.slo_attainment)
