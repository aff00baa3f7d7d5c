"""The switch interval every Tandem process sets (``engine.core.process.quick_handoffs``): a
thread that wakes while another runs Python gets the GIL within about that interval, not
CPython's 5 ms."""

from __future__ import annotations

import statistics
import sys

import pytest

from bench.gil_handoff import DEFAULT_S, wake_late_ms
from engine.gil import SWITCH_INTERVAL_S, quick_handoffs


@pytest.fixture
def restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_quick_handoffs_sets_the_interval(restore_interval):
    sys.setswitchinterval(DEFAULT_S)
    quick_handoffs()
    assert sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)


def test_a_waking_thread_is_late_by_the_interval_not_5_ms(restore_interval):
    slow = statistics.median(wake_late_ms(DEFAULT_S, 25))
    quick = statistics.median(wake_late_ms(SWITCH_INTERVAL_S, 25))
    assert slow > 3.0, slow  # the cost: a wake-up waits out CPython's 5 ms
    assert quick < 2.0, quick  # at 0.2 ms it runs about 0.4 ms late
    assert quick < slow / 3


def test_the_environment_replaces_the_interval(restore_interval, monkeypatch):
    from engine.gil import SWITCH_INTERVAL_ENV

    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "5000")
    quick_handoffs()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "fast")
    with pytest.raises(ValueError, match="microseconds"):
        quick_handoffs()


def test_the_bench_stack_option_sets_it_for_the_stack_only(monkeypatch):
    import os

    from bench.stacks import _switch_interval, parse_stack
    from engine.gil import SWITCH_INTERVAL_ENV

    monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    assert parse_stack("colocated:1:switch=5000").switch == 5000
    assert parse_stack("disagg:1p1d").switch is None
    with pytest.raises(ValueError, match="switch must be >= 1"):
        parse_stack("colocated:1:switch=0")
    with _switch_interval(5000):  # what the stack's processes inherit while it starts
        assert os.environ[SWITCH_INTERVAL_ENV] == "5000"
    assert SWITCH_INTERVAL_ENV not in os.environ
    with _switch_interval(None):
        assert SWITCH_INTERVAL_ENV not in os.environ
