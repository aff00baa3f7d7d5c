"""Checksums of whole KV blocks, computed where the pool lives: on the GPU for a GPU pool (no
block crosses to the host, one 8-byte sum per block comes back), over the bytes in place for a
host pool.

- GPU pool: a block's bytes are read as 64-bit words ``x_i`` and summed as
  ``sum((2i + 1) * x_i)`` modulo 2^64 (integer wrap-around, so the order of the reduction never
  matters). Every weight is odd, hence invertible modulo 2^64: a change to any one word always
  changes the sum, and a block left zero or stale by an incomplete transfer, or words moved
  within it, are caught unless the changes cancel exactly.
- host pool: CRC-32 of the block's bytes (zlib, reading the pool in place, no copy), which
  catches every burst error of up to 32 bits and a changed block otherwise with probability
  1 - 2^-32; the weighted sum costs several times a copy on a CPU.

Sender and receiver of a hand-off hold pools of one kind (block size, layout and dtype must
match; a CPU pool and a GPU pool never meet in one stack), so they compute the same function.
These checksums guard against transport faults, not against an adversary.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

MASK = (1 << 64) - 1


class BlockChecksums:
    """Per-block checksums of one pool ``cache`` (``[num_blocks, ...]``, contiguous)."""

    def __init__(self, cache: torch.Tensor, weighted: bool | None = None) -> None:
        """``weighted``: the weighted sum (True) or CRC-32 (False); None: by the device."""
        block_bytes = cache[0].numel() * cache.element_size()
        if block_bytes % 8:
            raise ValueError(f"blocks of {block_bytes} bytes are not whole 64-bit words")
        self.cache = cache.view(torch.uint8)  # as bytes: any element type, FP8 pools included
        if weighted is None:
            weighted = cache.device.type != "cpu"
        words = block_bytes // 8
        self.weights = (
            torch.arange(words, dtype=torch.int64, device=cache.device) * 2 + 1
            if weighted
            else None
        )

    def __call__(self, block_ids: Sequence[int]) -> list[int]:
        """The checksum of each block, as unsigned 64-bit integers, in order."""
        if not block_ids:
            return []
        if self.weights is None:
            flat = self.cache.view(self.cache.shape[0], -1)
            return [zlib.crc32(flat[i].numpy().data) for i in block_ids]
        idx = torch.tensor(list(block_ids), device=self.cache.device)
        words = self.cache.index_select(0, idx).reshape(len(block_ids), -1).view(torch.int64)
        sums = (words * self.weights).sum(dim=1)
        return [s & MASK for s in sums.tolist()]
