"""Tests of libkv.kv_manager: prefix hits, sharing, copy-on-write, growth, commit and free."""

from __future__ import annotations

import pytest

from libkv.block_pool import BlockPool
from libkv.hashing import encode_extra_keys, hash_prefix_blocks
from libkv.kv_manager import CopyOp, KVCacheManager, PrefixHit

BLOCK_SIZE = 4


def make_kv(
    num_blocks: int = 8, block_size: int = BLOCK_SIZE, prefix_caching: bool = True
) -> tuple[KVCacheManager, list[bytes]]:
    """A manager on a fresh pool, plus the list of hashes its pool evicts."""
    evicted: list[bytes] = []
    pool = BlockPool(num_blocks, block_size, on_evict=evicted.append)
    return KVCacheManager(pool, enable_prefix_caching=prefix_caching), evicted


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def admit_prompt(
    kv: KVCacheManager, seq_id: str, prompt: list[int], extra: bytes = b""
) -> list[CopyOp] | None:
    """Admit a whole prompt the way the scheduler does: reuse the hit, write from there on."""
    hit = kv.find_prefix(prompt, extra)
    num_computed = min(hit.num_tokens(kv.block_size), len(prompt) - 1)
    return kv.admit(seq_id, hit, num_computed, len(prompt), extra)


def prefill(kv: KVCacheManager, seq_id: str, prompt: list[int], extra: bytes = b"") -> list[int]:
    """Admit ``prompt``, compute it all and commit it. Returns the block ids of the sequence."""
    assert admit_prompt(kv, seq_id, prompt, extra) is not None
    kv.commit(seq_id, prompt, len(prompt))
    kv.check_integrity()
    return kv.block_ids(seq_id)


def ref_counts(kv: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in kv.pool.blocks]


def test_find_prefix_returns_the_longest_verified_run() -> None:
    kv, _ = make_kv()
    prompt = tokens(14)
    assert prefill(kv, "a", prompt) == [0, 1, 2, 3]
    # All three full blocks; the partial fourth is never cached.
    hit = kv.find_prefix(prompt)
    assert [b.block_id for b in hit.blocks] == [0, 1, 2]
    assert hit.hashes == hash_prefix_blocks(prompt, BLOCK_SIZE)
    assert hit.num_tokens(BLOCK_SIZE) == 12
    # Diverging inside block 2: the run stops at two blocks.
    diverged = prompt[:9] + [99] + prompt[10:]
    assert [b.block_id for b in kv.find_prefix(diverged).blocks] == [0, 1]
    # Diverging in block 0 breaks the whole chain, even if later blocks match.
    assert kv.find_prefix([99] + prompt[1:]).blocks == []
    # Shorter than a block: nothing to hit.
    assert kv.find_prefix(prompt[:3]).blocks == []
    kv.check_integrity()


def test_find_prefix_stops_at_a_forged_collision() -> None:
    kv, _ = make_kv()
    prompt = tokens(12)
    hashes = hash_prefix_blocks(prompt, BLOCK_SIZE)
    assert kv.admit("a", PrefixHit([], []), 0, 12, b"") == []
    assert kv.commit("a", prompt, 4) == 1
    # Forge a collision: block 1 registered under the hash of prompt block 1, other tokens.
    forged = kv.pool.blocks[kv.block_ids("a")[1]]
    assert kv.pool.cache(forged, hashes[1], [90, 91, 92, 93])
    hit = kv.find_prefix(prompt)
    assert [b.block_id for b in hit.blocks] == [0]  # block 1 is never served
    assert hit.hashes == hashes[:1]
    kv.check_integrity()


def test_find_prefix_with_caching_disabled_finds_nothing() -> None:
    kv, _ = make_kv(prefix_caching=False)
    prompt = tokens(8)
    assert prefill(kv, "a", prompt) == [0, 1]
    assert kv.pool.cached_hashes() == []
    assert kv.find_prefix(prompt).blocks == []
    assert admit_prompt(kv, "b", prompt) == []
    assert kv.block_ids("b") == [2, 3]
    kv.check_integrity()


def test_admit_with_a_hit_shares_blocks_and_allocates_the_rest() -> None:
    kv, _ = make_kv()
    a = tokens(10)
    assert prefill(kv, "a", a) == [0, 1, 2]
    b = a[:8] + [50, 51, 52, 53, 54]
    hit = kv.find_prefix(b)
    assert [x.block_id for x in hit.blocks] == [0, 1]
    assert kv.admit("b", hit, 8, len(b), b"") == []
    assert kv.block_ids("b") == [0, 1, 3, 4]
    assert ref_counts(kv)[:5] == [2, 2, 1, 1, 1]
    assert kv.table("b").hashes == hit.hashes
    kv.check_integrity()
    with pytest.raises(KeyError):
        kv.admit("b", PrefixHit([], []), 0, 1, b"")
    kv.check_integrity()


