"""The KV pool's layout and how tensor-parallel ranks split it (no torch).

Every pool is *head-major*: each worker's pool (each rank's, under tensor parallelism) is::

    [num_blocks, kv_heads, num_layers, 2, block_size, head_dim]

so one block is its KV heads one after another, each head one contiguous run of
``num_layers * 2 * block_size * head_dim`` elements (``head_bytes``). The model reads it through
a permuted view (``[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]``; the kernels
are stride-generic). Why heads outermost: a rank holds a contiguous range of the model's KV
heads, and any contiguous range of heads of one block is one contiguous byte range. When a
prefill pool at one TP size hands a prompt to a decode pool at another, each decode rank
copies, from each prefill rank that holds some of its heads, *one* range per block (per run of
blocks when the ranges are whole blocks): as many descriptors as a hand-off between two
single-device workers, whatever the two TP sizes. A per-rank pool with heads innermost
(``[..., block_size, kv_heads/tp, head_dim]``) would make the same copy
``num_layers * 2 * block_size`` strided pieces per block (960 for SmolLM2, 1,024 for
Llama-3-8B), each a descriptor for NIXL.

The *canonical block* is all of a block's KV heads in order: what a TP=1 pool holds, what the
gRPC block stream carries and what ``KVHandle.block_bytes`` counts, whatever the TP size.

KV heads are split over ranks in contiguous ranges, as evenly as possible (``split``); with
more ranks than KV heads each rank holds one, replicated on consecutive ranks (as in vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass

LAYOUT_VERSION = 1  # head-major blocks
LAYOUT_KEY = "kv_layout"  # Member.extra: the worker's KVLayout as JSON


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous ranges covering ``range(n)``, sizes differing by
    at most one (the larger ones last)."""
    if not 0 <= index < parts:
        raise ValueError(f"index {index} is not in [0, {parts})")
    return index * n // parts, (index + 1) * n // parts


def kv_heads_of_rank(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """KV heads ``[lo, hi)`` that rank ``rank`` of ``tp`` holds."""
    if tp <= num_kv_heads:
        return split(num_kv_heads, tp, rank)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in [0, {tp})")
    head = rank * num_kv_heads // tp
    return head, head + 1


@dataclass(frozen=True, slots=True)
class SlicePart:
    """The bytes of every block that move from one source rank's pool into one destination
    rank's pool: ``nbytes`` at ``src_offset`` of a source block to ``dst_offset`` of a
    destination block."""

    src_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The geometry of a worker's KV pool and its TP size (published in its member record)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "bfloat16", "float32", ...
    element_size: int
    tp: int = 1
    version: int = LAYOUT_VERSION

    @property
    def head_bytes(self) -> int:
        """Bytes of one KV head of one block (all layers, K and V)."""
        return self.num_layers * 2 * self.block_size * self.head_dim * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes of a canonical block (every KV head)."""
        return self.num_kv_heads * self.head_bytes

    def heads(self, rank: int) -> tuple[int, int]:
        return kv_heads_of_rank(self.num_kv_heads, self.tp, rank)

    def first_holder(self, rank: int) -> bool:
        """Whether no lower rank holds rank ``rank``'s heads too (replicated heads, more ranks
        than KV heads): the rank whose copy counts once in a block's checksum."""
        return rank == 0 or self.heads(rank - 1)[0] != self.heads(rank)[0]

    def shard_block_bytes(self, rank: int) -> int:
        lo, hi = self.heads(rank)
        return (hi - lo) * self.head_bytes

    def holders(self, head: int) -> list[int]:
        """Ranks that hold KV head ``head`` (several when heads are replicated)."""
        return [r for r in range(self.tp) if self.heads(r)[0] <= head < self.heads(r)[1]]

    def canonical_parts(self) -> list[SlicePart]:
        """How a canonical block is assembled from rank blocks: ``dst_offset`` is the offset
        in the canonical block (one part per rank that owns heads first)."""
        canon = KVLayout(**{**asdict(self), "tp": 1})
        return slice_plan(self, canon, 0)

    def refusal(self, other: KVLayout) -> str | None:
        """Why KV cannot move between pools of this layout and ``other`` (None: it can, at
        any pair of TP sizes: heads are re-sliced by `slice_plan`)."""
        if self.version != other.version:
            return f"KV layout versions differ ({self.version} vs {other.version})"
        mine, theirs = _geometry(self), _geometry(other)
        diff = [f"{k} {mine[k]} vs {theirs[k]}" for k in mine if mine[k] != theirs[k]]
        return f"KV geometry differs: {', '.join(diff)}" if diff else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> KVLayout:
        return cls(**json.loads(text))

    @classmethod
    def from_extra(cls, extra: Mapping[str, str]) -> KVLayout | None:
        text = extra.get(LAYOUT_KEY)
        return cls.from_json(text) if text else None


def pair_refusal(src: Mapping[str, str], dst: Mapping[str, str]) -> str | None:
    """Why KV cannot move from the worker whose member record has ``src`` (extra fields) to
    the one with ``dst`` (None: it can; also when a record carries no layout, from a worker
    older than layouts: the decode worker then checks the handle's block bytes)."""
    mine, theirs = KVLayout.from_extra(src), KVLayout.from_extra(dst)
    if mine is None or theirs is None:
        return None
    return mine.refusal(theirs)


def _geometry(layout: KVLayout) -> dict[str, object]:
    g = asdict(layout)
    del g["tp"], g["version"]
    return g


def slice_plan(src: KVLayout, dst: KVLayout, dst_rank: int) -> list[SlicePart]:
    """What destination rank ``dst_rank`` copies from which source ranks: one part per
    contiguous run of its heads held by one source rank. A replicated head is taken from the
    replica ``dst_rank`` picks round robin, so destination ranks spread over the replicas."""
    if src.refusal(dst) is not None:
        raise ValueError(src.refusal(dst))
    lo, hi = dst.heads(dst_rank)
    hb = src.head_bytes
    parts: list[SlicePart] = []
    head = lo
    while head < hi:
        holders = src.holders(head)
        rank = holders[dst_rank % len(holders)]
        s_lo, s_hi = src.heads(rank)
        end = min(hi, s_hi)
        parts.append(SlicePart(rank, (head - s_lo) * hb, (head - lo) * hb, (end - head) * hb))
        head = end
    return parts
