"""How long a restarted router takes to rebuild the block-location index, by index size.

    python -m lab.location_restart --workers 1000 --entries 330,1100,2200

Writes, into a fresh etcd on loopback, what ``workers`` summary publishers would hold: one
snapshot of ``entries`` random entries per worker plus a full ring of deltas (``RING`` deltas,
each adding ``entries / RING / 2`` entries and removing as many of the snapshot's: together as
large as the snapshot, when the publisher would write a new one), then times a new
``LocationIndex`` from
start to complete, and the memory of the index (tracemalloc). Complements
``bench/location_sim.py``, whose workers cache 8,192 blocks each (~330 entries at granularity
32); a GPU worker's prefix cache is larger.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import tracemalloc

from libkv.cluster.etcd_follow import EtcdConnection, read_prefix
from libkv.cluster.location_summary import (
    DELTA,
    LOCATIONS_PREFIX,
    RING,
    SNAPSHOT,
    Summary,
    delta_key,
    snapshot_key,
)
from libkv.cluster.summary_index import LocationIndex, SummaryIndex
from services.launcher.etcd import EtcdServer


async def fill(etcd: EtcdConnection, workers: int, entries: int, rng: random.Random) -> int:
    """Put every worker's snapshot and delta ring; returns the bytes written."""
    lease = await etcd.client.lease(600)
    sem, written = asyncio.Semaphore(64), [0]

    async def put(key: bytes, value: bytes) -> None:
        async with sem:
            await etcd.client.put(key, value, lease=lease.id)
            written[0] += len(key) + len(value)

    puts = []
    for w in range(workers):
        snap = [rng.getrandbits(64) for _ in range(entries)]
        puts.append(put(snapshot_key(f"w{w}", "i0"), Summary(SNAPSHOT, 1, 0, 32, 4, snap).encode()))
        k = max(entries // RING // 2, 1)
        for seq in range(1, RING + 1):
            delta = Summary(DELTA, 1, seq, 32, 4, [rng.getrandbits(64) for _ in range(k)],
                            snap[(seq - 1) * k : seq * k])  # fmt: skip
            puts.append(put(delta_key(f"w{w}", "i0", seq), delta.encode()))
    await asyncio.gather(*puts)
    return written[0]


async def measure(workers: int, entries: int) -> str:
    with EtcdServer() as server:
        etcd = EtcdConnection(server.endpoint, 60, "bench")
        nbytes = await fill(etcd, workers, entries, random.Random(entries))
        t0 = time.perf_counter()
        index = await LocationIndex.start(server.endpoint, timeout=60)
        elapsed = time.perf_counter() - t0
        total = index.entries()
        await index.stop()
        items, _ = await read_prefix(etcd, LOCATIONS_PREFIX.encode())
        tracemalloc.start()
        sink = SummaryIndex()
        sink.reset(items)
        memory = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        await etcd.close()
    return (f"| {workers:,} | {entries:,} | {total:,} | {nbytes / 2**20:.1f} | {elapsed:.2f} "
            f"| {memory / 2**20:.0f} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=1000)
    p.add_argument("--entries", default="330,1100,2200", help="snapshot entries per worker")
    args = p.parse_args()
    print("| workers | snapshot entries/worker | index entries | etcd MiB read | restart s "
          "| index MiB |\n|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for entries in (int(e) for e in args.entries.split(",")):
        print(asyncio.run(measure(args.workers, entries)), flush=True)


if __name__ == "__main__":
    main()
