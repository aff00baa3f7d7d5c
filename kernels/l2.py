"""L2 prefetch of a decode step's weights (issue 19): the switch and the byte patterns, with no
Triton, so CPU hosts import and test them.

At small batches a decode step's small kernels (RMSNorm, SiLU-and-multiply, RoPE with the KV
write) and decode attention are latency-bound: they leave most of the DRAM bandwidth idle. The
four products after them are bandwidth-bound but pay a start-up, their first tiles' DRAM
latency. The idea measured here: while a latency-bound kernel runs, ask the L2 (50 MB on an
H100) for the weight bytes the next product reads first, or for the whole ``o_proj`` during
attention, so the product finds them there. ``kernels.L2_PREFETCH`` says what is asked for;
``engine.model`` launches the prefetches; ``kernels.triton_prefetch`` issues them.
"""

from __future__ import annotations

from dataclasses import dataclass

LINE = 128  # bytes of an L2 line: the unit of the line prefetches
BULK = 4096  # bytes of one bulk prefetch (``cp.async.bulk.prefetch.L2``) at most
# How the prefetches are issued: one ``prefetch.global.L2`` per line, the same with the
# ``evict_last`` priority, or Hopper's bulk prefetch (one instruction per up to ``BULK`` bytes).
ASMS = ("line", "line_last", "bulk")


@dataclass(frozen=True, slots=True)
class L2Prefetch:
    """What a decode step (one query token per sequence, batches the skinny products take) asks
    into L2 ahead of its products; the default asks for nothing and launches nothing.

    ``o_proj``: the layer's whole ``o_proj`` weight, launched right before decode attention.
    ``head``: the first ``head`` (a fraction) of every product program's K range, launched right
    before the small kernel that precedes the product (the RMSNorms before QKV and gate/up,
    SiLU-and-multiply before down; attention before ``o_proj`` where ``o_proj`` is off).
    ``kv_evict_first``: decode attention loads K/V with ``evict_first``, so the streaming KV
    does not push the prefetched weights out. ``asm``: one of ``ASMS``."""

    o_proj: bool = False
    head: float = 0.0
    kv_evict_first: bool = False
    asm: str = "line"

    def __post_init__(self) -> None:
        if not 0.0 <= self.head <= 1.0:
            raise ValueError(f"head is a fraction of K, got {self.head}")
        if self.asm not in ASMS:
            raise ValueError(f"asm must be one of {ASMS}, got {self.asm!r}")

    @property
    def launches(self) -> bool:
        """Whether any prefetch kernel is launched (``kv_evict_first`` alone launches none)."""
        return self.o_proj or self.head > 0.0


@dataclass(frozen=True, slots=True)
class Pattern:
    """Bytes to prefetch, from a weight's first byte: ``rows`` rows of ``row_bytes`` at
    ``row_stride``, each cut into ``segs`` K ranges ``seg_stride`` bytes apart (a split-K
    product's programs, one per range), of which the first ``head_bytes`` (the bytes a program
    reads first; the last range may be shorter: it ends with the row)."""

    rows: int
    row_bytes: int
    row_stride: int
    segs: int
    seg_stride: int
    head_bytes: int

    def units(self, unit: int, spill: bool = False) -> int:
        """Prefetches of ``unit`` bytes that cover it (each range padded to whole units; with
        ``spill``, one more each: ranges that do not start at a unit's boundary)."""
        return self.rows * self.segs * (-(-self.head_bytes // unit) + spill)


def product_pattern(
    rows: int, k: int, row_stride: int, element_size: int, k_split: int, head: float
) -> Pattern:
    """What the programs of a product over a ``[rows, k]`` weight (``row_stride`` elements
    apart) read first when each takes ``k_split`` weights of a row (split-K; ``k``: one range):
    the first ``head`` of each range, rounded up to whole lines (``head`` 1: all of it)."""
    if rows <= 0 or k <= 0 or not 0 < k_split <= k or not 0.0 < head <= 1.0:
        raise ValueError(f"no pattern for {rows} x {k} rows, k_split {k_split}, head {head}")
    seg_bytes = k_split * element_size
    head_bytes = min(seg_bytes, -(-int(head * seg_bytes) // LINE) * LINE)
    return Pattern(rows, k * element_size, row_stride * element_size, -(-k // k_split),
                   seg_bytes, head_bytes)  # fmt: skip
