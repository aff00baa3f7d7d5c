"""The worker runtime's messages (with services.common.codec, its only pb2 user)."""

from __future__ import annotations

from tandem.v1 import common_pb2

from libkv.cluster.summary_state import SummaryStats
from services.worker.stats import WorkerStats


def stats_to_pb(s: WorkerStats) -> common_pb2.WorkerStats:
    loc = s.locations or SummaryStats()
    e = s.engine
    return common_pb2.WorkerStats(
        location_txns=loc.txns,
        location_puts=loc.puts,
        location_deletes=loc.deletes,
        worker_id=s.worker_id,
        incarnation=s.incarnation,
        queue_length=e.num_waiting,
        running=e.num_running,
        kv_blocks_total=e.kv_blocks_total,
        kv_blocks_used=e.kv_blocks_used,
        kv_blocks_cached=e.kv_blocks_cached,
        prefix_hit_tokens=e.prefix_hit_tokens,
        prompt_tokens=e.prompt_tokens,
        preemptions=e.num_preemptions,
        held_requests=s.held,
        integrity_ok=s.ok,
        role=s.role,
    )
