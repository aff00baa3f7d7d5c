"""Late planning (``EngineConfig.late_planning``): plan the next step just before the step in
flight ends, not as soon as it is launched.

With async scheduling (``engine.step_loop``) the host plans and launches step N+1 as soon as it
has read step N-1 back, while N runs on the device. A request that arrives after that plan
joins step N+2, which runs after N *and* N+1: its first token waits one whole step more than
it would without the overlap (vLLM's async scheduling pays the same step). Planning late,
the engine's loop waits for a command until the step in flight is predicted to end, less what
planning and launching the next step take and a guard, then plans: an arrival during that wait
joins N+1, and the device still finds N+1 queued when N ends.

The prediction is each kind of step's recent time (`kind`: rows, and prompt tokens where the
step computes any, in powers of two), an exponential average of how long such a step added to
the wall time when the device ran steps back to back, times `SAFETY`. The wait also ends when
the step in flight's event says it is done, when a command arrives, and after `MAX_HOLD_S`.
There is no wait when prompts already wait (an arrival would queue behind them), off CUDA
(the work is done when its launch returns) and before a kind of step has been seen.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.scheduler import SchedulerOutput

ALPHA = 0.3  # weight of the newest time in a kind's average
SAFETY = 0.9  # the prediction: this share of the average (an early plan costs nothing)
GUARD_S = 0.0005  # planned this long before the launch must start, on top of its own time
POLL_S = 0.0005  # the wait checks the step in flight's event this often
MAX_HOLD_S = 0.05  # never longer than this


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def kind(sched: SchedulerOutput) -> tuple[int, int]:
    """A step's kind: (rows, prompt tokens; 0 for a step of decodes alone), each rounded up to a
    power of two."""
    rows, tokens = len(sched.scheduled), sched.num_tokens
    return _pow2(rows), (_pow2(tokens) if tokens > rows else 0)


class PlanClock:
    """How long each kind of step takes, and how long planning and launching one takes (both
    exponential averages), and from them how long the next plan may wait."""

    def __init__(self) -> None:
        self._times: dict[tuple[int, int], float] = {}
        self.launch_s: float | None = None  # planning and launching one step, on the host
        self.holds = 0  # waits before a plan
        self.held_s = 0.0  # their summed time

    @staticmethod
    def _avg(old: float | None, new: float) -> float:
        return new if old is None else old + ALPHA * (new - old)

    def launched(self, seconds: float) -> None:
        """One step was planned and launched in ``seconds``."""
        self.launch_s = self._avg(self.launch_s, seconds)

    def ran(self, step_kind: tuple[int, int], seconds: float) -> None:
        """A step of ``step_kind`` added ``seconds`` to the wall time."""
        self._times[step_kind] = self._avg(self._times.get(step_kind), seconds)

    def slack(self, step_kind: tuple[int, int], began: float, now: float) -> float:
        """Seconds from ``now`` the next plan may wait: until the step in flight (of
        ``step_kind``, begun on the device at ``began``) is predicted to end, less the launch
        and the guard; 0 with no estimate yet."""
        took = self._times.get(step_kind)
        if took is None or self.launch_s is None:
            return 0.0
        left = began + SAFETY * took - now - self.launch_s - GUARD_S
        return min(left, MAX_HOLD_S) if left > 0 else 0.0

    def hold(self, seconds: float, done: torch.cuda.Event, wake: threading.Event) -> float:
        """Wait up to ``seconds``: until ``wake`` is set (a command came) or ``done`` has
        happened (the step in flight ended early); returns the time waited."""
        if seconds <= 0:
            return 0.0
        t0 = time.perf_counter()
        end = t0 + seconds
        while not wake.is_set() and not done.query():
            left = end - time.perf_counter()
            if left <= 0:
                break
            wake.wait(min(left, POLL_S))
        waited = time.perf_counter() - t0
        self.holds += 1
        self.held_s += waited
        return waited
