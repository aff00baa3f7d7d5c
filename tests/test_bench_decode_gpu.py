"""``python -m bench.decode_gpu --dry-run`` on the CPU (tiny shapes): the script the lead runs on
the GPU works end to end before a device call is spent on it."""

from __future__ import annotations

import json

import pytest

from bench import decode_gpu


def run_dry(tmp_path, *skip: str) -> dict:
    """The dry run with ``skip``ped sections; its JSON result (SystemExit if a section failed)."""
    argv = ["--dry-run", "--out", str(tmp_path), "--date", "2026-11-24"]
    decode_gpu.main([*argv, "--skip", *skip] if skip else argv)
    (out,) = tmp_path.glob("decode_gpu_*.json")
    return json.loads(out.read_text())


def test_the_spec_section_runs_dry(tmp_path, capsys) -> None:
    """The n-gram section replays the CPU traces over verify steps timed on the small shape
    (it once failed: `bench.spec_decode.replay` reads arguments this bench did not give)."""
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
