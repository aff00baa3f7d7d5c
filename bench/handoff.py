"""The KV hand-off of a ``tandem bench --stack`` run, from the decode workers' metrics.

Each decode worker's ``/metrics`` is read before and after a run; the difference gives, per
transport (``cuda-ipc``, ``nixl-read``, ``nixl-write``, ``grpc``), the transfers, bytes and
seconds spent obtaining KV blocks, plus failed transfers and prompts recomputed because their
KV did not arrive. From those and the run's records:

- hand-off time: mean seconds per transfer (sum over count of
  ``tandem_kv_transfer_duration_seconds``), and its p50 and p99 from the histogram's buckets
  (interpolated inside a bucket, as Prometheus' ``histogram_quantile``; the buckets go down to
  0.1 ms), which a few stalls do not move as they move the mean;
- its share of TTFT: hand-off mean over the run's TTFT p50. The first token is streamed by the
  prefill worker before the hand-off starts, so the hand-off delays the *second* token: the
  first inter-token gap (``first_gap_p50``) is where a client sees it;
- bandwidth: bytes over seconds of the transfers.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.metrics import RequestRecord, percentile


@dataclass(frozen=True, slots=True)
class HandoffCounters:
    """Sums over a stack's decode workers at one moment."""

    transfers: dict[str, float] = field(default_factory=dict)  # transport -> count
    bytes: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    failures: float = 0.0
    recomputed: float = 0.0
    slow: float = 0.0  # GPU transfers caught on an emulated/TCP path
    buckets: dict[float, float] = field(default_factory=dict)  # le -> cumulative count


def parse_metrics(text: str) -> HandoffCounters:
    """The hand-off counters in one worker's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    transfers: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    seconds: dict[str, float] = {}
    buckets: dict[float, float] = {}
    failures = recomputed = slow = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            transport = s.labels.get("transport", "")
            if s.name == "tandem_kv_transfers_total":
                transfers[transport] = transfers.get(transport, 0.0) + s.value
            elif s.name == "tandem_kv_transfer_bytes_total":
                nbytes[transport] = nbytes.get(transport, 0.0) + s.value
            elif s.name == "tandem_kv_transfer_duration_seconds_bucket":
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == "tandem_kv_transfer_duration_seconds_sum":
                seconds[transport] = seconds.get(transport, 0.0) + s.value
            elif s.name == "tandem_kv_transfer_failures_total":
                failures += s.value
            elif s.name == "tandem_kv_handoff_recomputed_total":
                recomputed += s.value
            elif s.name == "tandem_kv_slow_transfers_total":
                slow += s.value
    return HandoffCounters(transfers, nbytes, seconds, failures, recomputed, slow, buckets)


def _add(a: Mapping[Any, float], b: Mapping[Any, float], sign: float = 1.0) -> dict[Any, float]:
    return {k: a.get(k, 0.0) + sign * b.get(k, 0.0) for k in set(a) | set(b)}


def combine(parts: Sequence[HandoffCounters], sign: float = 1.0) -> HandoffCounters:
    """Sum of ``parts`` (``sign=-1`` on the second of two: a difference)."""
    out = HandoffCounters()
    for i, p in enumerate(parts):
        k = 1.0 if i == 0 else sign
        out = HandoffCounters(
            _add(out.transfers, p.transfers, k),
            _add(out.bytes, p.bytes, k),
            _add(out.seconds, p.seconds, k),
            out.failures + k * p.failures,
            out.recomputed + k * p.recomputed,
            out.slow + k * p.slow,
            _add(out.buckets, p.buckets, k),
        )
    return out


def stack_metrics(metrics_addresses: Mapping[str, str]) -> dict[str, str]:
    """Every process's ``/metrics`` text (name -> host:port of its /metrics, as a stack's
    ``scrape_targets``). One read serves `snapshot` and ``bench.engine_steps.snapshot`` (each
    takes the families it knows) and `save`."""
    texts = {}
    for name, address in metrics_addresses.items():
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
            texts[name] = r.read().decode()
    return texts


def save(texts: Mapping[str, str], folder: Path, suffix: str) -> None:
    """Write each process's text to ``folder/NAME.SUFFIX.prom``: the counters before and after
    a run, for whoever wants more of a run than its report (queue times, gRPC handling times,
    admission refusals)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / f"{name}.{suffix}.prom").write_text(text)


