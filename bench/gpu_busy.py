"""How busy the GPUs were during a run: the share of each sample period in which a kernel ran
(``nvidia-smi``'s ``utilization.gpu``), sampled every ``interval`` seconds by a child
``nvidia-smi --loop-ms`` while the run lasts, and kept for the measured window only (not the
warm-up request before it). Nothing on a host without ``nvidia-smi``."""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from time import perf_counter

from bench.metrics import percentile


@dataclass(slots=True)
class GpuBusy:
    """Samples (percent, one list per GPU index) and what a report shows of them."""

    samples: dict[int, list[float]] = field(default_factory=dict)
    times: dict[int, list[float]] = field(default_factory=dict)  # perf_counter() of each

    def window(self, start: float, end: float) -> GpuBusy:
        """The samples taken between ``start`` and ``end`` (perf_counter() times)."""
        out = GpuBusy()
        for gpu, values in self.samples.items():
            pairs = zip(self.times[gpu], values, strict=True)
            kept = [(t, v) for t, v in pairs if start <= t <= end]
            out.samples[gpu] = [v for _, v in kept]
            out.times[gpu] = [t for t, _ in kept]
        return out

    @property
    def mean(self) -> float | None:
        """The mean over every GPU's samples (None: none taken)."""
        values = [v for s in self.samples.values() for v in s]
        return sum(values) / len(values) if values else None

    @property
    def p10(self) -> float | None:
        """The 10th percentile of the samples: how busy the quietest tenth of the run was."""
        values = [v for s in self.samples.values() for v in s]
        return percentile(values, 10) if values else None


class GpuSampler:
    """``with GpuSampler() as s: ...`` then ``s.result``: samples taken while the block ran."""

    def __init__(self, interval: float = 0.1, gpus: str = "") -> None:
        self.interval = interval
        self.gpus = gpus  # "0,1": only these (nvidia-smi's -i); "": every GPU
        self.result = GpuBusy()
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuSampler:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self
        cmd = [smi, "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits",
               f"--loop-ms={max(1, int(self.interval * 1000))}"]  # fmt: skip
        if self.gpus:
            cmd += ["-i", self.gpus]
        self._proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self._reader = threading.Thread(target=self._read, name="gpu-busy", daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 2:
                continue
            try:
                index, busy = int(parts[0]), float(parts[1])
            except ValueError:  # "[N/A]" or a header
                continue
            self.result.samples.setdefault(index, []).append(busy)
            self.result.times.setdefault(index, []).append(perf_counter())

    def __exit__(self, *exc: object) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if self._reader is not None:
            self._reader.join(2)
