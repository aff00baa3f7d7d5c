"""lab.skinny_gpu's summary and report from a made-up result (the GPU run itself is the
lead's; ``python -m lab.skinny_gpu --dry-run`` checks the script on the CPU)."""

from __future__ import annotations

from lab.skinny_gpu import report, summary


def _step(weights: str, mode: str, batch: int, ms: float, roof: float) -> dict:
    return {"weights": weights, "mode": mode, "batch": batch, "step_ms": ms,
            "roofline_ms": roof, "frac_roofline": roof / ms}  # fmt: skip


def test_summary_takes_the_fastest_mode_per_dtype_and_batch():
    res = {"device": "GPU", "date": "d", "command": "c", "torch": "t", "shape": "s",
           "errors": {}, "seconds": {}, "ceilings": {"copy_TBps": 3.0},
           "steps": [_step("bf16", "step", 1, 6.2, 5.0),
                     _step("bf16", "step_pdl", 1, 5.5, 5.0),
                     _step("bf16", "step", 8, 5.9, 5.3),
                     _step("fp8", "step", 1, 3.4, 2.7),
                     _step("fp8", "step_pdl", 1, 3.2, 2.7)]}  # fmt: skip
    rows = summary(res)
    assert [r["batch"] for r in rows] == [1]  # batch 8 has no FP8 step: no ratio
    (b1,) = rows
    assert (b1["bf16_mode"], b1["fp8_mode"]) == ("step_pdl", "step_pdl")
    assert abs(b1["fp8_vs_bf16"] - 3.2 / 5.5) < 1e-9
    md = report(res)
    assert "## Best step per weight dtype" in md and "step_pdl" in md and "3.000 TB/s" in md


def test_report_lists_pdl_modes_and_the_plans_the_steps_used():
    pdl = {**_step("fp8", "step_pdl", 8, 3.0, 2.7), "same_as_no_pdl": True}
    plans = [{"weights": "fp8", "batch": 8, "qkv": "fma_n4_k1024_w4_s3_sk1", "o_proj": "x",
              "gate_up": "y", "down": "z", "lm_head": "w"}]  # fmt: skip
    res = {"device": "GPU", "date": "d", "command": "c", "torch": "t", "shape": "s",
           "errors": {}, "seconds": {},
           "steps": {"rows": [_step("bf16", "step", 8, 5.9, 5.3),
                              _step("fp8", "step", 8, 3.4, 2.7), pdl],
                     "plans": plans, "plans_source": "--plans p.json"}}  # fmt: skip
    (b8,) = summary(res)
    assert b8["fp8_mode"] == "step_pdl" and abs(b8["fp8_vs_bf16"] - 3.0 / 5.9) < 1e-9
    md = report(res)
    assert "same_as_no_pdl" in md and "| True |" in md
    assert "Skinny plans the steps used (--plans p.json)" in md
    assert "fma_n4_k1024_w4_s3_sk1" in md
