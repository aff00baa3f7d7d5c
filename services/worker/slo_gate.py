"""A worker's SLO admission (``--slo-shed-factor``): a new request whose objective this worker's
measured pace already misses is refused at once (RESOURCE_EXHAUSTED, which a router takes as
"try another worker", then as a 429 with Retry-After), instead of being admitted to miss it.

- decode: the measured step of decodes alone (`services.worker.pace`) at the current batch is
  already past ``factor`` times the request's TPOT objective; one more stream only makes the
  step longer, so the request would miss it too, and so would the streams running here.
- prefill: the prompt tokens queued here, at the measured prefill rate, already take longer
  than ``factor`` times the request's TTFT objective before its own prompt starts.

An idle worker never refuses (its step time is then an old figure and it is the best place there
is), nor does a worker with no measurement yet, nor a request without an objective (0), nor one
already admitted elsewhere (a started stream, a reservation): those keep the engine's
behaviour as it was without the flag."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import ResourceExhausted
from services.worker.pace import PaceReport


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    running: int  # streams decoding now
    prefill_backlog: int  # prompt tokens queued or part-computed


@dataclass(frozen=True, slots=True)
class SloGate:
    """``factor`` 0 turns it off; ``pace`` and ``load`` read the worker's figures now."""

    factor: float
    worker_id: str
    pace: Callable[[], PaceReport]
    load: Callable[[], WorkerLoad]

    def admit_decode(self, tpot_ms: float) -> None:
        """Refuse (ResourceExhausted) a new stream whose TPOT objective is already missed."""
        if self.factor <= 0 or tpot_ms <= 0:
            return
        running = self.load().running
        step_ms = self.pace().decode_step_ms
        if running and step_ms > self.factor * tpot_ms:
            raise ResourceExhausted(
                f"decode worker {self.worker_id}: its decode step takes {step_ms:.1f} ms at "
                f"batch {running}, past the request's TPOT objective of {tpot_ms:g} ms"
            )

    def admit_prefill(self, ttft_ms: float) -> None:
        """Refuse (ResourceExhausted) a prompt whose TTFT objective the queue already misses."""
        if self.factor <= 0 or ttft_ms <= 0:
            return
        backlog = self.load().prefill_backlog
        rate = self.pace().prefill_tokens_per_s
        if not backlog or rate <= 0:
            return
        wait_ms = backlog / rate * 1000
        if wait_ms > self.factor * ttft_ms:
            raise ResourceExhausted(
                f"prefill worker {self.worker_id}: {backlog} prompt tokens queued take "
                f"{wait_ms:.0f} ms at {rate:.0f} tokens/s, past the request's TTFT objective "
                f"of {ttft_ms:g} ms",
                retry_after_ms=int(wait_ms),
            )
