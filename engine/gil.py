"""The GIL's switch interval of every Tandem process (``quick_handoffs``): a leaf module, so the
services, the engine process and tensor-parallel ranks all set it first."""

from __future__ import annotations

import os
import sys

# How long a thread that runs Python keeps the GIL while another waits for it. CPython's 5 ms
# default is paid on the token path wherever a thread wakes to hand work on while another runs
# Python: this process's command reader and message writer beside the loop planning a step, a
# worker's pipe writer and a gateway's tokenizer threads beside their event loops. 0.2 ms
# makes such a wake-up about 0.4 ms late instead of 5 (`bench.gil_handoff`); two threads that
# both stay busy do 2-5% less work for the extra switches. The environment's
# TANDEM_SWITCH_INTERVAL_US replaces it (5000: CPython's own), to measure it.
SWITCH_INTERVAL_S = 0.0002
SWITCH_INTERVAL_ENV = "TANDEM_SWITCH_INTERVAL_US"


def quick_handoffs() -> None:
    """Let a waking thread take the GIL within ``SWITCH_INTERVAL_S`` (every Tandem process that
    hands work between threads calls this first; ``SWITCH_INTERVAL_ENV`` replaces it)."""
    text = os.environ.get(SWITCH_INTERVAL_ENV, "")
    try:
        seconds = int(text) / 1e6 if text else SWITCH_INTERVAL_S
    except ValueError:
        raise ValueError(f"{SWITCH_INTERVAL_ENV} must be microseconds, got {text!r}") from None
    sys.setswitchinterval(seconds)
