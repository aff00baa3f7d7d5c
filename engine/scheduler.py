"""Iteration-level continuous batching with chunked prefill (no torch).

Each step spends a token budget: running sequences first, oldest first (a decode costs one
token, an unfinished prefill takes the next chunk), then waiting sequences in arrival order
(their cached prefix is skipped). When the KV pool cannot grow a running sequence, the newest
running sequence is preempted: its blocks are freed and it returns to the front of the queue,
keeping its output tokens. It resumes like a new prompt: what the prefix cache still holds is
reused, and with a host tier (``libkv.host_tier``, which has had its full blocks since they
were computed) the rest of its KV is paged back in (a swap) when at least
``kv_swap_min_tokens`` are there; otherwise it is recomputed. The oldest sequence therefore
always makes progress, and no sequence is admitted whose worst case cannot fit in the pool
alone, so the loop can neither crash nor deadlock.

With async scheduling (``engine.step_loop``) a step is planned while the previous one still
runs: a running sequence may have its newest token in flight (``Sequence.num_inflight``). Its
position is planned like any other (the runner feeds the token from the device); a sequence
whose in-flight token is certainly its last (``Sequence.out_of_room``) is not planned again and
leaves no slot taken, and prefix-cache commits wait until a block's tokens are all known.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.sequence import FinishReason, SeqStatus, Sequence
from libkv.host_tier import HostHit, TierCopies
from libkv.kv_manager import CopyOp, KVCacheManager, PrefixHit


@dataclass(slots=True)
class ScheduledSeq:
    """``num_new`` tokens of ``seq`` computed this step, starting at ``seq.num_computed``.

    ``forks`` are further choices of the same request that sample their first token from this
    chunk's logits (``n > 1``: the prompt is computed once, then forked). A decoding sequence
    may carry ``draft``, speculative tokens computed after its newest one (the last
    ``len(draft)`` of ``num_new``); the engine sets ``num_accepted``, how many of them the model
    confirmed, before ``Scheduler.advance``.
    """

    seq: Sequence
    num_new: int
    block_ids: list[int]
    forks: list[Sequence] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    num_accepted: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so a token is sampled."""
        return self.seq.num_computed + self.num_new - len(self.draft) == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[CopyOp] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    loras: set[str] = field(default_factory=set)  # the adapters of the scheduled sequences
    tier: TierCopies = field(default_factory=TierCopies)  # host tier copies, before the step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)

    def add(self, s: ScheduledSeq) -> None:
        self.scheduled.append(s)
        if s.seq.lora:
            self.loras.add(s.seq.lora)


