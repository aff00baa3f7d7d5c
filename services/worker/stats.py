"""What a worker's Stats RPC reports: its engine's counters, the KV held for decode workers,
whether the block bookkeeping is intact, and what its block-location publisher wrote."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from libkv.block_pool import IntegrityError
from libkv.cluster.summary_state import SummaryStats

if TYPE_CHECKING:
    from engine.llm_engine import EngineStats, LLMEngine


@dataclass(frozen=True, slots=True)
class WorkerStats:
    engine: EngineStats
    worker_id: str
    incarnation: str
    role: str
    held: int  # requests whose prefilled KV waits for a decode worker
    ok: bool  # the block bookkeeping passed `check_integrity`
    locations: SummaryStats | None = None


def collect(engine: LLMEngine, worker_id: str, incarnation: str, role: str) -> WorkerStats:
    """The worker's stats now (takes the engine lock: call from a worker thread)."""
    try:
        engine.check_integrity()
        ok = True
    except IntegrityError:
        ok = False
    return WorkerStats(
        engine.stats(),
        worker_id,
        incarnation,
        role,
        held=engine.num_held,
        ok=ok,
        locations=getattr(engine.kv.listener, "stats", None),  # a SummaryPublisher's
    )
