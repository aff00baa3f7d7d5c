"""`lab.kv_timeline`'s reading of a profiler trace: windows, ops matched to their launches,
and the medians (the profiling itself needs CUDA: `test_kv_checked_peer_gpu.py` runs it)."""

from __future__ import annotations

from lab import kv_timeline


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace(shift: float, gap: float) -> list[dict]:
    """One window at ``shift``: a copy launched at +5 running +10..+110, a kernel launched at
    +20 starting ``gap`` after the copy ends, lasting 8; the window ends at +140."""
    t = shift
    return [
        _x("user_annotation", "window:on", t, 140),
        _x("cuda_runtime", "cudaMemcpyAsync", t + 5, 3, corr=int(t) + 1),
        _x("gpu_memcpy", "Memcpy PtoP (Device -> Device)", t + 10, 100, corr=int(t) + 1),
        _x("cuda_driver", "cuLaunchKernelEx", t + 20, 4, corr=int(t) + 2),
        _x("kernel", "wsum64_kernel(int*, long)", t + 110 + gap, 8, corr=int(t) + 2),
    ]


def test_windows_match_ops_to_launches_and_time_them_from_the_window() -> None:
    events = _trace(1000, 4) + _trace(2000, 6)
    events.append(_x("kernel", "elsewhere", 1500, 5, corr=999))  # launched outside any window
    wins = kv_timeline.windows(events, "window:on")
    assert len(wins) == 2
    w = wins[0]
    assert [o["name"] for o in w["ops"]] == ["Memcpy PtoP", "wsum64_kernel"]
    assert [o["cat"] for o in w["ops"]] == ["gpu_memcpy", "kernel"]
    assert w["ops"][1]["launch"] == 20 and w["ops"][1]["start"] == 114
    assert w["lead"] == 10 and w["busy"] == 112 and w["tail"] == 140 - 122
    assert w["after_copy"] == 12  # the copy ends at +110, the kernel at +122
    s = kv_timeline.summary(wins)
    assert s["windows"] == 2 and s["after_copy"] == 13  # 12 and 14
    assert s["ops"][1]["gap_before"] == 5  # 4 and 6
    assert "wsum64_kernel: launch 20" in kv_timeline.table("on", s)


def test_windows_that_queued_different_ops_are_told_apart() -> None:
    events = _trace(1000, 4) + _trace(2000, 6)[:3]  # the second window: the copy alone
    s = kv_timeline.summary(kv_timeline.windows(events, "window:on"))
    assert "ops" not in s and s["op_counts"] == [1, 2]