class Scheduler:
    """Owns the waiting queue, the running list and the KV cache manager."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_loras: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        """``max_loras``: at most that many LoRA adapters in one step (0: no limit); a
        sequence whose adapter would exceed it waits for a later step, without preemption.
        ``max_model_len``: the context limit (None: none), for sequences whose token in flight
        reaches it."""
        self.kv = kv
        self.max_loras = max_loras
        self.max_model_len = max_model_len if max_model_len is not None else 1 << 62
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` behind every waiting sequence of its priority or a more urgent one
        (lower number), ahead of less urgent ones; arrival order within a priority."""
        seq.status = SeqStatus.WAITING
        for i in range(len(self.waiting) - 1, -1, -1):
            if self.waiting[i].priority <= seq.priority:
                self.waiting.insert(i + 1, seq)
                return
        self.waiting.appendleft(seq)

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.key)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = seq.finish_reason or FinishReason.ABORT

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq`` and free its blocks; it is running, or waiting when it was preempted
        with its last token in flight."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq.key)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason

    def detach(self, seq: Sequence) -> None:
        """Take a running sequence out of the batch but keep its blocks (a prefill hand-off)."""
        self.running.remove(seq)
        seq.status = SeqStatus.FINISHED

    def attach(self, seq: Sequence) -> None:
        """Join a sequence whose KV is already in its block table straight into the batch."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.token_budget)
        budget = self._schedule_drafts(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        tier = self.kv.tier
        if out.scheduled and tier is not None and tier.pending:  # issued with this step
            out.tier = tier.take()
        return out

    def _ending(self, seq: Sequence) -> bool:
        """Whether ``seq``'s token in flight is certainly its last (max_tokens, context limit):
        it is not scheduled again and, finishing when the token arrives, takes no slot."""
        return seq.num_inflight > 0 and seq.out_of_room(self.max_model_len)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._ending(seq) or not self._lora_fits(seq, out):
                i += 1
                continue
            n = min(seq.num_uncomputed, budget)
            copies = self.kv.grow(seq.key, seq.num_computed, seq.num_computed + n)
            while copies is None:
                victim = self._victim(i)
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv.grow(seq.key, seq.num_computed, seq.num_computed + n)
            if copies is None:  # seq itself was the victim (newest of the least urgent)
                break
            out.copies.extend(copies)
            out.add(ScheduledSeq(seq, n, self.kv.block_ids(seq.key)))
            budget -= n
            i += 1
        return budget

    def _lora_fits(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Whether ``seq``'s adapter can join this step (its slot limit not yet reached)."""
        if not seq.lora or not self.max_loras or seq.lora in out.loras:
            return True
        return len(out.loras) < self.max_loras

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Add each decoding sequence's draft tokens with what the step has left: budget and
        free blocks only (a draft never preempts anything); a draft that does not fit is cut
        or dropped. Drafts go before new prefills, as in vLLM."""
        for s in out.scheduled:
            seq = s.seq
            if budget <= 0:
                break
            if not seq.draft_token_ids or s.num_new != 1 or not s.samples:
                continue
            draft = seq.draft_token_ids[:budget]
            end = seq.num_computed + 1 + len(draft)
            copies = self.kv.grow(seq.key, seq.num_computed, end)
            if copies is None:
                continue
            assert not copies, "the write block was made private when the step grew it"
            s.draft, s.num_new = draft, 1 + len(draft)
            s.block_ids = self.kv.block_ids(seq.key)
            budget -= len(draft)
        return budget

    def _victim(self, first: int) -> Sequence:
        """The sequence to preempt, among those not yet scheduled this step (``running[first:]``):
        the newest of the least urgent priority there (batch before interactive)."""
        rest = self.running[first:]
        worst = max(s.priority for s in rest)
        return next(s for s in reversed(rest) if s.priority == worst)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.key)
        seq.status, seq.num_computed = SeqStatus.WAITING, 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        skipped: list[Sequence] = []  # their adapter has no slot this step; they keep their place
        ending = sum(1 for s in self.running if self._ending(s))
        while self.waiting and budget > 0 and len(self.running) - ending < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_inflight:  # preempted with a token in flight: it must arrive first
                break
            if not self._lora_fits(seq, out):
                skipped.append(self.waiting.popleft())
                continue
            tokens = seq.all_token_ids
            hit, host, num_computed = self._cached_prefix(tokens, seq.cache_salt)
            n = min(len(tokens) - num_computed, budget)
            copies = self.kv.admit(seq.key, hit, num_computed, num_computed + n, seq.cache_salt)
            if copies is None:
                break
            self._page_in(seq, hit, host, num_computed)
            self.waiting.popleft()
            if not seq.output_token_ids:
                seq.num_cached_prompt_tokens = num_computed
            seq.num_computed = num_computed
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.copies.extend(copies)
            out.add(ScheduledSeq(seq, n, self.kv.block_ids(seq.key)))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _cached_prefix(self, tokens: list[int], salt: bytes) -> tuple[PrefixHit, HostHit, int]:
        """The device hit, the host-tier blocks to page in after it (those worth paging:
        ``HostTier.worth_paging``) and the tokens whose KV is then computed. At least the
        last token is computed: its logits give the next token."""
        bs = self.kv.block_size
        hit = self.kv.find_prefix(tokens, salt)
        on_device = hit.num_tokens(bs)
        host = self.kv.find_host(tokens, salt, hit)
        tier = self.kv.tier
        if host and tier is not None:
            more = min(len(host) * bs, len(tokens) - 1 - on_device)
            if tier.worth_paging(more):
                keep = -(-more // bs)  # the blocks holding those tokens
                host.truncate(keep)
                return hit, host, on_device + more
            tier.stats.short_hits += 1
        return hit, HostHit(), min(on_device, len(tokens) - 1)

    def _page_in(self, seq: Sequence, hit: PrefixHit, host: HostHit, num_computed: int) -> None:
        """Queue the page-ins of ``host`` into the blocks just allocated after the device hit,
        and count how a preempted sequence resumed (swapped in or recomputed)."""
        tier = self.kv.tier
        if tier is None:
            return
        if host:
            start = len(hit.blocks)
            tier.page_in(host, self.kv.block_ids(seq.key)[start : start + len(host)])
        if seq.num_preemptions and seq.output_token_ids:
            if host:
                tier.stats.swaps += 1
            elif num_computed < seq.num_known - self.kv.block_size:
                tier.stats.recomputes += 1

    def advance(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """Once the forward pass is launched: mark the chunk computed and publish newly full
        blocks whose tokens are all known (``commit``).

        Of a draft, only the ``num_accepted`` confirmed tokens count as computed (the engine
        appends them to the outputs after this call); the blocks past them are freed, so the
        rejected tokens' KV is neither kept nor ever cached."""
        for s in scheduled:
            seq = s.seq
            if not s.draft:
                seq.num_computed += s.num_new
                self.commit(seq)
                continue
            seq.num_computed += s.num_new - len(s.draft) + s.num_accepted
            tokens = seq.all_token_ids + s.draft[: s.num_accepted]
            self.kv.commit(seq.key, tokens, seq.num_computed)
            self.kv.truncate(seq.key, seq.num_computed + 1)

    def commit(self, seq: Sequence) -> None:
        """Publish (and seal) the full blocks of ``seq`` whose KV is computed and whose tokens
        are all known: a block holding a token still in flight waits for it (the engine calls
        this again when it arrives). Builds the token list only when a block is due."""
        n = min(seq.num_computed, seq.num_known)
        table = self.kv.table(seq.key)
        full = n // self.kv.block_size
        due = self.kv.enable_prefix_caching and full > len(table.hashes)
        if due or (self.kv.track_seals and full > table.num_sealed):
            self.kv.commit(seq.key, seq.all_token_ids, n)
