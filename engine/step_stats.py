"""What one engine step did, for observers (services turn it into metrics; the engine imports no
metrics library). ``LLMEngine.on_step``, when set, receives one `StepStats` per step, on the
engine's thread, so it must be quick and thread-safe."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence


@dataclass(slots=True)
class StepStats:
    """One forward pass: its wall time, its batch, the queue time of requests that were
    scheduled for the first time in it (seconds from arrival to first scheduling), and of
    requests whose first token it produced, the time from arrival to that token's read-back
    (the engine's part of their TTFT) and from first scheduling to it (their prompt's steps).

    ``seconds`` runs from the step's launch (the start of its ``step()`` call) to when its
    tokens were read back; with async scheduling, from the later of its launch and the read of
    the step before, so that overlapping steps are not counted twice: consecutive steps'
    seconds add up to the wall time they took."""

    seconds: float = 0.0
    prefill_seqs: int = 0  # sequences computing (part of) a prompt in this step
    prefill_tokens: int = 0
    decode_seqs: int = 0  # sequences producing their next token from cached KV
    draft_tokens: int = 0  # speculative tokens verified along with the decodes
    queue_seconds: list[float] = field(default_factory=list)
    first_token_seconds: list[float] = field(default_factory=list)
    prefill_seconds: list[float] = field(default_factory=list)

    @property
    def phase(self) -> str:
        """The step's phase: prefill when it computed any prompt tokens, else decode."""
        return "prefill" if self.prefill_seqs else "decode"

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs

    @property
    def num_tokens(self) -> int:
        """Tokens computed: prompt chunks, one per decoding sequence, and draft tokens."""
        return self.prefill_tokens + self.decode_seqs + self.draft_tokens


StepObserver = Callable[[StepStats], None]


def prefill_backlog(seqs: Iterable[Sequence]) -> int:
    """Prompt tokens of ``seqs`` (waiting and running) not computed yet: those of sequences
    still prefilling (a prompt, or prompt and outputs recomputed after a preemption)."""
    return sum(s.num_uncomputed for s in seqs if s.is_prefilling)


def batch_stats(sched: SchedulerOutput) -> StepStats:
    """The batch of ``sched`` (call before the scheduler advances it); marks each sequence's
    first scheduling so its queue time is counted once."""
    now = time.monotonic()
    out = StepStats()
    for s in sched.scheduled:
        seq = s.seq
        if seq.first_scheduled is None:
            seq.first_scheduled = now
            out.queue_seconds.append(now - seq.arrival_time)
        if seq.is_prefilling:
            out.prefill_seqs += 1
            out.prefill_tokens += s.num_new
        else:
            out.decode_seqs += 1
            out.draft_tokens += len(s.draft)
    return out


def first_tokens(stats: StepStats, seqs: Iterable[Sequence]) -> None:
    """Count, in ``stats``, the first token of each of ``seqs`` (choice 0 of requests that had
    no output before this step and have one now: a prefilled request followed here, a resumed
    or recomputed one already had its first token elsewhere or earlier)."""
    now = time.monotonic()
    for seq in seqs:
        if seq.first_scheduled is None:  # not scheduled through this engine's steps
            continue
        stats.first_token_seconds.append(now - seq.arrival_time)
        stats.prefill_seconds.append(now - seq.first_scheduled)


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding so far: verified drafts (one per sequence and step that had one),
    their tokens, the tokens the model kept, and kept tokens by draft position (``[0]``: first
    draft tokens kept; the acceptance rate at position j is ``accepted_per_pos[j] / drafts``)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, num_draft: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def copy(self) -> SpecStats:
        return SpecStats(
            self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_per_pos)
        )
