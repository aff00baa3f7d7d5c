"""bench/step_profile.py: kernels sorted into kinds by name, and the script's tiny CPU run
keeps its whole decode batch through both phases and writes its report and trace."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.step_profile import kind_of, main


def test_kernels_are_sorted_into_kinds_by_name() -> None:
    assert kind_of("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == "matmul"
    assert kind_of("_skinny_kernel") == "matmul"
    assert kind_of("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") == "attention"
    assert kind_of("_silu_and_mul_kernel") == "other"
    assert kind_of("Memcpy DtoH (Device -> Pinned)") == "other"


@pytest.mark.slow  # about 30 s on two CPU cores: the SmolLM2 shape, one engine
def test_step_profile_dry_run_keeps_its_batch_and_writes_the_report(tmp_path) -> None:
    out, trace = tmp_path / "profile.json", tmp_path / "mixed.json.gz"
    assert main(["--dry-run", "--out", str(out), "--trace", str(trace)]) == 0
    report = json.loads(out.read_text())
    assert set(report["phases"]) == {"decode", "mixed"}
    for phase in report["phases"].values():
        assert phase["batch"] == 2  # the dry run's batch, alive in every measured step
        assert phase["ms_per_step_wall"] > 0
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
