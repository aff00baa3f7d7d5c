"""bench/host_tier.py runs end to end in its tiny CPU configuration and writes its report (its
numbers are the GPU's business; here only the script is checked)."""

from __future__ import annotations

import json

import pytest

from bench.host_tier import main


@pytest.mark.slow  # about 75 s on two CPU cores: the SmolLM2 shape, three engines
def test_host_tier_bench_dry_run_writes_every_target(tmp_path) -> None:
    out = tmp_path / "host_tier.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert set(summary) == {"working_set_x", "ttft_p50_speedup", "hit_rate_vs_unbounded",
                            "page_in_vs_pinned", "tpot_busy_vs_quiet"}  # fmt: skip
    assert summary["working_set_x"] >= 2
    runs = report["multi_turn"]
    assert {r["requests"] for r in runs.values()} == {8}
    assert runs["gpu"]["host_hit_blocks"] == 0 and runs["host_tier"]["host_hit_blocks"] > 0
    assert runs["host_tier"]["hit_rate"] > runs["gpu"]["hit_rate"]
    assert runs["host_tier"]["hit_rate"] == runs["unbounded"]["hit_rate"]
    assert report["bandwidth"]["bytes"] == 8 * report["bandwidth"]["block_bytes"]
    assert report["decode"]["busy_blocks_per_step"] > 0
