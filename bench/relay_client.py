"""The client side of ``bench.router_relay``: streams kept running through the router by the
gateway's own backend (`services.gateway.grpc_backend`: tokens relayed by the router, or
streamed from the stand-in with the router out of the path) and probe requests timed to their
first event, every event checked for order (the stand-in's i-th token of a stream is
``FIRST_TOKEN + i``)."""

from __future__ import annotations

import abc
import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from bench.relay_worker import FIRST_TOKEN, StandInState
from engine.sampling_params import SamplingParams
from services.gateway.core import APIError, BackendRequest
from services.gateway.grpc_backend import GrpcBackend

PROMPT_TOKENS = 32  # the default: the router's routing work of a short chat turn
_ids = itertools.count()


@dataclass(slots=True)
class Tally:
    """What the client saw. ``counting`` gates events and gaps into the measured window."""

    counting: bool = False
    events: int = 0  # events received while counting (a hop that lags merges several)
    tokens: int = 0  # tokens those events carried
    gaps_s: list[float] = field(default_factory=list)  # between a stream's events, while counting
    streams_done: int = 0  # streams that ended with every token, in order, and usage
    order_errors: list[str] = field(default_factory=list)
    stream_errors: list[str] = field(default_factory=list)


class Probe(NamedTuple):
    """A probe's times (s): ``ttft`` as the client saw it; ``inbound``, from the client's send
    to the stand-in's Generate; ``outbound``, from the stand-in's first event to the client.
    ``path`` (both legs) is the TTFT less the stand-in's wait for its next tick: the router's
    part, plus the harness's own event-loop delays (see the stand-in's tick lateness)."""

    ttft: float
    inbound: float
    outbound: float

    @property
    def path(self) -> float:
        return self.inbound + self.outbound


def request(
    rid: str, max_tokens: int, model: str, timeout: float, prompt_tokens: int = PROMPT_TOKENS
) -> BackendRequest:
    """A token-id request as the gateway makes one (ignore_eos: it runs to max_tokens)."""
    prompt = tuple(range(200, 200 + prompt_tokens))
    return BackendRequest(
        rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), model=model,
        deadline=time.monotonic() + timeout, slo_ttft_ms=1000, slo_tpot_ms=50,
    )  # fmt: skip


class Streams(abc.ABC):
    """Streams kept running and probes spaced out, over a subclass's ``one_stream`` and
    ``probe``."""

    @abc.abstractmethod
    async def one_stream(self) -> None:
        """Run one stream to its end."""

    @abc.abstractmethod
    async def probe(self, state: StandInState) -> Probe:
        """One probe request, timed."""

    async def keep_running(self, slot: int, streams: int, step_s: float, until: float) -> None:
        """One of ``streams`` slots: start after its share of one step, then run streams back
        to back until ``until`` (time.monotonic)."""
        await asyncio.sleep(step_s * slot / streams)
        while time.monotonic() < until:
            await self.one_stream()

    async def probes(
        self, state: StandInState, every_s: float, until: float, jitter_s: float
    ) -> list[Probe]:
        """A probe every ``every_s`` (plus up to ``jitter_s``, so probes land at every phase
        of the step clock) until ``until``."""
        out = []
        while time.monotonic() < until:
            await asyncio.sleep(every_s + random.uniform(0, jitter_s))
            out.append(await self.probe(state))
        return out


class Client(Streams):
    """Streams and probes against one router."""

    def __init__(
        self, backend: GrpcBackend, model: str, tokens: int, prompt_tokens: int = PROMPT_TOKENS
    ) -> None:
        self.backend = backend
        self.model = model
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.tally = Tally()

    async def one_stream(self) -> None:
        """Run one stream of ``tokens`` tokens to its end, checking every event."""
        t = self.tally
        rid = f"stream-{next(_ids)}"
        i, last = 0, 0.0  # i: tokens received so far
        try:
            req = request(rid, self.tokens, self.model, 600, self.prompt_tokens)
            async for ev in self.backend.generate(req):
                now = time.perf_counter()
                got = list(ev.token_ids)
                if t.counting:
                    t.events += 1
                    t.tokens += len(got)
                    if i:
                        t.gaps_s.append(now - last)
                last = now
                expected = list(range(FIRST_TOKEN + i, FIRST_TOKEN + i + len(got)))
                if (not got or got != expected) and len(t.order_errors) < 20:
                    t.order_errors.append(f"{rid}: after {i} tokens an event carried {got}")
                i += len(got)
                if ev.finish_reason:
                    done = ev.usage is not None and ev.usage.completion_tokens == self.tokens
                    if i == self.tokens and done:
                        t.streams_done += 1
                    elif len(t.order_errors) < 20:
                        t.order_errors.append(f"{rid}: ended after {i} tokens, {ev.usage}")
        except APIError as e:
            t.stream_errors.append(f"{rid}: {e.status} {e.message}")

    async def probe(self, state: StandInState) -> Probe:
        """One 1-token request, timed on the clock the stand-in shares with this client."""
        rid = f"probe-{next(_ids)}"
        sent = time.monotonic()
        first = 0.0
        async for _ in self.backend.generate(request(rid, 1, self.model, 30, self.prompt_tokens)):
            first = first or time.monotonic()
        timing = state.timings.pop(rid)
        return Probe(first - sent, timing.arrived - sent, first - timing.first_sent)
