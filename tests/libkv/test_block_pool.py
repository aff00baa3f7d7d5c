"""Tests of libkv.block_pool: allocation order, free queues, LRU eviction, verified lookups."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Sequence

import pytest

from libkv.block_pool import BlockPool, KVBlock, NoFreeBlocksError
from libkv.hashing import ROOT_HASH, BlockHash, hash_block

BLOCK_SIZE = 4


def make_pool(num_blocks: int = 8, block_size: int = BLOCK_SIZE) -> tuple[BlockPool, list[bytes]]:
    """A pool plus the list its ``on_evict`` callback appends evicted hashes to."""
    evicted: list[bytes] = []
    return BlockPool(num_blocks, block_size, on_evict=evicted.append), evicted


def toks(i: int) -> tuple[int, ...]:
    """The (distinct) token ids of test block number ``i``."""
    return tuple(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE))


def key(i: int) -> BlockHash:
    return hash_block(ROOT_HASH, toks(i))


def cache_as(pool: BlockPool, block: KVBlock, i: int) -> None:
    """Register ``block`` as holding test block number ``i``."""
    assert pool.cache(block, key(i), toks(i))


def ids(blocks: Sequence[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockPool(0, 4)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_allocates_fresh_ids_in_ascending_order() -> None:
    pool, _ = make_pool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert ids(a) == [0, 1, 2] and ids(b) == [3, 4]
    assert all(blk.ref_cnt == 1 and blk.block_hash is None for blk in a + b)
    assert (pool.num_used, pool.num_free, pool.num_cached) == (5, 3, 0)
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_free_returns_blocks_to_the_right_queue() -> None:
    pool, evicted = make_pool(8)
    blocks = pool.allocate(4)
    cache_as(pool, blocks[1], 1)
    cache_as(pool, blocks[2], 2)
    pool.free(blocks)
    # 0 and 3 were never hashed: fresh queue (behind 4..7). 1 and 2 hold prefixes: cached.
    assert (pool.num_used, pool.num_free, pool.num_cached) == (0, 8, 2)
    assert pool.lookup(key(1), toks(1)) is blocks[1]
    pool.check_integrity()
    # The same blocks as ever (fresh 0 and 3..7, then cached 1 and 2, evicted in LRU order),
    # handed out by ascending id: one run.
    assert ids(pool.allocate(8)) == list(range(8))
    assert evicted == [key(1), key(2)]
    pool.check_integrity()


def test_fresh_blocks_are_reused_before_cached_ones() -> None:
    pool, evicted = make_pool(4)
    blocks = pool.allocate(4)
    cache_as(pool, blocks[0], 0)
    cache_as(pool, blocks[1], 1)
    pool.free(blocks)
    assert ids(pool.allocate(2)) == [2, 3]
    assert evicted == [] and pool.num_cached == 2
    assert pool.lookup(key(0), toks(0)) is blocks[0]
    (evictee,) = pool.allocate(1)
    assert evictee.block_id == 0 and evictee.block_hash is None and evictee.token_ids is None
    assert evicted == [key(0)]
    assert pool.lookup(key(0), toks(0)) is None
    assert pool.lookup(key(1), toks(1)) is blocks[1]
    pool.check_integrity()


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool, evicted = make_pool(4)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        cache_as(pool, blk, i)
    for i in (2, 0, 3, 1):  # free one at a time, in this order
        pool.free([blocks[i]])
    assert pool.num_cached == 4
    assert ids(pool.allocate(1)) == [2]
    assert ids(pool.allocate(2)) == [0, 3]
    assert ids(pool.allocate(1)) == [1]
    assert evicted == [key(2), key(0), key(3), key(1)]
    pool.check_integrity()


def test_freeing_a_table_in_reverse_evicts_leaves_before_parents() -> None:
    pool, evicted = make_pool(3)
    table = pool.allocate(3)
    parent = ROOT_HASH
    chain: list[BlockHash] = []
    for i, blk in enumerate(table):
        parent = hash_block(parent, toks(i))
        chain.append(parent)
        assert pool.cache(blk, parent, toks(i))
    pool.free(reversed(table))
    assert ids(pool.allocate(1)) == [2]  # the leaf goes first
    assert pool.lookup(chain[0], toks(0)) is table[0]  # the root survives longest
    assert ids(pool.allocate(2)) == [0, 1]  # evicted 1 then 0, handed out ascending
    assert evicted == [chain[2], chain[1], chain[0]]
    pool.check_integrity()


def test_touch_pulls_a_cached_block_from_the_middle_of_the_queue() -> None:
    pool, evicted = make_pool(4)
    blocks = pool.allocate(4)
    for i, blk in enumerate(blocks):
        cache_as(pool, blk, i)
    pool.free(blocks)  # cached queue: 0 1 2 3
    hit = pool.lookup(key(2), toks(2))
    assert hit is blocks[2]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_hash == key(2)
    assert (pool.num_used, pool.num_cached) == (1, 3)
    pool.check_integrity()
    assert ids(pool.allocate(3)) == [0, 1, 3]
    assert evicted == [key(0), key(1), key(3)]
    # The touched block kept its prefix and is still found.
    assert pool.lookup(key(2), toks(2)) is hit
    pool.check_integrity()


def test_touch_requeues_at_the_tail_when_freed_again() -> None:
    pool, evicted = make_pool(3)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        cache_as(pool, blk, i)
    pool.free(blocks)  # cached queue: 0 1 2
    pool.touch([blocks[0]])
    pool.free([blocks[0]])  # cached queue: 1 2 0
    assert ids(pool.allocate(3)) == [0, 1, 2]
    assert evicted == [key(1), key(2), key(0)]
    pool.check_integrity()


def test_touch_on_a_used_block_adds_a_reference() -> None:
    pool, _ = make_pool(2)
    (blk,) = pool.allocate(1)
    cache_as(pool, blk, 0)
    pool.touch([blk])
    assert blk.ref_cnt == 2 and pool.num_used == 1
    pool.free([blk])
    assert blk.ref_cnt == 1 and pool.num_cached == 0
    pool.free([blk])
    assert blk.ref_cnt == 0 and pool.num_cached == 1
    pool.check_integrity()


def test_double_free_raises_and_changes_nothing() -> None:
    pool, _ = make_pool(4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([a])
    never_allocated = pool.blocks[3]
    with pytest.raises(RuntimeError, match="double free of block 3"):
        pool.free([never_allocated])
    assert (pool.num_used, pool.num_free) == (1, 3)
    pool.check_integrity()
    pool.free([b])
    pool.check_integrity()


def test_lookup_verifies_the_stored_tokens() -> None:
    pool, _ = make_pool(4)
    (blk,) = pool.allocate(1)
    cache_as(pool, blk, 0)
    assert pool.lookup(key(0), toks(0)) is blk
    assert pool.lookup(key(0), list(toks(0))) is blk
    # A forged collision: the right hash with other tokens is never served.
    assert pool.lookup(key(0), toks(1)) is None
    assert pool.lookup(key(0), toks(0)[:-1] + (999,)) is None
    assert pool.lookup(key(1), toks(1)) is None  # unknown hash
    pool.free([blk])
    assert pool.lookup(key(0), toks(0)) is blk  # still found while cached
    assert pool.lookup(key(0), toks(1)) is None
    pool.check_integrity()


def test_cache_refuses_duplicates_and_the_first_copy_stays_shared() -> None:
    pool, evicted = make_pool(4)
    first, second = pool.allocate(2)
    assert pool.cache(first, key(0), toks(0))
    assert not pool.cache(second, key(0), toks(0))
    assert second.block_hash is None and second.token_ids is None
    assert not pool.cache(first, key(1), toks(1))  # a block holds one prefix only
    assert first.block_hash == key(0)
    assert pool.lookup(key(0), toks(0)) is first
    assert pool.lookup(key(1), toks(1)) is None
    assert pool.cached_hashes() == [key(0)]
    pool.free([second, first])
    assert pool.num_cached == 1  # the private duplicate went back to the fresh queue
    assert ids(pool.allocate(3)) == [1, 2, 3]
    assert evicted == []
    pool.check_integrity()


def test_cache_only_accepts_full_blocks_in_use() -> None:
    pool, _ = make_pool(4)
    (blk,) = pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.cache(blk, key(0), toks(0)[:-1])
    pool.free([blk])
    with pytest.raises(RuntimeError):
        pool.cache(blk, key(0), toks(0))
    assert pool.cached_hashes() == []
    pool.check_integrity()


def test_on_evict_receives_exactly_the_evicted_hashes_in_order() -> None:
    pool, evicted = make_pool(6)
    blocks = pool.allocate(6)
    for i in (1, 3, 4):
        cache_as(pool, blocks[i], i)
    pool.free([blocks[4], blocks[0], blocks[1], blocks[2], blocks[3], blocks[5]])
    assert evicted == []  # freeing never evicts: eviction is lazy
    assert ids(pool.allocate(3)) == [0, 2, 5]  # fresh first, no eviction
    assert evicted == []
    assert ids(pool.allocate(2)) == [1, 4]
    assert evicted == [key(4), key(1)]
    assert pool.cached_hashes() == [key(3)]
    pool.check_integrity()


def test_reset_prefix_cache_forgets_free_prefixes_only() -> None:
    pool, evicted = make_pool(4)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        cache_as(pool, blk, i)
    pool.free([blocks[1], blocks[0]])  # cached queue: 1 0; block 2 stays in use
    pool.reset_prefix_cache()
    assert evicted == [key(1), key(0)]
    assert pool.num_cached == 0 and pool.num_free == 3
    assert pool.lookup(key(0), toks(0)) is None
    assert pool.lookup(key(2), toks(2)) is blocks[2]
    assert pool.cached_hashes() == [key(2)]
    pool.check_integrity()
    pool.free([blocks[2]])
    assert pool.num_cached == 1
    assert ids(pool.allocate(4)) == [0, 1, 2, 3]
    assert evicted == [key(1), key(0), key(2)]
    pool.check_integrity()


def test_asking_for_too_many_blocks_raises_and_changes_nothing() -> None:
    pool, evicted = make_pool(4)
    blocks = pool.allocate(2)
    cache_as(pool, blocks[0], 0)
    pool.free([blocks[0]])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    assert (pool.num_used, pool.num_free, pool.num_cached) == (1, 3, 1)
    assert evicted == []
    assert pool.lookup(key(0), toks(0)) is blocks[0]
    pool.check_integrity()
    assert ids(pool.allocate(3)) == [0, 2, 3]
    assert evicted == [key(0)]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    pool, _ = make_pool(4)
    (blk,) = pool.allocate(1)
    blk.ref_cnt = 0  # lost without going back to a queue
    with pytest.raises(AssertionError):
        pool.check_integrity()


@pytest.mark.parametrize("seed", range(8))
def test_randomized_operations_keep_integrity(seed: int) -> None:
    rng = random.Random(seed)
    pool, evicted = make_pool(16)
    held: list[KVBlock] = []  # one entry per reference we own
    alive: dict[BlockHash, KVBlock] = {}  # our model of the hash map
    next_prefix = 0
    for _ in range(600):
        op = rng.choice(["alloc", "alloc", "free", "free", "cache", "touch"])
        if op == "alloc":
            n = rng.randint(0, 4)
            if n > pool.num_free:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n)
            else:
                free_before = pool.num_free
                got = pool.allocate(n)
                assert len(got) == n and pool.num_free == free_before - n
                assert all(b.ref_cnt == 1 and b.block_hash is None for b in got)
                held.extend(got)
        elif op == "free" and held:
            blk = held.pop(rng.randrange(len(held)))
            pool.free([blk])
        elif op == "cache" and held:
            blk = rng.choice(held)
            ok = pool.cache(blk, key(next_prefix), toks(next_prefix))
            assert ok == (blk.block_hash == key(next_prefix))
            if ok:
                alive[key(next_prefix)] = blk
            next_prefix += 1
        elif op == "touch" and alive:
            h = rng.choice(list(alive))
            blk = alive[h]
            assert pool.lookup(h, blk.token_ids or ()) is blk
            pool.touch([blk])
            held.append(blk)
        for h in evicted:
            alive.pop(h, None)
        evicted.clear()
        pool.check_integrity()
        assert set(alive) == set(pool.cached_hashes())
        assert pool.num_used == len({b.block_id for b in held})
        for blk in pool.blocks:
            assert blk.ref_cnt == sum(1 for h in held if h is blk)
    pool.free(held)
    assert pool.num_used == 0 and pool.num_cached == len(alive)
    pool.check_integrity()


BROKEN_POOL = """
from libkv.block_pool import BlockPool, IntegrityError
pool = BlockPool(4)
pool.allocate(1)[0].ref_cnt = 0  # a block in no queue and with no reference: lost
try:
    pool.check_integrity()
except IntegrityError as e:
    print("caught:", e)
"""


@pytest.mark.parametrize("flags", [[], ["-O"]])
def test_integrity_is_checked_also_under_python_o(flags: list[str]) -> None:
    """Workers report the check in their stats: it must not vanish with ``assert`` under -O."""
    out = subprocess.run(
        [sys.executable, *flags, "-c", BROKEN_POOL], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "caught: blocks lost or doubled", out.stderr
