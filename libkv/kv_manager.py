"""Block tables per sequence on top of the block pool: prefix hits, growth, copy-on-write.

A sequence's table maps its token positions to blocks; token ``i`` lives in slot
``table[i // block_size] * block_size + i % block_size``. Full blocks whose KV has been
computed are registered in the prefix cache under the hash chain and may be shared by many
sequences; they are immutable from then on. Writes only ever touch the block holding the
next uncomputed token, so copy-on-write only has to look at that one block::

    tokens:   [ shared | shared | shared |  private (partial) ]
    blocks:      b7       b3       b9         b12
                  \\ also in other sequences' tables //

The one case where the next write lands in a shared block is a prompt that hits the cache in
full: its last token must be recomputed to get logits, so the last block is copied into a
fresh private block first (``CopyOp``) and the KV is written into the copy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from libkv.block_pool import BlockPool, KVBlock, require
from libkv.hashing import ROOT_HASH, BlockHash, hash_block
from libkv.host_tier import HostHit, HostTier


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy the KV of block ``src`` into block ``dst`` before the next forward pass."""

    src: int
    dst: int


@dataclass(slots=True)
class PrefixHit:
    """Cached blocks covering the longest verified prefix of a token list."""

    blocks: list[KVBlock]
    hashes: list[BlockHash]

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


@dataclass(slots=True)
class BlockTable:
    """The blocks of one sequence, plus the hash chain of its full, computed blocks."""

    extra: bytes
    blocks: list[KVBlock] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    num_sealed: int = 0  # leading blocks known sealed (``KVCacheManager.track_seals``)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class CacheListener(Protocol):
    """Told which prefixes enter and leave the prefix cache (e.g. a block-location publisher).

    Both are called on the engine's thread, under its lock: keep them short and thread-safe.
    """

    def cached(self, index: int, block_hash: BlockHash, parent: BlockHash) -> None:
        """The full block at chain position ``index`` (0-based) is cached under ``block_hash``;
        ``parent`` is the hash of the block before it (``ROOT_HASH`` at position 0)."""

    def evicted(self, block_hash: BlockHash) -> None:
        """The cached block ``block_hash`` was evicted."""


