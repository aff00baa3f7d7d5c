"""A request's choices as the engine tracks them (no torch): ``n`` sequences of one prompt.

The prompt is computed once, by choice 0. When choice 0 samples its first token, the other
choices are forked from it (``due_sequences``, as the step is launched): they sample their first
tokens from the same logits, and once it is read (``join_forks``) their block tables share every
block of choice 0 (copy-on-write, see ``libkv.kv_manager.fork``)::

    prompt KV:  [ b0 | b1 | b2 (partial) ]  <- shared by choices 0..n-1 after the fork
    choice 1 writes its first output token into b2: grow() copies b2 into b7 first
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.sampling_params import TokenLogprob
from engine.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.scheduler import ScheduledSeq, Scheduler
    from libkv.kv_manager import KVCacheManager


@dataclass(slots=True)
class Choice:
    """One choice: its sequence, detokenizer and what it has produced so far."""

    seq: Sequence
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None = None
    text: str = ""
    stop_reason: str | int | None = None


@dataclass(slots=True)
class Request:
    """The live choices of a request, by index, and the indices still to be forked.

    ``parent`` is the sequence that computes the prompt (choice 0, or on a decode worker the
    first choice it continues); it stays referenced after it finishes, for the hold-off.
    ``hold_kv``: a prefill; after the first tokens the prompt's blocks are held, not decoded.
    """

    parent: Sequence
    live: dict[int, Choice]
    unborn: list[int] = field(default_factory=list)
    hold_kv: bool = False

    @property
    def request_id(self) -> str:
        return self.parent.request_id

    @property
    def done(self) -> bool:
        """Nothing left to run here: every choice finished (or was handed off)."""
        return not self.live and not self.unborn

    def forking(self, seq: Sequence) -> bool:
        """Whether ``seq`` is about to sample the first token from which choices fork."""
        return bool(self.unborn) and seq is self.parent and not seq.output_token_ids


@dataclass(slots=True)
class RequestTables:
    """The engine's request tables, one object its parts share (each changed under the engine
    lock): ``requests``, the live requests by id (a request leaves when done, aborted, moved
    or handed off); ``reserved``, decode-side block tables reserved for KV that will arrive;
    ``held``, prefill-side block tables kept for a decode worker, with ``held_seqs`` the
    choices of each that go on there (by index)."""

    requests: dict[str, Request] = field(default_factory=dict)
    reserved: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    held_seqs: dict[str, dict[int, Sequence]] = field(default_factory=dict)

    def register(self, req: Request, tables_in_use: Container[str]) -> None:
        """Add ``req`` as live. Its id must be free: neither live nor the key of a block table
        in ``tables_in_use`` (the KV manager's), unless that table is reserved for it."""
        rid = req.request_id
        if rid in self.requests or (rid in tables_in_use and rid not in self.reserved):
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        self.requests[rid] = req


def fork_sequence(parent: Sequence, index: int) -> Sequence:
    """A new choice of ``parent``'s request, sharing its prompt and scheduling state; its
    generator and matcher are set by the engine."""
    return Sequence(
        parent.request_id,
        parent.prompt_token_ids,
        parent.params,
        parent.arrival,
        parent.cache_salt,
        num_cached_prompt_tokens=parent.num_cached_prompt_tokens,
        arrival_time=parent.arrival_time,
        first_scheduled=parent.first_scheduled,
        priority=parent.priority,
        index=index,
        matcher=None if parent.matcher is None else parent.matcher.deep_copy(),
        lora=parent.lora,
    )


def due_sequences(
    scheduled: list[ScheduledSeq],
    requests: dict[str, Request],
    choice_of: Callable[[Sequence], Choice],
) -> list[Sequence]:
    """The sequences sampling in a step of ``scheduled``, in the runner's row order; forks the
    other choices of a request whose prompt is done (they sample from the same logits row;
    ``choice_of`` builds each one's choice)."""
    due: list[Sequence] = []
    for s in scheduled:
        if not s.samples:
            continue
        req = requests[s.seq.request_id]
        if req.forking(s.seq):
            for index in req.unborn:
                req.live[index] = choice_of(fork_sequence(s.seq, index))
                s.forks.append(req.live[index].seq)
            req.unborn = []
        due.append(s.seq)
        due.extend(s.forks)
    return due


def join_forks(
    scheduled: list[ScheduledSeq],
    requests: dict[str, Request],
    kv: KVCacheManager,
    scheduler: Scheduler,
) -> None:
    """After the prompt's forward pass: forked choices share its blocks and join the batch
    (unless the request is a prefill hand-off, which decodes elsewhere)."""
    for s in scheduled:
        for child in s.forks:
            child.num_computed = s.seq.num_computed
            if requests[s.seq.request_id].hold_kv:
                child.status = SeqStatus.RUNNING
                continue
            kv.fork(s.seq.key, child.key)
            scheduler.attach(child)
