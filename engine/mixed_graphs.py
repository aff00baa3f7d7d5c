"""Piecewise CUDA graphs for steps that compute prompt tokens (mixed prefill + decode).

A pure decode step replays one graph (``engine.cuda_graphs``); any other step (a prefill chunk,
alone or beside decodes) cannot: its attention is varlen over paged KV, with metadata (query
lengths, block tables, the prefill kernel's tile plan) that changes every step. But everything
else in the forward pass is row-wise: the embedding, the norms, the products, the MLP and the
ranks' sums compute each token's row from that row alone. So the forward pass is split around
attention into ``L + 1`` pieces (``DecoderModel.first_piece``, ``piece``, ``last_piece``; the
eager forward is the same loop), each piece captured per token bucket ``B`` as a graph of its
own, and a step replays the pieces of its bucket with attention run eagerly between them:

    replay piece 0 -> attention 0 -> replay piece 1 -> ... -> attention L-1 -> replay piece L

A step of ``T`` real tokens takes the smallest bucket ``B >= T``. Its ids and positions go into
static buffers (rows ``T..B`` keep whatever earlier steps left there: any valid id and
position); the pieces compute all ``B`` rows, attention computes the first ``T`` (its metadata
describes exactly those) and its output is copied into the static buffer the next piece reads.
The padded rows are garbage that stays in its rows: no piece mixes rows, and neither attention,
the KV writes nor the caller read a row past ``T``.

**Memory.** All pieces of all buckets share one memory pool. A piece's outputs (the QKV
attention reads, the residual stream the next piece reads) must stay where they are only until
their last reader has run. Replays run in capture order, one bucket per step, so capture keeps a
strong reference to a piece's outputs exactly until the next piece is captured (the cos/sin of
piece 0 until the bucket's last piece) and then keeps only an unowned view (`_unowned`): the
pool may give that memory to later pieces and later buckets, which at replay write it only after
its readers in the step have run. So the pool holds about one piece's working set at the largest
bucket, not ``L`` layers of activations per bucket. The views (``_Bucket``) are what a step
reads; the last piece's hidden states are valid until the next step's replay.

Off CUDA (or ``capture=False``) nothing is captured and ``run`` runs the same padded piece loop
eagerly on the same static buffers, so the CPU tests check the padding and slicing. Steps with
LoRA adapters are not graphed (the caller runs them eagerly), nor steps over the largest bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model import Carry
from kernels import AttentionMetadata

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def mixed_graph_sizes(candidates: tuple[int, ...], max_tokens: int, step_tokens: int) -> list[int]:
    """The buckets to capture: the candidates up to ``max_tokens`` (0: none), up to and
    including the first that holds a whole step (``step_tokens``, the engine's token budget)."""
    sizes = sorted(s for s in set(candidates) if 0 < s <= max_tokens)
    cover = next((s for s in sizes if s >= step_tokens), sizes[-1] if sizes else 0)
    return [s for s in sizes if s <= cover]


class _Memory:
    """A CUDA tensor's memory described by ``__cuda_array_interface__`` (as an integer type of
    its element size: the interface has no bfloat16), without a reference to the tensor."""

    def __init__(self, t: torch.Tensor) -> None:
        raw = t.view(_INT_OF_SIZE[t.element_size()])
        self.__cuda_array_interface__ = raw.__cuda_array_interface__


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep it allocated: once ``t`` is dropped its
    blocks return to the graphs' pool (see the module's note on memory)."""
    view = torch.as_tensor(_Memory(t), device=t.device).view(t.dtype)
    assert view.data_ptr() == t.data_ptr() and view.shape == t.shape, "a copy, not a view"
    return view


@dataclass(slots=True)
class _Bucket:
    """One bucket's graphs (``L + 1``) and what a step reads of their outputs, as unowned
    views: each layer's carry (its QKV is attention's input; cos/sin piece 0's) and the final
    hidden states."""

    graphs: list[torch.cuda.CUDAGraph]
    carries: list[Carry]
    hidden: torch.Tensor


class MixedGraphs:
    """The forward pass of steps up to ``sizes[-1]`` tokens as piecewise graphs, one set per
    bucket (see the module's note). ``run`` returns the hidden states of the step's rows."""

    def __init__(
        self, model, kv_cache: torch.Tensor, sizes: list[int], capture: bool = True
    ) -> None:
        if not sizes:
            raise ValueError("no token buckets to capture")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(sizes)
        dev = kv_cache.device
        self.captured = capture and dev.type == "cuda"
        n = self.sizes[-1]
        self._ids = torch.zeros(n, dtype=torch.long, device=dev)
        self._pos = torch.zeros(n, dtype=torch.long, device=dev)
        # Attention's output, which pieces 1..L read: zeros until a step fills its rows.
        self._o = torch.zeros((n, model.q_size), dtype=model.w.embed.dtype, device=dev)
        self._buckets: dict[int, _Bucket] = {}
        self.pool_bytes = 0  # device memory the capture took (reserved by the allocator)
        self.runs = 0  # steps run (replayed or, off CUDA, eager)
        self.tokens = 0  # their real tokens
        self.padded = 0  # their padding rows

    def padded_size(self, n: int) -> int | None:
        """The smallest bucket that holds ``n`` tokens, or None."""
        return next((s for s in self.sizes if s >= n), None)

    def _piece(self, k: int, b: int, carry):
        """Piece ``k`` of a ``b``-row step on the static buffers (``carry``: piece k-1's)."""
        m = self.model
        if k == 0:
            return m.first_piece(self._ids[:b], self._pos[:b])
        if k < m.num_layers:
            return m.piece(k, self._o[:b], carry)
        return m.last_piece(self._o[:b], carry)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool (off CUDA: nothing). The
        same buckets in the same order on every tensor-parallel rank (their sums meet)."""
        if not self.captured:
            return
        before = torch.cuda.memory_reserved(self.kv_cache.device)
        pool = None
        for b in reversed(self.sizes):
            pool = self._capture(b, pool)
        torch.cuda.synchronize(self.kv_cache.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.kv_cache.device) - before

    def _capture(self, b: int, pool):
        """Capture bucket ``b``'s pieces after one eager pass of them (which compiles their
        kernels and sets up cuBLAS); returns the pool."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            carry = None
            for k in range(self.model.num_layers + 1):
                carry = self._piece(k, b, carry)
        torch.cuda.current_stream().wait_stream(side)
        del carry
        graphs: list[torch.cuda.CUDAGraph] = []
        views: list[Carry] = []  # what a step reads of pieces 0..L-1
        carry = None  # the last piece's outputs: kept until the next piece is captured
        for k in range(self.model.num_layers + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._piece(k, b, carry)
            pool = graph.pool()
            graphs.append(graph)
            if k == 0:
                cos, sin = _unowned(out.cos), _unowned(out.sin)
            if k < self.model.num_layers:
                views.append(Carry(_unowned(out.qkv), _unowned(out.stream), cos, sin))
            # Drops piece k-1's outputs; piece 0's cos/sin live on in every carry after it.
            carry = out
        assert carry is not None  # the last piece's output: the final hidden states
        self._buckets[b] = _Bucket(graphs, views, _unowned(carry))
        return pool

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The final hidden states ``[T, hidden]`` of a step of ``T`` tokens (``T`` at most
        ``sizes[-1]``; ``meta`` describes them): on CUDA a view of the bucket's output, valid
        until the next run. Writes the step's K/V into the cache, as ``model.forward``."""
        t = input_ids.shape[0]
        b = self.padded_size(t)
        if b is None:
            raise ValueError(f"a step of {t} tokens exceeds the largest bucket {self.sizes[-1]}")
        self._ids[:t].copy_(input_ids)
        self._pos[:t].copy_(positions)
        self.runs += 1
        self.tokens += t
        self.padded += b - t
        if not self.captured:
            return self._eager(b, t, meta)
        m, bucket = self.model, self._buckets[b]
        bucket.graphs[0].replay()
        for i in range(m.num_layers):
            self._o[:t].copy_(m.attention(i, bucket.carries[i], self.kv_cache, meta, t))
            bucket.graphs[i + 1].replay()
        return bucket.hidden[:t]

    def _eager(self, b: int, t: int, meta: AttentionMetadata) -> torch.Tensor:
        """``run`` without graphs: the same pieces on ``b`` rows, attention on ``t``."""
        m = self.model
        carry = self._piece(0, b, None)
        for i in range(m.num_layers):
            self._o[:t].copy_(m.attention(i, carry, self.kv_cache, meta, t))
            carry = self._piece(i + 1, b, carry)
        return carry[:t]

    def release(self) -> None:
        """Drop every graph and view once the device has run them (the engine is closing;
        before a tensor-parallel rank leaves its group: ``DecodeGraphs.release``)."""
        if self._buckets:
            torch.cuda.synchronize(self.kv_cache.device)
        for bucket in self._buckets.values():
            for graph in bucket.graphs:
                graph.reset()
        self._buckets.clear()
        self.captured = False
