"""The engine's step: schedule, launch the forward pass and sampling, read the tokens back, emit;
synchronously, or overlapped one step ahead (async scheduling).

Overlapped (``EngineConfig.async_scheduling``), each ``step()`` call plans and launches step
N+1 while step N still runs on the device, then reads step N's tokens back (one wait, on the
event behind their copy to the host), emits them and returns them. Outputs lag one call, and
the device has the next step queued while the host does step N's bookkeeping::

    host, call k:  schedule N+1 | launch N+1 | wait for N | stop checks, detokenize N | return N
    device:        ... N ................... | N+1 ................................. | N+2 ...

While step N is in flight, a sequence that sampled in it has one token in flight
(``Sequence.num_inflight``): step N+1 plans that position, and the model runner gathers the id
from N's sampled ids on the device (``engine.inflight``). A sequence whose token in flight
certainly ends it (max_tokens, the context limit) is not planned into N+1. One that N ends by
EOS, a stop token or a stop string was planned: when N is read it finishes and frees its
blocks, and N+1's result for it is dropped when N+1 is read. An abort between two calls frees
the request's blocks at once and drops its results in flight the same way. A sequence preempted
while its token is in flight keeps the token when it arrives, then recomputes.

The invariant that makes freeing blocks under a step in flight safe: every device op of the
engine (block copies, forward passes, sampling, copies to and from the host, checksums, block
reads and writes) is issued on one CUDA stream, in program order. A block freed on the host
while the step in flight still writes it can only be written again, or read, by work issued
later, which the stream runs after. KV written from off the stream (a NIXL or CUDA IPC transfer
into reserved blocks) must wait for the step in flight first (``Stepper.await_device``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from engine.choices import due_sequences, join_forks
from engine.device_io import mark
from engine.inflight import InFlight
from engine.late_planning import PlanClock, kind
from engine.sequence import SeqStatus, Sequence
from engine.step_stats import SpecStats, StepObserver, batch_stats, first_tokens

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    from engine.choices import Choice, Request
    from engine.config import EngineConfig
    from engine.emit import Emitter
    from engine.model_runner import ModelRunner
    from engine.ngram import Proposer
    from engine.parallel.ranks import RankGroup
    from engine.request_output import RequestOutput
    from engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
    from engine.structured import GrammarRuntime
    from libkv.kv_manager import KVCacheManager


class Stepper:
    """``LLMEngine.step`` and what it runs, under the engine lock; a part the engine holds.

    ``requests`` is the engine's table of live requests (read; forks join a request's live
    choices); ``emitter`` turns sampled tokens into outputs; ``choice_of``
    builds a forked choice (generator, detokenizer); ``drop_unused_loras`` frees adapters no
    request uses any more. ``proposer`` (speculative decoding) and ``on_step`` (the observer
    of each step's ``StepStats``) may be replaced between steps. Counts ``overlapped_steps``
    (left in flight across a ``step()`` call) and ``dropped_tokens`` (sampled in flight for a
    sequence that ended, or left, meanwhile), and the drafts in ``spec``."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: Scheduler,
        runner: ModelRunner,
        kv: KVCacheManager,
        grammar: GrammarRuntime,
        emitter: Emitter,
        lock: threading.RLock,
        requests: dict[str, Request],
        proposer: Proposer | None,
        ranks: RankGroup | None,
        max_model_len: int,
        choice_of: Callable[[Sequence], Choice],
        drop_unused_loras: Callable[[], None],
    ) -> None:
        self.config, self.scheduler, self.runner, self.kv = config, scheduler, runner, kv
        self.grammar, self.emitter, self._lock, self._requests = grammar, emitter, lock, requests
        self.proposer, self.ranks, self.max_model_len = proposer, ranks, max_model_len
        self._choice_of, self._drop_unused_loras = choice_of, drop_unused_loras
        spec = config.speculative_config
        self.spec = SpecStats(accepted_per_pos=[0] * (spec.num_speculative_tokens if spec else 0))
        self.on_step: StepObserver | None = None
        self.inflight: InFlight | None = None  # the step launched and not read back yet
        self._last_read = 0.0  # perf_counter() when a step was last read back
        self.overlapped_steps = 0
        self.dropped_tokens = 0
        # Late planning (engine.late_planning): the steps' times, and the waits before plans.
        self.clock = PlanClock() if config.late_planning else None

    def step(self) -> list[RequestOutput]:
        """One iteration. Synchronous: schedule, run the model, sample, detokenize, finish what
        is done, and return this step's outputs. Overlapped (``config.async_scheduling``):
        launch the next step, then read back and return the previous one's outputs; a step that
        must not stay in flight (``_must_sync``) is read back in the same call."""
        with self._lock:
            t0 = time.perf_counter()
            prev, self.inflight = self.inflight, None
            if self.proposer is not None:  # a proposer makes every step synchronous
                self._propose(self.proposer)
            sched = self.scheduler.schedule()
            step, sync = None, True
            if sched.scheduled:
                sync = self._must_sync(sched)
                step = self._launch(sched, prev, t0, keep_states=not sync)
            outputs = self._read(prev) if prev is not None else []
            if step is not None and sync:
                outputs += self._read(step)
            elif step is not None:
                self.inflight = step
                self.overlapped_steps += 1
            return outputs + self.settle_if_idle()

    def _must_sync(self, sched: SchedulerOutput) -> bool:
        """Whether the step ``sched`` must be read back before ``step()`` returns, instead of
        staying in flight while the next step is planned: the fallback rules of async
        scheduling. They hold where the next step needs on the host what this one samples:

        - always, when async scheduling is off, with speculative decoding (the proposer drafts
          from every token so far) or under tensor parallelism (the other ranks build their
          input ids from host data);
        - a sequence sampling under a grammar (its matcher takes the token before the next
          bitmask), with repetition, frequency or presence penalties (they count its outputs)
          or short of ``min_tokens`` (its stop tokens stay masked by that count);
        - a prompt whose choices fork (n > 1: they join the batch once its tokens are read)
          and a prefill hand-off's first token (hold_kv: the request then leaves the batch).

        Plain greedy and sampled rows (temperature, top-k, top-p, min-p, seeds, logit bias,
        logprobs) overlap. Prompt logprobs, embeddings and scores never share a step: they run
        alone (``engine.pooling``), in stream order. Loading an adapter into a LoRA slot is a
        device copy in stream order too, behind the step in flight that may still read the
        slot, so it needs no read-back."""
        if not self.config.async_scheduling or self.ranks is not None or self.proposer is not None:
            return True
        for s in sched.scheduled:
            seq, p = s.seq, s.seq.params
            if not s.samples:
                continue
            req = self._requests[seq.request_id]
            if (
                seq.matcher is not None
                or p.has_penalties
                or len(seq.output_token_ids) < p.min_tokens
                or req.hold_kv
                or req.forking(seq)
            ):
                return True
        return False

    def _launch(
        self, sched: SchedulerOutput, prev: InFlight | None, t0: float, keep_states: bool
    ) -> InFlight:
        """Launch the step ``sched`` (forward pass and sampling, on the device's queue) and
        advance the host's bookkeeping as if it had run: its chunks count as computed, and
        each sampling sequence has one more token in flight."""
        stats = batch_stats(sched) if self.on_step is not None else None
        due = due_sequences(sched.scheduled, self._requests, self._choice_of)
        states = {}
        if keep_states:
            states = {id(s): s.generator.get_state() for s in due if s.generator is not None}
        sample = self.runner.execute(sched, self.grammar, prev.feed() if prev else None)
        if self.clock is not None:
            self.clock.launched(time.perf_counter() - t0)
        if any(s.draft for s in sched.scheduled):  # advance counts the kept drafts: read now
            self._count_drafts(sched.scheduled, due, sample.result().num_accepted)
        self.scheduler.advance(sched.scheduled)
        for seq in due:
            seq.num_inflight += 1
        done = mark(self.runner.device)
        return InFlight(sched, due, sample, stats, t0, done, states, kind(sched))

    def _read(self, step: InFlight) -> list[RequestOutput]:
        """Wait for ``step``'s tokens (a step's one host sync) and settle it: forks join,
        each sequence still live takes its tokens (stop checks, detokenization, finishing),
        blocks whose tokens are now known are published, and the step is reported. The result
        of a sequence aborted, finished, moved or handed off since the launch is dropped."""
        out = step.sample.result()
        live = [j for j, seq in enumerate(step.due) if self._live(seq)]
        self.dropped_tokens += len(step.due) - len(live)
        for j in live:  # a dropped sequence never runs again: its count no longer matters
            step.due[j].num_inflight -= 1
        join_forks(step.sched.scheduled, self._requests, self.kv, self.scheduler)
        due = [step.due[j] for j in live]
        tokens, lps = [out.token_ids[j] for j in live], [out.logprobs[j] for j in live]
        firsts = [seq for seq in due if seq.index == 0 and not seq.output_token_ids]
        outputs = self.emitter.emit(due, tokens, lps)
        for seq in due:
            if seq.status is SeqStatus.RUNNING and seq.key in self.kv:
                self.scheduler.commit(seq)
        self.seal_pending()
        self._drop_unused_loras()
        if self.proposer is not None:
            self.proposer.retain(self.scheduler.running)
        now = time.perf_counter()
        # The time this step added: from its launch, or from when the step before it was read
        # if that was later (overlapped, the calls' times then sum to the wall time).
        added = now - max(step.started, self._last_read)
        if self.clock is not None:
            self.clock.ran(step.kind, added)
        if step.stats is not None and self.on_step is not None:
            first_tokens(step.stats, [seq for seq in firsts if seq.output_token_ids])
            step.stats.seconds = added
            self.on_step(step.stats)
        self._last_read = now
        return outputs

    def _live(self, seq: Sequence) -> bool:
        """Whether ``seq`` still runs here as its request's choice (not aborted, finished,
        moved or handed off since a step in flight sampled it)."""
        req = self._requests.get(seq.request_id)
        choice = req.live.get(seq.index) if req is not None else None
        return choice is not None and choice.seq is seq

    def hold(self, wake: threading.Event) -> float:
        """With late planning, wait before the next plan (``engine.late_planning``): until the
        step in flight's predicted end less the next launch, until it is done, or until
        ``wake`` is set (a command came); returns the time waited (0: plan now)."""
        clock = self.clock
        with self._lock:
            step = self.inflight
            if clock is None or step is None or step.done is None or self.scheduler.waiting:
                return 0.0
            # On the device since the step before it ended (read back then), or its launch.
            began = max(self._last_read, step.started + (clock.launch_s or 0.0))
            seconds = clock.slack(step.kind, began, time.perf_counter())
        return clock.hold(seconds, step.done, wake)

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work: sequences to run, or a step in flight to read back."""
        with self._lock:
            return self.scheduler.has_work() or self.inflight is not None

    def settle_if_idle(self) -> list[RequestOutput]:
        """Read the step in flight back now if no live sequence waits for its tokens and there
        is nothing else to run (its last sequences ended, were aborted or moved): the engine
        then goes idle with nothing in flight, and that step's report holds no idle time."""
        step = self.inflight
        if step is None or self.scheduler.has_work() or any(self._live(s) for s in step.due):
            return []
        self.inflight = None
        return self._read(step)

    def await_device(self) -> None:
        """Block until the device has run the step in flight (nothing is read back): before
        KV is written into blocks from off the engine's stream, where the one-stream
        invariant of the module's note does not reach."""
        step = self.inflight
        if step is not None and step.done is not None:
            step.done.synchronize()

    def unsample(self, seq: Sequence) -> None:
        """Take back ``seq``'s token in flight, unread, so that it can move to another worker
        at the tokens its stream has (``hold_for_move``): the step in flight's result for it
        is dropped once it leaves, the KV that step writes at its newest known position is not
        counted (the taker computes it again), and a seeded generator returns to its state
        before that step sampled."""
        step = self.inflight
        assert step is not None and seq.num_inflight == 1
        self.await_device()  # the blocks' bytes are final before a peer reads them
        seq.num_inflight = 0
        seq.num_computed = seq.num_tokens - 1
        self.kv.truncate(seq.key, seq.num_computed)
        state = step.states.get(id(seq))
        if state is not None:
            seq.generator.set_state(state)

    def seal_pending(self) -> None:
        """Checksum the blocks sealed since the last call (``config.seal_checksums``) and keep
        the sums; a launch on a GPU, which waits for nothing."""
        with self._lock:
            sealed = self.kv.take_sealed()
            if sealed:
                self.runner.seal_checksums(sealed)

    def _propose(self, proposer: Proposer) -> None:
        """Set the draft of every decoding sequence for the next step: never past its
        ``max_tokens`` or the context limit (a step emits the kept drafts plus one token), and
        none for a grammar-constrained sequence (its matcher cannot take tokens back)."""
        seqs: list[Sequence] = []
        limits: list[int] = []
        for seq in self.scheduler.running:
            seq.draft_token_ids = []
            if seq.output_token_ids and seq.num_uncomputed == 1 and seq.matcher is None:
                seqs.append(seq)
                limits.append(
                    min(
                        seq.params.max_tokens - len(seq.output_token_ids),
                        self.max_model_len - seq.num_tokens,
                    )
                    - 1
                )
        if seqs:
            for seq, draft in zip(seqs, proposer.propose_all(seqs, limits), strict=True):
                seq.draft_token_ids = draft

    def _count_drafts(
        self, scheduled: list[ScheduledSeq], due: list[Sequence], accepted: list[int]
    ) -> None:
        """Tell each drafting chunk how many of its draft tokens were kept, and count them."""
        kept = {id(seq): n for seq, n in zip(due, accepted, strict=True)}
        for s in scheduled:
            if s.draft:
                s.num_accepted = kept[id(s.seq)]
                self.spec.add(len(s.draft), s.num_accepted)
