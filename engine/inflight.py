"""A step launched and not read back yet (``InFlight``, which ``engine.step_loop`` keeps until
it reads the step's tokens), and the input ids of the step launched after it (async scheduling).

Step N+1 is launched while step N still runs, so the newest token of a sequence that sampled in
step N is known only on the device. The host plans that position with a placeholder id and, for
each input position, the row of step N's sampled-ids tensor it comes from (``-1``: the host
knows the id); ``feed_ids`` then fills the placeholders on the device, behind step N's sampling
in the same stream, with no round trip through the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput
    from engine.spec_decode import StepSample
    from engine.step_stats import StepStats


@dataclass(frozen=True, slots=True)
class InflightIds:
    """Step N's sampled token ids on the device (``tokens``, one per sampling row) and the row
    of each sequence that sampled there (by ``id(sequence)``)."""

    tokens: torch.Tensor
    rows: dict[int, int]


@dataclass(slots=True)
class InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    sched: SchedulerOutput
    due: list[Sequence]  # the sampling sequences, in the runner's row order
    sample: StepSample
    stats: StepStats | None
    started: float  # perf_counter() when the step() call that launched it began
    done: torch.cuda.Event | None  # behind its last kernel (None off CUDA)
    # Seeded generators' states before this step sampled, by id(sequence): a live move takes
    # a token in flight back (``Stepper.unsample``).
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    kind: tuple[int, int] = (0, 0)  # engine.late_planning.kind: its time predicts the next's

    def feed(self) -> InflightIds | None:
        """Its sampled ids on the device, for the next step's tokens in flight."""
        tokens = self.sample.tokens
        if tokens is None:
            return None
        return InflightIds(tokens, {id(seq): i for i, seq in enumerate(self.due)})


def known_tokens(seq: Sequence, lo: int, hi: int) -> list[int]:
    """Tokens ``lo .. hi - 1`` of ``seq`` (``hi <= seq.num_known``), without building its
    whole token list."""
    prompt, n = seq.prompt_token_ids, len(seq.prompt_token_ids)
    if hi <= n:
        return prompt[lo:hi]
    if lo >= n:
        return seq.output_token_ids[lo - n : hi - n]
    return prompt[lo:] + seq.output_token_ids[: hi - n]


def step_inputs(
    seq: Sequence, lo: int, hi: int, fed: InflightIds | None
) -> tuple[list[int], list[int]]:
    """The input ids of positions ``lo .. hi - 1`` of ``seq`` and, for each, the row of
    ``fed.tokens`` to gather it from (``-1``: the id is known here; else the id is 0 until
    ``feed_ids`` runs). Only the newest position can be in flight."""
    known = seq.num_known
    ids = known_tokens(seq, lo, min(hi, known))
    src = [-1] * len(ids)
    if hi > known:
        if hi != known + 1 or fed is None or id(seq) not in fed.rows:
            raise AssertionError(f"{seq.request_id}: positions up to {hi} but {known} known")
        ids.append(0)
        src.append(fed.rows[id(seq)])
    return ids, src


def feed_ids(ids: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """``ids[i] = tokens[src[i]]`` wherever ``src[i] >= 0``, in place (on the device: queued
    behind the kernels that sampled ``tokens``; nothing waits)."""
    ids.copy_(torch.where(src >= 0, tokens[src.clamp(min=0)], ids))
