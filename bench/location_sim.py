"""Block locations at cluster scale: N simulated workers, the real publishers and index, real etcd.

    python -m bench.location_sim --workers 10,100,1000 --out bench/results/location_scale

Real: etcd (a fresh one per row, on loopback), the publishers (``SummaryPublisher``) fed block
by block as ``KVCacheManager`` would,
their writes, the router's index following etcd by watch, its lookups, and a restarted
router's rebuild. Simulated: the workers (an LRU prefix cache and a prefill clock each,
``bench/location_cluster.py``), the trace (``bench/location_trace.py``) and time. Time is
virtual: requests arrive so that the workers prefill ``--rate`` tokens/s each, and every
publisher flushes once per virtual interval (all of them sharing 4 etcd connections); after
each round the index catches up with etcd before routing goes on. Rates are per virtual
second; whether etcd could take them in real time is what the write ceiling, measured in the
same run, tells. An oracle cluster routes the same requests by an exact index of what every
worker caches: the hit rate to compare with.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.etcd_ceiling import Ceiling, ceilings
from bench.location_report import Row, render
from bench.location_run import DESIGNS, Sim, SimConfig, run_closing
from libkv.cluster.etcd_follow import EtcdConnection
from services.launcher.etcd import EtcdServer


async def run_all(args: argparse.Namespace) -> tuple[list[Row], list]:
    rows, ceiling = [], []
    for n in [int(x) for x in args.workers.split(",")]:
        for design in args.designs.split(","):
            with EtcdServer() as etcd:
                conns = [EtcdConnection(etcd.endpoint, 60, "sim") for _ in range(4)]
                if not ceiling:
                    ceiling = await ceilings(conns)
                    print(*(f"etcd ceiling: {c}" for c in ceiling), sep="\n", flush=True)
                cfg = SimConfig(n, design, args.rate, args.capacity, args.warmup, args.measure,
                                args.think, args.budget, args.interval)  # fmt: skip
                row = await run_closing(Sim(cfg, etcd.endpoint, conns))
            print(row, flush=True)
            rows.append(row)
    return rows, ceiling


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", default="10,100,1000")
    p.add_argument("--designs", default=",".join(DESIGNS))
    p.add_argument("--rate", type=float, default=30_000.0, help="prefilled tokens/s per worker")
    p.add_argument("--capacity", type=int, default=8192, help="prefix-cache blocks per worker")
    p.add_argument("--warmup", type=float, default=0.0, help="virtual s (0: fill the caches)")
    p.add_argument("--measure", type=float, default=3.0, help="virtual s measured")
    p.add_argument("--interval", type=float, default=1.0, help="summary: s between writes")
    p.add_argument("--think", type=float, default=2.0, help="virtual s between turns")
    p.add_argument("--budget", type=int, default=256, help="summary entry changes/s/worker")
    p.add_argument("--out", default="", help="write OUT.md and OUT.json")
    p.add_argument("--from-json", default="", help="only render the .md of an earlier run")
    args = p.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        rows = [Row(**r) for r in data["rows"]]
        ceiling = [Ceiling(**c) for c in data["ceiling"]]
        command, wall, date = data["command"], data["wall_s"], data["date"]
        load = data["loadavg"]
    else:
        t0 = time.monotonic()
        rows, ceiling = asyncio.run(run_all(args))
        command = "python -m bench.location_sim " + " ".join(sys.argv[1:] if argv is None else argv)
        wall = time.monotonic() - t0
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        load = [round(x, 2) for x in os.getloadavg()]
    text = render(rows, ceiling, command, wall, date, load)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(text)
        if not args.from_json:
            data = {"command": command, "date": date, "wall_s": wall, "loadavg": load,
                    "rows": [asdict(r) for r in rows],
                    "ceiling": [asdict(c) for c in ceiling]}  # fmt: skip
            out.with_suffix(".json").write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
