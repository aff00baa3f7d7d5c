"""``python -m lab.decode_gpu --dry-run`` on the CPU (tiny shapes): the script the lead runs on
the GPU works end to end before a device call is spent on it."""

from __future__ import annotations

import json

import pytest

from lab import decode_gpu


def run_dry(tmp_path, *skip: str) -> dict:
    """The dry run with ``skip``ped sections; its JSON result (SystemExit if a section failed)."""
    argv = ["--dry-run", "--out", str(tmp_path), "--date", "2026-11-24"]
    decode_gpu.main([*argv, "--skip", *skip] if skip else argv)
    (out,) = tmp_path.glob("decode_gpu_*.json")
    return json.loads(out.read_text())


def test_the_spec_section_runs_dry(tmp_path, capsys) -> None:
    """The n-gram section replays the CPU traces over verify steps timed on the small shape
    (it once failed: `lab.spec_decode.replay` reads arguments this bench did not give)."""
    res = run_dry(tmp_path, *(s for s in decode_gpu.SECTIONS if s != "spec"))
    assert res["errors"] == {} and set(res["seconds"]) == {"spec"}
    spec = res["spec"]
    assert spec["mode"] == "replay" and spec["shape"] == "smollm2-135m" and "draft" not in spec
    assert spec["rows"] and all(r["projected_speedup"] > 0 for r in spec["rows"])
    assert set(spec["step_ms"]) == {str(d) for d in range(len(spec["step_ms"]))}
    assert "N-gram speculative decoding" in capsys.readouterr().out


@pytest.mark.slow
def test_every_section_runs_dry(tmp_path) -> None:
    """All nine sections (about a minute and a half on two shared cores)."""
    res = run_dry(tmp_path)
    assert res["errors"] == {}
    assert set(res["seconds"]) == set(decode_gpu.SECTIONS)


def test_the_fp8_weights_section_times_the_lm_head_in_fp8_too(tmp_path, capsys) -> None:
    """FP8 steps with the LM head in bf16 and in FP8 (``quantize_lm_head``), each against the
    same bf16 steps; the head goes back to bf16 for the sections after."""
    res = run_dry(
        tmp_path, *(s for s in decode_gpu.SECTIONS if s not in ("ceilings", "fp8_weights"))
    )
    assert res["errors"] == {}
    rows = res["fp8_weights"]
    assert [(r["fp8"], r["batch"]) for r in rows] == [
        ("weights", 1), ("weights", 8), ("weights+lm_head", 1), ("weights+lm_head", 8)
    ]  # fmt: skip
    for head, w8 in zip(rows[2:], rows[:2], strict=True):
        assert head["bf16_ms"] == w8["bf16_ms"] and head["ratio"] == head["fp8_ms"] / w8["bf16_ms"]
        assert head["vs_fp8"] == head["fp8_ms"] / w8["fp8_ms"] > 0
    assert "weights+lm_head" in capsys.readouterr().out
