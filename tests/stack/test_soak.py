"""A bounded soak of the real stack on loopback (``slow``: minutes): mixed load (streaming and
not, chat and completions, disaggregated and decode-only prompts) with random client
cancellations and one worker restart half-way. At the end: no leaked blocks on any worker
(Stats and ``check_integrity()``), every process's RSS within ``RSS_BOUND_MIB`` of its size after
warm-up, and every request accounted for: completed with exactly the tokens it asked for,
cancelled by its client, or failed with a clear OpenAI error (only around the restart).

``TANDEM_SOAK_SECONDS`` sets the length (default 180); ``TANDEM_TEST_REPORT`` names a file the
measurements are appended to as a JSON line (the run recorded in ``bench/results/soak_cpu.md``)."""

from __future__ import annotations

import os
import platform
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from services.launcher.stack import Stack
from tests.stack.test_faults import BOUND, LEASE, mixed_request, stack_config
from tests.stack_probe import (
    LoadSpec,
    assert_no_leaks,
    errors,
    load,
    record,
    rss_mib,
    summary,
    wait_members,
)

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("TANDEM_SOAK_SECONDS", "180"))
CONCURRENCY = 6
CANCEL_PROB = 0.15
RSS_BOUND_MIB = 150.0  # growth allowed per process over the soak, after warm-up
RESTARTED = "decode-1"
TTL, REFRESH = 10, 3.0  # production's member lease: the soak is about leaks and accounting


def rss_all(stack: Stack) -> dict[str, float]:
    out = {name: rss_mib(child.pid) for name, child in stack.children.items()}
    out["etcd"] = rss_mib(stack.etcd.pid)
    return out


def lease_losses(log: Path) -> int:
    return log.read_text(errors="replace").count("is gone; re-registering")


@pytest.fixture(scope="module")
def stack(smol_dir, tmp_path_factory):
    config = stack_config(smol_dir, tmp_path_factory.mktemp("soak"), ttl=TTL, refresh=REFRESH)
    with Stack(config) as s:
        yield s


def test_soak(stack):
    spec = LoadSpec(stack.url, CONCURRENCY, BOUND, CANCEL_PROB, seed=42, make=mixed_request)
    with load(spec) as warm:  # the first requests size allocator arenas and caches
        warm.wait_for(2 * CONCURRENCY, 300)
    assert set(summary(warm.outcomes)) <= {"ok", "cancelled"}, errors(warm.outcomes)
    start_rss = rss_all(stack)
    t0 = time.monotonic()
    with load(spec) as running:
        time.sleep(SOAK_SECONDS / 2)
        restart_at = time.monotonic()
        stack.kill(RESTARTED, signal.SIGTERM, timeout=60)  # it drains for up to 30 s
        stack.restart(RESTARTED)
        wait_members(stack, lambda v: RESTARTED in v.get("decode", set()), within=30)
        restarted_rss = rss_mib(stack.children[RESTARTED].pid)
        restart_done = time.monotonic()
        time.sleep(max(0.0, SOAK_SECONDS - (time.monotonic() - t0)))
    elapsed = time.monotonic() - t0
    outcomes = running.outcomes
    results = summary(outcomes)
    final = assert_no_leaks(stack, within=LEASE + 3)
    end_rss = rss_all(stack)
    start_rss[RESTARTED] = restarted_rss  # a new process: measured from its own start
    growth = {name: end_rss[name] - start_rss[name] for name in end_rss}
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "TANDEM_TEST_REPORT=... pytest -m slow tests/stack/test_soak.py",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "seconds": round(elapsed, 1),
        "concurrency": CONCURRENCY,
        "cancel_probability": CANCEL_PROB,
        "requests": len(outcomes),
        "results": results,
        "errors": [e for e in errors(outcomes) if not e.startswith("cancelled")][:20],
        "error_started_s": [round(o.started - t0, 1) for o in outcomes if o.result == "error"],
        "restart": {
            "worker": RESTARTED,
            "at_s": round(restart_at - t0, 1),
            "back_after_s": round(restart_done - restart_at, 1),
        },  # fmt: skip
        "rss_mib_start": {k: round(v, 1) for k, v in start_rss.items()},
        "rss_mib_end": {k: round(v, 1) for k, v in end_rss.items()},
        "rss_bound_mib": RSS_BOUND_MIB,
        "kv_blocks_end": {
            n: [s.kv_blocks_used, s.kv_blocks_cached, s.kv_blocks_total] for n, s in final.items()
        },  # fmt: skip
        "completion_tokens": sum(o.tokens for o in outcomes if o.result == "ok"),
        # Member leases that lapsed under a live worker (it re-registered): a sign of stalls.
        "lease_losses": {n: lease_losses(c.log_path) for n, c in stack.children.items()},
    }
    record("soak", **report)
    # Every request is accounted for.
    assert set(results) <= {"ok", "cancelled", "error"}, (results, errors(outcomes))
    assert results.get("ok", 0) >= 10 and results.get("cancelled", 0) >= 1, results
    wrong = [o for o in outcomes if o.result == "ok" and o.tokens != o.asked]
    assert not wrong, [(o.path, o.stream, o.asked, o.tokens) for o in wrong]
    # Errors only from the restart: in flight on the stopped worker.
    window = (restart_at - BOUND, restart_done + TTL)
    stray = [o for o in outcomes if o.result == "error" and not window[0] < o.started < window[1]]
    assert not stray, errors(stray)
    # Memory stays bounded.
    assert all(g <= RSS_BOUND_MIB for g in growth.values()), growth
