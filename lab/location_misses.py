"""Why the block-location simulator's routed requests miss prefixes (``bench/location_sim.py``).

Runs one row of the simulator (same trace, publishers, etcd and index) and, for every measured
request, compares the worker it was routed to with the simulated worker that held the deepest
prefix of its chain at that moment (the simulated caches, exactly). A request that reused less
than that holder held is a miss, counted in blocks, by cause:

- ``routing``: the index showed the holder's prefix (to within 3 blocks, the base
  granularity's rounding), but the TTFT estimate (wait until idle + uncached blocks) chose
  another worker;
- ``delay``: the holder cached the missing blocks after its last summary write;
- ``content``: they were cached before it, but the summary does not show them.

Usage: ``python -m lab.location_misses --workers 100 --design summary``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

from bench.location_cluster import Cluster
from bench.location_run import DESIGNS, Sim, SimConfig, run_closing
from libkv.cluster.etcd_follow import EtcdConnection
from services.launcher.etcd import EtcdServer

CAUSES = ("routing", "delay", "content")


class Explained(Sim):
    """A `Sim` that classifies its misses (see the module docstring)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.since_write: list[set[bytes]] = [set() for _ in range(self.cfg.workers)]
        self.requests = Counter[str]()
        self.blocks = Counter[str]()

    async def flush_round(self) -> None:
        await super().flush_round()
        for s in self.since_write:  # every worker wrote what it had cached
            s.clear()

    def _request(self, sim: Cluster, oracle: Cluster, now: float, measuring: bool) -> None:
        chain = self.trace.next()
        match = self._match(chain, now)
        if measuring:
            self.chains.append(chain)
        held = []
        for lru in sim._lru:  # noqa: SLF001 - the simulated caches, exactly
            d = 0
            while d < len(chain) and chain[d] in lru:
                d += 1
            held.append(d)
        w = sim.route(chain, self._hits(match), now)
        if self.hinted is not None:
            self.hinted.note([(f"w{w}", "i0")], chain, now)
        if measuring:
            self._classify(chain, match, held, w)
        sim.serve(w, chain, now)
        self.since_write[w].update(chain[held[w] :])
        oracle.serve(oracle.route(chain, oracle.exact_hits(chain), now), chain, now)
        c = sim.counters
        if c.requests - self._last[0] >= 20 * self.cfg.workers:  # as Sim._request
            prefilled = c.prompt_tokens - c.hit_tokens
            self.per_request = max((prefilled - self._last[1]) / (c.requests - self._last[0]), 16.0)
            self._last = (c.requests, prefilled)

    def _classify(self, chain: list[bytes], match, held: list[int], w: int) -> None:
        best = max(held)
        self.requests["all"] += 1
        self.blocks["prompt"] += len(chain)
        self.blocks["reused"] += held[w]
        self.blocks["held"] += best
        if best <= held[w]:
            return
        h = held.index(best)
        shown = match.get((f"w{h}", "i0"), 0)
        if shown >= best - 3:
            cause = "routing"
        elif any(b in self.since_write[h] for b in chain[shown:best]):
            cause = "delay"
        else:
            cause = "content"
        self.requests[cause] += 1
        self.blocks[cause] += best - held[w]


async def explain(cfg: SimConfig) -> Explained:
    with EtcdServer() as etcd:
        conns = [EtcdConnection(etcd.endpoint, 60, "sim") for _ in range(4)]
        sim = Explained(cfg, etcd.endpoint, conns)
        row = await run_closing(sim)
    sim.row = row  # type: ignore[attr-defined]
    return sim


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=10)
    p.add_argument("--design", choices=DESIGNS[:2], default="summary")
    a = p.parse_args(argv)
    sim = asyncio.run(explain(SimConfig(a.workers, a.design)))
    row, b, r = sim.row, sim.blocks, sim.requests  # type: ignore[attr-defined]
    missed = b["held"] - b["reused"]
    print(f"{a.design} x{a.workers}: routed / exact index = {row.hit_rate:.1%} / "
          f"{row.oracle_hit_rate:.1%} = {row.hit_rate / row.oracle_hit_rate:.1%}")  # fmt: skip
    print(f"  prompt blocks {b['prompt']:,}: reused {b['reused'] / b['prompt']:.1%}, held by the "
          f"deepest holder {b['held'] / b['prompt']:.1%}; {r['all']:,} requests")  # fmt: skip
    for cause in CAUSES:
        print(f"  {cause}: {r[cause]:,} requests, {b[cause]:,} blocks "
              f"({b[cause] / max(missed, 1):.0%} of the missed)")  # fmt: skip


if __name__ == "__main__":
    main()
