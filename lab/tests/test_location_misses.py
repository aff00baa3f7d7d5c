"""lab.location_misses: every miss of a small simulator row is counted under one cause."""

from __future__ import annotations

import pytest

from bench.location_run import SimConfig
from lab.location_misses import CAUSES, explain

pytestmark = pytest.mark.timeout(300)


async def test_misses_add_up_to_what_the_deepest_holders_held_beyond_the_routed():
    sim = await explain(SimConfig(4, "summary", rate=8000.0, capacity=512, measure=2.0))
    b, r = sim.blocks, sim.requests
    assert r["all"] > 50 and b["reused"] <= b["held"] <= b["prompt"]
    assert sum(b[c] for c in CAUSES) == b["held"] - b["reused"] > 0
    assert sum(r[c] for c in CAUSES) <= r["all"]
    assert b["delay"] > 0  # next turns before their worker's summary: the etcd view's price