def test_a_fully_cached_prompt_copies_its_last_block_while_shared() -> None:
    kv, _ = make_kv()
    prompt = tokens(8)
    assert prefill(kv, "a", prompt) == [0, 1]
    shared = kv.pool.blocks[1]
    shared_hash, shared_tokens = shared.block_hash, shared.token_ids
    # Token 7 must be recomputed for its logits, and it lives in shared block 1: copy it.
    assert admit_prompt(kv, "b", prompt) == [CopyOp(src=1, dst=2)]
    assert kv.block_ids("b") == [0, 2]
    assert ref_counts(kv)[:3] == [2, 1, 1]
    assert kv.table("b").hashes == hash_prefix_blocks(prompt, BLOCK_SIZE)[:1]
    kv.check_integrity()
    # Writing token 7 into block 2 and committing leaves block 1 untouched and still shared.
    assert kv.commit("b", prompt, 8) == 0  # the first copy of the hash stays the shared one
    assert (shared.block_hash, shared.token_ids) == (shared_hash, shared_tokens)
    assert kv.pool.blocks[2].block_hash is None
    assert [x.block_id for x in kv.find_prefix(prompt).blocks] == [0, 1]
    kv.check_integrity()


def test_a_fully_cached_prompt_copies_its_last_block_from_the_free_cache() -> None:
    kv, evicted = make_kv(4)
    prompt = tokens(8)
    assert prefill(kv, "a", prompt) == [0, 1]
    kv.free("a")
    assert kv.pool.num_cached == 2
    assert admit_prompt(kv, "b", prompt) == [CopyOp(src=1, dst=2)]
    assert kv.block_ids("b") == [0, 2]
    # Block 1 went back to the cache, still holding its prefix; nothing was evicted.
    assert ref_counts(kv) == [1, 0, 1, 0]
    assert kv.pool.num_cached == 1 and evicted == []
    kv.check_integrity()


def test_can_admit_counts_the_copy_on_write_block() -> None:
    kv, _ = make_kv(3)
    prompt = tokens(8)
    assert prefill(kv, "a", prompt) == [0, 1]
    assert prefill(kv, "c", tokens(4, start=100)) == [2]
    hit = kv.find_prefix(prompt)
    assert not kv.can_admit(hit, 8)  # needs one block for the copy, none free
    assert kv.admit("b", hit, 7, 8, b"") is None
    assert "b" not in kv and ref_counts(kv) == [1, 1, 1]
    kv.free("c")
    assert kv.can_admit(kv.find_prefix(prompt), 8)
    assert admit_prompt(kv, "b", prompt) == [CopyOp(src=1, dst=2)]
    kv.check_integrity()


def test_a_fully_cached_prompt_needs_one_block_beyond_its_own() -> None:
    kv, _ = make_kv(2)
    prompt = tokens(8)
    prefill(kv, "a", prompt)
    kv.free("a")
    # Both hit blocks are free, yet the copy of the last one needs a third block.
    hit = kv.find_prefix(prompt)
    assert len(hit.blocks) == 2 and not kv.can_admit(hit, 8)
    assert kv.admit("b", hit, 7, 8, b"") is None
    assert kv.pool.num_cached == 2
    kv.check_integrity()


def test_grow_allocates_across_block_boundaries() -> None:
    kv, _ = make_kv(4)
    assert kv.admit("a", PrefixHit([], []), 0, 3, b"") == []
    assert kv.block_ids("a") == [0]
    assert kv.grow("a", 3, 4) == [] and kv.block_ids("a") == [0]
    assert kv.grow("a", 4, 5) == [] and kv.block_ids("a") == [0, 1]
    assert kv.grow("a", 5, 13) == [] and kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.grow("a", 13, 12) == [] and kv.block_ids("a") == [0, 1, 2, 3]  # never shrinks
    assert kv.grow("a", 13, 17) is None  # no room: nothing changes
    assert kv.block_ids("a") == [0, 1, 2, 3] and kv.pool.num_free == 0
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()


def test_grow_failure_changes_nothing() -> None:
    kv, _ = make_kv(3)
    assert kv.admit("a", PrefixHit([], []), 0, 4, b"") == []
    assert kv.admit("b", PrefixHit([], []), 0, 4, b"") == []
    assert kv.grow("a", 4, 12) is None
    assert kv.block_ids("a") == [0] and kv.pool.num_free == 1
    assert kv.grow("a", 4, 8) == [] and kv.block_ids("a") == [0, 2]
    kv.check_integrity()


