"""CUDA graphs for decode steps.

A pure-decode step (one new token per sequence) launches the same few hundred small kernels
every time; captured once per batch size and replayed, it costs one launch. Inputs live in
static device buffers that each step refills (one host-to-device copy for the per-token
vectors, one for the block tables, one for the LoRA tile tables); a batch is padded up to the
next captured size with rows that write no KV (slot block -1), attend to nothing (sequence
length 0) and use no adapter.

A row is one token of one sequence, not one sequence: a few new tokens of a sequence (a verify
step: its newest token and the draft after it) are that many rows sharing its block table,
row ``i`` at position ``p + i`` attending over ``p + i + 1`` tokens. Every layer writes all
rows' K/V before any row attends, so the rows see each other causally, as in a prefill chunk.

With multi-LoRA (``lora``) every size is captured twice, sharing one memory pool: once as the
base model (a step without adapters pays nothing for them) and once with the LoRA deltas of
every projection, which serves any mix of base rows and rows of up to ``max_loras`` adapters.
Its inputs are fixed-size tile tables (``kernels.reference.lora_tile_table``: the rows with an
adapter grouped by slot, then tiles padded with empty ones) and the slot buffers and scales of
``engine.lora.LoRAManager``, which are static and filled in place before the replay.

With async scheduling a row's token may still be in flight (sampled by the step before, not yet
read back): the row names the row of that step's sampled ids it comes from, and ``run``
gathers those ids on the device into the static input buffer before the replay
(``engine.inflight``).

With ``spread`` (`SpreadGraphs`), a size whose decode-attention plan a floor of splits changes
is captured once more with that floor, sharing the pool, and a step whose lengths differ widely
replays that capture: the rule's one or two splits per sequence (from batch 17 on an H200) wait
on the longest sequences, more splits cost on even short contexts
(bench/results/decode_attention_spread_h200/). The choice is the host's, from the batch's
lengths, which it has already.

Off CUDA (the CPU tests) nothing is captured: ``run`` fills the same buffers and runs the step
eagerly, so the batch a graph would replay is checked on any machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import kernels
from engine.inflight import feed_ids
from kernels import AttentionMetadata
from kernels.reference import lora_tile_table, max_lora_tiles

if TYPE_CHECKING:
    from engine.lora import LoRABatch, LoRAManager

# Rows of the packed per-token input buffer; _SRC: the row of the previous step's sampled ids an
# in-flight token comes from (-1: its id is in _IDS).
_IDS, _POS, _SLOT_BLOCK, _SLOT_OFF, _SEQ_LEN, _SRC = range(6)
_PADDING = (0, 0, -1, 0, 0, -1)


@dataclass(slots=True)
class DecodeBatch:
    """Host-side inputs of one decode step: one row per new token (see the module's note);
    with adapters, the step's adapter names and each row's ("" for the base model);
    ``feed_src``: each row's source among the previous step's sampled ids (-1: none)."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_blocks: list[int] = field(default_factory=list)
    slot_offsets: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    num_seqs: int = 0  # sequences the rows came from (``add``); rows - num_seqs: draft rows
    loras: list[str] = field(default_factory=list)
    token_loras: list[str] = field(default_factory=list)
    feed_src: list[int] = field(default_factory=list)

    @property
    def fed(self) -> bool:
        """Whether any row's token is in flight (gathered on the device)."""
        return any(s >= 0 for s in self.feed_src)

    def add(
        self,
        tokens: list[int],
        start: int,
        table: list[int],
        block_size: int,
        lora: str = "",
        src: int = -1,
    ) -> None:
        """Append one sequence's new ``tokens``, at positions ``start ..``, a row each (with
        the sequence's adapter ``lora``); ``src`` >= 0: the first token is in flight, row
        ``src`` of the previous step's sampled ids (``tokens[0]`` is a placeholder)."""
        for i, t in enumerate(tokens):
            self.feed_src.append(src if i == 0 else -1)
            p = start + i
            self.token_ids.append(t)
            self.positions.append(p)
            self.slot_blocks.append(table[p // block_size])
            self.slot_offsets.append(p % block_size)
            self.block_tables.append(table)
            self.seq_lens.append(p + 1)
            self.token_loras.append(lora)
        self.num_seqs += 1


@dataclass(frozen=True, slots=True)
class SpreadGraphs:
    """Decode graphs for batches of spread lengths: each size whose attention plan changes
    under a floor of ``splits`` splits per sequence is captured again with it, and a step
    replays that capture when its longest context is at least ``min_context`` tokens and
    ``ratio`` times the mean (on an H200, six splits took 0.69-0.95x the rule's attention
    time at batch 24-64 on lengths drawn from ctx * (1 +- 0.9), longest about 1.9x the mean, at
    1k-1.5k, and 0.77-0.85x at 4k-8k; 1.07-1.18x on even contexts of 384-1,024 tokens)."""

    splits: int = 6
    min_context: int = 1024
    ratio: float = 1.5

    def takes(self, seq_lens: Sequence[int]) -> bool:
        """Whether a step of these context lengths (one per row) replays the spread capture."""
        if not seq_lens:
            return False
        longest = max(seq_lens)
        return longest >= self.min_context and longest * len(seq_lens) >= self.ratio * sum(seq_lens)


def graph_batch_sizes(candidates: tuple[int, ...], max_rows: int) -> list[int]:
    """The candidates up to and including the first one that holds ``max_rows``."""
    sizes = sorted(set(candidates))
    cover = next((s for s in sizes if s >= max_rows), sizes[-1] if sizes else 0)
    return [s for s in sizes if s <= cover]


class DecodeGraphs:
    """Forward pass plus logits of a decode step, captured at several batch sizes (row counts),
    with ``lora`` each size again with the LoRA deltas, and with ``spread`` the sizes it
    changes again with more splits; off CUDA (or ``capture=False``) run eagerly on the same
    inputs."""

    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
        lora: LoRAManager | None = None,
        capture: bool = True,
        spread: SpreadGraphs | None = None,
    ) -> None:
        if not batch_sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(batch_sizes)
        self.block_size = block_size
        self.lora = lora
        self.spread = spread
        dev = kv_cache.device
        self.captured = capture and dev.type == "cuda"
        n, width = self.sizes[-1], max_blocks_per_seq
        self._host = torch.zeros((len(_PADDING), n), dtype=torch.long)
        self._vec = torch.zeros((len(_PADDING), n), dtype=torch.long, device=dev)
        self._host_tables = torch.zeros(n * width, dtype=torch.int32)
        self._tables = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self._query_start = torch.arange(n + 1, dtype=torch.long, device=dev)
        # LoRA tile tables: rows [n], then tile starts, lengths and slots [tiles] each.
        self._tiles = max_lora_tiles(n, lora.max_loras) if lora is not None else 0
        self._host_lora = torch.zeros(n + 3 * self._tiles, dtype=torch.int32)
        self._lora_tab = torch.zeros(n + 3 * self._tiles, dtype=torch.int32, device=dev)
        self._copied: torch.cuda.Event | None = None
        # CUDA: two sets of pinned staging buffers, used in turn (``run``).
        self._staging: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        self._turn = 0
        if self.captured:
            for _ in range(2):
                h, t, lo = (
                    x.pin_memory() for x in (self._host, self._host_tables, self._host_lora)
                )
                self._staging.append((h, t, lo, torch.cuda.Event()))
            self._host, self._host_tables, self._host_lora, self._copied = self._staging[0]
        # (size, LoRA deltas, spread capture) -> graph, logits
        self._graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}
        self._logits: dict[tuple[int, bool, bool], torch.Tensor] = {}
        self.spread_sizes = self._spread_sizes() if self.captured else set()
        self.runs = 0  # steps run (replayed or, off CUDA, eager)
        self.lora_runs = 0  # those of them with adapters (the LoRA variant)
        self.spread_runs = 0  # those that replayed a spread capture
        self.rows = 0  # rows of those steps, padding not counted

    @property
    def variants(self) -> list[bool]:
        """Whether each capture of a size has the LoRA deltas: base, and LoRA where enabled."""
        return [False, True] if self.lora is not None else [False]

    def _spread_sizes(self) -> set[int]:
        """The sizes whose decode-attention plan ``spread``'s floor changes (none where the
        decode batches take FlashAttention 3, or off Triton)."""
        if self.spread is None or self.model.choices.flash_decode:
            return set()
        heads = self.model.num_heads

        def plan(n: int) -> object:
            return kernels.attention_variant(n, 1, heads, self.kv_cache)

        out = set()
        for n in self.sizes:
            base = plan(n)
            with kernels.decode_split_floor(self.spread.splits):
                if base is not None and plan(n) != base:
                    out.add(n)
        return out

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size that holds ``n`` rows, or None."""
        return next((s for s in self.sizes if s >= n), None)

    def _meta(self, n: int, max_seq_len: int | None = None) -> AttentionMetadata:
        v = self._vec
        return AttentionMetadata(
            slot_blocks=v[_SLOT_BLOCK, :n],
            slot_offsets=v[_SLOT_OFF, :n],
            block_tables=self._tables[:n],
            seq_lens=v[_SEQ_LEN, :n],
            query_start_loc=self._query_start[: n + 1],
            max_query_len=1,
            max_seq_len=max_seq_len or self._tables.shape[1] * self.block_size,
            block_size=self.block_size,
        )

    def _lora_batch(self, n: int) -> LoRABatch:
        """The LoRA inputs of ``n`` rows: views of the tile tables (a prefix of each part)."""
        assert self.lora is not None
        rows, t = self.sizes[-1], self._tiles
        used = max_lora_tiles(n, self.lora.max_loras)
        tab = self._lora_tab
        parts = [tab[rows + i * t : rows + i * t + used] for i in range(3)]
        return self.lora.graph_batch(tab[:n], *parts)

    def _step(self, n: int, max_seq_len: int | None = None, with_lora: bool = False):
        lora = self._lora_batch(n) if with_lora else None
        meta = self._meta(n, max_seq_len)
        hidden = self.model.forward(
            self._vec[_IDS, :n], self._vec[_POS, :n], self.kv_cache, meta, lora
        )
        return self.model.logits(hidden)

    def _fill_lora(self, token_slots: list[int]) -> None:
        """Write the tile tables of the rows' slots (-1: none) for the next copy."""
        table = lora_tile_table(token_slots, self.sizes[-1], self._tiles)
        self._host_lora.copy_(torch.tensor(table, dtype=torch.int32))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool (off CUDA: nothing)."""
        if not self.captured:
            return
        for row, value in enumerate(_PADDING):
            self._vec[row].fill_(value)
        if self.lora is not None:  # no adapter rows: every tile is padding
            self._fill_lora([])
            self._lora_tab.copy_(self._host_lora)
        pool = None
        for n in reversed(self.sizes):
            for with_lora in self.variants:
                for spread in (False, True) if n in self.spread_sizes else (False,):
                    pool = self._capture((n, with_lora, spread), pool)
        torch.cuda.synchronize()

    def _capture(self, key: tuple[int, bool, bool], pool: Any) -> Any:
        """Capture one (size, LoRA, spread) variant into ``pool``; returns the pool."""
        n, with_lora, spread = key
        floor = (
            kernels.decode_split_floor(self.spread.splits)
            if spread and self.spread is not None
            else contextlib.nullcontext()
        )
        with floor:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles kernels, creates handles
                self._step(n, with_lora=with_lora)
                self._step(n, with_lora=with_lora)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[key] = self._step(n, with_lora=with_lora)
        self._graphs[key] = graph
        return graph.pool()

    def release(self) -> None:
        """Drop every captured graph and its outputs once the device has run them (the engine
        is closing). A graph that captured an NCCL collective holds a reference on the
        communicator, and NCCL's shutdown waits until every such graph is gone (pytorch
        #115388): a tensor-parallel rank releases its graphs before it leaves the group."""
        if self._graphs:
            torch.cuda.synchronize(self.kv_cache.device)
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._logits.clear()
        self.captured = False

    def run(
        self,
        batch: DecodeBatch,
        token_slots: list[int] | None = None,
        fed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay the graph of the batch's padded size; returns float32 logits ``[n, V]``, a
        row per batch row (a view of the graph's output, valid until the next run).
        ``token_slots``: each row's LoRA slot (-1: none; the caller placed the adapters), for
        the LoRA variant; None: the base one. ``fed``: the previous step's sampled ids on the
        device, which rows with a ``feed_src`` take as their token."""
        n = len(batch.token_ids)
        size = self.padded_size(n)
        if size is None:
            raise ValueError(f"batch of {n} exceeds the largest captured size {self.sizes[-1]}")
        with_lora = token_slots is not None
        if with_lora and self.lora is None:
            raise ValueError("these decode graphs were captured without LoRA")
        width = max(len(t) for t in batch.block_tables)
        if self._copied is not None:
            # This set's last copies are two runs old: the device has run them (with async
            # scheduling the step of that run has been read back since), so the wait returns
            # at once and filling the buffers never waits for the step in flight.
            self._turn ^= 1
            self._host, self._host_tables, self._host_lora, self._copied = self._staging[self._turn]
            self._copied.synchronize()
        h = self._host
        rows = (
            batch.token_ids,
            batch.positions,
            batch.slot_blocks,
            batch.slot_offsets,
            batch.seq_lens,
            batch.feed_src or [-1] * n,  # a batch built without ``add`` feeds nothing
        )
        for r, (values, pad) in enumerate(zip(rows, _PADDING, strict=True)):
            h[r, :n] = torch.tensor(values, dtype=torch.long)
            h[r, n:size] = pad
        tables = self._host_tables[: n * width].view(n, width)
        padded = [t + [0] * (width - len(t)) for t in batch.block_tables]
        tables.copy_(torch.tensor(padded, dtype=torch.int32))  # one tensor for all rows
        self._vec.copy_(h, non_blocking=True)
        if batch.fed:
            assert fed is not None, "rows in flight and no sampled ids to take them from"
            feed_ids(self._vec[_IDS, :size], self._vec[_SRC, :size], fed)
        self._tables[:n, :width].copy_(tables.to(self._tables.device, non_blocking=True))
        if token_slots is not None:
            self._fill_lora(token_slots)
            self._lora_tab.copy_(self._host_lora, non_blocking=True)
        spread = (
            size in self.spread_sizes
            and self.spread is not None
            and self.spread.takes(batch.seq_lens)
        )
        self.runs += 1
        self.lora_runs += with_lora
        self.spread_runs += spread
        self.rows += n
        if self._copied is None:
            # Eager, unpadded: the reference kernels would write padding's slot block -1.
            return self._step(n, max(batch.seq_lens), with_lora)
        self._copied.record()
        self._graphs[size, with_lora, spread].replay()
        return self._logits[size, with_lora, spread][:n]

    def replay(self, n: int, with_lora: bool = False, spread: bool = False) -> torch.Tensor:
        """Replay size ``n`` (its LoRA variant, its spread capture) on the inputs of the last
        ``run`` (for benchmarks)."""
        self._graphs[n, with_lora, spread].replay()
        return self._logits[n, with_lora, spread]
