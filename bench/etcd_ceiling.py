"""This machine's etcd write ceiling: puts/s that one client process gets through, measured in
the same run as the block-location simulator (``bench/location_sim.py``) as its reference."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from libkv.cluster.etcd_follow import EtcdConnection

PREFIX = b"/tandem/v1/ceiling/"


@dataclass(frozen=True, slots=True)
class Ceiling:
    what: str
    keys_per_s: float  # keys written per second
    txns_per_s: float  # etcd writes (revisions) per second
    mb_per_s: float  # key + value bytes per second


async def measure(
    conns: list[EtcdConnection],
    value_size: int,
    ops_per_txn: int = 1,
    seconds: float = 3.0,
    in_flight: int = 64,
) -> Ceiling:
    """Keep ``in_flight`` writes going over ``conns`` for ``seconds``: each a put of one key (or
    a transaction of ``ops_per_txn`` puts) with a ``value_size``-byte value under a lease."""
    lease = await conns[0].client.lease(600)
    value = b"x" * value_size
    done = [0]
    deadline = time.monotonic() + seconds

    async def writer(k: int) -> None:
        client = conns[k % len(conns)].client
        n = 0
        while time.monotonic() < deadline:
            keys = [PREFIX + f"{k}/{(n + j) % 1000}".encode() for j in range(ops_per_txn)]
            if ops_per_txn == 1:
                await client.put(keys[0], value, lease=lease.id)
            else:
                ops = [client.transactions.put(key, value, lease=lease.id) for key in keys]
                await client.transaction(compare=[], success=ops, failure=[])
            n += ops_per_txn
            done[0] += 1

    t0 = time.monotonic()
    await asyncio.gather(*(writer(k) for k in range(in_flight)))
    elapsed = time.monotonic() - t0
    await conns[0].client.revoke_lease(lease.id)
    txns = done[0] / elapsed
    key_bytes = len(PREFIX) + 8
    what = f"{value_size} B values" + (f", {ops_per_txn} puts per txn" if ops_per_txn > 1 else "")
    return Ceiling(what, txns * ops_per_txn, txns,
                   txns * ops_per_txn * (key_bytes + value_size) / 1e6)  # fmt: skip


async def ceilings(conns: list[EtcdConnection], seconds: float = 3.0) -> list[Ceiling]:
    """Small puts, puts of a typical summary delta (4 KiB), and 128-put transactions (the old
    per-block design's batches)."""
    return [
        await measure(conns, 128, seconds=seconds),
        await measure(conns, 4096, seconds=seconds),
        await measure(conns, 8, ops_per_txn=128, seconds=seconds, in_flight=8),
    ]
