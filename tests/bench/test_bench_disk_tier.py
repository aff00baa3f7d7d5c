"""bench/disk_tier.py runs end to end in its tiny CPU configuration and writes its report (its
numbers are the GPU's business; here only the script is checked)."""

from __future__ import annotations

import json

import pytest

from bench.disk_tier import main


@pytest.mark.slow  # about 20 s on two CPU cores: the SmolLM2 shape, four engines
def test_disk_tier_bench_dry_run_writes_every_target(tmp_path) -> None:
    out = tmp_path / "disk_tier.json"
    assert main(["--dry-run", "--out", str(out), "--disk-dir", str(tmp_path / "kv")]) == 0
    report = json.loads(out.read_text())
    assert set(report["summary"]) == {
        "working_set_blocks", "working_set_x_pool", "ttft_p50_host_vs_none",
        "ttft_p50_host_disk_vs_host", "ttft_p50_cold_vs_host", "disk_in_cold_vs_pinned",
    }  # fmt: skip
    runs = report["multi_turn"]
    assert {r["requests"] for r in runs.values()} == {12}
    assert runs["none"]["disk_hit_blocks"] == runs["host"]["disk_hit_blocks"] == 0
    assert runs["host_disk"]["disk_hit_blocks"] > 0
    assert runs["host_disk_cold"]["disk_hit_blocks"] > 0
    assert runs["host_disk"]["hit_rate"] > runs["host"]["hit_rate"]
    assert report["bandwidth"]["bytes"] == 8 * report["bandwidth"]["block_bytes"]
    assert list((tmp_path / "kv").iterdir()) == []  # every engine removed its file
