"""Checksums of whole KV blocks, computed where the pool lives: on the GPU for a GPU pool (no
block crosses to the host, one 8-byte sum per block comes back), over the bytes in place for a
host pool. The handle of a hand-off names the function (``KVHandle.checksum_algorithm``), so
sender and receiver always compute the same one.

Every function is defined on the *canonical* block (every KV head in order, ``libkv.kv_layout``)
and is a sum modulo 2^64 of per-head terms, so a tensor-parallel rank computes the part of its
heads (``partial``) and the ranks' parts add up to the canonical block's checksum: the same
value whatever the TP size of either side (a head replicated over several ranks counts once).

- ``xxh3-64-heads`` (host pools): ``sum((2h + 1) * xxh3_64(head h's bytes))`` over the block's
  KV heads ``h``. XXH3 reads each head's bytes once, in place (no copy), at memory speed (about
  4x CRC-32 on the 2-core test machine, ``bench/results/kv_checksum_cpu.md``); a changed head
  changes its digest except with probability 2^-64, and every weight is odd, hence invertible
  modulo 2^64, so a changed or moved head always changes the sum then.
- ``wsum64`` (GPU pools): the block's bytes read as 64-bit words ``x_i`` and summed as
  ``sum((2i + 1) * x_i)``, one reduction on the device (integer wrap-around, so the order of
  the reduction never matters). Every weight is odd: a change to any one word always changes
  the sum, and a block left zero or stale by an incomplete transfer, or words moved within it,
  are caught unless the changes cancel exactly. A rank's heads start at word ``o`` of the
  canonical block; it weights its words from ``2o + 1`` on.
- ``crc32`` (legacy): CRC-32 of a TP=1 host block, what a sender that names no function
  (an older worker) computed; checked, never sent.

Sender and receiver of a hand-off hold pools of one kind (block size, layout and dtype must
match; a CPU pool and a GPU pool never meet in one stack). A function other than the pool's
own still works (``xxh3-64-heads`` of a GPU pool copies the blocks to the host). These
checksums guard against transport faults, not against an adversary.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import xxhash

import kernels
from engine.device_io import upload

MASK = (1 << 64) - 1
XXH3_HEADS = "xxh3-64-heads"
WSUM64 = "wsum64"
CRC32 = "crc32"
ALGORITHMS = (XXH3_HEADS, WSUM64, CRC32)


def default_algorithm(device: torch.device) -> str:
    """What a pool on ``device`` computes for the blocks it sends."""
    return XXH3_HEADS if device.type == "cpu" else WSUM64


def legacy_algorithm(device: torch.device) -> str:
    """What a sender that named no function computed (older workers: by its pool's device)."""
    return CRC32 if device.type == "cpu" else WSUM64


class BlockChecksums:
    """Per-block checksums of one head-major pool ``cache`` (``[num_blocks, heads, ...]``,
    contiguous: one rank's heads, ``first_head`` the canonical index of its first; ``counted``
    False for a rank whose heads an earlier rank also holds, which then adds nothing)."""

    def __init__(
        self,
        cache: torch.Tensor,
        algorithm: str | None = None,
        first_head: int = 0,
        counted: bool = True,
    ) -> None:
        self.algorithm = algorithm or default_algorithm(cache.device)
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown KV checksum {self.algorithm!r} (known: {ALGORITHMS})")
        if self.algorithm == CRC32 and (first_head or not counted):
            raise ValueError("crc32 covers whole blocks of a TP=1 pool only")
        head_bytes = cache[0, 0].numel() * cache.element_size()
        if head_bytes % 8:
            raise ValueError(f"heads of {head_bytes} bytes are not whole 64-bit words")
        self.cache = cache.view(torch.uint8)  # as bytes: any element type, FP8 pools included
        self.heads = cache.shape[1]
        self.first_head = first_head
        self.counted = counted
        self.offset = first_head * head_bytes // 8  # where this rank's words start, canonically

    def on_device(self, block_ids: torch.Tensor) -> torch.Tensor:
        """This pool's part of each block's checksum as int64 (the unsigned sum's bits) on the
        pool's device, the blocks named by a tensor there: for ``wsum64`` one launch that
        reads each block once in place (``kernels.block_wsum64``) and returns without waiting;
        a host function computes on the host and puts the sums on the pool's device."""
        if not self.counted:
            return torch.zeros(block_ids.numel(), dtype=torch.int64, device=self.cache.device)
        if self.algorithm == WSUM64:
            words = self.cache.view(self.cache.shape[0], -1).view(torch.int64)
            return kernels.block_wsum64(words, block_ids, self.offset)
        sums = [s - (1 << 64) if s >> 63 else s for s in self(block_ids.tolist())]
        return torch.tensor(sums, dtype=torch.int64, device=self.cache.device)

    def __call__(self, block_ids: Sequence[int]) -> list[int]:
        """This pool's part of each block's checksum (the whole checksum at TP=1), as unsigned
        64-bit integers, in order; the parts of every rank add up modulo 2^64 (``combine``)."""
        if not block_ids:
            return []
        if not self.counted:
            return [0] * len(block_ids)
        if self.algorithm == WSUM64:
            idx = torch.tensor(list(block_ids), device=self.cache.device)
            return [s & MASK for s in self.on_device(idx).tolist()]
        if self.cache.device.type == "cpu":
            host = self.cache
        else:  # a host function over a device pool: only the named blocks cross
            host = self.cache[torch.tensor(list(block_ids), device=self.cache.device)].cpu()
            block_ids = range(len(block_ids))
        if self.algorithm == CRC32:
            flat = host.view(host.shape[0], -1)
            return [zlib.crc32(flat[i].numpy().data) for i in block_ids]
        heads = host.view(host.shape[0], self.heads, -1)
        weights = [2 * (self.first_head + h) + 1 for h in range(self.heads)]
        digest = xxhash.xxh3_64_intdigest
        return [
            sum(w * digest(heads[i, h].numpy().data) for h, w in enumerate(weights)) & MASK
            for i in block_ids
        ]


class SealedSums:
    """Each block's checksum (this pool's part), taken once when the block is sealed: full, its
    KV computed, never written again until the pool hands it out anew (``libkv`` keeps that
    flag, ``KVBlock.sealed``). Kept in one int64 per block on the pool's device, so sealing
    brings nothing back to the host and a hand-off only reads what is stored."""

    def __init__(self, fn: BlockChecksums, num_blocks: int) -> None:
        self.fn = fn
        self.table = torch.zeros(num_blocks, dtype=torch.int64, device=fn.cache.device)

    def seal(self, block_ids: Sequence[int]) -> None:
        """Take and keep the checksums of ``block_ids`` (on a GPU in stream order, after the
        step that completed them; the block ids go up, no sum comes back)."""
        if block_ids:
            idx = upload(list(block_ids), torch.long, self.table.device)  # no stream sync
            self.table.index_copy_(0, idx, self.fn.on_device(idx))

    def read(self, block_ids: Sequence[int], sealed: Sequence[bool]) -> list[int]:
        """The checksums of ``block_ids``: kept ones where ``sealed``, the others (a last,
        partial block) computed now; one transfer of 8 bytes per block to the host."""
        if not block_ids:
            return []
        dev = self.table.device
        out = self.table.index_select(0, torch.tensor(list(block_ids), device=dev))
        fresh = [i for i, done in enumerate(sealed) if not done]
        if fresh:
            ids = torch.tensor([block_ids[i] for i in fresh], device=dev)
            out[torch.tensor(fresh, device=dev)] = self.fn.on_device(ids)
        return [s & MASK for s in out.tolist()]


def combine(parts: Sequence[Sequence[int]]) -> list[int]:
    """Each block's checksum from every rank's part of it (``BlockChecksums.__call__``)."""
    return [sum(column) & MASK for column in zip(*parts, strict=True)]
