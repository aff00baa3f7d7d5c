"""Draft-model speculative decoding: a small model sharing the target's vocabulary proposes
each decoding sequence's next ``k`` tokens, greedily, and the target verifies them in its step.

**Where the draft's KV lives.** In a pool of its own (as many blocks as the target's, its own
block tables and prefix cache), on the worker that decodes, and nowhere else: it is never moved.
A sequence with no draft KV here (a prefill -> decode hand-off, a migrated stream, a sequence
back from preemption, a request that arrived with outputs) is first prefilled in the draft over
its whole history, prompt and outputs so far, at most ``max_num_batched_tokens`` tokens per step
(no draft for it until it has caught up; prefix-cache hits in the draft pool are skipped).

**One step** for a sequence with known tokens ``h_0 .. h_{n-1}`` (``h_{n-1}`` the newest, which
the target has no KV for yet) and ``c`` of them with draft KV::

    pass 0:  feed h_c .. h_{n-1}   at positions c .. n-1     last row's argmax -> d_1
    pass j:  feed d_j              at position  n-1+j         argmax -> d_{j+1}   (j < k)

Every sequence's rows go in one forward pass per ``j``. The drafts are the draft's argmax, a
point mass, which ``engine.spec_decode`` verifies as it verifies n-gram drafts: greedy output is
the target's own, and sampling keeps the target's distribution.

**After the target's step** the draft pool holds KV for ``h`` and ``d_1 .. d_{k-1}``; the
sequence now has ``h, d_1 .. d_a`` and one more token. At the next proposal the draft keeps the
KV of the longest prefix whose tokens match (``h, d_1 .. d_min(a, k-1)``) and frees the blocks
past it (``KVCacheManager.truncate``); only confirmed tokens' full blocks enter its prefix cache.
A sequence that leaves the running batch (finished, aborted, preempted, handed off) loses its
draft table at once (``retain``). A draft that finds no free block is dropped for that step:
speculation never preempts anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeBatch
from engine.errors import UnsupportedConfigError
from engine.model_runner import ModelRunner, StepPlan
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer
from engine.warmup import warm_up
from libkv.block_pool import BlockPool
from libkv.kv_manager import CopyOp, KVCacheManager


def check_same_vocab(
    target: ModelConfig, target_tok: Tokenizer, draft: ModelConfig, draft_dir: str
) -> None:
    """Refuse a draft whose token ids do not mean the target's: another vocabulary size, or a
    tokenizer that maps any token to another id."""
    if draft.vocab_size != target.vocab_size:
        raise UnsupportedConfigError(
            f"speculative draft model {draft_dir!r} has vocab_size {draft.vocab_size}, the "
            f"target {target.vocab_size}: a draft must share the target's tokenizer and vocabulary"
        )
    theirs = Tokenizer(draft_dir).hf.get_vocab(with_added_tokens=True)
    ours = target_tok.hf.get_vocab(with_added_tokens=True)
    if theirs != ours:
        differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
        raise UnsupportedConfigError(
            f"speculative draft model {draft_dir!r} has another tokenizer than the target: "
            f"{len(differ)} tokens differ (e.g. {differ[:3]}); a draft must share the target's "
            "tokenizer and vocabulary"
        )


@dataclass(slots=True)
class _DraftState:
    """A sequence's draft KV: ``computed`` leading positions are written, ``base`` of them
    history (tokens the sequence had when they were fed), then the draft tokens ``fed``, which
    the target may since have rejected (``computed == base + len(fed)``)."""

    seq: Sequence
    computed: int = 0
    base: int = 0
    fed: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Row:
    """One sequence's part of a draft forward pass."""

    state: _DraftState
    tokens: list[int]
    start: int  # position of tokens[0]
    samples: bool
    history: bool = True  # known tokens of the sequence (else one draft token)


