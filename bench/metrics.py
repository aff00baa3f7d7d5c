"""What users feel, as pure functions over per-request timings.

Definitions (those of vLLM's ``benchmark_serving`` and the DistServe paper):

- TTFT: from sending the request to the first chunk carrying output text.
- ITL: every gap between consecutive chunks carrying output text (a chunk may carry more than
  one token when the server coalesces them).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``: the mean time per output token after the
  first; undefined for a one-token answer.
- E2E: from sending to the end of the stream.
- goodput: completed requests that met both SLOs (``ttft <= slo.ttft`` and ``tpot <= slo.tpot``,
  a one-token answer meeting the TPOT SLO trivially) per second of benchmark wall time;
  attainment: the fraction of *sent* requests that met both (failures count as misses).
- percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objectives in seconds."""

    ttft: float = 1.0
    tpot: float = 0.05


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request's outcome; times in seconds, ``start`` relative to the run's start."""

    request_id: str
    start: float
    ttft: float | None
    itl: tuple[float, ...]
    e2e: float | None
    input_tokens: int
    output_tokens: int
    target_input_tokens: int = 0
    target_output_tokens: int = 0
    session: int | None = None
    turn: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.e2e is not None and self.ttft is not None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def record_from_trace(
    request_id: str,
    t0: float,
    sent: float,
    chunk_times: Sequence[float],
    end: float,
    input_tokens: int,
    output_tokens: int,
    *,
    error: str | None = None,
    **extra,
) -> RequestRecord:
    """A record from absolute clock readings: run start ``t0``, request ``sent``, the arrival of
    every chunk with output text, and the end of the stream. A stream that produced no text
    and no error is recorded as an error (there is no first token to time)."""
    if error is None and not chunk_times:
        error = "no output text"
    ok = error is None
    return RequestRecord(
        request_id=request_id,
        start=sent - t0,
        ttft=chunk_times[0] - sent if ok else None,
        itl=tuple(b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)),
        e2e=end - sent if ok else None,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        error=error,
        **extra,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Dist:
    """Mean and percentiles of one metric (seconds); NaN when there were no values."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Dist:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            len(values),
            sum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
            max(values),
        )


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    if not record.ok:
        return False
    assert record.ttft is not None
    tpot = record.tpot
    return record.ttft <= slo.ttft and (tpot is None or tpot <= slo.tpot)


@dataclass(frozen=True, slots=True)
class Summary:
    """Aggregates of one run (rates per second of ``duration``, the run's wall time)."""

    sent: int
    completed: int
    failed: int
    duration: float
    request_throughput: float
    input_token_throughput: float
    output_token_throughput: float
    goodput: float
    slo_attainment: float
    slo: SLO
    ttft: Dist
    tpot: Dist
    itl: Dist
    e2e: Dist
    input_tokens: int
    output_tokens: int


def summarize(records: Sequence[RequestRecord], duration: float, slo: SLO) -> Summary:
    """Aggregate ``records`` of a run that took ``duration`` seconds of wall time."""
    done = [r for r in records if r.ok]
    met = sum(meets_slo(r, slo) for r in records)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    in_tok = sum(r.input_tokens for r in done)
    out_tok = sum(r.output_tokens for r in done)
    return Summary(
        sent=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration,
        request_throughput=per_s(len(done)),
        input_token_throughput=per_s(in_tok),
        output_token_throughput=per_s(out_tok),
        goodput=per_s(met),
        slo_attainment=met / len(records) if records else math.nan,
        slo=slo,
        ttft=Dist.of([r.ttft for r in done if r.ttft is not None]),
        tpot=Dist.of([t for r in done if (t := r.tpot) is not None]),
        itl=Dist.of([g for r in done for g in r.itl]),
        e2e=Dist.of([r.e2e for r in done if r.e2e is not None]),
        input_tokens=in_tok,
        output_tokens=out_tok,
    )
