"""A worker's measured pace, published in its member record for the routers' choice of where a
prompt is computed (``services.router.disagg``): prompt tokens per second of compute and the
time of a step of decodes alone.

Fed one ``engine.step_stats.StepStats`` per engine step (chained after the metrics observer).
Both are decaying averages of sums, not of ratios, so a long step weighs more than a short one:
``rate = EWMA(prompt tokens) / EWMA(their seconds)``. The seconds of a step that also ran
decodes are less the decode step time measured so far (a mixed step's decodes would have cost
that alone), floored at half the step, so the rate is of the prompt work itself. Steps of fewer
than `MIN_PROMPT_TOKENS` prompt tokens are left out: their time is mostly the pass's fixed cost,
and a decode worker that only ever computed short prompts would otherwise report a rate far
below what a long prompt gets (it reports none instead, and routers borrow a peer's)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from engine.step_stats import StepStats

ALPHA = 0.1  # weight of each new step in the averages: about the last 10-20 steps count
MIN_STEP_S = 1e-6
MIN_PROMPT_TOKENS = 64


@dataclass(frozen=True, slots=True)
class PaceReport:
    prefill_tokens_per_s: float  # 0: no prompt computed yet
    decode_step_ms: float  # 0: no step of decodes alone yet


class PaceMeter:
    """The observer; thread-safe (steps arrive on the engine client's reader, reports are read
    by the registration's refresh thread)."""

    def __init__(self, alpha: float = ALPHA) -> None:
        self.alpha = alpha
        self._lock = threading.Lock()
        self._tokens = 0.0  # decaying sums of prompt tokens and of their compute seconds
        self._seconds = 0.0
        self._step_s = 0.0  # decaying mean of decode-only step seconds (0: none yet)

    def __call__(self, step: StepStats) -> None:
        if step.seconds <= 0:
            return
        with self._lock:
            if step.prefill_tokens >= MIN_PROMPT_TOKENS:
                seconds = step.seconds
                if step.decode_seqs and self._step_s:
                    seconds = max(seconds - self._step_s, seconds / 2)
                self._tokens = _decay(self._tokens, step.prefill_tokens, self.alpha)
                self._seconds = _decay(self._seconds, max(seconds, MIN_STEP_S), self.alpha)
            elif step.decode_seqs and not step.prefill_tokens:
                a = self.alpha if self._step_s else 1.0
                self._step_s += a * (step.seconds - self._step_s)

    def report(self) -> PaceReport:
        with self._lock:
            rate = self._tokens / self._seconds if self._seconds > 0 else 0.0
            return PaceReport(rate, self._step_s * 1000)


def _decay(total: float, x: float, alpha: float) -> float:
    return (1 - alpha) * total + alpha * x


def chain(*observers: Callable[[StepStats], None] | None) -> Callable[[StepStats], None]:
    """One ``on_step`` observer calling each of ``observers`` (None ones skipped) in turn."""
    live = [o for o in observers if o is not None]

    def both(step: StepStats) -> None:
        for o in live:
            o(step)

    return both
