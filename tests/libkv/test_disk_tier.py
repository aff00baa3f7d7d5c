"""The disk tier's bookkeeping under the host tier, with a real block pool and KV manager:
host evictions demoted to disk, lookups continuing from the host into the disk, the order of
a batch's copies, the size cap (leaves first, least recently used), no second write of a block
the disk holds, pinned slots, tenant and adapter separation."""

from __future__ import annotations

from libkv.block_pool import BlockPool
from libkv.disk_tier import DiskTier
from libkv.hashing import ROOT_HASH, encode_extra_keys, hash_prefix_blocks
from libkv.host_tier import HostTier
from libkv.kv_manager import KVCacheManager
from tests.libkv.test_host_tier import check, run

BS = 4


def make(num_blocks: int = 16, num_slots: int = 4, disk_slots: int = 8):
    kv = KVCacheManager(BlockPool(num_blocks, BS))
    tier = HostTier(num_slots, BS, block_bytes=100)
    tier.disk = DiskTier(disk_slots, BS, block_bytes=100)
    kv.set_tier(tier)
    return kv, tier


def chain(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def test_host_evictions_are_demoted_to_disk_before_their_slots_are_reused() -> None:
    kv, tier = make(num_slots=4)
    a, b = chain(100, 2), chain(200, 2)
    run(kv, "a", a)
    tier.take()  # a's page-outs issued: its slots hold data
    run(kv, "b", b)  # fills the host: the reserve (one slot) is made at take
    copies = tier.take()
    assert copies.out_slots == [2, 3]
    assert copies.demote_slots == [1] and copies.demote_disk == [0]  # a's tail, leaf first
    run(kv, "c", chain(300, 1))  # needs a slot: the demoted one, handed out last
    copies = tier.take()
    assert copies.out_slots == [1]
    assert copies.demote_slots == [0]  # a's head, now a leaf, demoted for the reserve
    assert tier.disk is not None and tier.disk.num_used == 2
    kv.pool.reset_prefix_cache()
    hit = tier.find(a, b"", 0, ROOT_HASH)
    assert hit.hashes == hash_prefix_blocks(a, BS)
    assert hit.slots == [-1, -1] and hit.disk == [1, 0]
    check(kv, tier)


def test_a_chain_continues_from_the_host_into_the_disk_and_copies_keep_their_order() -> None:
    kv, tier = make(num_slots=4, disk_slots=8)
    a = chain(100, 3)
    run(kv, "a", a)
    tier.take()
    run(kv, "b", chain(200, 2))  # evicts a's tail, then the reserve takes the next leaf
    tier.take()
    kv.pool.reset_prefix_cache()
    hit = tier.find(a, b"", 0, ROOT_HASH)
    assert hit.slots[0] >= 0 and hit.slots[1:] == [-1, -1]  # head on host, tail on disk
    tier.page_in(hit, [9, 8, 7])
    copies = tier.take()
    assert copies.in_slots == [hit.slots[0]] and copies.in_blocks == [9]
    assert copies.load_disk == hit.disk[1:] and copies.load_blocks == [8, 7]
    assert tier.stats.hit_blocks == 1
    assert tier.disk is not None and tier.disk.stats.hit_blocks == 2
    check(kv, tier)


def test_a_block_the_disk_holds_is_not_written_again() -> None:
    kv, tier = make(num_slots=2, disk_slots=8)
    a, b = chain(100, 1), chain(200, 1)
    run(kv, "a", a)
    tier.take()
    run(kv, "b", b)
    tier.take()  # a demoted
    assert tier.disk is not None and tier.disk.stats.page_out_blocks == 1
    kv.pool.reset_prefix_cache()
    run(kv, "a2", a)  # computed again: written through to the host again
    tier.take()
    run(kv, "c", chain(300, 1))
    copies = tier.take()
    assert tier.disk.stats.page_out_blocks == 2  # b went down; a's second copy did not
    assert len(copies.demote_slots) <= 1
    check(kv, tier)


def test_the_disk_cap_evicts_leaves_first_least_recently_used() -> None:
    disk = DiskTier(3, BS)
    a = chain(100, 3)
    hashes = hash_prefix_blocks(a, BS)
    parents = [ROOT_HASH, *hashes[:2]]
    for i in (2, 1, 0):  # demoted tail first, as the host tier drops leaves
        assert disk.put(hashes[i], tuple(a[i * BS : (i + 1) * BS]), parents[i]) is not None
    others = [hash_prefix_blocks(chain(1000 * k, 1), BS)[0] for k in (1, 2, 3)]
    kept = []
    for k, h in enumerate(others, start=1):
        disk.put(h, tuple(chain(1000 * k, 1)), ROOT_HASH)
        kept.append([disk.get(x, tuple(a[i * BS : (i + 1) * BS])) is not None
                     for i, x in enumerate(hashes)])  # fmt: skip
        disk.check_integrity()
        assert disk.num_used == 3  # the cap
    # the tail goes first, then the middle, then the head: a chain never loses its head first
    assert kept == [[True, True, False], [True, False, False], [False, False, False]]


def test_the_host_and_disk_caps_hold_under_many_chains() -> None:
    kv, tier = make(num_blocks=8, num_slots=4, disk_slots=6)
    for k in range(20):
        run(kv, f"s{k}", chain(100 * k, 3))
        tier.take()
        assert tier.num_used <= 4 and tier.disk is not None and tier.disk.num_used <= 6
        check(kv, tier)
    kv.pool.reset_prefix_cache()
    last = tier.find(chain(1900, 3), b"", 0, ROOT_HASH)
    assert len(last) >= 2  # the most recent chain is still found, from the host or the disk


def test_an_entry_that_reaches_the_disk_after_its_children_is_no_leaf() -> None:
    disk = DiskTier(2, BS)
    head, tail = hash_prefix_blocks(chain(100, 2), BS)
    assert disk.put(tail, tuple(chain(104, 1)), head) == 0  # the tail first, as demoted
    assert disk.put(head, tuple(chain(100, 1)), ROOT_HASH) == 1
    disk.check_integrity()
    other = hash_prefix_blocks(chain(500, 1), BS)[0]
    assert disk.put(other, tuple(chain(500, 1)), ROOT_HASH) == 0  # the tail is evicted...
    assert disk.get(head, tuple(chain(100, 1))) == 1  # ...not the head
    disk.check_integrity()


def test_disk_slots_of_queued_loads_are_pinned_until_taken() -> None:
    disk = DiskTier(1, BS)
    h = hash_prefix_blocks(chain(100, 1), BS)[0]
    assert disk.put(h, tuple(chain(100, 1)), ROOT_HASH) == 0
    disk.load(h, 0)
    other = hash_prefix_blocks(chain(200, 1), BS)[0]
    assert disk.put(other, tuple(chain(200, 1)), ROOT_HASH) is None  # nothing to evict
    disk.unpin_all()
    assert disk.put(other, tuple(chain(200, 1)), ROOT_HASH) == 0
    disk.check_integrity()


def test_tenants_and_adapters_never_share_disk_entries() -> None:
    kv, tier = make(num_slots=2, disk_slots=16)
    tokens = chain(100, 2)
    salts = [encode_extra_keys("acme"), encode_extra_keys("globex"),
             encode_extra_keys("acme", "sql-lora")]  # fmt: skip
    run(kv, "t0", tokens, salts[0])
    tier.take()
    run(kv, "y", chain(900, 2))  # pushes t0's blocks to disk
    tier.take()
    kv.pool.reset_prefix_cache()
    for salt in salts[1:] + [b""]:
        assert len(kv.find_host(tokens, salt, kv.find_prefix(tokens, salt))) == 0
    found = kv.find_host(tokens, salts[0], kv.find_prefix(tokens, salts[0]))
    assert len(found) == 2 and found.num_disk == 2
    check(kv, tier)