def test_commit_registers_full_computed_blocks_only() -> None:
    kv, _ = make_kv()
    prompt = tokens(10)
    assert kv.admit("a", PrefixHit([], []), 0, 10, b"") == []
    assert kv.commit("a", prompt, 3) == 0  # block 0 not computed in full yet
    assert kv.commit("a", prompt, 6) == 1
    assert kv.commit("a", prompt, 6) == 0  # idempotent
    assert kv.commit("a", prompt, 10) == 1  # block 1; the partial block 2 never
    expected = hash_prefix_blocks(prompt, BLOCK_SIZE)
    assert kv.table("a").hashes == expected
    assert [kv.pool.blocks[i].block_hash for i in range(3)] == [*expected, None]
    assert kv.pool.blocks[0].token_ids == tuple(prompt[:4])
    # Decoding on: commit with the grown token list registers the next block once it fills.
    kv.grow("a", 10, 12)
    assert kv.commit("a", [*prompt, 10, 11], 12) == 1
    assert kv.table("a").hashes == hash_prefix_blocks(tokens(12), BLOCK_SIZE)
    kv.check_integrity()


def test_commit_with_caching_disabled_registers_nothing() -> None:
    kv, _ = make_kv(prefix_caching=False)
    kv.admit("a", PrefixHit([], []), 0, 8, b"")
    assert kv.commit("a", tokens(8), 8) == 0
    assert kv.pool.cached_hashes() == [] and kv.table("a").hashes == []
    kv.check_integrity()


def test_tenants_never_share_blocks() -> None:
    kv, _ = make_kv(8)
    prompt = tokens(8)
    acme, globex = encode_extra_keys("acme"), encode_extra_keys("globex")
    assert prefill(kv, "a", prompt, acme) == [0, 1]
    assert kv.find_prefix(prompt, globex).blocks == []
    assert kv.find_prefix(prompt).blocks == []  # nor with no tenant
    assert prefill(kv, "b", prompt, globex) == [2, 3]
    assert prefill(kv, "c", prompt) == [4, 5]
    assert ref_counts(kv)[:6] == [1] * 6
    # Within one tenant the prefix is shared (and the last block copied).
    assert admit_prompt(kv, "d", prompt, acme) == [CopyOp(src=1, dst=6)]
    assert kv.block_ids("d") == [0, 6]
    assert kv.table("d").extra == acme
    kv.check_integrity()


def test_admit_returning_none_changes_nothing() -> None:
    kv, evicted = make_kv(3)
    prefix = tokens(8)
    prefill(kv, "a", prefix)
    kv.free("a")  # blocks 0 and 1 cached, block 2 fresh
    # Reusing the two cached blocks leaves one free block: 12 tokens fit, 16 do not.
    too_long = tokens(16)
    hit = kv.find_prefix(too_long)
    assert [b.block_id for b in hit.blocks] == [0, 1]
    assert not kv.can_admit(hit, 16)
    before = (ref_counts(kv), kv.pool.num_free, kv.pool.num_cached)
    assert kv.admit("b", hit, 8, 16, b"") is None
    assert "b" not in kv
    assert (ref_counts(kv), kv.pool.num_free, kv.pool.num_cached) == before
    assert evicted == []
    kv.check_integrity()
    fits = tokens(12)
    assert kv.can_admit(kv.find_prefix(fits), 12)
    assert admit_prompt(kv, "c", fits) == []
    assert kv.block_ids("c") == [0, 1, 2] and kv.pool.num_free == 0
    kv.check_integrity()


def test_free_releases_leaves_first() -> None:
    kv, evicted = make_kv(4)
    prompt = tokens(12)
    assert prefill(kv, "a", prompt) == [0, 1, 2]
    hashes = hash_prefix_blocks(prompt, BLOCK_SIZE)
    kv.free("a")
    kv.free("a")  # freeing an unknown sequence is a no-op
    assert "a" not in kv and kv.pool.num_cached == 3
    kv.check_integrity()
    assert kv.admit("b", PrefixHit([], []), 0, 8, b"") == []
    assert kv.block_ids("b") == [2, 3]  # the fresh block and the leaf, ascending
    assert evicted == [hashes[2]]
    assert [b.block_id for b in kv.find_prefix(prompt).blocks] == [0, 1]
    kv.check_integrity()


