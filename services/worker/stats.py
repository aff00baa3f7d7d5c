"""What a worker's Stats RPC reports: its engine's counters, the KV held for decode workers,
whether the block bookkeeping is intact, and what its block-location publisher wrote."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from libkv.cluster.summary_state import SummaryStats

if TYPE_CHECKING:
    from engine.core.client import EngineClient
    from engine.llm_engine import EngineStats


@dataclass(frozen=True, slots=True)
class WorkerStats:
    engine: EngineStats
    worker_id: str
    incarnation: str
    role: str
    held: int  # requests whose prefilled KV waits for a decode worker
    ok: bool  # the block bookkeeping passed `check_integrity`
    locations: SummaryStats | None = None


async def collect(
    engine: EngineClient,
    worker_id: str,
    incarnation: str,
    role: str,
    locations: SummaryStats | None = None,
) -> WorkerStats:
    """The worker's stats now (the engine answers between two steps); ``locations``: what
    its block-location publisher wrote."""
    stats, held, ok = await engine.worker_stats()
    return WorkerStats(stats, worker_id, incarnation, role, held=held, ok=ok, locations=locations)