class DraftProposer:
    """Runs the draft model and proposes drafts for a batch of decoding sequences."""

    def __init__(
        self,
        config: EngineConfig,
        target: ModelConfig,
        target_tok: Tokenizer,
        max_len: int,
        num_blocks: int,
    ) -> None:
        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        draft_mc = ModelConfig.from_dir(spec.model)
        check_same_vocab(target, target_tok, draft_mc, spec.model)
        self.k = spec.num_speculative_tokens
        self.chunk = config.max_num_batched_tokens
        self.block_size = config.block_size
        dconf = dataclasses.replace(
            config,
            model_dir=spec.model,
            speculative_config=None,
            enable_lora=False,
            num_kv_blocks=num_blocks,
            # Its mixed steps (catching up on a history) run eagerly: the target's plan sets
            # aside room for the draft's decode graphs only (``memory.Reserve``).
            mixed_graph_max_tokens=0,
        )
        # Its pool and the room for its graphs are planned by the target (``memory.Reserve``).
        self.runner = ModelRunner(
            dconf, draft_mc, max_len, num_blocks=num_blocks, graph_rows=config.max_draft_rows
        )
        warm_up(self.runner, max_len)
        self.model_config = draft_mc
        self.pool = BlockPool(num_blocks, config.block_size)
        self.kv = KVCacheManager(self.pool, config.enable_prefix_caching)
        self._states: dict[Hashable, _DraftState] = {}
        self.prefill_tokens = 0  # history tokens fed to catch up (hand-offs, returns)

    # -- the engine's interface ------------------------------------------------------------
    def propose_all(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """Per sequence, at most ``min(k, limit)`` draft tokens (none while it catches up)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        rows: list[tuple[int, _Row]] = []
        copies: list[CopyOp] = []
        budget = self.chunk
        for i, (seq, limit) in enumerate(zip(seqs, limits, strict=True)):
            want = min(self.k, limit)
            if want <= 0 or budget <= 0:
                continue
            row = self._first_row(seq, want, budget, copies)
            if row is not None:
                rows.append((i, row))
                budget -= len(row.tokens)
        if not rows:
            return drafts
        firsts = self._run([r for _, r in rows], copies)
        live: list[tuple[int, _DraftState, int]] = []
        for (i, row), tok in zip([x for x in rows if x[1].samples], firsts, strict=True):
            drafts[i] = [tok]
            if min(self.k, limits[i]) > 1:
                live.append((i, row.state, min(self.k, limits[i])))
        for j in range(1, self.k):
            live = [x for x in live if x[2] > j]
            if not live:
                break
            step = [_Row(st, [drafts[i][-1]], st.computed, True, False) for i, st, _ in live]
            for (i, _, _), tok in zip(live, self._run(step, []), strict=True):
                drafts[i].append(tok)
        return drafts

    def retain(self, running: Iterable[Sequence]) -> None:
        """Free the draft tables of sequences no longer in the running batch."""
        keep = {id(s) for s in running}
        for key in [k for k, st in self._states.items() if id(st.seq) not in keep]:
            self._drop(key)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # -- internals ---------------------------------------------------------------------------
    def _first_row(
        self, seq: Sequence, want: int, budget: int, copies: list[CopyOp]
    ) -> _Row | None:
        """This step's first-pass row of ``seq``: its history not yet in the draft (or the
        next chunk of it), with room for ``want - 1`` draft tokens after it when it catches up.
        None when the draft pool has no room (its draft table is dropped)."""
        st = self._state(seq, copies)
        if st is None:
            return None
        tokens = seq.all_token_ids
        todo = len(tokens) - st.computed
        take = min(todo, budget)
        caught_up = take == todo
        end = st.computed + take + (want - 1 if caught_up else 0)
        grown = self.kv.grow(seq.key, st.computed, end)
        if grown is None:
            self._drop(seq.key)
            return None
        copies.extend(grown)
        if take > 1:
            self.prefill_tokens += take - (1 if caught_up else 0)
        return _Row(st, tokens[st.computed : st.computed + take], st.computed, caught_up)

    def _state(self, seq: Sequence, copies: list[CopyOp]) -> _DraftState | None:
        """The sequence's draft state, reconciled with the tokens it has now."""
        key = seq.key
        st = self._states.get(key)
        if st is not None and st.seq is not seq:  # a new sequence under a reused key
            self._drop(key)
            st = None
        tokens = seq.all_token_ids
        if st is None:
            hit = self.kv.find_prefix(tokens, seq.cache_salt)
            cached = min(hit.num_tokens(self.block_size), len(tokens) - 1)
            admitted = self.kv.admit(key, hit, cached, cached, seq.cache_salt)
            if admitted is None:
                return None
            copies.extend(admitted)
            st = self._states[key] = _DraftState(seq, cached, cached)
            return st
        kept = st.base
        for t in st.fed:
            # The newest token is fed again even when its KV is there: its row gives d_1.
            if kept >= len(tokens) - 1 or tokens[kept] != t:
                break
            kept += 1
        st.computed = st.base = kept
        st.fed = []
        self.kv.truncate(key, kept)
        return st

    def _run(self, rows: list[_Row], copies: list[CopyOp]) -> list[int]:
        """One draft forward pass; the argmax of each sampling row. Marks the rows' tokens as
        computed and caches the draft blocks full of confirmed tokens."""
        logits = self._forward(rows, copies)
        for r in rows:
            st = r.state
            st.computed = r.start + len(r.tokens)
            if r.history:
                st.base = st.computed
                self.kv.commit(st.seq.key, st.seq.all_token_ids, st.base)
            else:
                st.fed.extend(r.tokens)
        return [] if logits is None else logits.argmax(dim=-1).tolist()

    def _forward(self, rows: list[_Row], copies: list[CopyOp]):
        """The logits of the sampling rows: through the draft's CUDA graphs, a row per token
        (``engine.cuda_graphs``), when the pass fits them; else one eager varlen pass."""
        graphs = self.runner.graphs
        if graphs is not None and graphs.padded_size(sum(len(r.tokens) for r in rows)):
            batch = DecodeBatch()
            last: list[int] = []
            for r in rows:
                batch.add(r.tokens, r.start, self.kv.block_ids(r.state.seq.key), self.block_size)
                if r.samples:
                    last.append(len(batch.token_ids) - 1)
            out = self.runner.run_rows(batch, copies)
            return out[torch.tensor(last, device=out.device)] if last else None
        return self.runner.run_plan(self._plan(rows), copies)

    def _plan(self, rows: list[_Row]) -> StepPlan:
        bs = self.block_size
        plan = StepPlan([], [], [], [0], [], [], max(len(r.tokens) for r in rows), [])
        for r in rows:
            table = self.kv.block_ids(r.state.seq.key)
            end = r.start + len(r.tokens)
            plan.token_ids.extend(r.tokens)
            plan.positions.extend(range(r.start, end))
            plan.slots.extend(table[p // bs] * bs + p % bs for p in range(r.start, end))
            plan.query_start.append(plan.query_start[-1] + len(r.tokens))
            plan.seq_lens.append(end)
            plan.block_tables.append(table)
            if r.samples:
                plan.sample_rows.append(plan.query_start[-1] - 1)
        return plan

    def _drop(self, key: Hashable) -> None:
        self._states.pop(key, None)
        if key in self.kv:
            self.kv.free(key)
