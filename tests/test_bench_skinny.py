"""bench.skinny_gpu's summary and report from a made-up result (the GPU run itself is the
lead's; ``python -m bench.skinny_gpu --dry-run`` checks the script on the CPU)."""

from __future__ import annotations

from bench.skinny_gpu import report, summary


def _step(weights: str, mode: str, batch: int, ms: float, roof: float) -> dict:
    return {"weights": weights, "mode": mode, "batch": batch, "step_ms": ms,
            "roofline_ms": roof, "frac_roofline": roof / ms}  # fmt: skip


def test_summary_takes_the_fastest_mode_per_dtype_and_batch():
    res = {"device": "GPU", "date": "d", "command": "c", "torch": "t", "shape": "s",
           "errors": {}, "seconds": {}, "ceilings": {"copy_TBps": 3.0},
           "steps": [_step("bf16", "old_unfused", 1, 6.2, 5.0),
                     _step("bf16", "new_fused", 1, 5.5, 5.0),
                     _step("bf16", "new_unfused", 8, 5.9, 5.3),
                     _step("fp8", "new_unfused", 1, 3.4, 2.7),
                     _step("fp8", "new_fused", 1, 3.2, 2.7)]}  # fmt: skip
    rows = summary(res)
    assert [r["batch"] for r in rows] == [1]  # batch 8 has no FP8 step: no ratio
    (b1,) = rows
    assert (b1["bf16_mode"], b1["fp8_mode"]) == ("new_fused", "new_fused")
    assert abs(b1["fp8_vs_bf16"] - 3.2 / 5.5) < 1e-9
    md = report(res)
    assert "## Best step per weight dtype" in md and "new_fused" in md and "3.000 TB/s" in md