class KVCacheManager:
    """Owns the block pool and one ``BlockTable`` per live sequence."""

    def __init__(
        self, pool: BlockPool, enable_prefix_caching: bool = True, track_seals: bool = False
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Seal each full, computed block once (``KVBlock.sealed``) and list it for the engine
        # to checksum (``take_sealed``): checked KV of a hand-off then reads the sums.
        self.track_seals = track_seals
        self._sealed: list[int] = []
        self._tables: dict[Hashable, BlockTable] = {}
        self._listener: CacheListener | None = None
        self.tier: HostTier | None = None  # the host tier below the prefix cache, if any
        self._pool_evict = pool.on_evict  # a callback the pool was built with, still called
        pool.set_on_evict(self._evicted)

    @property
    def listener(self) -> CacheListener | None:
        return self._listener

    def set_listener(self, listener: CacheListener | None) -> None:
        """Report cached and evicted prefix blocks to ``listener`` from now on."""
        self._listener = listener

    def set_tier(self, tier: HostTier | None) -> None:
        """Copy every block entering the prefix cache to ``tier`` (write-through) and tell it
        of evictions (``libkv.host_tier``)."""
        self.tier = tier

    def _evicted(self, block_hash: BlockHash) -> None:
        if self._pool_evict is not None:
            self._pool_evict(block_hash)
        if self._listener is not None:
            self._listener.evicted(block_hash)
        if self.tier is not None:
            self.tier.evicted(block_hash)

    # -- queries ----------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, token_ids: Sequence[int], extra: bytes = b"") -> PrefixHit:
        """Longest run of cached full blocks matching ``token_ids`` (hash and tokens verified)."""
        hit = PrefixHit([], [])
        if not self.enable_prefix_caching:
            return hit
        bs, parent = self.block_size, ROOT_HASH
        for start in range(0, len(token_ids) - bs + 1, bs):
            chunk = token_ids[start : start + bs]
            h = hash_block(parent, chunk, extra)
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            hit.blocks.append(block)
            hit.hashes.append(h)
            parent = h
        return hit

    def find_host(self, token_ids: Sequence[int], extra: bytes, hit: PrefixHit) -> HostHit:
        """Blocks of the host tier continuing the device hit ``hit`` (empty without a tier)."""
        if self.tier is None or not self.enable_prefix_caching:
            return HostHit()
        parent = hit.hashes[-1] if hit.hashes else ROOT_HASH
        return self.tier.find(token_ids, extra, len(hit.blocks), parent)

    def table(self, seq_id: Hashable) -> BlockTable:
        return self._tables[seq_id]

    def block_ids(self, seq_id: Hashable) -> list[int]:
        return self._tables[seq_id].block_ids

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    # -- allocation -------------------------------------------------------------------------
    def can_admit(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Whether a new sequence reusing ``hit`` and covering ``num_tokens`` fits now."""
        return self._new_blocks_needed(hit, num_tokens) <= self.pool.num_free - sum(
            1 for b in hit.blocks if b.ref_cnt == 0
        )

    def _new_blocks_needed(self, hit: PrefixHit, num_tokens: int) -> int:
        need = self.blocks_for(num_tokens) - len(hit.blocks)
        if hit.blocks and num_tokens <= len(hit.blocks) * self.block_size:
            need += 1  # the copy-on-write copy of the last hit block
        return max(need, 0)

    def admit(
        self, seq_id: Hashable, hit: PrefixHit, num_computed: int, num_tokens: int, extra: bytes
    ) -> list[CopyOp] | None:
        """Create the table of a new sequence: reuse ``hit``, then grow to ``num_tokens``.

        ``num_computed`` is the number of tokens whose KV is already valid (at most the hit);
        the slot of token ``num_computed`` is written next. Returns the copies to perform, or
        None (and changes nothing) when the pool cannot hold it.
        """
        if seq_id in self._tables:
            raise KeyError(f"sequence {seq_id!r} already has a block table")
        if not self.can_admit(hit, num_tokens):
            return None
        self.pool.touch(hit.blocks)
        table = BlockTable(extra, list(hit.blocks), list(hit.hashes))
        self._tables[seq_id] = table
        copies = self.grow(seq_id, num_computed, num_tokens)
        assert copies is not None
        return copies

    def grow(self, seq_id: Hashable, num_computed: int, num_tokens: int) -> list[CopyOp] | None:
        """Make the table cover ``num_tokens`` and the next write private. None if no room."""
        table = self._tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table.blocks)
        write_idx = num_computed // self.block_size
        cow = write_idx < len(table.blocks) and self._is_shared(table.blocks[write_idx])
        if max(need, 0) + int(cow) > self.pool.num_free:
            return None
        copies: list[CopyOp] = []
        if cow:
            old = table.blocks[write_idx]
            (new,) = self.pool.allocate(1, table.blocks[write_idx - 1] if write_idx else None)
            copies.append(CopyOp(old.block_id, new.block_id))
            table.blocks[write_idx] = new
            del table.hashes[write_idx:]
            table.num_sealed = min(table.num_sealed, write_idx)
            self.pool.free([old])
        if need > 0:  # behind the last block where it is free: the table stays one run
            table.blocks.extend(
                self.pool.allocate(need, table.blocks[-1] if table.blocks else None)
            )
        return copies

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Give ``dst`` a table sharing every block of ``src`` (one more reference each).

        Used for the choices of one prompt (``n > 1``): the next write of each lands in a
        shared block, so ``grow`` copies it first (copy-on-write) unless it is the last holder.
        """
        if dst in self._tables:
            raise KeyError(f"sequence {dst!r} already has a block table")
        table = self._tables[src]
        self.pool.touch(table.blocks)
        self._tables[dst] = BlockTable(
            table.extra, list(table.blocks), list(table.hashes), table.num_sealed
        )

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Free the table's blocks past those covering ``num_tokens`` tokens: slots written for
        speculative tokens the model rejected. They are never in the prefix cache (only blocks
        of confirmed, computed tokens are), so they go back to the fresh free list."""
        table = self._tables[seq_id]
        keep = self.blocks_for(num_tokens)
        if len(table.blocks) <= keep:
            return
        assert len(table.hashes) <= keep, "a cached block past the confirmed tokens"
        extra = table.blocks[keep:]
        del table.blocks[keep:]
        table.num_sealed = min(table.num_sealed, keep)
        self.pool.free(reversed(extra))

    def _is_shared(self, block: KVBlock) -> bool:
        return block.ref_cnt > 1 or block.block_hash is not None

    def commit(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> int:
        """Register every full block whose KV is now computed (and seal it, when tracking
        seals). Returns how many entered the prefix cache."""
        table, bs = self._tables[seq_id], self.block_size
        if self.track_seals:
            self._seal(table, num_computed // bs)
        if not self.enable_prefix_caching:
            return 0
        added = 0
        parent = table.hashes[-1] if table.hashes else ROOT_HASH
        for i in range(len(table.hashes), num_computed // bs):
            chunk = token_ids[i * bs : (i + 1) * bs]
            h = hash_block(parent, chunk, table.extra)
            table.hashes.append(h)
            if self.pool.cache(table.blocks[i], h, chunk):
                added += 1
                if self.tier is not None:
                    self.tier.cached(table.blocks[i].block_id, h, chunk, i, parent)
            if self._listener is not None:  # also when another block already holds the hash
                self._listener.cached(i, h, parent)
            parent = h
        return added

    def _seal(self, table: BlockTable, full: int) -> None:
        for block in table.blocks[table.num_sealed : full]:
            if not block.sealed:  # a prefix hit's blocks were sealed where first computed
                block.sealed = True
                self._sealed.append(block.block_id)
        table.num_sealed = max(table.num_sealed, full)

    def take_sealed(self) -> list[int]:
        """Blocks sealed since the last call, for the engine to checksum before their next
        use (no step writes them; a freed one keeps its bytes until allocated again)."""
        sealed, self._sealed = self._sealed, []
        return sealed

    def free(self, seq_id: Hashable) -> None:
        """Release every block of the sequence (leaves first, so they are evicted first)."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self.pool.free(reversed(table.blocks))

    def check_integrity(self) -> None:
        """Pool invariants, plus: reference counts equal the number of tables holding a block."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for table in self._tables.values():
            for block in table.blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            require(block.ref_cnt == refs.get(block.block_id, 0), f"ref leak on {block.block_id}")
