"""The host tier's bookkeeping with a real block pool and KV manager: write-through of cached
blocks, eviction to host, lookups past the device hit, page-in order, cancelled page-outs,
LRU of host slots, tenant and adapter separation."""

from __future__ import annotations

from libkv.block_pool import BlockPool
from libkv.hashing import ROOT_HASH, encode_extra_keys, hash_prefix_blocks
from libkv.host_tier import HostTier
from libkv.kv_manager import KVCacheManager

BS = 4


def make(num_blocks: int = 8, num_slots: int = 6, min_tokens: int = 0):
    kv = KVCacheManager(BlockPool(num_blocks, BS))
    tier = HostTier(num_slots, BS, block_bytes=100, min_tokens=min_tokens)
    kv.set_tier(tier)
    return kv, tier


def run(kv: KVCacheManager, seq: str, tokens: list[int], extra: bytes = b"") -> list[int]:
    """Admit ``tokens`` (no prefix reuse), compute them all, free: its full blocks are cached."""
    hit = kv.find_prefix([], extra)
    assert kv.admit(seq, hit, 0, len(tokens), extra) is not None
    ids = kv.block_ids(seq)
    kv.commit(seq, tokens, len(tokens))
    kv.free(seq)
    return ids


def check(kv: KVCacheManager, tier: HostTier) -> None:
    kv.check_integrity()
    tier.check_integrity()


def test_cached_blocks_are_written_through_in_one_batch() -> None:
    kv, tier = make()
    ids = run(kv, "a", list(range(10)))  # two full blocks and a partial one
    copies = tier.take()
    assert copies.out_blocks == ids[:2]
    assert copies.out_slots == [0, 1]
    assert not copies.in_blocks
    assert not tier.take()  # the queue starts empty again
    run(kv, "b", list(range(10)))  # same prefix hits the host: nothing to copy again
    assert not tier.take()
    assert tier.stats.page_out_blocks == 2
    check(kv, tier)


def test_prefix_evicted_from_device_is_found_on_the_host_in_chain_order() -> None:
    kv, tier = make(num_blocks=4, num_slots=8)
    a = list(range(100, 112))  # three full blocks
    run(kv, "a", a)
    tier.take()
    run(kv, "b", list(range(200, 216)))  # four blocks: evicts all of a's
    assert kv.find_prefix(a, b"").blocks == []
    hit = kv.find_prefix(a, b"")
    host = kv.find_host(a, b"", hit)
    assert host.slots == [0, 1, 2]
    assert host.hashes == hash_prefix_blocks(a, BS)
    check(kv, tier)


def test_host_lookup_continues_past_the_device_hit() -> None:
    kv, tier = make(num_blocks=6)
    a = list(range(12))
    run(kv, "a", a)
    tier.take()
    hit = kv.find_prefix(a, b"")
    assert len(hit.blocks) == 3
    assert len(kv.find_host(a, b"", hit)) == 0  # nothing past the device's hit
    part = type(hit)(hit.blocks[:1], hit.hashes[:1])  # as if blocks 1, 2 were evicted
    host = kv.find_host(a, b"", part)
    assert host.slots == [1, 2]
    assert tier.find(a, b"", 1, hit.hashes[0]).hashes == hit.hashes[1:]
    assert len(tier.find(a, b"", 1, ROOT_HASH)) == 0  # a wrong parent finds nothing


def test_page_ins_come_after_page_outs_and_keep_their_order() -> None:
    kv, tier = make(num_blocks=8, num_slots=8)
    a = list(range(16))
    run(kv, "a", a)
    tier.take()
    host = tier.find(a, b"", 0, ROOT_HASH)
    tier.page_in(host, [7, 5, 6, 4])
    run(kv, "b", list(range(50, 54)))  # one more page-out queued after the page-ins
    copies = tier.take()
    assert copies.out_slots == [4]
    assert copies.in_slots == [0, 1, 2, 3]
    assert copies.in_blocks == [7, 5, 6, 4]
    assert tier.stats.hit_blocks == 4 and tier.stats.page_in_blocks == 4