def test_free_of_a_sharer_keeps_the_shared_blocks() -> None:
    kv, _ = make_kv(8)
    a = tokens(10)
    assert prefill(kv, "a", a) == [0, 1, 2]
    assert prefill(kv, "b", a[:8] + [70, 71]) == [0, 1, 3]
    kv.free("b")
    assert ref_counts(kv)[:4] == [1, 1, 1, 0]
    assert kv.pool.num_used == 3 and kv.pool.num_cached == 0  # block 3 was only partial
    kv.check_integrity()
    kv.free("a")
    assert kv.pool.num_used == 0 and kv.pool.num_cached == 2
    kv.check_integrity()


def test_check_integrity_catches_a_reference_leak() -> None:
    kv, _ = make_kv(4)
    prefill(kv, "a", tokens(4))
    kv.pool.touch([kv.pool.blocks[0]])  # a reference no table accounts for
    with pytest.raises(AssertionError, match="ref leak on 0"):
        kv.check_integrity()


def test_fork_shares_every_block_and_copies_the_partial_one_on_write() -> None:
    kv, _ = make_kv()
    prompt = tokens(6)  # block 0 full (cached), block 1 holds 2 of 4 tokens
    assert prefill(kv, "p", prompt) == [0, 1]
    kv.fork("p", ("p", 1))
    kv.fork("p", ("p", 2))
    assert kv.block_ids(("p", 1)) == [0, 1] and ref_counts(kv)[:2] == [3, 3]
    kv.check_integrity()
    # Each choice writes its first output token at position 6, inside the shared block 1: the
    # first two to write get private copies, the last holder writes in place.
    assert kv.grow(("p", 1), 6, 7) == [CopyOp(1, 2)]
    assert kv.grow(("p", 2), 6, 7) == [CopyOp(1, 3)]
    assert kv.grow("p", 6, 7) == []
    assert kv.block_ids("p") == [0, 1] and kv.block_ids(("p", 1)) == [0, 2]
    assert ref_counts(kv)[:4] == [3, 1, 1, 1]
    with pytest.raises(KeyError):
        kv.fork("p", ("p", 1))
    for key in ("p", ("p", 1), ("p", 2)):
        kv.free(key)
    kv.check_integrity()
    assert kv.pool.num_used == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_full_computed_blocks_are_sealed_once_and_listed_for_their_checksum(
    prefix_caching,
) -> None:
    """Checked KV: a block is sealed when it is full and computed (whether or not prefix
    caching is on), listed once for the engine to checksum, and unsealed only when the pool
    hands it out again (new contents)."""
    pool = BlockPool(6, BLOCK_SIZE)
    kv = KVCacheManager(pool, enable_prefix_caching=prefix_caching, track_seals=True)
    prompt = tokens(10)  # blocks 0 and 1 full, block 2 holds 2 of 4 tokens
    assert admit_prompt(kv, "a", prompt) is not None
    kv.commit("a", prompt, 5)  # a first chunk: block 0 only is full
    assert kv.take_sealed() == [0] and kv.take_sealed() == []
    kv.commit("a", prompt, 10)
    assert kv.take_sealed() == [1]  # the partial last block is never sealed
    assert [b.sealed for b in pool.blocks[:3]] == [True, True, False]
    kv.commit("a", prompt, 10)
    assert kv.take_sealed() == []
    kv.free("a")
    assert pool.blocks[0].sealed and pool.blocks[1].sealed  # bytes kept until reallocated
    others = tokens(24, start=100)  # needs every block: the sealed ones are handed out anew
    assert admit_prompt(kv, "b", others) is not None
    assert not any(b.sealed for b in pool.blocks)
    kv.commit("b", others, 8)
    assert sorted(kv.take_sealed()) == sorted(kv.block_ids("b")[:2])
    kv.check_integrity()


def test_a_prefix_hit_is_not_sealed_again_and_a_copy_on_write_is() -> None:
    pool = BlockPool(8, BLOCK_SIZE)
    kv = KVCacheManager(pool, track_seals=True)
    prompt = tokens(8)  # two full blocks
    assert prefill(kv, "a", prompt) == [0, 1]
    assert kv.take_sealed() == [0, 1]
    # The same prompt again: both blocks hit; the last is copied (its last token is recomputed
    # for logits) into block 2, which is sealed once computed; block 0 is not listed again.
    assert admit_prompt(kv, "b", prompt) == [CopyOp(1, 2)]
    kv.commit("b", prompt, 8)
    assert kv.block_ids("b") == [0, 2] and kv.take_sealed() == [2]
    kv.free("a")
    kv.free("b")
    kv.check_integrity()


def test_without_tracking_nothing_is_sealed() -> None:
    kv, _ = make_kv()
    prefill(kv, "a", tokens(8))
    assert kv.take_sealed() == [] and not any(b.sealed for b in kv.pool.blocks)
