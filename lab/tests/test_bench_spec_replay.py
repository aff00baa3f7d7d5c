"""``lab.spec_replay``'s step timings with few steps: a tiny ``--steps``, or a draft that keeps
every token (so each step emits ``k + 1`` and fewer steps are timed), once left no step after
the two warm-up ones and crashed taking a median of nothing."""

from __future__ import annotations

import pytest

from lab.spec_replay import WARMUP_STEPS, draft_step_time, steady_median, step_times


def test_the_median_leaves_out_the_warm_up_but_keeps_one_step() -> None:
    assert WARMUP_STEPS == 2
    assert steady_median([90.0, 40.0, 3.0, 1.0, 2.0]) == 2.0  # the first two left out
    assert steady_median([90.0, 40.0, 3.0]) == 3.0
    assert steady_median([90.0, 5.0]) == 5.0  # only the last one is steady enough
    assert steady_median([7.0]) == 7.0
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        steady_median([])


def test_a_draft_step_is_timed_with_one_step() -> None:
    """The draft has the target's shape and seeded weights, so it keeps every token: one step
    (``--steps 1``) emits the rest of the request."""
    assert draft_step_time("smollm2-135m", "smollm2-135m", k=2, context=32, steps=1) > 0


def test_verify_steps_are_timed_with_one_step() -> None:
    times, rows = step_times("smollm2-135m", k=1, context=32, steps=1)
    assert set(times) == set(rows) == {0, 1} and all(t > 0 for t in times.values())
