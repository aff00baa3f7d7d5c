"""Bench measurements of prefix caching and block-location writes (no stack needed)."""

from __future__ import annotations

import math

import pytest

from bench.kv_stats import WorkerCounters, cache_report, ideal_hit_rate, render_cache_table
from bench.stacks import parse_stack, stack_config


def test_ideal_hit_rate_of_one_shared_cache():
    a = list(range(64))  # 4 blocks of 16
    b = a[:48] + [9] * 16  # shares 3 blocks with a
    assert ideal_hit_rate([a]) == 0.0
    # a again: all but its last token; b: 3 blocks.
    assert ideal_hit_rate([a, a, b]) == pytest.approx((63 + 48) / 192)
    # An LRU of 4 blocks has forgotten a's blocks by the time a comes again.
    c = list(range(100, 164))
    assert ideal_hit_rate([a, c, a], capacity=4) == 0.0
    assert ideal_hit_rate([a, c, a], capacity=8) == pytest.approx(63 / 192)


def test_cache_report_differences_and_normalisation():
    before = {"prefill-0": WorkerCounters(100, 0, 1, 2, 0, 50), "decode-0": WorkerCounters()}
    after = {
        "prefill-0": WorkerCounters(1100, 600, 3, 10, 2, 50),
        "decode-0": WorkerCounters(1000, 400, 1, 2, 0, 50),
    }
    c = cache_report(before, after, duration=10.0, ideal=(0.5, 0.4))
    assert (c.prompt_tokens, c.hit_tokens, c.hit_rate) == (2000, 1000, 0.5)
    assert (c.location_entries, c.location_txns) == (12, 3)
    assert c.writes_per_s_per_worker == pytest.approx(0.15)  # etcd writes
    assert c.prefilled_tokens_per_s_per_worker == pytest.approx(50.0)
    assert c.entries_per_1k_prefilled == pytest.approx(12.0)
    assert "50.0% | 100% / 125%" in render_cache_table([("kv", "shared-prefix", c)])
    empty = cache_report(after, after, 1.0, (0.0, 0.0))
    assert math.isnan(empty.hit_rate) and math.isnan(empty.entries_per_1k_prefilled)


def test_stack_spec_policy_and_routers():
    spec = parse_stack("disagg:2p2d:policy=round-robin:routers=2:threshold=64")
    assert (spec.policy, spec.routers, spec.threshold) == ("round-robin", 2, 64)
    cfg = stack_config(spec, "/m", "/r")
    assert (cfg.router_policy, cfg.num_routers, cfg.decode_only_threshold) == (
        "round-robin", 2, 64,
    )  # fmt: skip
    assert stack_config(parse_stack("disagg:1p1d"), "/m", "/r").router_policy == ""
    for bad in ("disagg:1p1d:policy=random", "disagg:1p1d:color=red"):
        with pytest.raises(ValueError):
            parse_stack(bad)
