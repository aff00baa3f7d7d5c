"""The block-location simulator's table (``bench/location_sim.py``) and its targets."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from bench.etcd_ceiling import Ceiling
from bench.report import cpu_model

MEMBER_REFRESH_S = 3.0  # every worker re-puts its member key this often (in every design)


@dataclass(frozen=True, slots=True)
class Row:
    design: str
    workers: int
    prefilled_per_worker: float  # tokens/s per worker (virtual seconds)
    writes_per_s: float  # keys put or deleted in etcd, all workers
    revisions_per_s: float  # etcd revisions (one per put or transaction), from etcd itself
    txns_per_s: float
    mb_per_s: float  # keys + values written
    entry_changes_per_s: float  # prefix entries announced or retracted
    router_apply_cpu: float  # seconds a router spends applying watch events per second
    index_mib: float
    index_entries: int
    lookup_p50_us: float
    lookup_p99_us: float
    hit_rate: float
    oracle_hit_rate: float
    restart_s: float
    restart_full: bool
    granularity: float  # median over workers, in blocks
    gaps: int
    sim_wall_s: float
    measured_s: float

    @property
    def total_writes_per_s(self) -> float:
        """Location writes plus member-key refreshes (not simulated: workers / 3 s)."""
        return self.writes_per_s + self.workers / MEMBER_REFRESH_S

    @property
    def hit_ratio(self) -> float:
        return self.hit_rate / self.oracle_hit_rate if self.oracle_hit_rate else float("nan")


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| design | workers | prefilled tok/s/worker | location writes/s (keys) | etcd revisions/s "
        "| + member refresh = total writes/s | MB/s | entry changes/s | router apply CPU s/s "
        "| index MiB (entries) | lookup p50/p99 us | hit rate: routed / exact index = ratio "
        "| restarted router s (complete) | granularity (blocks) | sim wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.design} | {r.workers:,} | {r.prefilled_per_worker:,.0f} "
            f"| {r.writes_per_s:,.0f} | {r.revisions_per_s:,.0f} "
            f"| {r.total_writes_per_s:,.0f} | {r.mb_per_s:.2f} | {r.entry_changes_per_s:,.0f} "
            f"| {r.router_apply_cpu:.3f} | {r.index_mib:,.1f} ({r.index_entries:,}) "
            f"| {r.lookup_p50_us:.0f}/{r.lookup_p99_us:.0f} "
            f"| {r.hit_rate:.1%} / {r.oracle_hit_rate:.1%} = {r.hit_ratio:.1%} "
            f"| {r.restart_s:.2f} ({'yes' if r.restart_full else 'NO'}) "
            f"| {r.granularity:g} | {r.sim_wall_s:.0f} |"
        )
    return "\n".join(lines)


def targets(rows: Sequence[Row], design: str) -> str:
    """The issue's targets against ``design``'s largest row."""
    ours = [r for r in rows if r.design == design]
    if not ours:
        return ""
    r = max(ours, key=lambda x: x.workers)
    checks = [
        ("etcd writes/s, all workers (locations + member refresh)", "<= 2,000",
         f"{r.total_writes_per_s:,.0f}", r.total_writes_per_s <= 2000),
        ("router index memory", "<= 1 GiB", f"{r.index_mib:,.1f} MiB", r.index_mib <= 1024),
        ("lookup p99", "<= 100 us", f"{r.lookup_p99_us:.0f} us", r.lookup_p99_us <= 100),
        ("routed hit rate / exact index's", ">= 95%", f"{r.hit_ratio:.1%}", r.hit_ratio >= 0.95),
        ("restarted router complete", "<= 2 s", f"{r.restart_s:.2f} s",
         r.restart_full and r.restart_s <= 2.0),
    ]  # fmt: skip
    title = (f"Targets, {design} design, at {r.workers:,} workers x "
             f"{r.prefilled_per_worker:,.0f} prefilled tok/s")  # fmt: skip
    lines = [title, "", "| target | goal | measured | met |", "|---|---|---:|---|"]
    lines += [f"| {a} | {b} | {c} | {'yes' if ok else 'no'} |" for a, b, c, ok in checks]
    return "\n".join(lines) + "\n"


ABOUT = """\
What is real: etcd (a fresh one per row, on loopback), the publishers (`SummaryPublisher`, one per
simulated worker, fed block by block as the engine's `KVCacheManager` would), every write they make,
a router's index following etcd by watch (with `RecentRoutes` in the `summary+hints` rows), its
lookups, and a restarted router's rebuild (a new `LocationIndex` reading etcd). Simulated: the
workers (an LRU prefix cache of `capacity` blocks and a prefill clock each), the trace (shared
system prompts with Zipf popularity, multi-turn conversations; each distinct prefix a random 128-bit
hash instead of the sha256 chain) and time: requests arrive so that every worker prefills `rate`
tokens per virtual second; each publisher flushes once per virtual interval (all sharing 4 etcd
connections), and the index catches up with etcd before routing goes on, so watch latency is not in
the figures. Rates are per virtual second; whether etcd could take them in real time is what the
ceiling above (same run, same machine) says. A second cluster routes the same requests by an exact
index of every cached block (no delay): the hit rate to compare with. Routing: lowest estimated time
to first token (wait until idle + uncached tokens / rate) over the holders a lookup reports (the
first 32 per chain position) and the least busy worker. Index memory: tracemalloc of an index
rebuilt from etcd. Lookup times: the last 20,000 prompts looked up again after the run (the
simulator's own objects frozen out of the garbage collector), once each, right after reading its
hashes (as a router has just computed them), in the thread's CPU time (`time.thread_time_ns`): on
this shared 2-core machine other processes preempt the simulator for milliseconds at a time, which
wall-clock percentiles would count. Member-key refreshes (every worker every 3 s, every design) are
added, not simulated."""


def render(
    rows: Sequence[Row],
    ceiling: Sequence[Ceiling],
    command: str,
    wall: float,
    now: str,
    load: Sequence[float],
) -> str:
    ceil = "\n".join(f"| {c.what} | {c.keys_per_s:,.0f} | {c.txns_per_s:,.0f} "
                     f"| {c.mb_per_s:.1f} |" for c in ceiling)  # fmt: skip
    return "\n".join([
        "# Block locations at scale (simulated workers, real publishers, index and etcd)", "",
        f"- date: {now}", f"- command: `{command}` ({wall:.0f} s)",
        "- trace and workers: see below; every worker prefills about 30,000 tokens per virtual "
        "second into an 8,192-block (131,072-token) LRU prefix cache; conversations' turns come "
        "about 2 virtual s apart",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores; load average at the end "
        f"{[round(x, 2) for x in load]}", "",
        table(rows), "", targets(rows, "summary+hints"), targets(rows, "summary"),
        "etcd write ceiling on this machine (one Python client process, 4 connections, 64 "
        "writes in flight; same run)", "",
        "| writes | keys/s | etcd writes (revisions)/s | MB/s |", "|---|---:|---:|---:|",
        ceil, "", ABOUT, "",
    ])  # fmt: skip
