"""Where a hand-off's time goes, op by op: a few calls of a function profiled (torch.profiler,
CUDA activity through CUPTI), each in its own window, and per window the GPU work it queued
with when the host launched each piece and when the GPU ran it (issue 18: what the check adds
behind the copy between two GPUs).

Per window, times in microseconds from the window's start (the host entering the call):

- ``ops``: each copy, memset and kernel the call queued, in the GPU's order: its name, when
  its launch call began on the host (``launch``), when it started and ended on the GPU; so a
  GPU op that starts right when its launch ends waited for the host, and a gap between ops
  with no launch in it is the GPU's own (a dependency, a copy-engine to SM switch);
- ``lead``: the window's start to the first op's start (the host's set-up before the GPU
  works); ``busy``: first op start to last op end; ``tail``: last op end to the window's end
  (noticing it finished: the event poll, then the rest of the call);
- ``after_copy``: the last copy's end to the last op's end (what runs behind the copy).

`summary` gives the median of each over the windows and the op-by-op medians where the
windows queued the same ops. The raw trace is Chrome's format (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def profile(calls: dict[str, Callable[[], object]], reps: int, trace: Path) -> dict[str, list]:
    """Each of ``calls`` run ``reps`` times in turn under the profiler (after one unprofiled
    run each), each call in a window named after it; returns name -> its windows (`windows`)
    and writes the trace to ``trace``."""
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            for name, fn in calls.items():
                with torch.profiler.record_function(f"window:{name}"):
                    fn()
        torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    return {name: windows(events, f"window:{name}") for name in calls}


def windows(events: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """The windows named ``label`` in a Chrome trace's events, each with its GPU ops matched
    to their launches by correlation id (ops launched inside the window)."""
    spans = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0))
        for e in events
        if e.get("ph") == "X" and e.get("name") == label and e.get("cat") == "user_annotation"
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    gpu = [
        e for e in events
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "correlation" in e.get("args", {})
    ]  # fmt: skip
    out = []
    for start, end in spans:
        ops = []
        for e in gpu:
            launch = launches.get(e["args"]["correlation"])
            if launch is None or not start <= launch["ts"] <= end:
                continue
            ops.append({
                "name": short(e["name"]),
                "cat": e["cat"],
                "launch": launch["ts"] - start,
                "start": e["ts"] - start,
                "end": e["ts"] + e.get("dur", 0) - start,
            })  # fmt: skip
        ops.sort(key=lambda o: o["start"])
        win: dict[str, Any] = {"window_us": end - start, "ops": ops}
        if ops:
            last = max(o["end"] for o in ops)
            copies = [o["end"] for o in ops if o["cat"] == "gpu_memcpy"]
            win |= {
                "lead": ops[0]["start"],
                "busy": last - ops[0]["start"],
                "tail": end - start - last,
                "after_copy": last - max(copies) if copies else None,
            }
        out.append(win)
    return out


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    name = name.split("(")[0].strip()
    return name if len(name) <= 60 else name[:57] + "..."


def summary(wins: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over windows: of the window, lead, busy, tail and after-copy, and op by op
    (launch, start, end, and the gap from the op before) where every window queued the same
    ops; else the op counts seen."""
    out: dict[str, Any] = {"windows": len(wins)}
    for key in ("window_us", "lead", "busy", "tail", "after_copy"):
        vals = [w[key] for w in wins if w.get(key) is not None]
        if vals:
            out[key] = round(statistics.median(vals), 1)
    shapes = {tuple(o["name"] for o in w["ops"]) for w in wins}
    if len(shapes) != 1:
        out["op_counts"] = sorted({len(s) for s in shapes})
        return out
    names = next(iter(shapes))
    rows = []
    for i, name in enumerate(names):
        col = [w["ops"][i] for w in wins]
        gaps = [o["start"] - w["ops"][i - 1]["end"] for o, w in zip(col, wins, strict=True)]
        rows.append({
            "name": name,
            "launch": round(statistics.median(o["launch"] for o in col), 1),
            "start": round(statistics.median(o["start"] for o in col), 1),
            "end": round(statistics.median(o["end"] for o in col), 1),
            "gap_before": round(statistics.median(gaps), 1) if i else None,
        })  # fmt: skip
    out["ops"] = rows
    return out


def table(name: str, s: dict[str, Any]) -> str:
    """``summary`` as text: the medians, then the ops."""
    head = ", ".join(f"{k} {s[k]}" for k in ("window_us", "lead", "busy", "tail", "after_copy")
                     if k in s)  # fmt: skip
    lines = [f"{name} ({s['windows']} windows; us): {head}"]
    for o in s.get("ops", []):
        gap = "" if o["gap_before"] is None else f", gap {o['gap_before']}"
        lines.append(f"  {o['name']}: launch {o['launch']}, start {o['start']}, "
                     f"end {o['end']}{gap}")  # fmt: skip
    if "op_counts" in s:
        lines.append(f"  windows queued different ops: counts {s['op_counts']}")
    return "\n".join(lines)