def snapshot(texts: Mapping[str, str]) -> HandoffCounters:
    """Summed counters of the decode workers (name -> its `stack_metrics` text)."""
    return combine([parse_metrics(t) for name, t in texts.items() if name.startswith("decode")])


@dataclass(frozen=True, slots=True)
class HandoffReport:
    """The hand-off of one run (see the module docstring)."""

    transports: dict[str, int]  # transport -> transfers in the run
    transfers: int
    gbytes_per_s: float
    mean_ms: float
    p50_ms: float
    p99_ms: float
    share_of_ttft_p50: float
    first_gap_p50_ms: float
    failures: int
    recomputed: int
    slow: int


def report(
    before: HandoffCounters, after: HandoffCounters, records: Sequence[RequestRecord]
) -> HandoffReport:
    d = combine([after, before], sign=-1.0)
    count = sum(d.transfers.values())
    seconds = sum(d.seconds.values())
    nbytes = sum(d.bytes.values())
    ok = [r for r in records if r.ok]
    ttft_p50 = percentile([r.ttft for r in ok if r.ttft is not None], 50)
    gaps = [r.itl[0] for r in ok if r.itl]
    mean = seconds / count if count else math.nan
    return HandoffReport(
        transports={k: round(v) for k, v in sorted(d.transfers.items()) if v > 0},
        transfers=round(count),
        gbytes_per_s=nbytes / seconds / 1e9 if seconds > 0 else math.nan,
        mean_ms=mean * 1000,
        p50_ms=quantile(d.buckets, 0.5) * 1000,
        p99_ms=quantile(d.buckets, 0.99) * 1000,
        share_of_ttft_p50=mean / ttft_p50 if count and ttft_p50 > 0 else math.nan,
        first_gap_p50_ms=percentile(gaps, 50) * 1000 if gaps else math.nan,
        failures=round(d.failures),
        recomputed=round(d.recomputed),
        slow=round(d.slow),
    )


def quantile(buckets: Mapping[float, float], q: float) -> float:
    """The ``q`` quantile of a histogram (upper bound -> cumulative count, ``+Inf`` included),
    interpolated linearly inside its bucket from the bucket below (0 for the first), as
    Prometheus' ``histogram_quantile`` does; the largest finite bound when it falls in
    ``+Inf``'s bucket; NaN with no observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lo_bound, lo_count = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lo_bound
            if count == lo_count:
                return le
            return lo_bound + (le - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = le, count
    return lo_bound


def render(rows: Sequence[tuple[str, str, str, HandoffReport]]) -> str:
    """Markdown table: one row per (endpoint, workload, rate)."""

    def f(x: float, spec: str) -> str:
        return "-" if math.isnan(x) else format(x, spec)

    lines = [
        "| endpoint | workload | rate | transports | hand-off mean ms | p50 ms | p99 ms "
        "| share of TTFT p50 | first gap p50 ms | GB/s | failed | recomputed | slow path |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for endpoint, workload, rate, h in rows:
        used = ", ".join(f"{k} {v}" for k, v in h.transports.items()) or "none"
        lines.append(
            f"| {endpoint} | {workload} | {rate} | {used} | {f(h.mean_ms, '.2f')} "
            f"| {f(h.p50_ms, '.2f')} | {f(h.p99_ms, '.2f')} "
            f"| {f(h.share_of_ttft_p50 * 100, '.1f')}% | {f(h.first_gap_p50_ms, '.1f')} "
            f"| {f(h.gbytes_per_s, '.1f')} | {h.failures} | {h.recomputed} | {h.slow} |"
        )
    return "\n".join(lines)
