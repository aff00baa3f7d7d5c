"""The lab's checked-KV benchmarks run small (``lab.kv_checksum``, ``lab.kv_launch_host``;
with CUDA also ``lab.kv_check_peer``): ``python -m pytest lab/tests`` (``-m gpu`` on a GPU host).
They were the product tests' last cases until the benchmarks left ``bench/``."""

from __future__ import annotations

import json
import os

import pytest
import torch

BLOCK_BYTES = 256 * 1024
TWO = torch.cuda.is_available() and torch.cuda.device_count() > 1


def test_the_check_bench_runs_dry(tmp_path, capsys) -> None:
    """``lab.kv_checksum --dry-run`` runs the A/B of the check's kernel arms on the torch
    references (the transport's arms need CUDA: ``tests/gpu/test_kv_checked_gpu.py``)."""
    import json

    from lab import kv_checksum

    assert kv_checksum.main(["--dry-run", "--stack-handoff-ms", "2.5", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kv_checksum_cpu_wsum64.json").read_text())
    assert [r["tokens"] for r in rows] == [40, 100]
    ab = rows[0]["ab_kernels"]
    assert ab["pairs"] == 6 and ab["stack_handoff_ms"] == 2.5 and ab["a_ms"] > 0
    assert "ab_transport" not in rows[0]
    assert "of 2.5 ms" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_check_bench_runs_dry_on_the_gpu(tmp_path, capsys) -> None:
    """``lab.kv_checksum --dry-run --device cuda``: both A/B pairs of arms run, the transport
    one through the compare behind the copy (the bench refuses a verify on the device)."""
    import json

    from lab import kv_checksum

    # The sender's pool goes on the current GPU: GPU 0 (another test may have left it at 1).
    with torch.cuda.device(0):
        assert kv_checksum.main(["--dry-run", "--device", "cuda", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kv_checksum_cuda_wsum64.json").read_text())
    if torch.cuda.device_count() > 1:  # the bench moves to the second GPU: no one-GPU A/B
        assert rows[-1]["dst_device"] == "cuda:1" and "ab_transport" not in rows[-1]
        return  # (`test_kv_checked_peer_gpu.py` measures the check between two GPUs)
    ab = rows[-1]["ab_transport"]
    assert ab["compared_fetches"] == ab["fused_fetches"] > 0 and ab["device_verifies"] == 0
    assert ab["behind_fetches"] == ab["compared_fetches"]  # the compare behind the copy
    assert {"ab_kernels", "checked_device_overhead"} <= rows[0].keys()
    assert ab["launch_b_us"] > 0 and rows[0]["ab_kernels"]["host_b_us"] > 0
    assert ab["launch_b_med_us"] > 0 and rows[-1]["ab_transport_runs"]["launch_a_med_us"] > 0
    runs = rows[-1]["ab_transport_runs"]  # the check of runs, nothing uploaded
    assert runs["behind"] and runs["run_fetches"] == runs["compared_fetches"] > 0
    assert ab["run_fetches"] == 0 and rows[0]["device_runs_check_ms"] > 0
    assert rows[0]["device_memcpy_run_ms"] > 0 and rows[0]["device_checked_run_ms"] > 0
    launches = rows[-1]["triton_launches"]  # both arms' copies straight through, once compiled
    assert launches["sum"]["fast"] > 0 and launches["copy"]["fast"] > 0
    assert launches["runs"]["fast"] > 0 and launches["compare"]["fast"] > 0
    assert not any(v["broken"] for v in launches.values())
    out = capsys.readouterr().out
    assert "ab_transport: A = fetch+verify, sums off" in out and "Triton launches" in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_peer_check_bench_runs(tmp_path, capsys) -> None:
    from lab import kv_check_peer

    rc = kv_check_peer.main(["--tokens", "64", "128", "--block-bytes", str(BLOCK_BYTES),
                             "--pairs", "4", "--repeat", "2", "--stack-handoff-ms", "128=0.5",
                             "--interference", "1", "--timeline", "2",
                             "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    out = json.loads((tmp_path / "kv_check_peer.json").read_text())
    assert [r["tokens"] for r in out["rows"]] == [64, 128]
    for r in out["rows"]:
        assert r["device_copy_ms"] > 0 and r["device_checked_run_ms"] > 0
        ab = r["ab_run"]
        assert ab["compared_fetches"] > 0
        # one contiguous run: by the SM copy that sums on one GPU, the copy engines from another
        assert (ab["peer_run_fetches"] > 0) == TWO and (ab["run_fetches"] > 0) == (not TWO)
        assert r["chunked_copy_over_copy"] > 0 and r["trailing_check_by_trail_and_ratio"]
        assert (
            r["interference"]["victim_alone_ms"] > 0
            and r["interference"]["victim_with_ce_check"] > 0
        )
        assert r["ab_scattered"]["compared_fetches"] > 0
        # op by op: both ways queued a copy, sums on a sum and a compare behind it too
        tl = r["timeline"]
        assert tl["off"]["windows"] == tl["on"]["windows"] == 2
        assert tl["on"]["busy"] > 0 and tl["on"]["after_copy"] is not None
        assert len(tl["on"]["ops"]) > len(tl["off"]["ops"])
        assert (tmp_path / f"timeline_{r['tokens']}.json.gz").stat().st_size > 0
    assert out["rows"][1]["ab_run"]["of_stack_handoff"] is not None
    assert "| 128 |" in (tmp_path / "kv_check_peer.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="times the launches on a CPU only")
def test_the_launch_host_time_bench_runs(tmp_path):
    """``lab.kv_launch_host`` (in a process of its own: it patches torch and Triton) times
    both launch paths of the three launches and prints what sums on adds over sums off."""
    pytest.importorskip("triton", reason="needs triton (PYTHONPATH=/tmp/triton-N)")
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [sys.executable, "-m", "lab.kv_launch_host", "--blocks", "4", "--calls", "200"],
        capture_output=True, text=True, env=env, timeout=120, check=True,
    )  # fmt: skip
    lines = run.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[2:5]] == ["copy", "check,", "check,"]
    assert all(float(x) > 0 for ln in lines[2:5] for x in ln.split()[-2:])
    assert lines[5].startswith("sums on over sums off: kernel[grid] with views")
    assert "ONE contiguous run" in lines[7]  # the transport's host work per fetch
    assert [int(ln.split()[0]) for ln in lines[9:12]] == [64, 128, 256]
    assert all(float(x) > 0 for ln in lines[9:12] for x in ln.split()[1:3])
