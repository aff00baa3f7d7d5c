"""bench.handoff's hand-off figures from a decode worker's real Prometheus text: the mean, and
the p50 / p99 read off ``tandem_kv_transfer_duration_seconds``' buckets, which reach below a
millisecond (a GPU hand-off's scale)."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, generate_latest

from bench import handoff
from services.observability.metrics import HANDOFF_BUCKETS, KVTransferMetrics


def scrape(durations: dict[str, list[float]]) -> handoff.HandoffCounters:
    registry = CollectorRegistry()
    m = KVTransferMetrics.create(registry)
    for transport, seconds in durations.items():
        m.init(transport)
        for s in seconds:
            m.done(transport, 128, 128 * 2**21, s)
    return handoff.parse_metrics(generate_latest(registry).decode())


def test_sub_millisecond_handoffs_fall_in_their_own_buckets():
    assert HANDOFF_BUCKETS[0] <= 0.0001
    assert sum(1 for b in HANDOFF_BUCKETS if b <= 0.001) >= 5
    assert list(HANDOFF_BUCKETS) == sorted(HANDOFF_BUCKETS)


def test_p50_and_p99_come_from_the_buckets_and_ignore_the_stalls():
    before = scrape({"cuda-ipc": [0.0007] * 5})
    # 95 hand-offs of 0.78 ms and 5 stalls of 20 ms after the first snapshot (one worker's
    # counters only grow: the second scrape holds both)
    after = scrape({"cuda-ipc": [0.0007] * 5 + [0.00078] * 95 + [0.02] * 5})
    rep = handoff.report(before, after, [])
    assert rep.transfers == 100
    assert math.isclose(rep.mean_ms, (95 * 0.78 + 5 * 20) / 100, rel_tol=1e-6)
    assert rep.mean_ms > 1.7  # the stalls more than double the mean...
    assert 0.75 <= rep.p50_ms <= 1.0  # ...but the median stays in the 0.75-1 ms bucket
    assert 10.0 <= rep.p99_ms <= 25.0  # the p99 sees them
    table = handoff.render([("e", "w", "r", rep)])
    assert "p50 ms | p99 ms" in table and f"| {rep.p50_ms:.2f} | {rep.p99_ms:.2f} |" in table


def test_quantile_edges():
    assert math.isnan(handoff.quantile({}, 0.5))
    assert math.isnan(handoff.quantile({0.001: 0.0, math.inf: 0.0}, 0.5))
    # every observation past the last finite bound: that bound
    assert handoff.quantile({0.001: 0.0, 0.01: 0.0, math.inf: 4.0}, 0.5) == 0.01
    # linear inside the bucket, from the bucket below
    assert math.isclose(handoff.quantile({0.001: 0.0, 0.002: 10.0, math.inf: 10.0}, 0.5), 0.0015)
    assert math.isclose(handoff.quantile({0.001: 10.0, math.inf: 10.0}, 0.5), 0.0005)
