"""The GPU-busy sampler of `tandem bench`, over a stand-in ``nvidia-smi`` that prints what the
real one prints with ``--query-gpu=index,utilization.gpu --format=csv,noheader,nounits``."""

from __future__ import annotations

import os
import stat
import time

from bench.gpu_busy import GpuSampler


def test_samples_each_gpu_while_the_block_runs(tmp_path, monkeypatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'echo "$@" > "$(dirname "$0")/args"\n'
        "while true; do echo '0, 90'; echo '1, 40'; echo '[N/A]'; sleep 0.02; done\n"
    )
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with GpuSampler(interval=0.02, gpus="0,1") as sampler:
        time.sleep(0.3)
    busy = sampler.result
    assert set(busy.samples) == {0, 1} and len(busy.samples[0]) >= 3
    assert busy.mean is not None and 40 < busy.mean < 90
    assert busy.p10 == 40
    times = busy.times[0]
    assert len(times) == len(busy.samples[0]) and times == sorted(times)
    mid = busy.window(times[1], times[-2])  # the measured window only
    assert len(mid.samples[0]) == len(times) - 2 and mid.samples[1]
    args = (tmp_path / "args").read_text()
    assert "--loop-ms=20" in args and "-i 0,1" in args


def test_nothing_without_nvidia_smi(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with GpuSampler() as sampler:
        pass
    assert sampler.result.mean is None and sampler.result.p10 is None
