"""One row of the block-location simulator (``bench/location_sim.py``): a design (summaries,
with or without the router's recent routes) at one cluster size, against a fresh etcd."""

from __future__ import annotations

import asyncio
import gc
import math
import random
import statistics
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import aetcd

from bench.location_cluster import BLOCK, Cluster
from bench.location_report import Row
from bench.location_trace import Trace, TraceConfig
from libkv.cluster import summary_index
from libkv.cluster.etcd_follow import EtcdConnection, read_prefix
from libkv.cluster.location_summary import LOCATIONS_PREFIX, delta_key
from libkv.cluster.recent_routes import HintedIndex, RecentRoutes
from libkv.cluster.summary_publisher import SummaryConfig, SummaryPublisher

DESIGNS = ("summary", "summary+hints")
PER_REQUEST_GUESS = 800.0  # prefilled tokens per request, until measured
LOOKUP_SAMPLE = 20_000  # recent prompts looked up again, timed, after the run


@dataclass(frozen=True, slots=True)
class SimConfig:
    workers: int
    design: str
    rate: float = 30_000.0  # prefilled tokens/s per worker
    capacity: int = 8192  # prefix-cache blocks per worker
    warmup: float = 0.0  # virtual seconds before measuring (0: until caches fill)
    measure: float = 3.0  # virtual seconds measured
    think: float = 2.0  # mean virtual seconds between two turns of one conversation
    budget: int = 256
    interval: float = 1.0  # summary design: seconds between a worker's writes
    seed: int = 0


@dataclass(slots=True)
class SimLease:
    """A lease of the simulated worker (granted for real; no keepalive needed in a run)."""

    lease_id: int | None
    registered: bool = True
    registrations: int = 1


def _timed(fn: Callable[..., None], acc: list[float]) -> Callable[..., None]:
    def wrapper(*args: bytes) -> None:
        t0 = time.perf_counter()
        fn(*args)
        acc[0] += time.perf_counter() - t0

    return wrapper


