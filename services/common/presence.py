"""A worker's presence in etcd: its member key and the block-location summaries published under
the same lease (``libkv.summary_publisher``), started and stopped together."""

from __future__ import annotations

import argparse
import os

from engine import LLMEngine
from libkv.etcd_follow import Endpoints
from libkv.registry import Registration
from libkv.summary_publisher import SummaryConfig, SummaryPublisher


def add_location_flags(p: argparse.ArgumentParser) -> None:
    """Routing granularity and write bounds of the block locations a worker publishes."""
    env = os.environ.get
    p.add_argument(
        "--kv-location-blocks",
        type=int,
        default=int(env("TANDEM_KV_LOCATION_BLOCKS", "4")),
        help="finest routing granularity: every N-th block of the prefix hash chain is "
        "published (plus the last block of every cached prompt); coarsened under load",
    )
    p.add_argument(
        "--kv-location-interval",
        type=float,
        default=float(env("TANDEM_KV_LOCATION_INTERVAL", "1.0")),
        help="seconds between block-location writes to etcd (one key each: a delta or a snapshot)",
    )
    p.add_argument(
        "--kv-location-budget",
        type=int,
        default=int(env("TANDEM_KV_LOCATION_BUDGET", "256")),
        help="block-location entry changes per second before the granularity is coarsened",
    )


def location_config(args: argparse.Namespace) -> SummaryConfig:
    return SummaryConfig(
        base=args.kv_location_blocks,
        interval=args.kv_location_interval,
        budget=args.kv_location_budget,
    )


class Presence:
    """The registration plus the location publisher attached to the engine's prefix cache."""

    def __init__(self, registration: Registration, publisher: SummaryPublisher) -> None:
        self.registration = registration
        self.publisher = publisher

    @classmethod
    def start(
        cls,
        endpoints: Endpoints,
        registration: Registration,
        engine: LLMEngine,
        config: SummaryConfig,
    ) -> Presence:
        """Publish what ``engine`` caches from now on, under ``registration``'s lease."""
        member = registration.member
        publisher = SummaryPublisher(
            endpoints, member.worker_id, member.incarnation, registration, config
        )
        engine.kv.set_listener(publisher)
        publisher.start()
        return cls(registration, publisher)

    async def stop(self) -> None:
        """Stop publishing, then revoke the lease (which deletes member key and locations)."""
        await self.publisher.stop()
        await self.registration.stop()
