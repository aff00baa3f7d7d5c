"""The KV tiers on a worker's Prometheus endpoint: occupancy and hits per tier, bytes and copy
seconds paged out and in, preempted sequences resumed by swap or recompute."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.core.messages import Snapshot
from engine.llm_engine import EngineStats
from libkv.host_tier import TierStats
from services.observability.engine import EngineCollector


class Client:
    snapshot: Snapshot | None = None


def samples(reg: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(reg).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(stats: EngineStats) -> dict[tuple[str, tuple], float]:
    client = Client()
    client.snapshot = Snapshot(stats, num_held=0)
    reg = CollectorRegistry()
    reg.register(EngineCollector(client))  # type: ignore[arg-type]
    return samples(reg)


def test_tiers_are_reported_per_tier_and_direction() -> None:
    tier = TierStats(capacity_blocks=1000, used_blocks=250, block_bytes=4096, block_size=16,
                     hit_blocks=3, page_out_blocks=10, page_in_blocks=3, swaps=2, recomputes=1,
                     cancelled=4, page_out_seconds=0.5, page_in_seconds=0.25)  # fmt: skip
    got = scrape(EngineStats(0, 1, 100, 40, 10, 5, 80, 256, tier=tier))
    assert got[("tandem_engine_kv_tier_capacity_blocks", (("tier", "host"),))] == 1000
    assert got[("tandem_engine_kv_tier_capacity_blocks", (("tier", "gpu"),))] == 100
    assert got[("tandem_engine_kv_tier_used_blocks", (("tier", "host"),))] == 250
    assert got[("tandem_engine_kv_tier_used_blocks", (("tier", "gpu"),))] == 50
    assert got[("tandem_engine_kv_tier_hit_tokens_total", (("tier", "host"),))] == 48
    assert got[("tandem_engine_kv_tier_hit_tokens_total", (("tier", "gpu"),))] == 32
    assert got[("tandem_engine_kv_tier_page_bytes_total", (("direction", "out"),))] == 40960
    assert got[("tandem_engine_kv_tier_page_bytes_total", (("direction", "in"),))] == 12288
    assert got[("tandem_engine_kv_tier_page_seconds_total", (("direction", "in"),))] == 0.25
    assert got[("tandem_engine_preemption_resumes_total", (("how", "swap"),))] == 2
    assert got[("tandem_engine_preemption_resumes_total", (("how", "recompute"),))] == 1
    assert got[("tandem_engine_kv_tier_cancelled_page_outs_total", ())] == 4


def test_without_a_host_tier_only_the_gpu_tier_is_reported() -> None:
    got = scrape(EngineStats(0, 1, 100, 40, 10, 5, 80, 256))
    assert got[("tandem_engine_kv_tier_used_blocks", (("tier", "gpu"),))] == 50
    assert got[("tandem_engine_kv_tier_hit_tokens_total", (("tier", "gpu"),))] == 80
    assert not any(labels == (("tier", "host"),) for _, labels in got)
    assert not any(name.startswith("tandem_engine_kv_tier_page") for name, _ in got)


def test_the_disk_tier_is_reported_as_its_own_tier() -> None:
    host = TierStats(capacity_blocks=100, used_blocks=90, block_bytes=4096, block_size=16,
                     hit_blocks=1, page_in_blocks=1)  # fmt: skip
    disk = TierStats(capacity_blocks=5000, used_blocks=700, block_bytes=4096, block_size=16,
                     hit_blocks=2, page_out_blocks=700, page_in_blocks=2,
                     page_out_seconds=1.5, page_in_seconds=0.125)  # fmt: skip
    got = scrape(EngineStats(0, 1, 100, 40, 10, 5, 80, 256, tier=host, disk_tier=disk))
    assert got[("tandem_engine_kv_tier_capacity_blocks", (("tier", "disk"),))] == 5000
    assert got[("tandem_engine_kv_tier_used_blocks", (("tier", "disk"),))] == 700
    assert got[("tandem_engine_kv_tier_hit_tokens_total", (("tier", "disk"),))] == 32
    assert got[("tandem_engine_kv_tier_hit_tokens_total", (("tier", "host"),))] == 16
    assert got[("tandem_engine_kv_tier_hit_tokens_total", (("tier", "gpu"),))] == 32  # 80 - 48
    assert got[("tandem_engine_kv_disk_tier_bytes_total", (("direction", "out"),))] == 700 * 4096
    assert got[("tandem_engine_kv_disk_tier_bytes_total", (("direction", "in"),))] == 2 * 4096
    assert got[("tandem_engine_kv_disk_tier_seconds_total", (("direction", "in"),))] == 0.125