def test_a_queued_page_out_of_an_evicted_block_is_cancelled() -> None:
    kv, tier = make(num_blocks=2)
    run(kv, "a", list(range(8)))  # both blocks cached, page-outs queued, not taken
    b = run(kv, "b", list(range(20, 28)))  # evicts a's blocks before their copies went out
    copies = tier.take()
    assert tier.stats.cancelled == 2
    assert copies.out_blocks == b == [0, 1]  # b's two blocks only (ascending), into a's freed slots
    assert copies.out_slots == [0, 1]
    assert len(tier.find(list(range(8)), b"", 0, ROOT_HASH)) == 0  # a never reached the host
    check(kv, tier)


def test_host_slots_are_evicted_least_recently_used_and_pinned_slots_are_kept() -> None:
    kv, tier = make(num_blocks=16, num_slots=2)
    run(kv, "a", list(range(4)))
    run(kv, "b", list(range(10, 14)))
    tier.take()
    a_hit = tier.find(list(range(4)), b"", 0, ROOT_HASH)
    tier.page_in(a_hit, [3])  # a is used again (and pinned until taken)
    run(kv, "c", list(range(20, 24)))  # needs a slot: b's, the least recently used
    assert len(tier.find(list(range(10, 14)), b"", 0, ROOT_HASH)) == 0
    assert len(tier.find(list(range(4)), b"", 0, ROOT_HASH)) == 1
    run(kv, "d", list(range(30, 34)))  # a is pinned, c's slot is taken
    assert len(tier.find(list(range(4)), b"", 0, ROOT_HASH)) == 1
    copies = tier.take()
    assert copies.in_slots == [a_hit.slots[0]]
    check(kv, tier)


def test_tenants_and_adapters_never_share_host_entries() -> None:
    kv, tier = make(num_blocks=16, num_slots=16)
    tokens = list(range(8))
    salts = [
        encode_extra_keys("acme"),
        encode_extra_keys("globex"),
        encode_extra_keys("acme", "sql-lora"),
    ]
    run(kv, "t0", tokens, salts[0])
    tier.take()  # the page-outs were issued
    kv.pool.reset_prefix_cache()  # only the host tier holds it now
    for salt in salts[1:] + [b""]:
        assert len(kv.find_host(tokens, salt, kv.find_prefix(tokens, salt))) == 0
    assert len(kv.find_host(tokens, salts[0], kv.find_prefix(tokens, salts[0]))) == 2
    run(kv, "t2", tokens, salts[2])
    assert tier.num_used == 4  # the same tokens under two salts: two entries each
    check(kv, tier)


def test_a_full_tier_drops_chains_from_their_leaves() -> None:
    kv, tier = make(num_blocks=4, num_slots=6)
    a, b = list(range(100, 112)), list(range(200, 216))
    run(kv, "a", a)
    tier.take()
    run(kv, "b", b)  # seven blocks for six slots: a's leaf goes, not its head
    assert tier.find(a, b"", 0, ROOT_HASH).slots == [0, 1]
    tier.take()
    run(kv, "c", list(range(300, 308)))  # two more: a's next leaf, then its head
    assert len(tier.find(a, b"", 0, ROOT_HASH)) == 0
    assert len(tier.find(b, b"", 0, ROOT_HASH)) == 4
    check(kv, tier)


def test_hits_shorter_than_min_tokens_are_not_worth_paging() -> None:
    _, tier = make(min_tokens=8)
    assert not tier.worth_paging(4)
    assert tier.worth_paging(8)
    assert not tier.worth_paging(0)


def test_listener_hears_host_entries_come_and_go() -> None:
    events: list[tuple] = []

    class Listener:
        def cached(self, index, block_hash, parent):
            events.append(("cached", index, block_hash, parent))

        def evicted(self, block_hash):
            events.append(("evicted", block_hash))

    kv, tier = make(num_blocks=16, num_slots=1)
    tier.listener = Listener()
    a, b = list(range(4)), list(range(10, 14))
    run(kv, "a", a)
    run(kv, "b", b)
    (ha,), (hb,) = hash_prefix_blocks(a, BS), hash_prefix_blocks(b, BS)
    assert events == [("cached", 0, ha, ROOT_HASH), ("evicted", ha), ("cached", 0, hb, ROOT_HASH)]
