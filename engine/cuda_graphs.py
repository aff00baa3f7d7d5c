"""CUDA graphs for decode steps.

A pure-decode step (one new token per sequence) launches the same few hundred small kernels
every time; captured once per batch size and replayed, it costs one launch. Inputs live in
static device buffers that each step refills (one host-to-device copy for the per-token
vectors, one for the block tables); a batch is padded up to the next captured size with rows
that write no KV (slot block -1) and attend to nothing (sequence length 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import AttentionMetadata

# Rows of the packed per-token input buffer.
_IDS, _POS, _SLOT_BLOCK, _SLOT_OFF, _SEQ_LEN = range(5)
_PADDING = (0, 0, -1, 0, 0)


@dataclass(slots=True)
class DecodeBatch:
    """Host-side inputs of one pure-decode step: one new token per sequence."""

    token_ids: list[int]
    positions: list[int]
    slot_blocks: list[int]
    slot_offsets: list[int]
    block_tables: list[list[int]]
    seq_lens: list[int]


def graph_batch_sizes(candidates: tuple[int, ...], max_num_seqs: int) -> list[int]:
    """The candidates up to and including the first one that holds ``max_num_seqs``."""
    sizes = sorted(set(candidates))
    cover = next((s for s in sizes if s >= max_num_seqs), sizes[-1] if sizes else 0)
    return [s for s in sizes if s <= cover]


class DecodeGraphs:
    """Forward pass plus logits of a decode step, captured at several batch sizes."""

    def __init__(
        self,
        model,
        kv_cache: torch.Tensor,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        block_size: int,
    ) -> None:
        if not batch_sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(batch_sizes)
        self.block_size = block_size
        dev = kv_cache.device
        n, width = self.sizes[-1], max_blocks_per_seq
        self._host = torch.zeros((5, n), dtype=torch.long).pin_memory()
        self._vec = torch.zeros((5, n), dtype=torch.long, device=dev)
        self._host_tables = torch.zeros(n * width, dtype=torch.int32).pin_memory()
        self._tables = torch.zeros((n, width), dtype=torch.int32, device=dev)
        self._query_start = torch.arange(n + 1, dtype=torch.long, device=dev)
        self._copied = torch.cuda.Event()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def padded_size(self, n: int) -> int | None:
        """The smallest captured size that holds ``n`` rows, or None."""
        return next((s for s in self.sizes if s >= n), None)

    def _meta(self, n: int) -> AttentionMetadata:
        v = self._vec
        return AttentionMetadata(
            slot_blocks=v[_SLOT_BLOCK, :n],
            slot_offsets=v[_SLOT_OFF, :n],
            block_tables=self._tables[:n],
            seq_lens=v[_SEQ_LEN, :n],
            query_start_loc=self._query_start[: n + 1],
            max_query_len=1,
            max_seq_len=self._tables.shape[1] * self.block_size,
            block_size=self.block_size,
        )

    def _step(self, n: int) -> torch.Tensor:
        hidden = self.model.forward(
            self._vec[_IDS, :n], self._vec[_POS, :n], self.kv_cache, self._meta(n)
        )
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, sharing one memory pool."""
        for row, value in enumerate(_PADDING):
            self._vec[row].fill_(value)
        pool = None
        for n in reversed(self.sizes):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compiles kernels, creates handles
                self._step(n)
                self._step(n)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[n] = self._step(n)
            pool = graph.pool()
            self._graphs[n] = graph
        torch.cuda.synchronize()

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Replay the graph of the batch's padded size; returns float32 logits ``[n, V]``."""
        n = len(batch.token_ids)
        size = self.padded_size(n)
        if size is None:
            raise ValueError(f"batch of {n} exceeds the largest captured size {self.sizes[-1]}")
        width = max(len(t) for t in batch.block_tables)
        self._copied.synchronize()  # the pinned buffers are free again
        h = self._host
        rows = (
            batch.token_ids,
            batch.positions,
            batch.slot_blocks,
            batch.slot_offsets,
            batch.seq_lens,
        )
        for r, (values, pad) in enumerate(zip(rows, _PADDING, strict=True)):
            h[r, :n] = torch.tensor(values, dtype=torch.long)
            h[r, n:size] = pad
        tables = self._host_tables[: n * width].view(n, width)
        tables.zero_()
        for i, t in enumerate(batch.block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self._vec.copy_(h, non_blocking=True)
        self._tables[:n, :width].copy_(tables.to(self._tables.device, non_blocking=True))
        self._copied.record()
        self._graphs[size].replay()
        return self._logits[size][:n]

    def replay(self, n: int) -> torch.Tensor:
        """Replay size ``n`` on the inputs of the last ``run`` (for benchmarks)."""
        self._graphs[n].replay()
        return self._logits[n]
