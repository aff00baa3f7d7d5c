"""A worker's presence in etcd: its member key and the block locations published under the same
lease (``libkv.locations``), started and stopped together."""

from __future__ import annotations

import argparse
import os

from engine import LLMEngine
from libkv.etcd_follow import Endpoints
from libkv.locations import LocationPublisher, PublisherConfig
from libkv.registry import Registration


def add_location_flags(p: argparse.ArgumentParser) -> None:
    """Routing granularity and write bounds of the block locations a worker publishes."""
    env = os.environ.get
    p.add_argument(
        "--kv-location-blocks",
        type=int,
        default=int(env("TANDEM_KV_LOCATION_BLOCKS", "4")),
        help="publish every N-th block of the prefix hash chain (routing granularity)",
    )
    p.add_argument(
        "--kv-location-interval",
        type=float,
        default=float(env("TANDEM_KV_LOCATION_INTERVAL", "0.25")),
        help="seconds between block-location transactions (at most 128 keys each)",
    )


def location_config(args: argparse.Namespace) -> PublisherConfig:
    return PublisherConfig(every=args.kv_location_blocks, interval=args.kv_location_interval)


class Presence:
    """The registration plus the location publisher attached to the engine's prefix cache."""

    def __init__(self, registration: Registration, publisher: LocationPublisher) -> None:
        self.registration = registration
        self.publisher = publisher

    @classmethod
    def start(
        cls,
        endpoints: Endpoints,
        registration: Registration,
        engine: LLMEngine,
        config: PublisherConfig,
    ) -> Presence:
        """Publish what ``engine`` caches from now on, under ``registration``'s lease."""
        member = registration.member
        publisher = LocationPublisher(
            endpoints, member.worker_id, member.incarnation, registration, config
        )
        engine.kv.set_listener(publisher)
        publisher.start()
        return cls(registration, publisher)

    async def stop(self) -> None:
        """Stop publishing, then revoke the lease (which deletes member key and locations)."""
        await self.publisher.stop()
        await self.registration.stop()
