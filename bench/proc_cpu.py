"""CPU time of a stack's processes over a run, in cores (CPU seconds per wall second): which
process is busy (an engine at one core is bound by its host work; a router or gateway near one
core limits what it relays), read from ``/proc/PID/stat`` before and after. Linux only; other
hosts report nothing."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of ``pid`` (every thread) so far; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def with_engines(named: Mapping[str, int]) -> dict[str, int]:
    """``named`` plus each process's Python children (a worker's engine process, named
    ``NAME/engine``; a tensor-parallel engine's ranks are its own children, not counted)."""
    out = dict(named)
    for name, pid in named.items():
        engines = [c for c in children(pid) if b"spawn_main" in _cmdline(c)]
        for i, child in enumerate(sorted(engines)):
            out[f"{name}/engine" if i == 0 else f"{name}/engine{i}"] = child
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class CpuMeter:
    """``start()`` then ``stop(seconds)``: each process's cores over that time."""

    def __init__(self, named: Mapping[str, int]) -> None:
        self.named = dict(named)
        self._before: dict[str, float] = {}

    def start(self) -> None:
        self._before = {n: s for n, p in self.named.items() if (s := cpu_seconds(p)) is not None}

    def stop(self, seconds: float) -> dict[str, float]:
        out = {}
        for name, before in self._before.items():
            after = cpu_seconds(self.named[name])
            if after is not None and seconds > 0:
                out[name] = round((after - before) / seconds, 3)
        return out
