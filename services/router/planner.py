"""The pool planner (no grpc): how many prefill and decode workers the recent traffic needs, from
what this router routed and what the workers measured, for an autoscaler to apply (KEDA or an
HPA on external metrics; docs/operations.md shows how).

Over the last ``window`` seconds::

    prefill workers = prompt tokens to compute per second / (prefill rate * utilization)
    decode workers  = completion tokens per second / (decode tokens per second * utilization)

The prompt tokens are the uncached parts this router routed (whichever pool computed them: the
question is the split a disaggregated deployment needs). The prefill rate is the mean of the
prefill workers' measured rates (of any worker's while no prefill worker has one). A decode
worker's throughput is taken at the request's TPOT objective: the router fits the decode step
time against the batch, ``step = a + b * batch``, to the decode workers' reports in the window;
a worker then runs ``batch = (SLO_tpot - a) / b`` streams at once, producing ``batch / SLO_tpot``
tokens per second. Until the reports span two batch sizes (or when the step does not grow with
the batch there) it is the highest throughput a decode worker reported, which is known to meet
its step time. ``utilization`` (below 1) keeps queues short enough for the TTFT objective.

Every figure is exported (``tandem_planner_*``) at scrape time; each router plans from its own
traffic, so an autoscaler sums the demand over routers (the desired worker counts add up) or,
with one router, reads them as they are.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from libkv.cluster.registry import Member, MemberChange

MIN_FIT_SAMPLES = 5


@dataclass(frozen=True, slots=True)
class Plan:
    """What the traffic of the window needs (worker counts fractional and without a floor; an
    autoscaler sums them over routers and rounds up). NaN where a figure is not known yet (no
    rate measured)."""

    prompt_tokens_per_s: float
    output_tokens_per_s: float
    prefill_rate: float  # prompt tokens per second of one prefill worker
    decode_rate: float  # completion tokens per second of one decode worker at the TPOT SLO
    prefill_workers: float
    decode_workers: float

    @property
    def prefill_fraction(self) -> float:
        """Prefill workers over all workers (NaN when either is unknown)."""
        total = self.prefill_workers + self.decode_workers
        return self.prefill_workers / total if total > 0 else math.nan


class Planner:
    """Collects the window's traffic (`routed`, `finished`) and decode reports (`observe`, a
    `MemberWatcher` listener) on the router's event loop, and plans from them (`plan`, also
    from the metrics server's thread)."""

    def __init__(
        self,
        window: float = 60.0,
        utilization: float = 0.8,
        model: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``model``: plan only that base model's workers ("": every member seen)."""
        if window <= 0 or not 0 < utilization <= 1:
            raise ValueError("planner window > 0 and 0 < utilization <= 1")
        self.window, self.utilization, self.clock = window, utilization, clock
        self.model = model
        self._prompt: deque[tuple[float, int]] = deque()
        self._output: deque[tuple[float, int]] = deque()
        self._steps: deque[tuple[float, int, float]] = deque()  # (t, batch, step seconds)
        self._decode_rate_seen = math.nan  # the last decode rate the window's reports gave

    def routed(self, uncached_tokens: int) -> None:
        """A request whose prompt needs ``uncached_tokens`` computed was routed."""
        self._prompt.append((self.clock(), uncached_tokens))

    def finished(self, output_tokens: int) -> None:
        """A stream ended after ``output_tokens`` completion tokens."""
        self._output.append((self.clock(), output_tokens))

    def observe(self, change: MemberChange) -> None:
        """A decode worker's report: one (batch, step time) point for the fit."""
        m = change.member
        if change.kind != "put" or m is None or m.role != "decode":
            return
        if self.model and m.model != self.model:
            return
        if m.load.running > 0 and m.load.decode_step_ms > 0:
            self._steps.append((self.clock(), m.load.running, m.load.decode_step_ms / 1000))

    def plan(self, members: Iterable[Member], slo_tpot_s: float) -> Plan:
        """The window's plan with the live ``members`` (their measured prefill rates), decode
        throughput taken at ``slo_tpot_s``."""
        now = self.clock()
        for q in (self._prompt, self._output, self._steps):
            while q and q[0][0] < now - self.window:
                q.popleft()
        # Copies (atomic under the GIL): scrapes run on the metrics server's thread while the
        # event loop appends.
        span = self.window
        prompt = sum(n for _, n in list(self._prompt)) / span
        output = sum(n for _, n in list(self._output)) / span
        prefill_rate = _prefill_rate(list(members))
        decode_rate = self._decode_rate(slo_tpot_s)
        util = self.utilization
        return Plan(
            prompt, output, prefill_rate, decode_rate,
            _workers(prompt, prefill_rate * util), _workers(output, decode_rate * util),
        )  # fmt: skip

    def _decode_rate(self, slo_tpot_s: float) -> float:
        """A decode worker's tokens per second at ``slo_tpot_s`` from the window's reports;
        with none (no stream decoded in the window) the last rate found: the speed is the
        workers', not the traffic's, so an idle minute does not make the plan unknown."""
        points = [(b, s) for _, b, s in list(self._steps)]
        if points:
            self._decode_rate_seen = self._fitted_rate(points, slo_tpot_s)
        return self._decode_rate_seen

    @staticmethod
    def _fitted_rate(points: list[tuple[int, float]], slo_tpot_s: float) -> float:
        best = max(b / s for b, s in points)  # the highest throughput seen
        fit = _line(points)
        if fit is None:
            return best
        a, b = fit
        batch = (slo_tpot_s - a) / b
        if batch < 1:  # even one stream misses the objective: one at a time
            return 1 / max(a + b, 1e-9)
        return batch / slo_tpot_s


def _prefill_rate(members: list[Member]) -> float:
    def rates(role: str | None) -> list[float]:
        chosen = [m for m in members if role is None or m.role == role]
        return [m.load.prefill_tokens_per_s for m in chosen if m.load.prefill_tokens_per_s > 0]

    found = rates("prefill") or rates(None)
    return sum(found) / len(found) if found else math.nan


def _workers(demand: float, capacity: float) -> float:
    """Workers that serve ``demand`` at ``capacity`` each, unrounded and with no floor: the
    routers' figures add up, and the autoscaler's own minimum keeps a pool alive (NaN:
    unknown)."""
    if not capacity > 0:  # also NaN
        return math.nan
    return demand / capacity


def _line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares ``step = a + b * batch``; None with too few points, one batch size, or a
    step that does not grow with the batch."""
    if len(points) < MIN_FIT_SAMPLES:
        return None
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(s for _, s in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    if sxx <= 0:
        return None
    slope = sum((b - mx) * (s - my) for b, s in points) / sxx
    if slope <= 0:
        return None
    return my - slope * mx, slope
