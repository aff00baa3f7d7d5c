"""A worker's presence in etcd: its member key (role, model, address, incarnation, KV capacity,
load and pace, hand-off record) and the block-location summaries published under the same lease
(``libkv.cluster.summary_publisher``), started and stopped together."""

from __future__ import annotations

from typing import TYPE_CHECKING

from libkv.cluster.etcd_follow import Endpoints
from libkv.cluster.registry import Member, MemberLoad, Registration
from libkv.cluster.summary_publisher import SummaryConfig, SummaryPublisher
from libkv.cluster.tiers import HOST, tier_incarnation
from libkv.kv_layout import LAYOUT_KEY
from services.worker.config import WorkerConfig
from services.worker.pace import PaceMeter

if TYPE_CHECKING:
    from engine.core.client import EngineClient


class Presence:
    """The registration plus the location publishers attached to the engine's prefix cache
    and, when it has one, its host tier (``libkv.cluster.tiers``)."""

    def __init__(
        self,
        registration: Registration,
        publisher: SummaryPublisher,
        host: SummaryPublisher | None = None,
    ) -> None:
        self.registration = registration
        self.publisher = publisher
        self.host_publisher = host

    @classmethod
    def start(
        cls,
        endpoints: Endpoints,
        registration: Registration,
        engine: EngineClient,
        config: SummaryConfig,
    ) -> Presence:
        """Publish what ``engine`` caches from now on, under ``registration``'s lease."""
        member = registration.member
        publisher = SummaryPublisher(
            endpoints, member.worker_id, member.incarnation, registration, config
        )
        host = None
        if engine.info.host_blocks:
            inc = tier_incarnation(member.incarnation, HOST)
            host = SummaryPublisher(endpoints, member.worker_id, inc, registration, config)
            engine.set_host_listener(host)
            host.start()
        engine.set_listener(publisher)
        publisher.start()
        return cls(registration, publisher, host)

    async def stop(self) -> None:
        """Stop publishing, then revoke the lease (which deletes member key and locations)."""
        await self.publisher.stop()
        if self.host_publisher is not None:
            await self.host_publisher.stop()
        await self.registration.stop()


async def register(
    config: WorkerConfig,
    address: str,
    engine: EngineClient,
    incarnation: str,
    extra: dict[str, str] | None = None,
    pace: PaceMeter | None = None,
) -> Presence | None:
    """Register this worker in etcd and publish its cached prefixes under the same lease
    (None when no etcd is configured); ``pace``: its measured speed, reported with its load."""
    if not config.etcd:
        return None

    def load() -> MemberLoad:  # the engine's counters as of its latest step
        assert engine.snapshot is not None
        s = engine.snapshot.stats
        measured = pace.report() if pace is not None else None
        return MemberLoad(
            queue_length=s.num_waiting,
            running=s.num_running,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_free=s.kv_blocks_total - s.kv_blocks_used,
            prefill_backlog=s.prefill_backlog,
            prefill_tokens_per_s=measured.prefill_tokens_per_s if measured else 0.0,
            decode_step_ms=measured.decode_step_ms if measured else 0.0,
            max_batched_tokens=config.max_num_batched_tokens,
        )

    member = Member(
        worker_id=config.worker_id,
        role=config.role,
        model=config.model_name,
        address=address,
        kv_blocks_total=engine.info.num_blocks,
        block_size=config.block_size,
        incarnation=incarnation,
        extra={**(extra or {}), LAYOUT_KEY: engine.info.layout.to_json()},
        tensor_parallel_size=config.tensor_parallel_size,
    )
    registration = await Registration.start(
        list(config.etcd),
        member,
        ttl=config.member_ttl,
        refresh=config.member_refresh,
        load_fn=load,
    )
    return Presence.start(list(config.etcd), registration, engine, config.locations)
