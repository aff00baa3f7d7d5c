"""``results.json``: the run's description and every run with every request, strict JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

from bench.gpu_busy import GpuBusy
from bench.report.run import RunReport


def _clean(x):
    """JSON-safe: NaN and infinities become null (strict JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def to_json(meta: dict, reports: Sequence[RunReport]) -> dict:
    """``meta`` with a ``runs`` list: each run's load, aggregates, measurements and requests."""
    runs = []
    for rep in reports:
        r = rep.result
        records = [{**dataclasses.asdict(rec), "tpot": rec.tpot, "ok": rec.ok} for rec in r.records]
        runs.append(
            {
                "endpoint": r.endpoint,
                "workload": r.workload,
                "rate": "inf" if math.isinf(r.rate) else r.rate,
                "concurrency": r.concurrency,
                "not_sent": r.not_sent,
                "seed": r.seed,
                "trace_speed": r.trace_speed,
                "summary": dataclasses.asdict(rep.summary),
                "cache": dataclasses.asdict(rep.cache) if rep.cache else None,
                "handoff": dataclasses.asdict(rep.handoff) if rep.handoff else None,
                "gpu_busy": _busy_json(rep.gpu_busy),
                "cpu_cores": rep.cpu,
                "engine_steps": (
                    {p: dataclasses.asdict(v) for p, v in rep.steps.items()} if rep.steps else None
                ),
                "kernel_compiles_serving": rep.compiles,
                "ttft_split_ms": rep.ttft,
                "ttft_hops_ms": rep.hops,
                "records": records,
            }
        )
    return _clean({**meta, "runs": runs})


def _busy_json(busy: GpuBusy | None) -> dict | None:
    if busy is None or busy.mean is None:
        return None
    return {"mean": busy.mean, "p10": busy.p10, "samples": busy.samples, "times": busy.times}


def write_json(path: Path, meta: dict, reports: Sequence[RunReport]) -> None:
    """Write :func:`to_json` to ``path`` (NaN would be an error: ``_clean`` removed them)."""
    path.write_text(json.dumps(to_json(meta, reports), indent=1, allow_nan=False) + "\n")
