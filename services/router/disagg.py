"""Conditional disaggregation by prediction (no grpc): for each request, whether its prompt is
computed on a prefill worker and handed over, or on the decode worker itself, chunked between
the decodes of the streams it runs.

From what workers report in their member records (``libkv.cluster.registry.MemberLoad``: prompt
tokens queued to compute, the prefill rate they measured, their decode step time and batch,
their chunk size), corrected by what this router sent them since (`Backlogs`), it predicts
for both options the request's TTFT and the TPOT it costs::

    disagg       TTFT = (queued_p + uncached_p) / rate_p
                 TPOT = step_d + (queued_d / rate_d + hand-off) / L
    decode-only  TTFT = (queued_d + uncached_d) / rate_d + chunks * step_d
                 TPOT = step_d + (queued_d + uncached_d) / rate_d / L   (streams decoding there)

``L`` is the output a stream makes on it (the mean this router saw end, at most what the request
books); ``chunks`` the steps the prompt takes on the decode worker, each also running its
decodes. The first token streams from the prefill worker as soon as it is sampled, so in Tandem
the hand-off falls into the request's TPOT, not its TTFT: what it adds is measured by the
router, from the prefill reply to the decode worker's first event, less the one decode step
that token would have taken anyway. Each option's headroom is ``min(1 - TTFT / SLO_ttft,
1 - TPOT / SLO_tpot)``; the router takes the option with the most (decode-only on a tie):

- ``headroom``: both meet the SLOs, the chosen one by more;
- ``saturated``: only the chosen one meets them (the other's pool is saturated);
- ``both-miss``: neither meets them; the one that misses by less in all, the sum of how far
  past each SLO it is (``TTFT / SLO_ttft - 1`` where positive, and the same of TPOT): an
  objective both miss by about as much (a decode step longer than the TPOT objective) does not
  hide a large difference in the other.

Without a measured rate on either side yet (a cold start) the old length rule decides:
``cold-start`` (the uncached part against ``--decode-only-threshold``). With no prefill
worker that can hand KV to the decode worker: ``no-prefill``. ``--disagg-mode length`` keeps
the length rule for every request (reason ``length``): fixed placement whatever the load, for
an operator who sizes the pools by hand or a test of the hand-off itself.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from libkv.cluster.registry import Member, MemberChange, MemberLoad

DISAGG, LOCAL = "disagg", "decode-only"
MODES = ("slo", "length")  # --disagg-mode: predicted against the SLOs, or the length rule
EWMA_ALPHA = 0.2  # weight of the newest sample in the router's own averages


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's objectives in seconds (both > 0)."""

    ttft_s: float
    tpot_s: float


@dataclass(frozen=True, slots=True)
class Pace:
    """One worker's speed and queue as the prediction uses them."""

    queued: int  # prompt tokens waiting to be computed there (reported, corrected)
    rate: float  # prompt tokens per second it computes (> 0)
    step_s: float  # seconds of one decode step at its batch (0: not measured)
    batch: int  # sequences decoding there
    chunk: int  # most prompt tokens per step (0: unknown, taken as the whole prompt)


@dataclass(frozen=True, slots=True)
class Prediction:
    choice: str  # DISAGG or LOCAL
    ttft_s: float
    tpot_s: float

    def headroom(self, slo: Slo) -> float:
        """The smaller fraction of either SLO left (negative: missed by that fraction)."""
        return min(1 - self.ttft_s / slo.ttft_s, 1 - self.tpot_s / slo.tpot_s)

    def excess(self, slo: Slo) -> float:
        """How far past the SLOs it is in all: the fractions by which each is missed, summed."""
        return max(self.ttft_s / slo.ttft_s - 1, 0) + max(self.tpot_s / slo.tpot_s - 1, 0)


@dataclass(frozen=True, slots=True)
class Decision:
    choice: str  # DISAGG or LOCAL
    reason: str
    predicted: Prediction | None = None  # the chosen option's prediction (None: no model)


def predict_disagg(
    prefill: Pace, decode: Pace, uncached: int, out_tokens: int, handoff_s: float
) -> Prediction:
    """The module docstring's disagg option: ``uncached`` prompt tokens on ``prefill``."""
    ttft = (prefill.queued + uncached) / prefill.rate
    tpot = decode.step_s + (decode.queued / decode.rate + handoff_s) / max(out_tokens, 1)
    return Prediction(DISAGG, ttft, tpot)


def predict_local(decode: Pace, uncached: int, out_tokens: int) -> Prediction:
    """The module docstring's decode-only option: ``uncached`` prompt tokens on ``decode``,
    chunked between the decodes of its batch."""
    tokens = decode.queued + uncached
    compute = tokens / decode.rate
    chunks = math.ceil(tokens / decode.chunk) if decode.chunk > 0 else 1
    ttft = compute + (chunks * decode.step_s if decode.batch else 0.0)
    # The streams decoding there wait for the whole prompt; with none, only the request's own
    # decode (after its prompt) counts.
    tpot = decode.step_s + (compute / max(out_tokens, 1) if decode.batch else 0.0)
    return Prediction(LOCAL, ttft, tpot)


def choose(disagg: Prediction, local: Prediction, slo: Slo) -> Decision:
    """The option with the most headroom under ``slo`` (decode-only on a tie), and why."""
    a, b = disagg.headroom(slo), local.headroom(slo)
    if a < 0 and b < 0:
        best = disagg if disagg.excess(slo) < local.excess(slo) else local
        return Decision(best.choice, "both-miss", best)
    best, other = (disagg, b) if a > b else (local, a)
    return Decision(best.choice, "headroom" if other >= 0 else "saturated", best)


