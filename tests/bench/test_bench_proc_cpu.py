"""CPU time of a stack's processes over a run, read from /proc (real processes)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time

from bench.proc_cpu import CpuMeter, cpu_seconds, with_engines


def test_a_busy_process_counts_near_a_core_and_an_idle_one_near_none() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)  # past the interpreters' start
        meter = CpuMeter({"busy": busy.pid, "idle": idle.pid, "gone": 2**22 + 7})
        meter.start()
        time.sleep(1.0)
        cores = meter.stop(1.0)
    finally:
        busy.kill()
        idle.kill()
    assert "gone" not in cores
    assert cores["busy"] > 0.3 and cores["idle"] < 0.1, cores
    assert cpu_seconds(os.getpid()) is not None and cpu_seconds(2**22 + 7) is None


def _sleep() -> None:
    time.sleep(30)


def test_a_workers_spawned_engine_is_named_after_it() -> None:
    proc = multiprocessing.get_context("spawn").Process(target=_sleep, daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 20
        named = with_engines({"me": os.getpid()})
        while "me/engine" not in named:
            assert time.monotonic() < deadline, named
            time.sleep(0.1)
            named = with_engines({"me": os.getpid()})
        assert named["me/engine"] == proc.pid
    finally:
        proc.kill()