class Sim:
    """One row: a design at one cluster size, against a fresh etcd."""

    def __init__(self, cfg: SimConfig, endpoint: str, conns: list[EtcdConnection]) -> None:
        self.cfg, self.endpoint, self.conns = cfg, endpoint, conns
        self.hinted: HintedIndex | None = None
        self.now = 0.0  # virtual
        self.per_request = PER_REQUEST_GUESS  # prefilled tokens per request, lately
        self._last = (0, 0)  # (requests, prefilled tokens) at the last rate update
        self.interval = cfg.interval
        # A conversation's next turn comes after about `active` other requests.
        active = int(cfg.think * cfg.workers * cfg.rate / PER_REQUEST_GUESS)
        self.trace = Trace(TraceConfig(active=active, seed=cfg.seed))
        self.pubs: list[SummaryPublisher] = []
        self.index: summary_index.LocationIndex | None = None
        self.apply_s = [0.0]
        self.chains: deque[list[bytes]] = deque(maxlen=LOOKUP_SAMPLE)  # recent prompts
        self._widx: dict[tuple[str, str], int] = {}

    async def setup(self) -> None:
        cfg = self.cfg
        leases = await asyncio.gather(*(self.conns[w % 4].client.lease(3600)
                                        for w in range(cfg.workers)))  # fmt: skip
        for w, lease in enumerate(leases):
            conn, lh = self.conns[w % 4], SimLease(lease.id)
            config = SummaryConfig(interval=cfg.interval, budget=cfg.budget)
            pub = SummaryPublisher(self.endpoint, f"w{w}", "i0", lh, config, etcd=conn)
            self.pubs.append(pub)
        self.index = await summary_index.LocationIndex.start(self.endpoint)
        self.index.put = _timed(self.index.put, self.apply_s)  # type: ignore[method-assign]
        self.index.delete = _timed(self.index.delete, self.apply_s)  # type: ignore[method-assign]
        if cfg.design == "summary+hints":
            self.hinted = HintedIndex(self.index, RecentRoutes(ttl=2 * cfg.interval))

    def _match(self, chain: list[bytes], now: float):
        if self.hinted is not None:
            return self.hinted.match(chain, now)
        assert self.index is not None
        return self.index.match(chain)

    def _hits(self, match):
        w = self._widx
        return ((d, (w.setdefault(h, int(h[0][1:])) for h in hs))
                for d, hs in match.positions())  # fmt: skip

    async def _revision(self) -> int:
        client = self.conns[0].client
        req = aetcd.rpc.RangeRequest(key=b"\0", range_end=b"\0", count_only=True)
        return (await client.kvstub.Range(req, timeout=10)).header.revision

    async def flush_round(self) -> None:
        sem = asyncio.Semaphore(64)

        async def one(p) -> None:
            async with sem:
                await p.flush()

        await asyncio.gather(*(one(p) for p in self.pubs))
        rev = await self._revision()
        index = self.index
        assert index is not None
        while index.follower.revision < rev:
            await asyncio.sleep(0.002)

    def _stats(self) -> tuple[int, int, int, int]:
        """(etcd writes, keys written, bytes, entry changes) so far, over all publishers."""
        st = [p.stats for p in self.pubs]
        txns = sum(s.txns for s in st)
        key_bytes = len(delta_key("w100", "i0", 0))
        return (txns, txns, sum(s.bytes for s in st) + txns * key_bytes,
                sum(s.puts + s.deletes for s in st))  # fmt: skip

    async def run(self) -> Row:
        """Warm up until the caches are full, then measure ``cfg.measure`` virtual seconds; both
        start and end on a flush round, so each measured interval holds one round."""
        cfg, iv = self.cfg, self.interval
        rng = random.Random(cfg.seed + 1)
        await self.setup()
        sim = Cluster(cfg.workers, cfg.capacity, cfg.rate, self.pubs)
        oracle = Cluster(cfg.workers, cfg.capacity, cfg.rate)
        warmup = cfg.warmup or 1.5 * cfg.capacity * BLOCK / cfg.rate
        first, last = math.ceil(warmup / iv), math.ceil((warmup + cfg.measure) / iv)
        now, t_wall, base = 0.0, time.monotonic(), ()
        for k in range(1, last + 1):
            while True:  # the requests before round k (Poisson arrivals: memoryless)
                gap = rng.expovariate(cfg.workers * cfg.rate / self.per_request)
                if now + gap >= k * iv:
                    break
                now += gap
                self._request(sim, oracle, now, k > first)
            now = k * iv
            await self.flush_round()
            if now % 1.0 < iv:
                print(f"  {cfg.design} x{cfg.workers}: {now:.0f}/{last * iv:.0f} virtual s, "
                      f"{time.monotonic() - t_wall:.0f} s", flush=True)  # fmt: skip
            if k == first:
                base = (self._stats(), await self._revision(), self.apply_s[0],
                        asdict(sim.counters), asdict(oracle.counters))  # fmt: skip
        self.now = now
        span = (last - first) * iv
        return await self._finish(sim, oracle, base, span, time.monotonic() - t_wall)

    def _request(self, sim: Cluster, oracle: Cluster, now: float, measuring: bool) -> None:
        """Route and serve one request in both clusters; keep the prefill rate at cfg.rate."""
        chain = self.trace.next()
        match = self._match(chain, now)
        if measuring:
            self.chains.append(chain)
        w = sim.route(chain, self._hits(match), now)
        if self.hinted is not None:
            self.hinted.note([(f"w{w}", "i0")], chain, now)
        sim.serve(w, chain, now)
        oracle.serve(oracle.route(chain, oracle.exact_hits(chain), now), chain, now)
        c = sim.counters
        if c.requests - self._last[0] >= 20 * self.cfg.workers:  # about every 0.5 virtual s
            prefilled = c.prompt_tokens - c.hit_tokens
            self.per_request = max((prefilled - self._last[1]) / (c.requests - self._last[0]), 16.0)
            self._last = (c.requests, prefilled)

    async def _finish(self, sim, oracle, base, span, wall) -> Row:
        (txns0, keys0, bytes0, changes0), rev0, apply0, sim0, ora0 = base
        txns, keys, nbytes, changes = self._stats()
        revisions = await self._revision() - rev0
        lookups = self._lookups()
        restart_s, full = await self._restart()
        memory = await self._memory()
        n = self.cfg.workers
        hit = _rate(sim.counters, sim0)
        ora = _rate(oracle.counters, ora0)
        prefilled = ((sim.counters.prompt_tokens - sim0["prompt_tokens"])
                     - (sim.counters.hit_tokens - sim0["hit_tokens"]))  # fmt: skip
        grans = [p.granularity for p in self.pubs]
        assert self.index is not None
        return Row(
            design=self.cfg.design, workers=n,
            prefilled_per_worker=prefilled / span / n,
            writes_per_s=(keys - keys0) / span, revisions_per_s=revisions / span,
            txns_per_s=(txns - txns0) / span, mb_per_s=(nbytes - bytes0) / span / 1e6,
            entry_changes_per_s=(changes - changes0) / span,
            router_apply_cpu=(self.apply_s[0] - apply0) / span,
            index_mib=memory / 2**20, index_entries=self.index.entries(),
            lookup_p50_us=lookups[len(lookups) // 2] / 1e3,
            lookup_p99_us=lookups[int(len(lookups) * 0.99)] / 1e3,
            hit_rate=hit, oracle_hit_rate=ora, restart_s=restart_s, restart_full=full,
            granularity=statistics.median(grans), gaps=getattr(self.index, "stats", None)
            and self.index.stats.gaps or 0, sim_wall_s=wall, measured_s=span,
        )  # fmt: skip

    def _lookups(self) -> list[int]:
        """CPU nanoseconds of one lookup of each recent prompt, sorted: timed apart from the
        simulation, with the simulator's own objects frozen out of the garbage collector, in
        this thread's CPU time (other processes on a shared machine do not count). The prompt's
        hashes are read just before, as a router has just computed them; the index is not
        warmed."""
        assert self.index is not None
        gc.collect()
        gc.freeze()
        out = []
        try:
            for chain in self.chains:
                b"".join(chain)
                t0 = time.thread_time_ns()
                self._match(chain, self.now)  # with the hints of the run's last seconds
                out.append(time.thread_time_ns() - t0)
        finally:
            gc.unfreeze()
        return sorted(out)

    async def _restart(self) -> tuple[float, bool]:
        """A router started now: seconds until its index is read, and whether it is complete."""
        cls = type(self.index)
        t0 = time.perf_counter()
        fresh = await cls.start(self.endpoint, timeout=60)  # type: ignore[attr-defined]
        elapsed = time.perf_counter() - t0
        assert self.index is not None
        full = fresh.synced and fresh.entries() == self.index.entries()
        await fresh.stop()
        return elapsed, full

    async def _memory(self) -> int:
        """Bytes the index structures take (tracemalloc, rebuilt from a read of etcd)."""
        items, _ = await read_prefix(self.conns[0], LOCATIONS_PREFIX.encode())
        sink = summary_index.SummaryIndex()
        tracemalloc.start()
        sink.reset(items)
        size = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return size

    async def close(self) -> None:
        for p in self.pubs:
            await p.stop()
        if self.index is not None:
            await self.index.stop()


async def run_closing(sim: Sim) -> Row:
    """Run ``sim``, then close it and its etcd connections, whatever happens."""
    try:
        return await sim.run()
    finally:
        await sim.close()
        for c in sim.conns:
            await c.close()


def _rate(c, before: dict) -> float:
    prompt = c.prompt_tokens - before["prompt_tokens"]
    return (c.hit_tokens - before["hit_tokens"]) / prompt if prompt else float("nan")