def pace_of(m: Member, queued: int, rate: float = 0.0) -> Pace | None:
    """``m``'s pace with ``queued`` prompt tokens (`Backlogs.queued`); its own measured rate,
    else ``rate`` (a peer's, for a worker that never computed a prompt); None without one."""
    load = m.load
    own = load.prefill_tokens_per_s
    use = own if own > 0 else rate
    if use <= 0:
        return None
    return Pace(queued, use, load.decode_step_ms / 1000, load.running, load.max_batched_tokens)


class Backlogs:
    """Prompt tokens this router sent each worker to compute and not yet computed (a prefill
    call until its reply, a decode-only call until its first event), so a load report up to one
    member refresh old is corrected as `services.router.policy.Chooser.load` corrects requests:
    ``queued = own now + max(reported - own when the report arrived, 0)``."""

    def __init__(self) -> None:
        self.own: Counter[str] = Counter()
        self._at_report: dict[str, tuple[MemberLoad, int]] = {}

    def add(self, worker_id: str, tokens: int) -> None:
        self.own[worker_id] += tokens

    def done(self, worker_id: str, tokens: int) -> None:
        self.own[worker_id] -= tokens

    def observe(self, change: MemberChange) -> None:
        """A `MemberWatcher` listener (through the chooser's)."""
        w = change.worker_id
        if change.kind == "put" and change.member is not None:
            self._at_report[w] = (change.member.load, self.own[w])
        else:
            self._at_report.pop(w, None)

    def queued(self, m: Member) -> int:
        own = self.own[m.worker_id]
        reported = m.load.prefill_backlog
        seen = self._at_report.get(m.worker_id)
        if seen is None or seen[0] is not m.load:
            return max(own, reported)
        return own + max(reported - seen[1], 0)


class Ewma:
    """An exponentially weighted mean (None until the first sample)."""

    def __init__(self, alpha: float = EWMA_ALPHA) -> None:
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)


class Disaggregator:
    """Decides disagg or decode-only for each request (the module docstring), from the members'
    reports, this router's `Backlogs`, and what it measured: the hand-off (seconds per prompt
    token moved) and the output of streams that ended here."""

    def __init__(self, default_slo: Slo, threshold: int, mode: str = "slo") -> None:
        if mode not in MODES:
            raise ValueError(f"disagg mode {mode!r} is not one of {', '.join(MODES)}")
        self.default_slo = default_slo
        self.threshold = threshold  # the cold-start rule (--decode-only-threshold)
        self.mode = mode
        self.backlogs = Backlogs()
        self.handoff_per_token = Ewma()  # seconds per prompt token of a hand-off
        self.output_tokens = Ewma()  # completion tokens of a stream that ended

    def slo(self, ttft_ms: float, tpot_ms: float) -> Slo:
        """A request's objectives: its own where given (> 0), else this router's defaults."""
        d = self.default_slo
        return Slo(ttft_ms / 1000 if ttft_ms > 0 else d.ttft_s,
                   tpot_ms / 1000 if tpot_ms > 0 else d.tpot_s)  # fmt: skip

    def handed_off(self, tokens: int, seconds: float, step_s: float = 0.0) -> None:
        """A hand-off of ``tokens`` prompt tokens took ``seconds`` (prefill reply to the decode
        worker's first event), on a decode worker whose step takes ``step_s`` (that token's own
        step, which decoding there without a hand-off would take too)."""
        if tokens > 0 and seconds >= 0:
            self.handoff_per_token.add(max(seconds - step_s, 0.0) / tokens)

    def finished(self, tokens: int) -> None:
        """A stream ended after ``tokens`` completion tokens."""
        if tokens > 0:
            self.output_tokens.add(tokens)

    def decide(
        self,
        slo: Slo,
        booked: int,
        prefill: tuple[Member, int] | None,
        decode_recv: Member | None,
        decode_local: tuple[Member, int],
        peers: list[Member],
    ) -> Decision:
        """Where to compute a prompt: ``prefill`` (worker, uncached tokens there) handing over
        to ``decode_recv``, or ``decode_local`` (worker, uncached tokens there). ``booked``:
        the completion tokens the request books; ``peers``: every live worker, whose measured
        rates stand in for a worker that has none yet."""
        local_m, uncached_d = decode_local
        if prefill is None or decode_recv is None:
            return Decision(LOCAL, "no-prefill")
        if self.mode == "length":
            return Decision(DISAGG if uncached_d >= self.threshold else LOCAL, "length")
        rates = [m.load.prefill_tokens_per_s for m in peers if m.load.prefill_tokens_per_s > 0]
        peer_rate = sum(rates) / len(rates) if rates else 0.0
        pm, uncached_p = prefill
        b = self.backlogs
        p, dr, dl = (pace_of(m, b.queued(m), peer_rate) for m in (pm, decode_recv, local_m))
        if p is None or dr is None or dl is None:
            choice = DISAGG if uncached_d >= self.threshold else LOCAL
            return Decision(choice, "cold-start")
        seen = self.output_tokens.value
        out = max(1, min(booked, round(seen)) if seen else booked)
        handoff = (self.handoff_per_token.value or 0.0) * uncached_p
        a = predict_disagg(p, dr, uncached_p, out, handoff)
        return choose(a, predict_local(dl, uncached_d, out), slo)
